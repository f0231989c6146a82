"""The allocation trace: the one contract between the CPU probe and the allocator simulator.

A trace is the ordered stream of allocation requests a CUDA run of the job would make to the
caching allocator. The probe writes it, the orchestration rewrites it (CPU -> CUDA differences),
the simulator replays it. Standard library only (it runs in the probe bundle, Python >= 3.9).

On-disk form (JSON, ``format: "xmem-trace"``), version 2 (written)::

    {
      "format": "xmem-trace",
      "version": 2,
      "meta": {...},                      # free-form: tool, torch version, script, mode, steps
      "sites": [                          # where allocations come from, each listed once:
        ["activation", "forward", "GPT.blocks.0.mlp.up", "aten.mm"],
        ...                               # category, phase, module path, op
      ],
      "events": [
        ["alloc", 7, 4096, 0, 0],         # id, bytes requested, stream, index into "sites"
        ["free", 7],                      # id of a live allocation
        ["empty_cache"],                  # torch.cuda.empty_cache()
        ["mark", "step 1"]                # a label (step boundaries, phases)
      ]
    }

Version 1 (still read: traces kept by ``xmem bench ... --resume`` and older probes) has no
``sites``; its allocations carry category and phase themselves, and no module or op::

        ["alloc", 7, 4096, 0, "activation", "forward"]   # id, size, stream, category, phase
                                                          # (stream, category, phase optional)

The module path is the ``nn.Module`` that was running when the block was made: the root
module's class name, then the attribute names down to the module (``GPT.blocks.3.attn``; wrapper
levels such as FSDP's ``_fsdp_wrapped_module`` are left out), empty outside any module. A block
made by backward names the forward module whose autograd node made it; one made while
activation checkpointing recomputes a module's forward in backward carries the suffix
``RECOMPUTED``; one made by the script's loss computation outside any module (between the
model's forward and backward, or by its backward nodes) is ``LOSS``. The op is the ATen operator that returned the block (``aten.mm``), or what made
it outside the dispatcher (``ALL_GATHER`` for an FSDP unshard's storage); empty when unknown.

Marks are free-form labels; a prefix gives some of them a meaning the rewrite for a GPU
(``orchestrate``) acts on, in traces of either version: ``cublas:THREAD`` (the first BLAS op of
a thread: its cuBLAS workspaces), ``cudnn:CALLS ...`` (a convolution run through cuDNN:
``conv_marks``), ``reduce:OP ...`` (a reduction that may stage partial results in global
memory: ``reductions``; older traces lack them and simulate without
those blocks). A reader that does not know a prefix keeps the mark and allocates nothing for it.

Rules a valid trace obeys (``Trace.validate`` checks them): ids of live allocations are unique;
a free names a live id; sizes are non-negative integers (the unrounded bytes the framework asked
for, as ``requested_size`` in a PyTorch snapshot); streams are non-negative integers (0 is the
default stream). Categories are the strings of ``Category``; an unknown category string is
kept as is (a newer probe may know more), a missing one reads as ``other``.

Interning makes an allocation event shorter than version 1's, so the attribution costs the
trace no size (``bench/speed/estimator_speed.py`` prints the figures).
"""

from __future__ import annotations

import contextlib
import enum
import gc
import hashlib
import json
from typing import (
    Any,
    Dict,
    Final,
    Iterable,
    Iterator,
    List,
    Literal,
    NamedTuple,
    Optional,
    Tuple,
    Union,
)

from xmem_admission.contract.errors import TraceError

FORMAT = "xmem-trace"
VERSION = 2
READABLE_VERSIONS = (1, 2)
# Module-path suffix of blocks made while activation checkpointing recomputes a forward.
RECOMPUTED = " (recomputed)"
# Module path of blocks made between the model's forward and backward outside any module (the
# script's loss), and by backward nodes made there.
LOSS = "(loss)"
# The op of a block made outside the dispatcher by an FSDP unshard (a storage regrown for the
# all-gather).
ALL_GATHER = "FSDP all-gather"

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
    module: str = ""  # the nn.Module path that made it (version 2)
    source: str = ""  # the op that made it (version 2)


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


class NoteKind(str, enum.Enum):
    """What a trace's note says about how the trace stands for the job's GPU run."""

    # a size fake execution could not know (boolean-mask indexing, ``nonzero``, ``unique``),
    # traced at the largest it can have: the estimate is an upper bound there
    BOUNDED = "bounded"
    # a ``torch.compile``d module or function traced as eager code
    COMPILED_EAGERLY = "compiled_eagerly"
    # a side effect outside the estimation (an experiment tracker, a Hub push) switched off
    TURNED_OFF = "turned_off"
    # a library's CUDA kernels stood for by what their sources allocate (bitsandbytes, ...)
    MODELLED = "modelled"


# Notes whose presence makes the estimate an upper bound rather than a point estimate.
UPPER_BOUND_NOTES = frozenset({NoteKind.BOUNDED.value, NoteKind.COMPILED_EAGERLY.value})

# How each kind of note reads to a person (the table output and the HTML report).
NOTE_HEADINGS = {
    NoteKind.BOUNDED.value: "upper bound: a size fake execution cannot know, taken at its largest",
    NoteKind.COMPILED_EAGERLY.value: "upper bound: compiled code traced as eager code",
    NoteKind.TURNED_OFF.value: "turned off for the estimation",
    NoteKind.MODELLED.value: "modelled from the library's sources",
}


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


def note_groups(notes: List[Dict[str, Any]]) -> List[Tuple[str, List[str]]]:
    """Notes by kind, in the order first said: (heading, one line each); a repeated note says
    how often, and a bound the most it can add."""
    groups: List[Tuple[str, List[str]]] = []
    for kind in dict.fromkeys(str(n.get("kind", "")) for n in notes):
        lines = []
        for n in notes:
            if n.get("kind") != kind:
                continue
            extra = []
            if n.get("count", 1) > 1:
                extra.append(f"{n['count']} times")
            if kind == NoteKind.BOUNDED.value and n.get("extra_bytes"):
                extra.append(f"at most {_size(int(n['extra_bytes']))} over in all")
            lines.append(str(n.get("message", "")) + (f" ({', '.join(extra)})" if extra else ""))
        groups.append((NOTE_HEADINGS.get(kind, kind), lines))
    return groups


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
        module: str = "",
        source: str = "",
    ) -> None:
        self.events.append(Alloc(ALLOC, id, size, stream, _category_str(category), phase,
                                 module, source))

    def free(self, id: int) -> None:
        self.events.append(Free(FREE, id))

    def empty_cache(self) -> None:
        self.events.append(EmptyCache(EMPTY_CACHE))

    def mark(self, label: str) -> None:
        self.events.append(Mark(MARK, label))

    def note(self, kind: Union[NoteKind, str], message: str, key: str = "",
             extra_bytes: int = 0) -> None:
        """Say something about how this trace stands for the GPU run, once per ``(kind, key or
        message)``: ``meta["notes"]`` holds ``{"kind", "message", "count", "extra_bytes"}``
        items in the order first said; a repeat counts (``count``) and adds ``extra_bytes``
        (what a bound may cost over the job's true size, where it is known)."""
        kind = kind.value if isinstance(kind, NoteKind) else str(kind)
        notes: List[Dict[str, Any]] = self.meta.setdefault("notes", [])
        ident = key or message
        for item in notes:
            if item["kind"] == kind and item.get("key", item["message"]) == ident:
                item["count"] += 1
                item["extra_bytes"] = item.get("extra_bytes", 0) + int(extra_bytes)
                return
        item = {"kind": kind, "message": message, "count": 1, "extra_bytes": int(extra_bytes)}
        if key:
            item["key"] = key
        notes.append(item)

    def notes(self) -> List[Dict[str, Any]]:
        """The notes said while tracing (``note``), oldest first."""
        return list(self.meta.get("notes") or [])

    @property
    def upper_bound(self) -> bool:
        """Is any size in this trace a bound rather than what the job will allocate?"""
        return any(item.get("kind") in UPPER_BOUND_NOTES for item in self.notes())

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
        sites: Dict[Tuple[str, str, str, str], int] = {}
        events: List[List[Any]] = []
        for e in self.events:
            if e.op == ALLOC:
                key = (e.category, e.phase, e.module, e.source)
                site = sites.get(key)
                if site is None:
                    site = sites[key] = len(sites)
                events.append([ALLOC, e.id, e.size, e.stream, site])
            else:
                events.append(list(e))
        return {"format": FORMAT, "version": VERSION, "meta": self.meta,
                "sites": [list(key) for key in sites], "events": events}

    def dump(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as fh, gc_paused():
            fh.write(json.dumps(self.to_dict(), separators=(",", ":")))  # json.dump: pure Python
            fh.write("\n")

    @classmethod
    def from_dict(cls, data: Any) -> Trace:
        if not isinstance(data, dict):
            raise TraceError("a trace must be a JSON object with 'format', 'version', 'events'")
        if data.get("format") != FORMAT:
            raise TraceError(f"not an xmem trace: 'format' is {data.get('format')!r}, "
                             f"expected {FORMAT!r}")
        version = data.get("version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise TraceError(f"unsupported trace version {version!r} "
                             f"(this xmem reads versions 1 and 2)")
        raw = data.get("events")
        if not isinstance(raw, list):
            raise TraceError("'events' must be a list")
        meta = data.get("meta", {})
        if not isinstance(meta, dict):
            raise TraceError("'meta' must be an object")
        sites = _parse_sites(data.get("sites")) if version == 2 else None
        with gc_paused():
            events = _read_well_formed(raw, sites) if sites is not None else None
        if events is not None:
            return cls(events, meta)
        # something in the events is off: read them one by one for the exact error
        trace = cls(list(_parse_events(raw, sites)), meta)
        trace.validate()
        return trace

    @classmethod
    def load(cls, path: str) -> Trace:
        try:
            with open(path, encoding="utf-8") as fh, gc_paused():
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


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a block that makes millions of objects and no
    garbage (a trace's events written, read or checked): each collection the new objects start
    walks every object made so far. Reading the events of a GRPO trace (3.08 million) took
    about 4x as long with the collector on (json.load 5.2 -> 1.8 s, the events checked 4.4 ->
    1.4 s; /tmp copy of that trace, 2 cores)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def allocation_digest(trace: Trace, extra: Any = None) -> str:
    """A digest of what the simulation consumes from the trace: each allocation's size, stream
    and site (category, phase, module, op), which allocation each free releases (by order, not
    by id), ``empty_cache`` calls, marks and the notes; plus ``extra`` (JSON: the per-GPU
    results, which carry what the environment changed). Two traces with one digest are replayed
    identically, so two runs of a program that differ in one option and share a digest show
    that the option's value does not change the program's memory."""
    digest = hashlib.sha256()
    order: Dict[int, int] = {}
    sites: Dict[Tuple[str, str, str, str], int] = {}
    lines: List[str] = []
    for event in trace.events:
        if event.op == ALLOC:
            order[event.id] = len(order)
            key = (event.category, event.phase, event.module, event.source)
            site = sites.get(key)
            if site is None:
                site = sites[key] = len(sites)
                lines.append("s" + json.dumps(list(key)))
            lines.append(f"a{event.size},{event.stream},{site}")
        elif event.op == FREE:
            lines.append(f"f{order.get(event.id, -1)}")
        else:
            lines.append(json.dumps(list(event)))
        if len(lines) >= 4096:
            digest.update("\n".join(lines).encode("utf-8"))
            lines = []
    digest.update("\n".join(lines).encode("utf-8"))
    notes = [[n.get("kind"), n.get("key") or n.get("message"), n.get("count"),
              n.get("extra_bytes")] for n in trace.notes()]
    digest.update(json.dumps([notes, extra], sort_keys=True, default=str).encode("utf-8"))
    return digest.hexdigest()[:32]


def mark_fields(label: str, prefix: str) -> Tuple[str, Dict[str, str]]:
    """A ``prefix`` mark's kind (the rest of its first word) and its ``key=value`` fields, as the
    probe writes ``cudnn:`` and ``reduce:`` marks; ValueError when ``label`` is not one."""
    head, _, rest = label.partition(" ")
    if not head.startswith(prefix) or len(head) == len(prefix):
        raise ValueError(f"not a {prefix} mark: {label!r}")
    return head[len(prefix):], dict(part.split("=", 1) for part in rest.split() if "=" in part)


def _category_str(category: Union[Category, str]) -> str:
    return category.value if isinstance(category, Category) else str(category)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


Site = Tuple[str, str, str, str]  # category, phase, module path, op


def _parse_sites(raw: Any) -> List[Site]:
    if not isinstance(raw, list):
        raise TraceError("a version-2 trace needs 'sites', a list of [category, phase, module, "
                         "op]")
    sites: List[Site] = []
    for index, item in enumerate(raw):
        if not (isinstance(item, list) and len(item) == 4
                and all(isinstance(v, str) for v in item)):
            raise TraceError(f"site {index}: expected [category, phase, module, op] strings, "
                             f"got {item!r:.80}")
        sites.append((item[0] or Category.OTHER.value, item[1], item[2], item[3]))
    return sites


def _read_well_formed(raw: List[Any], sites: List[Site]) -> Optional[List[Event]]:
    """A version-2 trace's events, checked as ``_parse_events`` and ``Trace.validate`` check
    them, in one pass that builds each event from its list without naming the checks (a
    GRPO trace of 3 million events is read about twice as fast); None at the first event
    that is not well formed, and then ``_parse_events`` names what is wrong with it."""
    made = tuple.__new__
    count = len(sites)
    live: set[int] = set()
    add, discard = live.add, live.discard
    events: List[Event] = []
    append = events.append
    for item in raw:
        if type(item) is not list or not item:
            return None
        op = item[0]
        if op == ALLOC:
            if len(item) != 5:
                return None
            _, ident, size, stream, site = item
            if not (type(ident) is int and type(size) is int and type(stream) is int
                    and type(site) is int and size >= 0 and stream >= 0 and 0 <= site < count
                    and ident not in live):
                return None
            add(ident)
            append(made(Alloc, (ALLOC, ident, size, stream) + sites[site]))
        elif op == FREE:
            if len(item) != 2 or type(item[1]) is not int or item[1] not in live:
                return None
            discard(item[1])
            append(made(Free, (FREE, item[1])))
        elif op == MARK:
            if len(item) != 2 or type(item[1]) is not str:
                return None
            append(made(Mark, (MARK, item[1])))
        elif op == EMPTY_CACHE:
            append(made(EmptyCache, (EMPTY_CACHE,)))
        else:
            return None
    return events


def _parse_events(raw: Iterable[Any], sites: Optional[List[Site]] = None) -> Iterator[Event]:
    for index, item in enumerate(raw):
        if not isinstance(item, list) or not item:
            raise TraceError(f"event {index}: expected a non-empty list, got {item!r:.60}")
        op = item[0]
        if op == ALLOC and sites is not None:
            if len(item) != 5:
                raise TraceError(f"event {index}: 'alloc' takes id, size, stream, site")
            ident, size, stream, site = item[1], item[2], item[3], item[4]
            _check_alloc(index, ident, size, stream)
            if not _is_count(site) or site >= len(sites):
                raise TraceError(f"event {index}: site must index 'sites' (0-{len(sites) - 1}), "
                                 f"got {site!r}")
            yield Alloc(ALLOC, ident, size, stream, *sites[site])
        elif op == ALLOC:
            if not 3 <= len(item) <= 6:
                raise TraceError(f"event {index}: 'alloc' takes id, size[, stream, category, phase]")
            ident, size = item[1], item[2]
            stream = item[3] if len(item) > 3 else 0
            category = item[4] if len(item) > 4 and item[4] else Category.OTHER.value
            phase = item[5] if len(item) > 5 and item[5] else ""
            _check_alloc(index, ident, size, stream)
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


def _check_alloc(index: int, ident: Any, size: Any, stream: Any) -> None:
    if not isinstance(ident, int) or isinstance(ident, bool):
        raise TraceError(f"event {index}: allocation id must be an integer, got {ident!r}")
    if not _is_count(size):
        raise TraceError(f"event {index}: size must be a non-negative integer, got {size!r}")
    if not _is_count(stream):
        raise TraceError(f"event {index}: stream must be a non-negative integer, got {stream!r}")
