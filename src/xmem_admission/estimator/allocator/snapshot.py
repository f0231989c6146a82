"""Real-GPU ground truth: load ``torch.cuda.memory._dump_snapshot()`` pickles and replay them.

A snapshot holds the allocator's segments at the dump and a ring buffer of the events that led
there (``device_traces``: alloc, free_requested, free_completed, segment_alloc, segment_free,
oom, ...). The trace usually starts late (after the model was built), so the replay first
rebuilds the state that existed when recording began:

- segments: those at the dump that no ``segment_alloc`` of the trace created, plus those the
  trace released without having created them;
- live blocks in them: blocks the trace frees without having allocated them, and blocks still
  active at the dump that the trace never allocated. The dump gives the exact size of the
  latter; for the former the trace gives only the requested size, so the block is the rounded
  request, extended over the gap up to its neighbour when ``should_split`` could not have
  split that gap off (a large-pool remainder of at most 1 MiB, or any oversize block);

then replays every alloc and free in order through ``CachingAllocator`` configured from the
snapshot's ``allocator_settings``. New segments get the GPU's own address when the simulator
asks for the same size the trace's ``segment_alloc`` got, so best fit on (size, address) can
reproduce every placement. Releases are replayed as they show in the trace: a run of
``segment_free`` not followed by a new segment is an ``empty_cache``; one followed by a
``segment_alloc`` means cudaMalloc failed there, which the replay reproduces by limiting the
simulated capacity for that request to what the GPU had.

Loading is safe: the unpickler refuses every class, so a pickle can only build plain data.
Standard library only.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from bisect import bisect_left, bisect_right, insort
from typing import Any, Dict, List, Optional, Set, Tuple

from xmem_admission.contract.errors import AllocatorStateError, SimulatedOutOfMemory, SnapshotError
from xmem_admission.estimator.allocator.alloc_conf import (
    AllocatorConfig,
    config_from_snapshot_settings,
)
from xmem_admission.estimator.allocator.caching import CachingAllocator, kSmallSize
from xmem_admission.estimator.allocator.segments import DeviceAddressSpace
from xmem_admission.estimator.trace import Trace

_FREE_ACTIONS = ("free_completed", "free")  # "free": the name in early snapshot versions
_ACTIVE_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")
_UNSUPPORTED = ("segment_map", "segment_unmap")


class _DataOnlyUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, strings and numbers; refuses to look up any class."""

    def find_class(self, module: str, name: str) -> Any:
        raise SnapshotError(f"the pickle asks to load {module}.{name}; a memory snapshot holds "
                            f"only plain data, so it was not loaded")


def load_snapshot(path: str) -> Dict[str, Any]:
    """Read a snapshot pickle without executing anything it contains."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
    except FileNotFoundError:
        raise SnapshotError(f"{path}: no such file") from None
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return loads_snapshot(raw, path)


def loads_snapshot(raw: bytes, name: str = "snapshot") -> Dict[str, Any]:
    """``load_snapshot`` for bytes already in memory."""
    if not raw:
        raise SnapshotError(f"{name}: the file is empty")
    try:
        data = _DataOnlyUnpickler(io.BytesIO(raw)).load()
    except SnapshotError as exc:
        raise SnapshotError(f"{name}: {exc}") from None
    except EOFError:
        raise SnapshotError(f"{name}: the pickle is truncated") from None
    except (pickle.UnpicklingError, ValueError, TypeError, KeyError, IndexError,
            AttributeError, MemoryError, RecursionError, OverflowError) as exc:
        detail = str(exc) or type(exc).__name__
        if "truncated" in detail:
            raise SnapshotError(f"{name}: the pickle is truncated ({detail})") from None
        raise SnapshotError(f"{name}: not a readable pickle ({detail})") from None
    return _check_shape(data, name)


def _check_shape(data: Any, name: str) -> Dict[str, Any]:
    """``data`` itself once it has the shape of a memory snapshot; else SnapshotError."""
    if not isinstance(data, dict) or "segments" not in data or "device_traces" not in data:
        what = type(data).__name__ if not isinstance(data, dict) else \
            f"a dict with keys {sorted(map(str, data))[:6]}"
        raise SnapshotError(f"{name}: not a CUDA memory snapshot (expected a dict with "
                            f"'segments' and 'device_traces', got {what})")
    if not isinstance(data["segments"], list) or not isinstance(data["device_traces"], list):
        raise SnapshotError(f"{name}: 'segments' and 'device_traces' must be lists")
    for i, seg in enumerate(data["segments"]):
        if not isinstance(seg, dict) or not all(
                _is_int(seg.get(k)) for k in ("address", "total_size")) or \
                not isinstance(seg.get("blocks", []), list):
            raise SnapshotError(f"{name}: segment {i} lacks an integer address/total_size "
                                f"or a list of blocks")
    for d, trace in enumerate(data["device_traces"]):
        if not isinstance(trace, list):
            raise SnapshotError(f"{name}: device_traces[{d}] is not a list")
        for i, entry in enumerate(trace):
            if not isinstance(entry, dict) or not isinstance(entry.get("action"), str) or \
                    not all(_is_int(entry.get(k, 0)) for k in ("addr", "size", "stream")):
                raise SnapshotError(f"{name}: device {d} trace entry {i} is malformed "
                                    f"(needs an action and integer addr, size, stream)")
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass
class ReplayReport:
    """How a simulated replay of a snapshot's trace compares with the GPU's own record."""

    devices: int = 0
    events: int = 0
    allocs: int = 0
    addresses_matched: int = 0
    segment_allocs_expected: int = 0
    segment_allocs_matched: int = 0
    segment_allocs_extra: int = 0  # cudaMallocs the simulator made that the GPU did not
    segment_frees_expected: int = 0
    segment_frees_matched: int = 0
    ooms_expected: int = 0
    ooms_matched: int = 0
    reserved_expected_bytes: int = 0
    reserved_simulated_bytes: int = 0
    segments_expected: int = 0
    segments_simulated: int = 0
    mismatches: List[str] = dataclasses.field(default_factory=list)

    @property
    def match(self) -> bool:
        return (self.segment_allocs_matched == self.segment_allocs_expected
                and self.segment_allocs_extra == 0
                and self.segment_frees_matched == self.segment_frees_expected
                and self.ooms_matched == self.ooms_expected
                and self.reserved_simulated_bytes == self.reserved_expected_bytes)

    def note(self, text: str) -> None:
        if len(self.mismatches) < 20:
            self.mismatches.append(text)

    def to_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["match"] = self.match
        return out


class _ReplayDevice(DeviceAddressSpace):
    """cudaMalloc that answers with the GPU's address when the request is the GPU's request."""

    def __init__(self, synthetic_base: int):
        super().__init__(synthetic_base)
        self._synthetic_base = synthetic_base  # addresses the GPU never used start here
        self.expect: Optional[Tuple[int, int]] = None
        self._starts: List[int] = []
        self._ends: Dict[int, int] = {}

    def occupy(self, addr: int, size: int) -> None:
        insort(self._starts, addr)
        self._ends[addr] = addr + size

    def _is_free(self, addr: int, size: int) -> bool:
        i = bisect_right(self._starts, addr + size - 1)
        return i == 0 or self._ends[self._starts[i - 1]] <= addr

    def malloc(self, size: int) -> Optional[int]:
        expect, self.expect = self.expect, None
        if expect is not None and expect[1] == size and self._is_free(expect[0], size):
            addr: Optional[int] = expect[0]
        else:
            addr = super().malloc(size)
        if addr is None:
            return None
        self.occupy(addr, size)
        return addr

    def free(self, addr: int, size: int) -> None:
        self._starts.remove(addr)
        del self._ends[addr]
        if addr >= self._synthetic_base:
            super().free(addr, size)


def replay_snapshot(data: Dict[str, Any], config: Optional[AllocatorConfig] = None) -> ReplayReport:
    """Replay every device's trace of a loaded snapshot and compare with the GPU's record.

    ``config`` overrides the allocator settings the snapshot recorded (to test a rule).
    """
    report = ReplayReport()
    traces = data["device_traces"]
    if config is None:
        config = config_from_snapshot_settings(data.get("allocator_settings"))
    if config.expandable_segments:
        raise SnapshotError("the snapshot uses expandable segments, whose replay is not "
                            "supported (their pages are mapped, not cudaMalloc'd)")
    devices = sorted({seg.get("device", 0) for seg in data["segments"]} |
                     set(range(len(traces))))
    report.devices = len(devices)
    for device in devices:
        segments = [s for s in data["segments"] if s.get("device", 0) == device]
        trace = traces[device] if device < len(traces) else []
        _replay_device(segments, trace, config, report, device)
    return report


def _replay_device(segments: List[Dict[str, Any]], trace: List[Dict[str, Any]], config: Any,
                   report: ReplayReport, device: int) -> None:
    for entry in trace:
        if entry["action"] in _UNSUPPORTED or any(s.get("is_expandable") for s in segments):
            raise SnapshotError(f"device {device}: the snapshot uses expandable segments, whose "
                                f"replay is not supported")
    # Pass 1: which segments and blocks existed before the trace started.
    created: Dict[int, int] = {}
    freed_before_created: List[Tuple[int, int, int]] = []
    trace_live: Set[int] = set()
    freed_preexisting: Dict[int, Tuple[int, int]] = {}  # address -> (requested, event index)
    trace_allocs: List[Tuple[int, int]] = []  # (address, event index) of every alloc
    for index, entry in enumerate(trace):
        action, addr = entry["action"], entry.get("addr", 0)
        if action == "segment_alloc":
            created[addr] = entry.get("size", 0)
        elif action == "segment_free":
            if created.pop(addr, None) is None:
                freed_before_created.append((addr, entry.get("size", 0), entry.get("stream", 0)))
        elif action == "alloc":
            trace_live.add(addr)
            trace_allocs.append((addr, index))
        elif action in _FREE_ACTIONS:
            if addr in trace_live:
                trace_live.discard(addr)
            elif addr not in freed_preexisting:
                freed_preexisting[addr] = (entry.get("size", 0), index)
    trace_allocs.sort()
    initial: List[Tuple[int, int, int, bool]] = [
        (s["address"], s["total_size"], s.get("stream", 0), s.get("segment_type") == "small")
        for s in segments if s["address"] not in created]
    # A released segment of kSmallBuffer (2 MiB) bytes can only be a small-pool one.
    initial += [(a, size, stream, size == 2 * kSmallSize)
                for a, size, stream in freed_before_created]
    initial.sort()
    dump_blocks = {b["address"]: b for s in segments for b in s.get("blocks", [])
                   if isinstance(b, dict) and b.get("state") in _ACTIVE_STATES
                   and _is_int(b.get("address")) and _is_int(b.get("size"))}
    highest = max([a + size for a, size, _, _ in initial] +
                  [e.get("addr", 0) + e.get("size", 0) for e in trace] + [0])
    # Segments the GPU did not make get addresses above every address the snapshot names.
    device_mem = _ReplayDevice(max(DeviceAddressSpace.BASE, highest + (1 << 30)))
    alloc = CachingAllocator(config, device=device_mem)
    live = _restore(alloc, device_mem, initial, dump_blocks, trace_live, freed_preexisting,
                    trace_allocs, report)
    _replay_events(alloc, device_mem, trace, live, sum(s[1] for s in initial), report)
    report.reserved_expected_bytes += sum(s["total_size"] for s in segments)
    report.reserved_simulated_bytes += alloc.reserved_bytes
    report.segments_expected += len(segments)
    report.segments_simulated += len(alloc.segments())


def _restore(alloc: CachingAllocator, device_mem: _ReplayDevice,
             initial: List[Tuple[int, int, int, bool]], dump_blocks: Dict[int, Dict[str, Any]],
             trace_live: Set[int], freed_preexisting: Dict[int, Tuple[int, int]],
             trace_allocs: List[Tuple[int, int]], report: ReplayReport) -> Dict[int, Any]:
    """Rebuild the pre-trace segments; returns address -> simulated block of live blocks."""
    starts = [a for a, _, _, _ in initial]
    per_segment: Dict[int, List[Tuple[int, Optional[int], int]]] = {a: [] for a in starts}

    def owner(addr: int) -> Optional[int]:
        i = bisect_right(starts, addr) - 1
        if i >= 0 and addr < starts[i] + initial[i][1]:
            return starts[i]
        return None

    for addr, dumped in dump_blocks.items():
        seg = owner(addr)
        if seg is not None and addr not in trace_live and addr not in freed_preexisting:
            per_segment[seg].append((addr, dumped["size"], dumped.get("requested_size", 0)))
    for addr, (requested, _index) in freed_preexisting.items():
        seg = owner(addr)
        if seg is None:
            report.note(f"free of {addr:#x}, which lies in no segment that existed before "
                        f"the trace")
            continue
        per_segment[seg].append((addr, None, requested))
    live: Dict[int, Any] = {}
    for seg_addr, seg_size, stream, is_small in initial:
        blocks = sorted(per_segment[seg_addr])
        resolved = []
        for i, (addr, size, requested) in enumerate(blocks):
            if size is None:
                limit = blocks[i + 1][0] if i + 1 < len(blocks) else seg_addr + seg_size
                rounded = alloc.round_size(requested)
                # The first allocation into the gap before this block is freed starts where
                # the free space after it starts: the block's true end.
                evidence = _first_alloc_between(trace_allocs, addr + rounded, limit,
                                                freed_preexisting[addr][1])
                size = _infer_block_size(alloc, rounded, limit - addr, is_small,
                                         None if evidence is None else evidence - addr)
            resolved.append((addr, size, requested))
        try:
            restored = alloc.restore_segment(seg_addr, seg_size, stream, is_small, resolved)
        except AllocatorStateError as exc:
            raise SnapshotError(f"the snapshot's segments are inconsistent: {exc}") from None
        device_mem.occupy(seg_addr, seg_size)
        for block in restored:
            live[block.addr] = block
    return live


def _first_alloc_between(trace_allocs: List[Tuple[int, int]], start: int, end: int,
                         before: int) -> Optional[int]:
    """Address of the earliest trace alloc (event index < ``before``) in [start, end)."""
    i = bisect_left(trace_allocs, (start, -1))
    best: Optional[Tuple[int, int]] = None
    while i < len(trace_allocs) and trace_allocs[i][0] < end:
        addr, index = trace_allocs[i]
        if index < before and (best is None or index < best[1]):
            best = (addr, index)
        i += 1
    return None if best is None else best[0]


def _infer_block_size(alloc: CachingAllocator, size: int, room: int, is_small: bool,
                      evidence: Optional[int]) -> int:
    """The size of a block known by its rounded request ``size``, ``room`` bytes from its
    start to the next known block; ``evidence``: where the free space after it began, if an
    allocation landed there first."""
    if size >= room:
        return room
    if is_small:
        return size  # small-pool blocks split whenever >= 512 bytes remain
    if size >= alloc.config.max_split_size:
        return room  # oversize blocks are never split
    if evidence is not None and 0 <= evidence - size <= kSmallSize:
        return evidence  # an unsplit remainder of at most 1 MiB, then free space
    if room - size <= kSmallSize:
        return room  # should_split could not have split the rest off
    return size


def _replay_events(alloc: CachingAllocator, device_mem: _ReplayDevice,
                   trace: List[Dict[str, Any]], live: Dict[int, Any], reserved: int,
                   report: ReplayReport) -> None:
    created: List[Tuple[int, int]] = []
    released: List[Tuple[int, int]] = []
    alloc.on_segment_alloc = lambda a, s, _st: created.append((a, s))
    alloc.on_segment_free = lambda a, s, _st: released.append((a, s))
    pending_alloc: Optional[Tuple[int, int]] = None
    pending_frees: List[Tuple[int, int]] = []
    implied: Optional[Tuple[int, int]] = None  # a segment_alloc the ring buffer cut off
    first_request = True

    def flush_empty_cache() -> None:
        released.clear()
        alloc.empty_cache()
        _compare_frees(pending_frees, released, "empty_cache", report)
        pending_frees.clear()

    for index, entry in enumerate(trace):
        report.events += 1
        action = entry["action"]
        addr, size, stream = entry.get("addr", 0), entry.get("size", 0), entry.get("stream", 0)
        if action == "segment_alloc":
            pending_alloc = (addr, size)
            reserved += size
            continue
        if action == "segment_free":
            pending_frees.append((addr, size))
            reserved -= size
            continue
        if action in ("alloc", "oom"):
            # Releases right before a request: an empty_cache() call, or cudaMalloc failing
            # for this request (release steps, then retry). The trace shows both the same
            # way; the failure chain runs only after the cache had no block for the request,
            # while empty_cache frees every wholly free segment, so: the set released decides.
            if pending_frees and set(pending_frees) == _releasable(alloc):
                flush_empty_cache()
            if first_request and pending_alloc is None and action == "alloc":
                implied = _cut_off_segment(alloc, addr, size, stream)
                pending_alloc = implied
            first_request = False
            expect_oom = action == "oom"
            if expect_oom:
                report.ooms_expected += 1
                # PyTorch stores the device's free bytes under "device_free" for an oom entry
                free = entry.get("device_free", addr)
                alloc.capacity_bytes = reserved + (free if _is_int(free) else 0)
            elif pending_frees:
                alloc.capacity_bytes = reserved  # cudaMalloc failed until the frees were done
            if pending_alloc is not None and implied is None:
                report.segment_allocs_expected += 1
            device_mem.expect = pending_alloc
            created.clear()
            released.clear()
            try:
                block = alloc.malloc(size, stream)
            except SimulatedOutOfMemory:
                block = None
            alloc.capacity_bytes = None
            device_mem.expect = None
            if implied is not None:
                if created != [implied]:
                    report.note(f"event {index}: the request that opens the trace did not get "
                                f"the segment it must have been given")
                    report.segment_allocs_extra += 1
                created.clear()
                pending_alloc = implied = None
            _compare_request(index, entry, block, pending_alloc, created, report)
            if pending_frees:
                _compare_frees(pending_frees, released, f"event {index}", report)
            pending_alloc = None
            pending_frees = []
            if expect_oom:
                report.ooms_matched += block is None
                if block is not None:
                    report.note(f"event {index}: the GPU ran out of memory, the simulator did not")
            elif block is not None:
                report.allocs += 1
                live[addr] = block
            continue
        if pending_frees:
            flush_empty_cache()
        if action in _FREE_ACTIONS:
            first_request = False
            block = live.pop(addr, None)
            if block is None:
                report.note(f"event {index}: free of {addr:#x}, which the replay does not hold")
            else:
                alloc.free(block)
    if pending_frees:
        flush_empty_cache()


def _cut_off_segment(alloc: CachingAllocator, addr: int, size: int,
                     stream: int) -> Optional[Tuple[int, int]]:
    """The trace's first request landed at the start of a wholly free segment that best fit
    would not have chosen: the segment was cudaMalloc'd for it just before the ring buffer's
    first entry. Un-restore it and return (address, size) to hand out again, else None."""
    head = alloc._segments.get(addr)
    if head is None or head.allocated or head.next is not None:
        return None
    if alloc.peek_free_block(size, stream) is head:
        return None
    segment = (addr, head.size)
    alloc.release_segment(addr)
    return segment


def _releasable(alloc: CachingAllocator) -> Set[Tuple[int, int]]:
    """(address, size) of every segment empty_cache would release now (wholly free ones)."""
    return {(seg["address"], seg["total_size"]) for seg in alloc.segments()
            if len(seg["blocks"]) == 1 and seg["allocated_size"] == 0 and not seg["is_expandable"]}


def _compare_request(index: int, entry: Dict[str, Any], block: Any,
                     expected: Optional[Tuple[int, int]], created: List[Tuple[int, int]],
                     report: ReplayReport) -> None:
    if expected is not None:
        if created == [expected]:
            report.segment_allocs_matched += 1
        else:
            got = ", ".join(f"{s} bytes" for _, s in created) or "no new segment"
            report.note(f"event {index}: the GPU made a {expected[1]}-byte segment for a "
                        f"{entry.get('size', 0)}-byte request, the simulator {got}")
    elif created:
        report.segment_allocs_extra += len(created)
        report.note(f"event {index}: the simulator made a {created[0][1]}-byte segment for a "
                    f"{entry.get('size', 0)}-byte request the GPU served from its cache")
    if block is not None and entry["action"] == "alloc":
        if block.addr == entry.get("addr"):
            report.addresses_matched += 1


def _compare_frees(expected: List[Tuple[int, int]], released: List[Tuple[int, int]],
                   where: str, report: ReplayReport) -> None:
    report.segment_frees_expected += len(expected)
    matched = len(set(expected) & set(released))
    report.segment_frees_matched += matched
    if matched != len(expected) or len(released) != len(expected):
        report.note(f"{where}: the GPU released {len(expected)} segments, the simulator "
                    f"{len(released)} ({matched} the same)")


def trace_from_snapshot(data: Dict[str, Any], device: int = 0) -> Trace:
    """The alloc/free stream of one device's trace as an xmem trace (ids = event order).

    Frees of blocks allocated before recording began are dropped (the trace does not hold
    their allocation), so the result replays from an empty allocator.
    """
    traces = data["device_traces"]
    if not 0 <= device < len(traces):
        raise SnapshotError(f"the snapshot has no trace for device {device}")
    out = Trace(meta={"source": "torch.cuda.memory._dump_snapshot", "device": device})
    live: Dict[int, int] = {}
    for index, entry in enumerate(traces[device]):
        action = entry["action"]
        if action == "alloc":
            live[entry.get("addr", 0)] = index
            out.alloc(index, entry.get("size", 0), entry.get("stream", 0))
        elif action in _FREE_ACTIONS:
            ident = live.pop(entry.get("addr", 0), None)
            if ident is not None:
                out.free(ident)
    return out
