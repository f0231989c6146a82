"""Expandable segments (``expandable_segments:True``), mixed into ``CachingAllocator``.

Follows ``ExpandableSegment`` and the ``find_expandable_block`` / ``map_block`` /
``try_allocate_expandable_block`` / ``unmap_block`` / ``release_expandable_segment`` functions
of ``c10/cuda/CUDACachingAllocator.cpp`` (2.9-2.11). Each (stream, pool) reserves one virtual
range of 1 1/8 times the GPU's memory and maps physical pages into it on demand: 2 MiB pages for
the small pool, ``large_segment_size`` (20 MiB) pages for the large pool. Reserved memory is the
mapped pages; it grows by whole pages at the lowest address that fits the request, and only
``empty_cache`` or the out-of-memory release step unmaps wholly free pages again.

Two PyTorch details worth knowing: mapping pages does not count as a new ``segment`` in the
statistics (only ``reserved_bytes`` and ``num_device_alloc`` move), and blocks in expandable
segments never count as ``inactive_split``. Standard library only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, Optional, Tuple

from xmem_admission.estimator.allocator.blocks import (
    Block,
    BlockPool,
    ExpandableSegment,
    SegmentHook,
    merge_neighbours,
)

if TYPE_CHECKING:  # pragma: no cover
    from xmem_admission.estimator.allocator.alloc_conf import AllocatorConfig
    from xmem_admission.estimator.allocator.segments import DeviceAddressSpace
    from xmem_admission.estimator.allocator.statistics import Counters

kSmallBuffer = 2097152  # small-pool page size (CUDACachingAllocator.cpp kSmallBuffer, 2 MiB)
# Virtual size assumed when neither the capacity nor the device total is known: only the
# address layout depends on it (ExpandableSegment reserves 1 1/8 x totalGlobalMem).
DEFAULT_DEVICE_TOTAL = 1 << 40


class ExpandableSegmentsMixin:
    """The expandable-segment half of ``CachingAllocator`` (uses its attributes)."""

    # What this half uses of ``CachingAllocator`` (set by its __init__).
    config: AllocatorConfig
    capacity_bytes: Optional[int]
    device_total_bytes: Optional[int]
    device: DeviceAddressSpace
    total_reserved: int
    capacity_refusals: int
    num_device_alloc: int
    num_device_free: int
    on_segment_alloc: Optional[SegmentHook]
    on_segment_free: Optional[SegmentHook]
    _all: Counters

    def _init_expandable(self) -> None:
        self._exp_segments: List[ExpandableSegment] = []

    def _expandable_heads(self) -> List[Block]:
        return [es.head for es in self._exp_segments]

    # -- finding room ---------------------------------------------------------------------
    def _expandable_best_fit(self, pool: BlockPool, i: int, block: Block) -> Tuple[int, Block]:
        """``get_free_block`` for expandable blocks: the size a block can grow to counts."""
        keys = pool.keys
        blocks = pool.blocks

        def growable(b: Block) -> int:
            nxt = b.next
            return b.size + (nxt.size if nxt is not None and not nxt.mapped else 0)

        j = i + 1
        while block.exp is not None and j < len(keys):
            candidate = blocks[keys[j]]
            if growable(candidate) >= growable(block):
                break
            i, block = j, candidate
            j += 1
        return i, block

    def _find_expandable_block(self, pool: BlockPool, size: int) -> Block:
        """The lowest address where free and unmapped blocks together give ``size`` bytes."""
        for addr in sorted(pool.unmapped):
            candidate = pool.unmapped[addr]
            prev = candidate.prev
            if prev is not None and not prev.allocated:
                candidate = prev  # a free mapped block just before it can be used too
            total = 0
            b: Optional[Block] = candidate
            while total < size and b is not None and not b.allocated:
                total += b.size
                b = b.next
            if total >= size:
                return candidate
        page = kSmallBuffer if pool.is_small else self.config.large_segment_size
        device_total = self.device_total_bytes or DEFAULT_DEVICE_TOTAL
        # ExpandableSegment: max_handles = numSegments(totalGlobalMem + totalGlobalMem / 8)
        pages = -(-(device_total + device_total // 8) // page)
        base = self.device.reserve(page * pages)
        assert base is not None, "reserving a virtual range never fails (no memory is mapped)"
        es = ExpandableSegment(base, page, page * pages)
        block = Block(base, es.size, pool)
        block.mapped = False
        block.exp = es
        es.head = block
        pool.unmapped[base] = block
        self._exp_segments.append(es)
        return block

    def _map_block(self, to_map: Block, size: int) -> Optional[Block]:
        """``map_block``: map the pages covering ``size`` bytes from the start of ``to_map``.

        Returns the (possibly merged) free mapped block, or None when the pages cannot be
        created (physical memory exhausted: cuMemCreate fails, nothing is mapped).
        """
        es = to_map.exp
        assert es is not None, "only blocks of expandable segments are mapped"
        page = es.page
        offset = to_map.addr - es.base
        begin = offset // page
        end = -(-(offset + size) // page)
        nbytes = (end - begin) * page
        if nbytes == 0:
            return None
        if self.capacity_bytes is not None and self.total_reserved + nbytes > self.capacity_bytes:
            self.capacity_refusals += 1
            return None
        pool = to_map.pool
        del pool.unmapped[to_map.addr]
        to_map.mapped = True
        if nbytes < to_map.size:
            rest = Block(to_map.addr + nbytes, to_map.size - nbytes, pool, to_map, to_map.next)
            rest.mapped = False
            rest.exp = es
            if to_map.next is not None:
                to_map.next.prev = rest
            to_map.next = rest
            pool.unmapped[rest.addr] = rest
            to_map.size = nbytes
        block = merge_neighbours(to_map, pool, True)[0]
        pool.add(block)
        self.total_reserved += nbytes
        es.mapped_bytes += nbytes
        pool.kind.counters.add_reserved(nbytes)
        self._all.add_reserved(nbytes)
        self.num_device_alloc += 1
        if self.on_segment_alloc is not None:
            self.on_segment_alloc(to_map.addr, nbytes, pool.stream)
        return block

    def _try_allocate_expandable_block(self, pool: BlockPool, size: int) -> Optional[Block]:
        """``try_allocate_expandable_block``: map pages until one free block holds ``size``."""
        candidate = self._find_expandable_block(pool, size)
        if not candidate.mapped:
            mapped = self._map_block(candidate, min(candidate.size, size))
            if mapped is None:
                return None
            candidate = mapped
        while candidate.size < size:
            nxt = candidate.next  # invariant: free -> unmapped -> *
            assert nxt is not None, "a free expandable block too small is followed by unmapped"
            merged = self._map_block(nxt, min(size - candidate.size, nxt.size))
            if merged is None:
                return None
            candidate = merged
        pool.discard(candidate)
        return candidate

    # -- giving memory back ---------------------------------------------------------------
    def _unmap_block(self, block: Block) -> Optional[Block]:
        """``unmap_block``: unmap the whole pages inside a free block; the unmapped block."""
        es = block.exp
        assert es is not None, "only blocks of expandable segments are unmapped"
        page = es.page
        offset = block.addr - es.base
        begin = -(-offset // page)
        end = (offset + block.size) // page
        if begin >= end:
            return None
        pool = block.pool
        pool.discard(block)
        start = es.base + begin * page
        nbytes = (end - begin) * page
        after = block.addr + block.size - (start + nbytes)
        if start > block.addr:
            # keep the object at the lower address as the free mapped part before the hole
            hole = Block(start, nbytes, pool, block, block.next)
            if block.next is not None:
                block.next.prev = hole
            block.next = hole
            block.size = start - block.addr
            pool.add(block)
        else:
            hole = block
            hole.size = nbytes
        hole.mapped = False
        hole.exp = es
        if after > 0:
            tail = Block(start + nbytes, after, pool, hole, hole.next)
            tail.exp = es
            if hole.next is not None:
                hole.next.prev = tail
            hole.next = tail
            pool.add(tail)
        hole = merge_neighbours(hole, pool, False)[0]
        pool.unmapped[hole.addr] = hole
        self.total_reserved -= nbytes
        es.mapped_bytes -= nbytes
        pool.kind.counters.res_b -= nbytes
        self._all.res_b -= nbytes
        self.num_device_free += 1
        if self.on_segment_free is not None:
            self.on_segment_free(start, nbytes, pool.stream)
        return hole

    def _release_expandable_block(self, block: Block) -> None:
        """``release_blocks`` for an expandable free block: unmap, drop a wholly empty segment."""
        hole = self._unmap_block(block)
        if hole is not None and hole.prev is None and hole.next is None:
            es = hole.exp
            if es is None or hole.size != es.size or hole.mapped:
                raise AssertionError("expandable segment's last block disagrees with the segment")
            del hole.pool.unmapped[hole.addr]
            self._exp_segments.remove(es)
            self.device.unreserve(es.base, es.size)

