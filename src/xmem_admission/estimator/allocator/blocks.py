"""The allocator's data: blocks, pools and expandable segments (standard library only).

A ``Block`` is a range of device memory inside a segment; a ``BlockPool`` holds the cached free
blocks of one kind (small or large) on one stream, sorted by (size, address) through the key
``size << SHIFT | address``; an ``ExpandableSegment`` is one reserved virtual range whose pages
are mapped on demand. ``merge_neighbours`` is PyTorch's ``try_merge_blocks``. The allocator
(``caching``) and its halves (``segments``, ``expandable``, ``cache_release``) work on these.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Callable, Dict, List, Optional, Tuple

from xmem_admission.estimator.allocator.statistics import Counters

SHIFT = 48  # free-block key = size << SHIFT | address; device addresses stay below 2**48
ADDR_LIMIT = 1 << SHIFT


SegmentHook = Callable[[int, int, int], None]


class Block:
    """A range of device memory inside a segment: allocated, free (cached) or unmapped."""

    __slots__ = ("addr", "size", "requested", "pool", "prev", "next", "allocated", "mapped",
                 "exp", "gc_base", "tag")
    # Left unset by __init__ (the hot path): a replay's label for the block, set when it is
    # handed out (``simulate`` stores the index of the allocation's category there).
    tag: int

    def __init__(self, addr: int, size: int, pool: BlockPool,
                 prev: Optional[Block] = None, next: Optional[Block] = None):
        self.addr = addr
        self.size = size
        self.requested = 0
        self.pool = pool
        self.prev = prev
        self.next = next
        self.allocated = False
        self.mapped = True
        self.exp: Optional[ExpandableSegment] = None  # the expandable segment it lives in
        self.gc_base = 0  # pool kind's get_free_block call count when cached (GC age)

    @property
    def stream(self) -> int:
        return self.pool.stream

    @property
    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("free" if self.mapped else "unmapped")
        return f"Block({self.addr:#x}, {self.size}, {state}, stream {self.pool.stream})"


class PoolKind:
    """What all pools of one kind (small or large) share across streams: stats, GC clock."""

    __slots__ = ("is_small", "counters", "gc_calls")

    def __init__(self, is_small: bool):
        self.is_small = is_small
        self.counters = Counters()
        self.gc_calls = 0  # BlockPool::get_free_blocks_call_count (one set for all streams)


class BlockPool:
    """The cached free blocks of one kind on one stream, sorted by (size, address)."""

    __slots__ = ("stream", "kind", "is_small", "keys", "blocks", "unmapped")

    def __init__(self, stream: int, kind: PoolKind):
        self.stream = stream
        self.kind = kind
        self.is_small = kind.is_small
        self.keys: List[int] = []
        self.blocks: Dict[int, Block] = {}
        self.unmapped: Dict[int, Block] = {}  # expandable segments' unmapped ranges by address

    def add(self, block: Block) -> None:
        key = block.size << SHIFT | block.addr
        insort(self.keys, key)
        self.blocks[key] = block
        block.gc_base = self.kind.gc_calls  # BlockPool::insert_into_blocks

    def discard(self, block: Block) -> None:
        key = block.size << SHIFT | block.addr
        keys = self.keys
        del keys[bisect_left(keys, key)]
        del self.blocks[key]

    def sorted_blocks(self) -> List[Block]:
        return [self.blocks[k] for k in self.keys]


class ExpandableSegment:
    """One reserved virtual range whose pages are mapped on demand."""

    __slots__ = ("base", "page", "size", "mapped_bytes", "head")

    def __init__(self, base: int, page: int, size: int):
        self.base = base
        self.page = page
        self.size = size
        self.mapped_bytes = 0

    # The block at ``base``, set right after the segment is made and never replaced.
    head: Block


def merge_neighbours(block: Block, pool: BlockPool, mapped: bool) -> Tuple[Block, int, int]:
    """``try_merge_blocks`` with the previous, then the next block, when free and in the given
    mapped state. Keeps the lower object (a segment's head never changes). Returns the merged
    block, how many blocks it subsumed and their bytes. The merged block is in no index."""
    merged = merged_bytes = 0
    prev = block.prev
    if prev is not None and not prev.allocated and prev.mapped == mapped:
        if mapped:
            pool.discard(prev)
        else:
            del pool.unmapped[prev.addr]
        merged, merged_bytes = 1, prev.size
        prev.size += block.size
        nxt = prev.next = block.next
        if nxt is not None:
            nxt.prev = prev
        block = prev
    nxt = block.next
    if nxt is not None and not nxt.allocated and nxt.mapped == mapped:
        if mapped:
            pool.discard(nxt)
        else:
            del pool.unmapped[nxt.addr]
        merged += 1
        merged_bytes += nxt.size
        block.size += nxt.size
        after = block.next = nxt.next
        if after is not None:
            after.prev = block
    return block, merged, merged_bytes
