"""The allocation trace: the one contract between the CPU probe and the allocator simulator.

A trace is the ordered stream of allocation requests a CUDA run of the job would make to the
caching allocator. The probe writes it, the orchestration rewrites it (CPU -> CUDA differences),
the simulator replays it. Standard library only (it runs in the probe bundle, Python >= 3.9).

On-disk form (JSON, ``format: "xmem-trace"``, ``version: 1``)::

    {
      "format": "xmem-trace",
      "version": 1,
      "meta": {...},                      # free-form: tool, torch version, script, mode, steps
      "events": [
        ["alloc", 7, 4096, 0, "activation", "forward"],   # id, bytes requested, stream,
                                                          # category, phase (both optional)
        ["free", 7],                                      # id of a live allocation
        ["empty_cache"],                                  # torch.cuda.empty_cache()
        ["mark", "step 1"]                                # a label (step boundaries, phases)
      ]
    }

Rules a valid trace obeys (``Trace.validate`` checks them): ids of live allocations are unique;
a free names a live id; sizes are non-negative integers (the unrounded bytes the framework asked
for, as ``requested_size`` in a PyTorch snapshot); streams are non-negative integers (0 is the
default stream). Categories are the strings of ``Category``; an unknown category string is
kept as is (a newer probe may know more), a missing one reads as ``other``.
"""

from __future__ import annotations

import enum
import json
from typing import Any, Dict, Final, Iterable, Iterator, List, Literal, NamedTuple, Optional, Union

from xmem_admission.contract.errors import TraceError

FORMAT = "xmem-trace"
VERSION = 1

ALLOC: Final = "alloc"
FREE: Final = "free"
EMPTY_CACHE: Final = "empty_cache"
MARK: Final = "mark"


class Category(str, enum.Enum):
    """What a block holds: the breakdown of the peak is reported per category."""

    PARAMETER = "parameter"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    ACTIVATION = "activation"
    TEMPORARY = "temporary"
    INPUT = "input"
    WORKSPACE = "workspace"
    COMMUNICATION = "communication"  # DDP gradient buckets, FSDP all-gather/reduce-scatter buffers
    OTHER = "other"


# One event, as held in memory: the JSON list turned into a named tuple whose first field is the
# operation, so an event still equals the plain tuple of its JSON list and ``list(event)`` is
# that list. ``event.op == ALLOC`` narrows an ``Event`` to ``Alloc`` for the type checker.
class Alloc(NamedTuple):
    """A request for ``size`` bytes on ``stream``, live under ``id`` until its ``Free``."""

    op: Literal["alloc"]
    id: int
    size: int
    stream: int
    category: str
    phase: str


class Free(NamedTuple):
    """The release of the live allocation ``id``."""

    op: Literal["free"]
    id: int


class EmptyCache(NamedTuple):
    """``torch.cuda.empty_cache()``."""

    op: Literal["empty_cache"]


class Mark(NamedTuple):
    """A label in the stream (step boundaries, phases, cuBLAS handle creation)."""

    op: Literal["mark"]
    label: str


Event = Union[Alloc, Free, EmptyCache, Mark]


class Trace:
    """An ordered list of allocator events plus free-form metadata."""

    __slots__ = ("events", "meta")

    def __init__(self, events: Optional[List[Event]] = None, meta: Optional[Dict[str, Any]] = None):
        self.events: List[Event] = events if events is not None else []
        self.meta: Dict[str, Any] = meta if meta is not None else {}

    # -- building ---------------------------------------------------------------------------
    def alloc(
        self,
        id: int,
        size: int,
        stream: int = 0,
        category: Union[Category, str] = Category.OTHER,
        phase: str = "",
    ) -> None:
        self.events.append(Alloc(ALLOC, id, size, stream, _category_str(category), phase))

    def free(self, id: int) -> None:
        self.events.append(Free(FREE, id))

    def empty_cache(self) -> None:
        self.events.append(EmptyCache(EMPTY_CACHE))

    def mark(self, label: str) -> None:
        self.events.append(Mark(MARK, label))

    # -- reading ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.events)

    def __iter__(self) -> Iterator[Event]:
        return iter(self.events)

    def validate(self) -> None:
        """Raise ``TraceError`` naming the first event that breaks the rules above."""
        live = set()
        for index, event in enumerate(self.events):
            if event.op == ALLOC:
                if event.id in live:
                    raise TraceError(f"event {index}: allocation id {event.id} is already live")
                live.add(event.id)
            elif event.op == FREE:
                if event.id not in live:
                    raise TraceError(
                        f"event {index}: free of id {event.id}, which is not a live allocation"
                    )
                live.discard(event.id)

    # -- (de)serialising --------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "meta": self.meta,
                "events": [list(e) for e in self.events]}

    def dump(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.to_dict(), fh, separators=(",", ":"))
            fh.write("\n")

    @classmethod
    def from_dict(cls, data: Any) -> Trace:
        if not isinstance(data, dict):
            raise TraceError("a trace must be a JSON object with 'format', 'version', 'events'")
        if data.get("format") != FORMAT:
            raise TraceError(f"not an xmem trace: 'format' is {data.get('format')!r}, "
                             f"expected {FORMAT!r}")
        if data.get("version") != VERSION:
            raise TraceError(f"unsupported trace version {data.get('version')!r} "
                             f"(this xmem reads version {VERSION})")
        raw = data.get("events")
        if not isinstance(raw, list):
            raise TraceError("'events' must be a list")
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise TraceError("'meta' must be an object")
        trace = cls(list(_parse_events(raw)), meta)
        trace.validate()
        return trace

    @classmethod
    def load(cls, path: str) -> Trace:
        try:
            with open(path, encoding="utf-8") as fh:
                data = json.load(fh)
        except FileNotFoundError:
            raise TraceError(f"{path}: no such file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise TraceError(f"{path}: cannot read: {exc}") from None
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}: not valid JSON (truncated?): {exc}") from None
        try:
            return cls.from_dict(data)
        except TraceError as exc:
            raise TraceError(f"{path}: {exc}") from None


def _category_str(category: Union[Category, str]) -> str:
    return category.value if isinstance(category, Category) else str(category)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _parse_events(raw: Iterable[Any]) -> Iterator[Event]:
    for index, item in enumerate(raw):
        if not isinstance(item, list) or not item:
            raise TraceError(f"event {index}: expected a non-empty list, got {item!r:.60}")
        op = item[0]
        if op == ALLOC:
            if not 3 <= len(item) <= 6:
                raise TraceError(f"event {index}: 'alloc' takes id, size[, stream, category, phase]")
            ident, size = item[1], item[2]
            stream = item[3] if len(item) > 3 else 0
            category = item[4] if len(item) > 4 and item[4] else Category.OTHER.value
            phase = item[5] if len(item) > 5 and item[5] else ""
            if not isinstance(ident, int) or isinstance(ident, bool):
                raise TraceError(f"event {index}: allocation id must be an integer, got {ident!r}")
            if not _is_count(size):
                raise TraceError(f"event {index}: size must be a non-negative integer, got {size!r}")
            if not _is_count(stream):
                raise TraceError(f"event {index}: stream must be a non-negative integer, "
                                 f"got {stream!r}")
            if not isinstance(category, str) or not isinstance(phase, str):
                raise TraceError(f"event {index}: category and phase must be strings")
            yield Alloc(ALLOC, ident, size, stream, category, phase)
        elif op == FREE:
            if len(item) != 2 or not isinstance(item[1], int) or isinstance(item[1], bool):
                raise TraceError(f"event {index}: 'free' takes exactly one integer id")
            yield Free(FREE, item[1])
        elif op == EMPTY_CACHE:
            yield EmptyCache(EMPTY_CACHE)
        elif op == MARK:
            if len(item) != 2 or not isinstance(item[1], str):
                raise TraceError(f"event {index}: 'mark' takes exactly one string label")
            yield Mark(MARK, item[1])
        else:
            raise TraceError(f"event {index}: unknown operation {op!r} "
                             f"(expected alloc, free, empty_cache or mark)")
