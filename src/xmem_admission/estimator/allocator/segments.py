"""Segments: simulated device addresses, their reconstruction, their table and their checks.

``DeviceAddressSpace`` stands in for cudaMalloc's choice of address; ``restore_segment``
rebuilds a segment that existed before a recorded trace began; ``segment_table`` lists segments
like a memory snapshot does; ``check_invariants`` verifies the whole state (tests, debugging):

- segments do not overlap; the blocks of a segment tile it exactly, linked both ways;
- allocated + cached free bytes inside segments == reserved bytes (mapped pages for expandable
  segments), and the statistics agree with a recount;
- every free mapped block is in its pool's sorted index, and no two free blocks that could
  merge sit next to each other (``free_block`` merges eagerly);
- inactive_split counts exactly the free blocks of split non-expandable segments.

Standard library only.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

from xmem_admission.contract.errors import AllocatorStateError
from xmem_admission.estimator.allocator.blocks import ADDR_LIMIT, SHIFT, Block, BlockPool, PoolKind
from xmem_admission.estimator.allocator.statistics import Counters, OversizeStat


class Books(Protocol):
    """What these functions read and write of a ``CachingAllocator`` (its books)."""

    _segments: Dict[int, Block]
    _small: PoolKind
    _large: PoolKind
    _all: Counters
    _mss: int
    total_reserved: int
    oversize_allocations: OversizeStat
    oversize_segments: OversizeStat

    def pools(self) -> List[BlockPool]: ...

    def _pool_pair(self, stream: int) -> Tuple[BlockPool, BlockPool]: ...

    def _segment_heads(self) -> List[Block]: ...


class DeviceAddressSpace:
    """Simulated cudaMalloc addresses: first fit among released ranges, else above the rest.

    The real driver's choice is not knowable; this one is deterministic and realistic
    (2 MiB-aligned, in the range x86-64 CUDA processes see). Capacity is checked by the
    allocator, not here. A replay substitutes an object returning the GPU's own addresses.
    """

    # Where the three real snapshots' segments lie (0x7f1f... to 0x7f5c...: tests/data/
    # snapshots); any base works, placement only compares addresses with each other.
    BASE = 0x7F00_0000_0000
    # Every segment size is a multiple of 2 MiB (kSmallBuffer, kRoundLarge) and the real
    # snapshots' segment addresses are 2 MiB-aligned, so 2 MiB alignment mimics cudaMalloc.
    ALIGN = 2 * 1024 * 1024

    def __init__(self, base: Optional[int] = None) -> None:
        self._top = self.BASE if base is None else base
        self._holes: List[Tuple[int, int]] = []  # released (address, size), by address

    def malloc(self, size: int) -> Optional[int]:
        size = -(-size // self.ALIGN) * self.ALIGN
        for i, (addr, hole) in enumerate(self._holes):
            if hole >= size:
                if hole == size:
                    del self._holes[i]
                else:
                    self._holes[i] = (addr + size, hole - size)
                return addr
        addr = self._top
        if addr + size > ADDR_LIMIT:
            raise AllocatorStateError("simulated device address space exhausted")
        self._top = addr + size
        return addr

    def free(self, addr: int, size: int) -> None:
        size = -(-size // self.ALIGN) * self.ALIGN
        holes = self._holes
        i = bisect_left(holes, (addr, 0))
        holes.insert(i, (addr, size))
        if i + 1 < len(holes) and addr + size == holes[i + 1][0]:
            holes[i] = (addr, size + holes.pop(i + 1)[1])
        if i > 0 and holes[i - 1][0] + holes[i - 1][1] == addr:
            prev_addr, prev_size = holes[i - 1]
            holes[i - 1] = (prev_addr, prev_size + holes.pop(i)[1])

    reserve = malloc  # virtual ranges for expandable segments come from the same space
    unreserve = free



def restore_segment(alloc: Books, addr: int, size: int, stream: int,
                    is_small: bool, live: Sequence[Tuple[int, int, int]]) -> List[Block]:
    """See ``CachingAllocator.restore_segment``."""
    end = addr + size
    if addr < 0 or size <= 0 or end > ADDR_LIMIT or addr in alloc._segments:
        raise AllocatorStateError(f"cannot restore a segment at {addr:#x} of {size} bytes")
    pool = alloc._pool_pair(stream)[0 if is_small else 1]
    pieces: List[Tuple[int, int, Optional[int]]] = []
    cursor = addr
    for b_addr, b_size, b_requested in sorted(live):
        if b_addr < cursor or b_size <= 0 or b_addr + b_size > end:
            raise AllocatorStateError(f"block at {b_addr:#x} of {b_size} bytes does not fit "
                                      f"segment {addr:#x}..{end:#x} beside its neighbours")
        if b_addr > cursor:
            pieces.append((cursor, b_addr - cursor, None))
        pieces.append((b_addr, b_size, b_requested))
        cursor = b_addr + b_size
    if cursor < end:
        pieces.append((cursor, end - cursor, None))
    kind = pool.kind.counters
    alloc.total_reserved += size
    for counters in (kind, alloc._all):
        counters.add_segment(size)
    if size >= alloc._mss:
        alloc.oversize_segments.increase()
    prev: Optional[Block] = None
    allocated: List[Block] = []
    for b_addr, b_size, requested in pieces:
        block = Block(b_addr, b_size, pool, prev)
        if prev is None:
            alloc._segments[addr] = block
        else:
            prev.next = block
        prev = block
        if requested is None:
            pool.add(block)
            if len(pieces) > 1:
                kind.add_split(1, b_size)
                alloc._all.add_split(1, b_size)
            continue
        block.allocated = True
        block.requested = requested
        allocated.append(block)
        kind.add_allocation(b_size, requested)
        alloc._all.add_allocation(b_size, requested)
        if b_size >= alloc._mss:
            alloc.oversize_allocations.increase()
    return allocated


def segment_table(alloc: Books) -> List[Dict[str, Any]]:
    """Every segment (each mapped range of an expandable one) with its blocks, by address."""
    out: List[Dict[str, Any]] = []
    for head in alloc._segment_heads():
        block: Optional[Block] = head
        while block is not None:
            if not block.mapped:
                block = block.next
                continue
            start = block
            blocks: List[Dict[str, Any]] = []
            while block is not None and block.mapped:
                blocks.append({"address": block.addr, "size": block.size,
                               "requested_size": block.requested if block.allocated else 0,
                               "state": "active_allocated" if block.allocated else "inactive"})
                block = block.next
            out.append({"address": start.addr, "total_size": sum(b["size"] for b in blocks),
                        "stream": start.pool.stream, "is_expandable": start.exp is not None,
                        "segment_type": "small" if start.pool.is_small else "large",
                        "allocated_size": sum(b["size"] for b in blocks
                                              if b["state"] == "active_allocated"),
                        "blocks": blocks})
    out.sort(key=lambda s: s["address"])
    return out


def _fail(message: str) -> None:
    raise AssertionError(f"allocator invariant broken: {message}")


def check_invariants(alloc: Books) -> None:
    """Raise AssertionError naming the first broken invariant."""
    ranges: List[Tuple[int, int]] = []
    allocated = {True: 0, False: 0}  # by is_small
    allocated_count = {True: 0, False: 0}
    reserved = {True: 0, False: 0}
    split = {True: [0, 0], False: [0, 0]}
    free_keys = set()
    for head in alloc._segment_heads():
        if head.prev is not None:
            _fail(f"segment head {head!r} has a previous block")
        is_small = head.pool.is_small
        block: Optional[Block] = head
        end = head.addr
        blocks_in_segment = 0
        while block is not None:
            blocks_in_segment += 1
            if block.addr != end:
                _fail(f"{block!r} starts at {block.addr:#x}, expected {end:#x}")
            if block.size <= 0:
                _fail(f"{block!r} has no size")
            if block.next is not None and block.next.prev is not block:
                _fail(f"broken back link after {block!r}")
            if block.pool is not head.pool:
                _fail(f"{block!r} belongs to another pool than its segment")
            if block.mapped:
                reserved[is_small] += block.size
                if block.allocated:
                    allocated[is_small] += block.size
                    allocated_count[is_small] += 1
                else:
                    free_keys.add(block.size << SHIFT | block.addr)
                    if block.pool.blocks.get(block.size << SHIFT | block.addr) is not block:
                        _fail(f"free {block!r} is missing from its pool")
            elif block.allocated:
                _fail(f"{block!r} is allocated but unmapped")
            nxt = block.next
            if nxt is not None and not block.allocated and not nxt.allocated and \
                    block.mapped == nxt.mapped:
                _fail(f"{block!r} and {nxt!r} should have been merged")
            end = block.addr + block.size
            block = nxt
        if head.exp is None:
            if head.mapped is False:
                _fail(f"{head!r} of a cudaMalloc'd segment is unmapped")
            if blocks_in_segment > 1:
                b: Optional[Block] = head
                while b is not None:
                    if not b.allocated:
                        split[is_small][0] += 1
                        split[is_small][1] += b.size
                    b = b.next
        elif end != head.addr + head.exp.size:
            _fail(f"expandable segment at {head.addr:#x} does not cover its virtual range")
        ranges.append((head.addr, end))
    ranges.sort()
    for (a0, a1), (b0, _) in zip(ranges, ranges[1:]):
        if b0 < a1:
            _fail(f"segments [{a0:#x}, {a1:#x}) and [{b0:#x}, ...) overlap")
    indexed = set()
    for pool in alloc.pools():
        if pool.keys != sorted(pool.keys) or set(pool.keys) != set(pool.blocks):
            _fail(f"pool index of stream {pool.stream} is out of order or out of step")
        indexed.update(pool.keys)
    if indexed != free_keys:
        _fail(f"{len(indexed - free_keys)} indexed blocks are not in any segment")
    total = reserved[True] + reserved[False]
    if total != alloc.total_reserved:
        _fail(f"allocated + free inside segments = {total}, reserved = {alloc.total_reserved}")
    for is_small, counters in ((True, alloc._small.counters), (False, alloc._large.counters)):
        recount = (allocated[is_small], allocated_count[is_small], reserved[is_small],
                   split[is_small][0], split[is_small][1])
        booked = (counters.alloc_b, counters.alloc_n, counters.res_b, counters.split_n,
                  counters.split_b)
        if recount != booked:
            _fail(f"{'small' if is_small else 'large'} pool statistics {booked} != recount "
                  f"{recount} (allocated bytes, allocations, reserved, inactive split n/bytes)")
    agg = alloc._all
    if (agg.alloc_b, agg.res_b) != (allocated[True] + allocated[False], total):
        _fail("aggregate statistics disagree with the pools")
