"""Replay an allocation trace through the caching-allocator simulator.

This is the estimator's entry point into the allocator: ``simulate(trace, ...)`` runs every
event of an ``xmem_admission.estimator.trace.Trace`` in order and returns the peaks, the PyTorch-style
statistics, a per-category breakdown of what was allocated at each peak and, on request, a
timeline. A simulated out-of-memory stops the replay where a real job would have died; the
peaks are those reached before it.

Zero-byte allocations never reach PyTorch's caching allocator (``NativeCachingAllocator::
allocate`` skips ``malloc`` when ``size == 0``), so they are tracked but cost nothing here.
Standard library only (probe bundle, Python >= 3.9).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from xmem_admission.contract.cudnn import TRANSIENT_PREFIX, later_plans
from xmem_admission.contract.errors import SimulatedOutOfMemory, TraceError
from xmem_admission.estimator.allocator.alloc_conf import AllocatorConfig
from xmem_admission.estimator.allocator.caching import CachingAllocator
from xmem_admission.estimator.trace import ALLOC, EMPTY_CACHE, FREE, Category, Trace

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class OutOfMemoryInfo:
    """Where and in what state the simulated allocator ran out of memory."""

    event_index: int
    requested_bytes: int
    allocation_bytes: int  # the cudaMalloc size that failed (PyTorch's "tried to allocate")
    stream: int
    allocated_bytes: int
    reserved_bytes: int
    free_cached_bytes: int
    capacity_bytes: Optional[int]
    allowed_bytes: Optional[int]
    message: str

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class SimulationResult:
    """What a replay of a trace produced (all sizes in bytes)."""

    stats: Dict[str, int]
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    oom: Optional[OutOfMemoryInfo]
    num_events: int  # events replayed, the failing one included
    allocated_by_category_at_peak_reserved: Dict[str, int]
    allocated_by_category_at_peak_allocated: Dict[str, int]
    peak_reserved_event: int  # index of the event that reached the reserved peak (-1: none)
    peak_allocated_event: int
    # the allocated and inactive-split bytes right after ``peak_reserved_event`` (what
    # ``peak.itemise`` reads there without replaying the trace again)
    allocated_at_peak_reserved: int
    inactive_split_at_peak_reserved: int
    timeline: Optional[List[Tuple[int, int, int]]]  # (event index, allocated, reserved)
    config: AllocatorConfig
    capacity_bytes: Optional[int]
    # whether the result depends on ``capacity_bytes``: the capacity refused memory at least
    # once (so cached blocks were released, or the replay ran out), or a memory fraction
    # derived its limit from it. When False the replay ran as with no limit, and it is the
    # replay under any capacity of at least ``peak_reserved_bytes`` (``replays.Replays``).
    capacity_bound: bool = True

    def to_dict(self, include_stats: bool = True) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "peak_allocated_bytes": self.peak_allocated_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "oom": self.oom.to_dict() if self.oom else None,
            "num_events": self.num_events,
            "peak_reserved_event": self.peak_reserved_event,
            "peak_allocated_event": self.peak_allocated_event,
            "allocated_at_peak_reserved": self.allocated_at_peak_reserved,
            "inactive_split_at_peak_reserved": self.inactive_split_at_peak_reserved,
            "allocated_by_category_at_peak_reserved":
                dict(self.allocated_by_category_at_peak_reserved),
            "allocated_by_category_at_peak_allocated":
                dict(self.allocated_by_category_at_peak_allocated),
            "capacity_bytes": self.capacity_bytes,
            "allocator_config": self.config.to_dict(),
        }
        if include_stats:
            out["stats"] = dict(self.stats)
        if self.timeline is not None:
            out["timeline"] = [list(sample) for sample in self.timeline]
        return out


def simulate(
    trace: Trace,
    config: Optional[AllocatorConfig] = None,
    capacity_bytes: Optional[int] = None,
    memory_fraction: Optional[float] = None,
    timeline: bool = False,
    device_total_bytes: Optional[int] = None,
) -> SimulationResult:
    """Replay ``trace`` through a fresh ``CachingAllocator`` configured by ``config``.

    ``capacity_bytes`` is what the allocator may reserve (None: unlimited);
    ``memory_fraction`` and ``device_total_bytes`` model a per-process memory fraction
    (see ``CachingAllocator``). Raises ``TraceError`` for a free of an unknown id or a
    reused live id (traces loaded from disk are validated up front).
    """
    config = config if config is not None else AllocatorConfig()
    alloc = CachingAllocator(config, capacity_bytes, memory_fraction,
                             device_total_bytes=device_total_bytes)
    counters = alloc.counters
    malloc = alloc.malloc
    free = alloc.free
    names: List[str] = [c.value for c in Category]
    index_of: Dict[str, int] = {name: i for i, name in enumerate(names)}
    sums: List[int] = [0] * len(names)
    at_peak_allocated: List[int] = list(sums)
    at_peak_reserved: List[int] = list(sums)
    peak_allocated = peak_reserved = 0
    peak_allocated_event = peak_reserved_event = -1
    allocated_at_peak_reserved = split_at_peak_reserved = 0
    live: Dict[Any, Any] = {}
    samples: Optional[List[Tuple[int, int, int]]] = [] if timeline else None
    last_sample = (0, 0)
    oom: Optional[OutOfMemoryInfo] = None
    events = trace.events
    num_events = len(events)
    for index, event in enumerate(events):
        if event.op == ALLOC:
            ident = event.id
            if ident in live:
                raise TraceError(f"event {index}: allocation id {ident!r} is already live")
            size = event.size
            if size == 0:
                live[ident] = None
                continue
            category = event.category
            ci = index_of.get(category)
            if ci is None:
                ci = index_of[category] = len(names)
                names.append(category)
                sums.append(0)
                at_peak_allocated.append(0)
                at_peak_reserved.append(0)
            try:
                block = malloc(size, event.stream)
            except SimulatedOutOfMemory as exc:
                try:
                    if not event.phase.startswith(TRANSIENT_PREFIX):
                        raise
                    # a cuDNN workspace that does not fit: PyTorch runs the next plan
                    # (Conv_v8.cpp, try_plans), no OOM
                    next_block = _next_plan(malloc, event.phase, event.stream, exc)
                except SimulatedOutOfMemory as failed:
                    oom = _oom_info(index, failed)
                    num_events = index + 1
                    break
                if next_block is None:
                    live[ident] = None
                    continue
                block = next_block
            block.tag = ci
            live[ident] = block
            sums[ci] += block.size
            allocated = counters.alloc_b
            if allocated > peak_allocated:
                peak_allocated = allocated
                peak_allocated_event = index
                at_peak_allocated = sums[:]
            reserved = counters.res_b
            if reserved > peak_reserved:
                peak_reserved = reserved
                peak_reserved_event = index
                at_peak_reserved = sums[:]
                allocated_at_peak_reserved = allocated
                split_at_peak_reserved = counters.split_b
        elif event.op == FREE:
            block = live.pop(event.id, _MISSING)
            if block is None:
                continue
            if block is _MISSING:
                raise TraceError(f"event {index}: free of id {event.id!r}, "
                                 f"which is not a live allocation")
            sums[block.tag] -= block.size
            free(block)
        elif event.op == EMPTY_CACHE:
            alloc.empty_cache()
        else:
            continue
        if samples is not None:
            state = (counters.alloc_b, counters.res_b)
            if state != last_sample:
                samples.append((index, state[0], state[1]))
                last_sample = state
    stats = alloc.stats()
    return SimulationResult(
        stats=stats,
        peak_allocated_bytes=stats["allocated_bytes.all.peak"],
        peak_reserved_bytes=stats["reserved_bytes.all.peak"],
        oom=oom,
        num_events=num_events,
        allocated_by_category_at_peak_reserved=dict(zip(names, at_peak_reserved)),
        allocated_by_category_at_peak_allocated=dict(zip(names, at_peak_allocated)),
        peak_reserved_event=peak_reserved_event,
        peak_allocated_event=peak_allocated_event,
        allocated_at_peak_reserved=allocated_at_peak_reserved,
        inactive_split_at_peak_reserved=split_at_peak_reserved,
        timeline=samples,
        config=config,
        capacity_bytes=capacity_bytes,
        capacity_bound=alloc.capacity_refusals > 0 or alloc.allowed_bytes is not None,
    )


def _next_plan(malloc: Any, phase: str, stream: int, failed: SimulatedOutOfMemory) -> Any:
    """``try_plans`` after a convolution's first workspace did not fit: the block of the first
    later plan the allocator gives, None when a plan that needs no workspace runs (or, for a
    workspace without its plans, the fitted rule's, the next plan is taken to need none);
    the last failure is raised when no plan is left (torch: "unable to find an engine")."""
    sizes = later_plans(phase)
    if sizes is None:
        return None
    for size in sizes:
        if size == 0:
            return None
        try:
            return malloc(size, stream)
        except SimulatedOutOfMemory as exc:
            failed = exc
    raise failed


def _oom_info(index: int, exc: SimulatedOutOfMemory) -> OutOfMemoryInfo:
    return OutOfMemoryInfo(
        event_index=index, requested_bytes=exc.requested_bytes, allocation_bytes=exc.allocation_bytes,
        stream=exc.stream, allocated_bytes=exc.allocated_bytes,
        reserved_bytes=exc.reserved_bytes, free_cached_bytes=exc.free_cached_bytes,
        capacity_bytes=exc.capacity_bytes, allowed_bytes=exc.allowed_bytes, message=str(exc))
