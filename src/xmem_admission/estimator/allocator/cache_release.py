"""Giving cached memory back to CUDA, mixed into ``CachingAllocator``.

The three ways PyTorch's caching allocator returns segments (``CUDACachingAllocator.cpp``,
2.9-2.11): ``release_available_cached_blocks`` (the first step after a failed cudaMalloc, only
with ``max_split_size_mb``: free one oversize cached block large enough, else the largest ones
until enough), ``release_cached_blocks`` (``empty_cache`` and the last step before an OOM: free
every cached segment that is wholly free, unmap free pages of expandable segments) and
``garbage_collect_cached_blocks`` (with ``garbage_collection_threshold`` and a memory fraction:
free the unsplit large cached blocks that went unused longest, before cudaMalloc is tried).
Standard library only.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from xmem_admission.estimator.allocator.blocks import SHIFT, Block, BlockPool, PoolKind, SegmentHook

if TYPE_CHECKING:  # pragma: no cover
    from xmem_admission.estimator.allocator.alloc_conf import AllocatorConfig
    from xmem_admission.estimator.allocator.segments import DeviceAddressSpace
    from xmem_admission.estimator.allocator.statistics import Counters, OversizeStat


class CacheReleaseMixin:
    """The release half of ``CachingAllocator`` (uses its attributes)."""

    # What this half uses of ``CachingAllocator`` (set by its __init__).
    config: AllocatorConfig
    allowed_bytes: Optional[int]
    device: DeviceAddressSpace
    total_reserved: int
    num_device_free: int
    num_sync_all_streams: int
    oversize_segments: OversizeStat
    on_segment_free: Optional[SegmentHook]
    _mss: int
    _all: Counters
    _large: PoolKind
    _pools: Dict[int, Tuple[BlockPool, BlockPool]]
    _segments: Dict[int, Block]

    if TYPE_CHECKING:  # pragma: no cover
        def pools(self) -> List[BlockPool]: ...

        def _release_expandable_block(self, block: Block) -> None: ...

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every cached segment that is wholly free."""
        self._release_cached_blocks()

    def _release_block(self, block: Block) -> None:
        """``release_block``: cudaFree a wholly free, unsplit, cached segment."""
        if block.prev is not None or block.next is not None or block.allocated or block.exp:
            raise AssertionError(f"release of {block!r}, which is not a whole free segment")
        pool = block.pool
        size = block.size
        self.num_device_free += 1
        pool.discard(block)
        del self._segments[block.addr]
        self.device.free(block.addr, size)
        self.total_reserved -= size
        pool.kind.counters.drop_segment(size)
        self._all.drop_segment(size)
        if size >= self._mss:
            self.oversize_segments.current -= 1
        if self.on_segment_free is not None:
            self.on_segment_free(block.addr, size, pool.stream)

    def _release_available_cached_blocks(self, pool: BlockPool, rsize: int) -> bool:
        """Free one oversize cached block big enough, else the largest ones until enough."""
        mss = self._mss
        if not self.config.max_split_size_limited:
            return False
        target = rsize if rsize >= mss else mss
        keys = pool.keys
        i = bisect_left(keys, target << SHIFT)
        if i < len(keys) and pool.blocks[keys[i]].exp is None:
            self._release_block(pool.blocks[keys[i]])
            return True
        if i == 0:
            return False
        released = 0
        j = i - 1  # the largest block below the target; walk down while oversize
        while released < target and j >= 0 and (keys[j] >> SHIFT) >= mss:
            block = pool.blocks[keys[j]]
            if block.exp is None:
                released += block.size
                self._release_block(block)  # removes keys[j]; lower indices are unchanged
            j -= 1
        return released >= target

    def _release_cached_blocks(self) -> None:
        """``release_cached_blocks``: sync all streams, free every unsplit cached segment."""
        self.num_sync_all_streams += 1  # synchronize_and_free_events
        for pool in self.pools():
            to_unmap = []
            for block in pool.sorted_blocks():
                if block.exp is not None:
                    to_unmap.append(block)
                elif block.prev is None and block.next is None:
                    self._release_block(block)
            for block in to_unmap:
                self._release_expandable_block(block)

    def _garbage_collect(self) -> None:
        """``garbage_collect_cached_blocks``: free the oldest unsplit large cached blocks."""
        assert self.allowed_bytes is not None, "garbage collection needs a memory fraction"
        threshold = int(self.config.garbage_collection_threshold * self.allowed_bytes)
        if self.total_reserved <= threshold:
            return
        target = self.total_reserved - threshold
        clock = self._large.gc_calls
        large = [self._pools[s][1] for s in sorted(self._pools)]
        freeable = [b for p in large for b in p.sorted_blocks() if b.prev is None and b.next is None]
        count = len(freeable)
        if not count:
            return
        total_age = sum(clock - b.gc_base for b in freeable)
        reclaimed = 0
        freed_one = True
        while reclaimed < target and freed_one and count > 0:
            age_threshold = total_age / count
            freed_one = False
            for pool in large:
                for block in pool.sorted_blocks():
                    if block.prev is None and block.next is None and block.exp is None and \
                            clock - block.gc_base >= age_threshold:
                        freed_one = True
                        reclaimed += block.size
                        total_age -= clock - block.gc_base
                        count -= 1
                        self._release_block(block)
