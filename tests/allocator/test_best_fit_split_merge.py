"""Best fit on (size, address), the split thresholds, and merging on free, computed by hand."""

from __future__ import annotations

import pytest

from xmem_admission.contract.errors import AllocatorStateError

from .helpers import MiB, make


def test_best_fit_takes_the_smallest_block_that_fits_then_the_lowest_address():
    alloc = make()
    a1, a2, a3 = alloc.malloc(12 * MiB), alloc.malloc(14 * MiB), alloc.malloc(12 * MiB)
    addresses = [a1.addr, a2.addr, a3.addr]
    for block in (a1, a2, a3):
        alloc.free(block)
    # Cached: 12 MiB, 14 MiB, 12 MiB segments. 11 MiB fits all three.
    first = alloc.malloc(11 * MiB)
    second = alloc.malloc(11 * MiB)
    third = alloc.malloc(11 * MiB)
    assert [first.addr, second.addr, third.addr] == addresses[0::2] + [addresses[1]]
    # 12 - 11 = 1 MiB left is not more than 1 MiB: the whole 12 MiB is handed out...
    assert first.size == second.size == 12 * MiB
    # ...but 14 - 11 = 3 MiB is split off.
    assert third.size == 11 * MiB
    assert alloc.reserved_bytes == 38 * MiB  # no new segment


def test_a_large_block_splits_only_when_more_than_1_mib_would_remain():
    alloc = make()
    exact = alloc.malloc(11 * MiB)  # 12 MiB segment, exactly 1 MiB would remain
    assert exact.size == 12 * MiB and not exact.is_split
    split = alloc.malloc(11 * MiB - 512)  # 1 MiB + 512 bytes would remain
    assert split.size == 11 * MiB - 512 and split.is_split
    assert alloc.stats()["allocated_bytes.all.current"] == 23 * MiB - 512
    assert alloc.stats()["requested_bytes.all.current"] == 22 * MiB - 512


def test_a_small_block_splits_whenever_512_bytes_or_more_remain():
    alloc = make()
    a = alloc.malloc(MiB)  # from a 2 MiB small segment: 1 MiB remains and is split off
    b = alloc.malloc(MiB - 512)  # from the 1 MiB remainder: 512 bytes remain, still split
    c = alloc.malloc(100)  # the 512-byte sliver fits exactly
    assert (a.size, b.size, c.size) == (MiB, MiB - 512, 512)
    assert (b.addr, c.addr) == (a.addr + MiB, a.addr + 2 * MiB - 512)
    assert alloc.reserved_bytes == 2 * MiB


def test_the_front_of_a_cached_block_is_handed_out_and_the_rest_stays_cached():
    alloc = make()
    a = alloc.malloc(2 * MiB)  # 20 MiB segment
    b = alloc.malloc(2 * MiB)
    assert b.addr == a.addr + 2 * MiB
    stats = alloc.stats()
    assert stats["inactive_split.large_pool.current"] == 1
    assert stats["inactive_split_bytes.large_pool.current"] == 16 * MiB


def test_freeing_merges_with_free_neighbours_and_restores_the_whole_segment():
    alloc = make()
    a, b, c = alloc.malloc(2 * MiB), alloc.malloc(2 * MiB), alloc.malloc(2 * MiB)
    alloc.free(b)  # free islands: b (2 MiB) and the 14 MiB tail
    stats = alloc.stats()
    assert (stats["inactive_split.all.current"], stats["inactive_split_bytes.all.current"]) == \
        (2, 16 * MiB)
    alloc.free(a)  # a merges with b: 4 MiB + 14 MiB tail
    stats = alloc.stats()
    assert (stats["inactive_split.all.current"], stats["inactive_split_bytes.all.current"]) == \
        (2, 18 * MiB)
    alloc.free(c)  # everything merges into one unsplit 20 MiB block
    stats = alloc.stats()
    assert (stats["inactive_split.all.current"], stats["inactive_split_bytes.all.current"]) == \
        (0, 0)
    (segment,) = alloc.segments()
    assert segment["blocks"] == [{"address": a.addr, "size": 20 * MiB, "requested_size": 0,
                                  "state": "inactive"}]
    alloc.check_invariants()


def test_blocks_never_merge_across_segments():
    alloc = make()
    a = alloc.malloc(12 * MiB)
    b = alloc.malloc(12 * MiB)
    alloc.free(a)
    alloc.free(b)
    assert len(alloc.segments()) == 2
    assert alloc.malloc(20 * MiB).size == 20 * MiB  # neither 12 MiB block could serve it
    assert alloc.reserved_bytes == 44 * MiB


def test_double_free_is_refused():
    alloc = make()
    block = alloc.malloc(4096)
    alloc.free(block)
    with pytest.raises(AllocatorStateError, match="not allocated"):
        alloc.free(block)
