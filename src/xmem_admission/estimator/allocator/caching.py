"""A simulation of PyTorch's CUDA caching allocator (``c10/cuda/CUDACachingAllocator.cpp``).

It follows ``DeviceCachingAllocator`` of PyTorch 2.9-2.11 rule by rule, with simulated device
addresses, so that a replay places every block where the GPU's allocator placed it:

- ``round_size``: at least 512 bytes, multiples of 512, or the next of N power-of-two divisions;
- ``get_pool``: requests <= 1 MiB (after rounding) use the small pool, others the large one;
  each stream has its own pools (blocks never move between streams);
- ``get_free_block``: best fit = ``lower_bound`` on (size, address) within the stream's pool,
  with the ``max_split_size`` oversize rules;
- ``get_allocation_size``: 2 MiB small segments, ``large_segment_size`` (20 MiB) for 1-10 MiB,
  otherwise rounded up to 2 MiB;
- ``should_split`` / ``alloc_found_block``: the front of the block is handed out, the rest
  goes back to the pool; ``free_block`` merges with free neighbours of the same segment;
- the cudaMalloc-failure chain: garbage collection (with a memory fraction), cudaMalloc,
  ``release_available_cached_blocks`` (with max_split_size), ``release_cached_blocks``, retry,
  then an out-of-memory error carrying the state;
- expandable segments (``expandable.py``), ``empty_cache``.

Not modelled: CUDA graphs' private pools, ``record_stream`` (cross-stream uses), IPC, the
``cudaMallocAsync`` backend, free-memory callbacks (only CUDA IPC registers one).

Torch releases: the rules above hold unchanged for every torch from 2.2 to 2.15 under the same
effective settings; what differs by release is which settings exist and how they are parsed,
which ``parse_alloc_conf(text, version)`` applies (``config.torch_release`` records the
release). The evidence, and the one known difference not modelled (a per-process memory
fraction of exactly 1.0 before 2.10), are in ``torch_releases.py``.

The hot path is written for speed (``__slots__``, sorted integer keys with ``bisect``, no
per-event dicts). A free block's key is ``size << 48 | address``, so ``bisect_left`` on
``size << 48`` is exactly ``lower_bound`` on (size, address). Standard library only.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any, Dict, List, Optional, Sequence, Tuple

from xmem_admission.contract.errors import AllocatorStateError, AllocConfError, SimulatedOutOfMemory
from xmem_admission.estimator.allocator.alloc_conf import AllocatorConfig, Backend
from xmem_admission.estimator.allocator.blocks import (
    ADDR_LIMIT,
    SHIFT,
    Block,
    BlockPool,
    PoolKind,
    SegmentHook,
    merge_neighbours,
)
from xmem_admission.estimator.allocator.cache_release import CacheReleaseMixin
from xmem_admission.estimator.allocator.expandable import ExpandableSegmentsMixin
from xmem_admission.estimator.allocator.segments import (
    DeviceAddressSpace,
    check_invariants,
    restore_segment,
    segment_table,
)
from xmem_admission.estimator.allocator.statistics import Counters, OversizeStat, stats_dict

# c10/core/AllocatorConfig.h (2.11) / CUDACachingAllocator.cpp (<= 2.10) constants:
kMinBlockSize = 512  # "all sizes are rounded to at least 512 bytes"
kSmallSize = 1048576  # "largest 'small' allocation is 1 MiB"
kSmallBuffer = 2097152  # "'small' allocations are packed in 2 MiB blocks"
kMinLargeAlloc = 10485760  # "allocations between 1 and 10 MiB may use kLargeBuffer"
kRoundLarge = 2097152  # "round up large allocations to 2 MiB"

class CachingAllocator(ExpandableSegmentsMixin, CacheReleaseMixin):
    """One device's caching allocator.

    ``capacity_bytes``: memory the allocator may reserve before cudaMalloc fails (the GPU's
    memory minus the CUDA context and other non-allocator memory); None = unlimited. It is a
    plain attribute: a replay may change it between calls. ``memory_fraction`` models
    ``torch.cuda.set_per_process_memory_fraction`` (it overrides the config's
    ``per_process_memory_fraction``) against ``device_total_bytes`` (default: the capacity).
    ``on_segment_alloc`` / ``on_segment_free`` hooks get (address, bytes, stream).
    """

    def __init__(self, config: Optional[AllocatorConfig] = None,
                 capacity_bytes: Optional[int] = None, memory_fraction: Optional[float] = None,
                 device: Optional[DeviceAddressSpace] = None,
                 device_total_bytes: Optional[int] = None):
        config = config if config is not None else AllocatorConfig()
        if config.backend is not Backend.NATIVE:
            raise AllocConfError("backend:cudaMallocAsync hands allocation to CUDA's stream-ordered "
                                 "allocator; xmem simulates only the native caching allocator")
        self.config = config
        self.capacity_bytes = capacity_bytes
        self.device_total_bytes = device_total_bytes if device_total_bytes is not None \
            else capacity_bytes
        fraction = memory_fraction if memory_fraction is not None \
            else config.per_process_memory_fraction
        # setMemoryFraction (2.10+): a fraction below 1 limits reserved memory to
        # fraction * totalGlobalMem; 1.0 means no limit (allowed_memory_maximum = nullopt).
        self.allowed_bytes: Optional[int] = None
        if fraction is not None:
            if not 0.0 <= fraction <= 1.0:
                raise AllocConfError(f"memory fraction must be in [0, 1], got {fraction}")
            if fraction < 1.0:
                if self.device_total_bytes is None:
                    raise AllocConfError("a per-process memory fraction needs the device's "
                                         "capacity (give capacity_bytes / --capacity-bytes)")
                self.allowed_bytes = int(fraction * self.device_total_bytes)
        self._gc = self.allowed_bytes is not None and config.garbage_collection_threshold > 0
        self._mss = config.max_split_size
        self._rounding = any(d > 1 for d in config.roundup_power2_divisions)
        self._expandable = config.expandable_segments
        self.device = device if device is not None else DeviceAddressSpace()
        self._small = PoolKind(True)
        self._large = PoolKind(False)
        self._all = Counters()
        self._pools: Dict[int, Tuple[BlockPool, BlockPool]] = {}
        self._segments: Dict[int, Block] = {}  # cudaMalloc'd segments: address -> head block
        self.total_reserved = 0  # total_allocated_memory in PyTorch: bytes held from CUDA
        self.oversize_allocations = OversizeStat()
        self.oversize_segments = OversizeStat()
        self.num_alloc_retries = self.num_ooms = self.num_sync_all_streams = 0
        self.num_device_alloc = self.num_device_free = 0
        # how often the capacity (or the memory fraction's limit) refused memory; not one of
        # PyTorch's statistics: a replay whose count stays 0 ran as it would with no limit
        self.capacity_refusals = 0
        self.on_segment_alloc: Optional[SegmentHook] = None
        self.on_segment_free: Optional[SegmentHook] = None
        self._init_expandable()

    # ---------------------------------------------------------------- public queries
    @property
    def counters(self) -> Counters:
        """The all-pools statistics, read live by replays (``alloc_b``, ``res_b``, ...)."""
        return self._all

    @property
    def allocated_bytes(self) -> int:
        return self._all.alloc_b

    @property
    def reserved_bytes(self) -> int:
        return self._all.res_b

    def stats(self) -> Dict[str, int]:
        """The statistics ``torch.cuda.memory_stats()`` would report now."""
        mss = self._mss
        return stats_dict(
            {"all": self._all, "small_pool": self._small.counters,
             "large_pool": self._large.counters},
            self.oversize_allocations, self.oversize_segments,
            {"num_alloc_retries": self.num_alloc_retries, "num_ooms": self.num_ooms,
             "num_sync_all_streams": self.num_sync_all_streams,
             "num_device_alloc": self.num_device_alloc,
             "num_device_free": self.num_device_free,
             "max_split_size": -1 if not self.config.max_split_size_limited else mss})

    def pools(self) -> List[BlockPool]:
        """Every pool, large before small per stream order (PyTorch's release order)."""
        streams = sorted(self._pools)
        return [self._pools[s][1] for s in streams] + [self._pools[s][0] for s in streams]

    # ---------------------------------------------------------------- rounding and sizes
    def round_size(self, size: int) -> int:
        """``round_size``: the block size a request of ``size`` bytes needs."""
        if size < kMinBlockSize:
            return kMinBlockSize
        if self._rounding:
            # roundup_power2_divisions(size): interval index clamp(log2(size) - 20, 0, 15)
            index = min(max(size.bit_length() - 1 - 20, 0), 15)
            divisions = self.config.roundup_power2_divisions[index]
            if divisions > 1 and size > kMinBlockSize * divisions:
                return _roundup_power2_next_division(size, divisions)
        return (size + kMinBlockSize - 1) & -kMinBlockSize

    def allocation_size(self, rounded: int) -> int:
        """``get_allocation_size``: the segment cudaMalloc'd when no cached block fits."""
        if rounded <= kSmallSize:
            return kSmallBuffer
        if rounded < kMinLargeAlloc:
            return self.config.large_segment_size
        return (rounded + kRoundLarge - 1) // kRoundLarge * kRoundLarge

    def _pool_pair(self, stream: int) -> Tuple[BlockPool, BlockPool]:
        pair = self._pools.get(stream)
        if pair is None:
            if not isinstance(stream, int) or stream < 0:
                raise AllocatorStateError(f"stream must be a non-negative integer, got {stream!r}")
            pair = self._pools[stream] = (BlockPool(stream, self._small),
                                          BlockPool(stream, self._large))
        return pair

    # ---------------------------------------------------------------- malloc
    def malloc(self, size: int, stream: int = 0) -> Block:
        """``DeviceCachingAllocator::malloc``: a block of at least ``size`` bytes on ``stream``.

        Raises ``SimulatedOutOfMemory`` when the failure chain cannot make room.
        """
        if size < kMinBlockSize:
            rsize = kMinBlockSize
        elif self._rounding:
            rsize = self.round_size(size)
        else:
            rsize = (size + 511) & -512
        pair = self._pools.get(stream)
        if pair is None:
            pair = self._pool_pair(stream)
        pool = pair[0] if rsize <= kSmallSize else pair[1]
        block = self._get_free_block(pool, rsize)
        if block is None:
            block = self._malloc_new(pool, size, rsize)
        # should_split: small pool or expandable: >= 512 left; large pool: request below
        # max_split_size and strictly more than 1 MiB (kSmallSize) left.
        bsize = block.size
        remaining = bsize - rsize
        if pool.is_small or block.exp is not None:
            split = remaining >= kMinBlockSize
        else:
            split = remaining > kSmallSize and rsize < self._mss
        kind = pool.kind.counters
        agg = self._all
        already_split = block.prev is not None or block.next is not None
        if split:
            # alloc_found_block: the front is handed out, the remainder stays cached.
            nxt = block.next
            rest = Block(block.addr + rsize, remaining, pool, block, nxt)
            if nxt is not None:
                nxt.prev = rest
            block.next = rest
            block.size = bsize = rsize
            if block.exp is not None:
                rest.exp = block.exp
                pool.add(rest)
            else:
                pool.add(rest)
                if already_split:
                    kind.add_split(0, -rsize)
                    agg.add_split(0, -rsize)
                else:
                    kind.add_split(1, remaining)
                    agg.add_split(1, remaining)
        elif already_split and block.exp is None:
            kind.add_split(-1, -bsize)
            agg.add_split(-1, -bsize)
        block.allocated = True
        block.requested = size
        # allocation, allocated_bytes (and so active*), requested_bytes: increase_stat.
        kind.add_allocation(bsize, size)
        agg.add_allocation(bsize, size)
        if bsize >= self._mss:
            self.oversize_allocations.increase()
        return block

    def _get_free_block(self, pool: BlockPool, rsize: int) -> Optional[Block]:
        """``get_free_block``: take the best fit out of the pool, or None."""
        if self._gc:
            pool.kind.gc_calls += 1  # track block reuse interval only when GC is enabled
        i = self._best_fit(pool, rsize)
        if i < 0:
            return None
        key = pool.keys.pop(i)
        return pool.blocks.pop(key)

    def _best_fit(self, pool: BlockPool, rsize: int) -> int:
        """Index in ``pool.keys`` of the block ``get_free_block`` would choose, or -1."""
        keys = pool.keys
        i = bisect_left(keys, rsize << SHIFT)
        if i == len(keys):
            return -1
        if pool.blocks[keys[i]].exp is not None:
            i = self._expandable_best_fit(pool, i, pool.blocks[keys[i]])[0]
        mss = self._mss
        bsize = keys[i] >> SHIFT
        if rsize < mss:
            if bsize >= mss:
                return -1  # do not hand an oversize block to a small-enough request
        elif bsize >= rsize + self.config.max_non_split_rounding_size:
            return -1  # oversize blocks may be rounded up only within the limit
        return i

    def peek_free_block(self, size: int, stream: int = 0) -> Optional[Block]:
        """The cached block ``malloc(size, stream)`` would reuse now, without taking it."""
        rsize = self.round_size(size)
        pool = self._pool_pair(stream)[0 if rsize <= kSmallSize else 1]
        i = self._best_fit(pool, rsize)
        return None if i < 0 else pool.blocks[pool.keys[i]]

    def release_segment(self, addr: int) -> None:
        """cudaFree the wholly free cached segment at ``addr`` now, unrecorded (replay hook)."""
        head = self._segments.get(addr)
        if head is None:
            raise AllocatorStateError(f"no cudaMalloc'd segment at {addr:#x}")
        hooks = self.on_segment_free
        self.on_segment_free = None
        try:
            self._release_block(head)
        finally:
            self.on_segment_free = hooks

    def _malloc_new(self, pool: BlockPool, size: int, rsize: int) -> Block:
        """No cached block fits: GC, cudaMalloc and the release-and-retry chain, or OOM."""
        alloc_size = self.allocation_size(rsize)
        if self._gc:
            self._garbage_collect()
        block = self._alloc_block(pool, rsize, alloc_size, False)
        if block is None and self._release_available_cached_blocks(pool, rsize):
            block = self._alloc_block(pool, rsize, alloc_size, False)
        if block is None:
            self._release_cached_blocks()  # always "succeeds"; the retry counts
            block = self._alloc_block(pool, rsize, alloc_size, True)
        if block is None:
            self.num_ooms += 1
            raise SimulatedOutOfMemory(size, alloc_size, pool.stream, self._all.alloc_b,
                                       self._all.res_b, self.capacity_bytes, self.allowed_bytes)
        return block

    def _alloc_block(self, pool: BlockPool, rsize: int, alloc_size: int,
                     is_retry: bool) -> Optional[Block]:
        """``alloc_block``: a new segment (or newly mapped pages), or None when CUDA says no."""
        if is_retry:
            self.num_alloc_retries += 1
        if self.allowed_bytes is not None and \
                self.total_reserved + alloc_size > self.allowed_bytes:
            self.capacity_refusals += 1
            return None
        if self._expandable:
            return self._try_allocate_expandable_block(pool, rsize)
        if self.capacity_bytes is not None and \
                self.total_reserved + alloc_size > self.capacity_bytes:
            self.capacity_refusals += 1
            return None
        addr = self.device.malloc(alloc_size)
        if addr is None:
            return None
        if addr < 0 or addr + alloc_size > ADDR_LIMIT or addr in self._segments:
            raise AllocatorStateError(f"device returned an unusable address {addr:#x}")
        block = Block(addr, alloc_size, pool)
        self._segments[addr] = block
        self.total_reserved += alloc_size
        pool.kind.counters.add_segment(alloc_size)
        self._all.add_segment(alloc_size)
        if alloc_size >= self._mss:
            self.oversize_segments.increase()
        self.num_device_alloc += 1
        if self.on_segment_alloc is not None:
            self.on_segment_alloc(addr, alloc_size, pool.stream)
        return block

    # ---------------------------------------------------------------- free
    def free(self, block: Block) -> None:
        """``DeviceCachingAllocator::free``: return an allocated block to its pool."""
        if not block.allocated:
            raise AllocatorStateError(f"free of {block!r}, which is not allocated (double free?)")
        block.allocated = False
        size = block.size
        block.pool.kind.counters.drop_allocation(size, block.requested)
        self._all.drop_allocation(size, block.requested)
        if size >= self._mss:
            self.oversize_allocations.current -= 1
        self._free_block(block)

    def _free_block(self, block: Block) -> None:
        """``free_block``: merge with free neighbours (keeping the lower object) and cache."""
        pool = block.pool
        block, merged, merged_bytes = merge_neighbours(block, pool, block.mapped)
        pool.add(block)
        if block.exp is None:
            # inactive_split: each subsumed split block goes, the merged one counts if split.
            net_n, net_b = -merged, -merged_bytes
            if block.prev is not None or block.next is not None:
                net_n += 1
                net_b += block.size
            if net_n or net_b:
                pool.kind.counters.add_split(net_n, net_b)
                self._all.add_split(net_n, net_b)

    # ---------------------------------------------------------------- replay hook
    def restore_segment(self, addr: int, size: int, stream: int, is_small: bool,
                        live: Sequence[Tuple[int, int, int]]) -> List[Block]:
        """Recreate a cudaMalloc'd segment as it stood before a recorded trace began.

        ``live`` lists its allocated blocks as (address, size, requested size); the gaps
        between them become cached free blocks. Returns the allocated blocks in address
        order. Used by snapshot replays, whose traces start after the model was built.
        """
        return restore_segment(self, addr, size, stream, is_small, live)

    # ---------------------------------------------------------------- introspection
    def segments(self) -> List[Dict[str, Any]]:
        """Every segment with its blocks, like the ``segments`` of a memory snapshot."""
        return segment_table(self)

    def _segment_heads(self) -> List[Block]:
        return list(self._segments.values()) + self._expandable_heads()

    def check_invariants(self) -> None:
        """Raise AssertionError if the allocator's books do not balance (tests, debugging)."""
        check_invariants(self)

def _roundup_power2_next_division(size: int, divisions: int) -> int:
    """``roundup_power2_next_division``: next of ``divisions`` equal steps between powers of 2.

    E.g. 1200 with 4 divisions lies in [1024, 2048) whose steps are 1024, 1280, 1536, 1792:
    1280 (the example in CUDACachingAllocator.cpp).
    """
    if size & (size - 1) == 0:
        return size
    floor = 1 << (size.bit_length() - 1)
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded = size & ~(step - 1)
    return size if rounded == size else rounded + step
