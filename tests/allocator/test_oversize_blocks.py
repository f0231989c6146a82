"""max_split_size_mb and max_non_split_rounding_mb: oversize blocks are never split or misused."""

from __future__ import annotations

from .helpers import MiB, make


def test_a_request_below_max_split_size_never_takes_an_oversize_cached_block():
    alloc = make("max_split_size_mb:40")
    alloc.free(alloc.malloc(50 * MiB))  # a cached 50 MiB block, oversize
    block = alloc.malloc(30 * MiB)
    assert block.size == 30 * MiB
    assert alloc.reserved_bytes == 80 * MiB  # a new 30 MiB segment instead


def test_without_max_split_size_the_same_request_splits_the_cached_block():
    alloc = make()
    alloc.free(alloc.malloc(50 * MiB))
    block = alloc.malloc(30 * MiB)
    assert block.size == 30 * MiB and block.is_split
    assert alloc.reserved_bytes == 50 * MiB


def test_an_oversize_request_takes_a_cached_block_whole_within_the_rounding_limit():
    alloc = make("max_split_size_mb:40")
    cached = alloc.malloc(50 * MiB)
    alloc.free(cached)
    block = alloc.malloc(41 * MiB)  # 50 < 41 + 20: reused whole, never split
    assert (block.addr, block.size) == (cached.addr, 50 * MiB)
    stats = alloc.stats()
    assert stats["oversize_allocations.current"] == 1
    assert stats["oversize_segments.current"] == 1
    assert stats["allocated_bytes.all.current"] == 50 * MiB
    assert stats["max_split_size"] == 40 * MiB


def test_an_oversize_cached_block_too_much_bigger_than_the_request_is_left_alone():
    alloc = make("max_split_size_mb:40")
    alloc.free(alloc.malloc(70 * MiB))
    block = alloc.malloc(45 * MiB)  # 70 >= 45 + 20: a new 46 MiB segment
    assert block.size == 46 * MiB
    assert alloc.reserved_bytes == 116 * MiB


def test_max_non_split_rounding_widens_the_limit():
    alloc = make("max_split_size_mb:40,max_non_split_rounding_mb:30")
    alloc.free(alloc.malloc(70 * MiB))
    block = alloc.malloc(45 * MiB)  # 70 < 45 + 30
    assert block.size == 70 * MiB
    assert alloc.reserved_bytes == 70 * MiB


def test_unlimited_split_size_reports_minus_one_like_pytorch():
    assert make().stats()["max_split_size"] == -1
