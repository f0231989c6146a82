"""The cudaMalloc-failure chain, empty_cache and the out-of-memory error, computed by hand."""

from __future__ import annotations

import pytest

from xmem_admission.contract.errors import SimulatedOutOfMemory

from .helpers import MiB, make


def test_when_cudamalloc_fails_all_unsplit_cached_segments_are_freed_and_the_retry_counts():
    alloc = make(capacity_bytes=100 * MiB)
    alloc.free(alloc.malloc(60 * MiB))
    block = alloc.malloc(70 * MiB)  # 60 + 70 > 100: release the cached 60 MiB, retry
    assert block.size == 70 * MiB
    stats = alloc.stats()
    assert (stats["num_alloc_retries"], stats["num_device_free"], stats["num_device_alloc"],
            stats["num_sync_all_streams"]) == (1, 1, 2, 1)
    assert (stats["reserved_bytes.all.current"], stats["reserved_bytes.all.peak"]) == \
        (70 * MiB, 70 * MiB)
    assert stats["num_ooms"] == 0


def test_with_max_split_size_one_large_enough_oversize_block_is_freed_first():
    alloc = make("max_split_size_mb:40", capacity_bytes=200 * MiB)
    blocks = [alloc.malloc(n * MiB) for n in (50, 60, 70)]
    for block in blocks:
        alloc.free(block)
    # 30 MiB may not use the oversize blocks; 180 + 30 > 200: free the smallest cached block
    # of at least max_split_size (the 50 MiB one) and try again, without counting a retry.
    alloc.malloc(30 * MiB)
    stats = alloc.stats()
    assert (stats["num_device_free"], stats["num_alloc_retries"]) == (1, 0)
    assert alloc.reserved_bytes == 160 * MiB
    remaining = sorted(s["total_size"] for s in alloc.segments())
    assert remaining == [30 * MiB, 60 * MiB, 70 * MiB]


def test_with_max_split_size_the_largest_oversize_blocks_are_freed_until_enough():
    alloc = make("max_split_size_mb:40", capacity_bytes=180 * MiB)
    blocks = [alloc.malloc(46 * MiB) for _ in range(3)]
    for block in blocks:
        alloc.free(block)
    # 138 + 80 > 180 and no single cached block >= 80 MiB: free 46 + 46 >= 80 from the
    # largest down, then 46 + 80 fits.
    alloc.malloc(80 * MiB)
    stats = alloc.stats()
    assert (stats["num_device_free"], stats["num_alloc_retries"]) == (2, 0)
    assert alloc.reserved_bytes == 126 * MiB


def test_out_of_memory_carries_the_state_after_the_release_steps():
    alloc = make(capacity_bytes=100 * MiB)
    alloc.malloc(2 * MiB)  # a 20 MiB segment: 18 MiB stays cached but split, not releasable
    with pytest.raises(SimulatedOutOfMemory) as info:
        alloc.malloc(85 * MiB)  # 20 + 86 > 100 even after the release steps
    oom = info.value
    assert (oom.requested_bytes, oom.allocation_bytes, oom.stream) == (85 * MiB, 86 * MiB, 0)
    assert (oom.allocated_bytes, oom.reserved_bytes, oom.free_cached_bytes) == \
        (2 * MiB, 20 * MiB, 18 * MiB)
    assert oom.capacity_bytes == 100 * MiB
    stats = alloc.stats()
    assert (stats["num_ooms"], stats["num_alloc_retries"], stats["num_device_free"]) == (1, 1, 0)
    alloc.check_invariants()


def test_a_memory_fraction_limits_reserved_memory_below_the_capacity():
    alloc = make(capacity_bytes=1000 * MiB, memory_fraction=0.25)
    alloc.malloc(200 * MiB)
    with pytest.raises(SimulatedOutOfMemory) as info:
        alloc.malloc(60 * MiB)  # 200 + 60 > 250 allowed
    assert info.value.allowed_bytes == 250 * MiB


def test_empty_cache_frees_only_wholly_free_segments():
    alloc = make()
    kept = alloc.malloc(2 * MiB)  # its 20 MiB segment stays (partly allocated)
    alloc.free(alloc.malloc(30 * MiB))  # too big for the 18 MiB remainder: its own segment
    alloc.free(alloc.malloc(100))  # a whole free 2 MiB small segment
    alloc.empty_cache()
    assert [s["total_size"] for s in alloc.segments()] == [20 * MiB]
    stats = alloc.stats()
    assert (stats["num_device_free"], stats["segment.all.current"]) == (2, 1)
    assert stats["reserved_bytes.all.freed"] == 32 * MiB
    alloc.free(kept)
    alloc.empty_cache()
    assert alloc.reserved_bytes == 0 and alloc.segments() == []
