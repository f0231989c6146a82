"""The statistics ``torch.cuda.memory_stats()`` reports, kept the way the simulator needs them.

PyTorch keeps a ``Stat`` (current, peak, allocated = total increase, freed = total decrease)
per statistic and per pool type (``c10/core/CachingDeviceAllocator.h`` ``DeviceStats``;
``increase_stat``/``decrease_stat`` in ``CUDACachingAllocator.cpp``). Here each pool type (and
the aggregate) is one ``Counters`` object with plain integer slots: the allocator's hot path
updates them inline, and ``freed`` is derived as ``total - current`` instead of being stored.

Active blocks: PyTorch counts a freed block as active until the CUDA events of the streams it
was recorded on complete (``record_stream``). The trace format has no ``record_stream``, so
every block is active exactly while it is allocated and the ``active`` statistics equal the
``allocation`` ones; they are reported under both names.

Standard library only (probe bundle, Python >= 3.9).
"""

from __future__ import annotations

from typing import Dict, Tuple

# (name in memory_stats(), attribute prefix in Counters). "active" mirrors "allocation" and
# "active_bytes" mirrors "allocated_bytes", see the module docstring.
_STATS: Tuple[Tuple[str, str], ...] = (
    ("allocation", "alloc_n"),
    ("segment", "seg_n"),
    ("active", "alloc_n"),
    ("inactive_split", "split_n"),
    ("allocated_bytes", "alloc_b"),
    ("reserved_bytes", "res_b"),
    ("active_bytes", "alloc_b"),
    ("inactive_split_bytes", "split_b"),
    ("requested_bytes", "req_b"),
)
_PREFIXES = ("alloc_n", "alloc_b", "req_b", "seg_n", "res_b", "split_n", "split_b")


class Counters:
    """Current, peak and total-increase of every statistic for one pool type (or all pools)."""

    __slots__ = tuple(p + s for p in _PREFIXES for s in ("", "_peak", "_total"))
    # The slots above, spelled out for the type checker.
    alloc_n: int
    alloc_n_peak: int
    alloc_n_total: int
    alloc_b: int
    alloc_b_peak: int
    alloc_b_total: int
    req_b: int
    req_b_peak: int
    req_b_total: int
    seg_n: int
    seg_n_peak: int
    seg_n_total: int
    res_b: int
    res_b_peak: int
    res_b_total: int
    split_n: int
    split_n_peak: int
    split_n_total: int
    split_b: int
    split_b_peak: int
    split_b_total: int

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)

    def add_allocation(self, nbytes: int, requested: int) -> None:
        """A block of ``nbytes`` handed out for a request of ``requested`` bytes."""
        v = self.alloc_n + 1
        self.alloc_n = v
        self.alloc_n_total += 1
        if v > self.alloc_n_peak:
            self.alloc_n_peak = v
        v = self.alloc_b + nbytes
        self.alloc_b = v
        self.alloc_b_total += nbytes
        if v > self.alloc_b_peak:
            self.alloc_b_peak = v
        v = self.req_b + requested
        self.req_b = v
        self.req_b_total += requested
        if v > self.req_b_peak:
            self.req_b_peak = v

    def drop_allocation(self, nbytes: int, requested: int) -> None:
        self.alloc_n -= 1
        self.alloc_b -= nbytes
        self.req_b -= requested

    def add_segment(self, nbytes: int) -> None:
        n = self.seg_n + 1
        self.seg_n = n
        self.seg_n_total += 1
        if n > self.seg_n_peak:
            self.seg_n_peak = n
        self.add_reserved(nbytes)

    def drop_segment(self, nbytes: int) -> None:
        self.seg_n -= 1
        self.res_b -= nbytes

    def add_reserved(self, nbytes: int) -> None:
        b = self.res_b + nbytes
        self.res_b = b
        self.res_b_total += nbytes
        if b > self.res_b_peak:
            self.res_b_peak = b

    def add_split(self, count: int, nbytes: int) -> None:
        """Apply a net change of inactive split blocks (``count``) and bytes (either sign)."""
        if count:
            n = self.split_n + count
            self.split_n = n
            if count > 0:
                self.split_n_total += count
                if n > self.split_n_peak:
                    self.split_n_peak = n
        if nbytes:
            b = self.split_b + nbytes
            self.split_b = b
            if nbytes > 0:
                self.split_b_total += nbytes
                if b > self.split_b_peak:
                    self.split_b_peak = b


class OversizeStat:
    """A single ``Stat`` (oversize allocations or segments: only counted with max_split_size)."""

    __slots__ = ("current", "peak", "total")

    def __init__(self) -> None:
        self.current = self.peak = self.total = 0

    def increase(self) -> None:
        self.current += 1
        self.total += 1
        if self.current > self.peak:
            self.peak = self.current


def stats_dict(
    pools: Dict[str, Counters],
    oversize_allocations: OversizeStat,
    oversize_segments: OversizeStat,
    counters: Dict[str, int],
) -> Dict[str, int]:
    """Flatten into ``torch.cuda.memory_stats()`` keys, sorted like PyTorch sorts them.

    ``pools`` maps ``all``, ``small_pool``, ``large_pool`` to their counters; ``counters``
    holds the plain event counters (``num_alloc_retries``, ``num_ooms``, ...,
    ``max_split_size``).
    """
    out: Dict[str, int] = {}
    for stat, prefix in _STATS:
        for pool_name, c in pools.items():
            current = getattr(c, prefix)
            total = getattr(c, prefix + "_total")
            key = f"{stat}.{pool_name}."
            out[key + "current"] = current
            out[key + "peak"] = getattr(c, prefix + "_peak")
            out[key + "allocated"] = total
            out[key + "freed"] = total - current
    for name, stat_obj in (("oversize_allocations", oversize_allocations),
                           ("oversize_segments", oversize_segments)):
        out[name + ".current"] = stat_obj.current
        out[name + ".peak"] = stat_obj.peak
        out[name + ".allocated"] = stat_obj.total
        out[name + ".freed"] = stat_obj.total - stat_obj.current
    out.update(counters)
    return dict(sorted(out.items()))
