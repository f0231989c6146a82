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

Expandable segments (``expandable_segments:True``) record ``segment_map`` / ``segment_unmap``
(pages mapped into, or unmapped from, one virtual range per stream and pool) instead of
``segment_alloc`` / ``segment_free``. Their replay needs the whole history (a trace that starts
from an empty allocator: the ring buffer kept every event), since pages mapped before the
trace cannot be told apart from pages the trace maps. The k-th virtual range the simulator
reserves gets the address of the first page the GPU mapped for the request that made it
(``find_expandable_block`` maps a new range from its start), so every later page and block can
land at the GPU's address; each request's maps and unmaps are compared with the GPU's, as are
the mapped bytes at the dump. Unmaps not followed by maps for the next request are an
``empty_cache``; unmaps followed by maps are the out-of-memory release-and-retry chain.

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
_EXPANDABLE_ACTIONS = ("segment_map", "segment_unmap")
_CUDAMALLOC_ACTIONS = ("segment_alloc", "segment_free")


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
    # expandable segments: the segment_* counts above count pages mapped and unmapped
    expandable: bool = False
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
        # expandable segments: the GPU's pages mapped for the request being replayed
        self.maps: List[Tuple[int, int]] = []
        self._ranges: Dict[int, int] = {}  # reserved virtual ranges: base -> size
        # every (address, event index, pool) the GPU mapped, pool = (stream, is_small) of the
        # request served; the event being replayed and its pool
        self.all_maps: List[Tuple[int, int, Tuple[int, bool]]] = []
        self.at = 0
        self.pool = (0, False)
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

    def reserve(self, size: int) -> Optional[int]:
        """A virtual range for an expandable segment: where the GPU mapped this request's
        first page when that address starts no range yet, else an address it never used.
        (A request may reserve twice: a range made, then released by the out-of-memory
        chain, then made again; so the maps stay set for the whole request.)"""
        maps = self.maps
        if maps and maps[0][0] not in self._ranges:
            addr: Optional[int] = maps[0][0]
        else:
            # a range made by a request that then ran out of memory maps nothing yet: it is
            # where the GPU next maps a page for the same pool outside every range it has
            addr = next((a for a, index, pool in self.all_maps
                         if index > self.at and pool == self.pool and
                         not any(b <= a < b + n for b, n in self._ranges.items())), None)
            if addr is None:
                addr = DeviceAddressSpace.malloc(self, size)
        if addr is not None:
            self._ranges[addr] = size
        return addr

    def unreserve(self, addr: int, size: int) -> None:
        del self._ranges[addr]
        if addr >= self._synthetic_base:
            DeviceAddressSpace.free(self, addr, size)


def replay_snapshot(data: Dict[str, Any], config: Optional[AllocatorConfig] = None,
                    device_total_bytes: Optional[int] = None) -> ReplayReport:
    """Replay every device's trace of a loaded snapshot and compare with the GPU's record.

    ``config`` overrides the allocator settings the snapshot recorded (to test a rule).
    ``device_total_bytes`` (the GPU's totalGlobalMem, which a snapshot does not record) sizes
    the virtual range of each expandable segment, 1 1/8 of it; the default (1 TiB) is larger
    than any GPU's, so a range runs out only where the GPU's would have run out first.
    """
    report = ReplayReport()
    traces = data["device_traces"]
    if config is None:
        config = config_from_snapshot_settings(data.get("allocator_settings"))
    report.expandable = config.expandable_segments
    devices = sorted({seg.get("device", 0) for seg in data["segments"]} |
                     set(range(len(traces))))
    report.devices = len(devices)
    for device in devices:
        segments = [s for s in data["segments"] if s.get("device", 0) == device]
        trace = traces[device] if device < len(traces) else []
        if config.expandable_segments:
            _replay_expandable_device(segments, trace, config, report, device,
                                      device_total_bytes)
        else:
            _replay_device(segments, trace, config, report, device)
    return report


def _replay_device(segments: List[Dict[str, Any]], trace: List[Dict[str, Any]], config: Any,
                   report: ReplayReport, device: int) -> None:
    if any(entry["action"] in _EXPANDABLE_ACTIONS for entry in trace) or \
            any(s.get("is_expandable") for s in segments):
        raise SnapshotError(f"device {device}: the snapshot maps expandable segments but its "
                            f"allocator_settings say expandable_segments is off")
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
            report.ooms_expected += expect_oom
            _limit_capacity(alloc, entry, reserved, bool(pending_frees))
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


def _replay_expandable_device(segments: List[Dict[str, Any]], trace: List[Dict[str, Any]],
                              config: AllocatorConfig, report: ReplayReport,
                              device: int, device_total_bytes: Optional[int]) -> None:
    """Replay one device's complete history of expandable segments (see the module's doc)."""
    if any(entry["action"] in _CUDAMALLOC_ACTIONS for entry in trace) or \
            any(not s.get("is_expandable", False) for s in segments):
        raise SnapshotError(f"device {device}: the snapshot's allocator_settings say "
                            f"expandable_segments is on, but it holds cudaMalloc'd segments "
                            f"(segment_alloc/segment_free, or a segment that is not "
                            f"expandable); a mix is not replayed")
    mapped = sum(e.get("size", 0) for e in trace if e["action"] == "segment_map") - \
        sum(e.get("size", 0) for e in trace if e["action"] == "segment_unmap")
    dumped = sum(s["total_size"] for s in segments)
    allocated: Set[int] = set()
    unknown_frees = 0
    for entry in trace:
        if entry["action"] == "alloc":
            allocated.add(entry.get("addr", 0))
        elif entry["action"] in _FREE_ACTIONS:
            if entry.get("addr", 0) in allocated:
                allocated.discard(entry.get("addr", 0))
            else:
                unknown_frees += 1
    if mapped != dumped or unknown_frees:
        raise SnapshotError(
            f"device {device}: the trace does not start from an empty allocator ({dumped} bytes "
            f"mapped at the dump, {mapped} mapped by the trace; {unknown_frees} frees of blocks "
            f"allocated before it): an expandable-segment snapshot replays only from its whole "
            f"history (record with a ring buffer, max_entries, larger than the run's events)")
    highest = max([s["address"] + s["total_size"] for s in segments] +
                  [e.get("addr", 0) + e.get("size", 0) for e in trace] + [0])
    device_mem = _ReplayDevice(max(DeviceAddressSpace.BASE, highest + (1 << 30)))
    alloc = CachingAllocator(config, device=device_mem, device_total_bytes=device_total_bytes)
    device_mem.all_maps = _maps_by_pool(alloc, trace)
    maps: List[Tuple[int, int]] = []
    unmaps: List[Tuple[int, int]] = []
    alloc.on_segment_alloc = lambda a, s, _st: maps.append((a, s))
    alloc.on_segment_free = lambda a, s, _st: unmaps.append((a, s))
    live: Dict[int, Any] = {}
    gpu_maps: List[Tuple[int, int]] = []
    gpu_unmaps: List[Tuple[int, int]] = []
    reserved = highest = 0  # the GPU's reserved bytes, and their high point in a request

    def compare(expected: List[Tuple[int, int]], got: List[Tuple[int, int]], where: str,
                verb: str) -> int:
        same = len(set(expected) & set(got))
        if expected != got:
            report.note(f"{where}: the GPU {verb} {_ranges_text(expected)}, the simulator "
                        f"{_ranges_text(got)}")
        return same

    def flush_empty_cache(where: str) -> None:
        nonlocal highest
        highest = reserved
        unmaps.clear()
        alloc.empty_cache()
        report.segment_frees_expected += len(gpu_unmaps)
        report.segment_frees_matched += compare(gpu_unmaps, unmaps, f"{where} (empty_cache)",
                                                "unmapped")
        gpu_unmaps.clear()

    for index, entry in enumerate(trace):
        report.events += 1
        action = entry["action"]
        addr, size, stream = entry.get("addr", 0), entry.get("size", 0), entry.get("stream", 0)
        if action == "segment_map":
            gpu_maps.append((addr, size))
            reserved += size
            highest = max(highest, reserved)
            continue
        if action == "segment_unmap":
            gpu_unmaps.append((addr, size))
            reserved -= size
            continue
        if action in ("alloc", "oom"):
            # as for cudaMalloc'd segments: the set released tells empty_cache (every whole
            # free page) from the out-of-memory chain (what this request needed)
            if gpu_unmaps and set(gpu_unmaps) == _unmappable(alloc):
                flush_empty_cache(f"event {index}")
            expect_oom = action == "oom"
            report.ooms_expected += expect_oom
            # pages mapped before a release were mapped, so the GPU had room for them too
            # (map_block maps page runs one by one; the one that failed came after them)
            _limit_capacity(alloc, entry, reserved if action == "oom" else highest,
                            bool(gpu_unmaps))
            device_mem.maps = list(gpu_maps)
            device_mem.at = index
            device_mem.pool = (stream, alloc.round_size(size) <= kSmallSize)
            maps.clear()
            unmaps.clear()
            try:
                block = alloc.malloc(size, stream)
            except SimulatedOutOfMemory:
                block = None
            alloc.capacity_bytes = None
            device_mem.maps = []
            where = f"event {index} ({size}-byte request)"
            report.segment_allocs_expected += len(gpu_maps)
            matched = compare(gpu_maps, maps, where, "mapped")
            report.segment_allocs_matched += matched
            report.segment_allocs_extra += len(maps) - matched
            if gpu_unmaps or unmaps:
                report.segment_frees_expected += len(gpu_unmaps)
                report.segment_frees_matched += compare(gpu_unmaps, unmaps, where, "unmapped")
            gpu_maps.clear()
            gpu_unmaps.clear()
            highest = reserved
            if expect_oom:
                report.ooms_matched += block is None
                if block is not None:
                    report.note(f"event {index}: the GPU ran out of memory, the simulator did not")
            elif block is not None:
                report.allocs += 1
                report.addresses_matched += block.addr == addr
                live[addr] = block
            continue
        if gpu_unmaps:
            flush_empty_cache(f"event {index}")
        if gpu_maps:
            report.segment_allocs_expected += len(gpu_maps)
            report.note(f"event {index}: the GPU mapped {_ranges_text(gpu_maps)} for no request")
            gpu_maps.clear()
        if action in _FREE_ACTIONS:
            block = live.pop(addr, None)
            if block is None:
                report.note(f"event {index}: free of {addr:#x}, which the replay does not hold")
            else:
                alloc.free(block)
    if gpu_unmaps:
        flush_empty_cache("at the dump")
    report.reserved_expected_bytes += dumped
    report.reserved_simulated_bytes += alloc.reserved_bytes
    report.segments_expected += len(segments)
    report.segments_simulated += len(alloc.segments())


def _maps_by_pool(alloc: CachingAllocator, trace: List[Dict[str, Any]]
                  ) -> List[Tuple[int, int, Tuple[int, bool]]]:
    """(address, event index, (stream, is_small)) of every segment_map, with the pool of the
    request it served (the next alloc or oom)."""
    out: List[Tuple[int, int, Tuple[int, bool]]] = []
    waiting: List[Tuple[int, int]] = []
    for index, entry in enumerate(trace):
        if entry["action"] == "segment_map":
            waiting.append((entry.get("addr", 0), index))
        elif entry["action"] in ("alloc", "oom") and waiting:
            pool = (entry.get("stream", 0), alloc.round_size(entry.get("size", 0)) <= kSmallSize)
            out += [(addr, i, pool) for addr, i in waiting]
            waiting = []
    return out


def _unmappable(alloc: CachingAllocator) -> Set[Tuple[int, int]]:
    """(address, bytes) of every range of whole pages empty_cache would unmap now: those inside
    each free mapped block of an expandable segment (``unmap_block``)."""
    out: Set[Tuple[int, int]] = set()
    for pool in alloc.pools():
        for block in pool.sorted_blocks():
            es = block.exp
            if es is None:
                continue
            begin = -(-(block.addr - es.base) // es.page)
            end = (block.addr + block.size - es.base) // es.page
            if begin < end:
                out.add((es.base + begin * es.page, (end - begin) * es.page))
    return out


def _ranges_text(ranges: List[Tuple[int, int]]) -> str:
    if not ranges:
        return "nothing"
    return ", ".join(f"{size} bytes at {addr:#x}" for addr, size in ranges)


def _limit_capacity(alloc: CachingAllocator, entry: Dict[str, Any], reserved: int,
                    released_first: bool) -> None:
    """What the GPU could still reserve for the request ``entry``: for an oom, its reserved
    bytes plus the free bytes it reported; after releases, its reserved bytes once the request
    was served (cudaMalloc, or mapping pages, failed until the releases were done)."""
    if entry["action"] == "oom":
        # PyTorch stores the device's free bytes under "device_free" for an oom entry
        free = entry.get("device_free", entry.get("addr", 0))
        alloc.capacity_bytes = reserved + (free if _is_int(free) else 0)
    elif released_first:
        alloc.capacity_bytes = reserved


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
