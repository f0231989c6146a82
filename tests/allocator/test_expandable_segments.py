"""expandable_segments:True: one growing virtual range per (stream, pool), mapped by pages."""

from __future__ import annotations

import pytest

from xmem_admission.contract.errors import SimulatedOutOfMemory

from .helpers import GiB, MiB, make


def test_reserved_grows_by_20_mib_pages_and_blocks_stay_contiguous():
    alloc = make("expandable_segments:True", device_total_bytes=8 * GiB)
    a = alloc.malloc(3 * MiB)  # maps one 20 MiB page
    stats = alloc.stats()
    assert (alloc.reserved_bytes, stats["num_device_alloc"]) == (20 * MiB, 1)
    assert stats["segment.all.current"] == 0  # mapping pages is not a new segment in PyTorch
    b = alloc.malloc(30 * MiB)  # 17 MiB free + one more page, right after a
    assert b.addr == a.addr + 3 * MiB
    assert (alloc.reserved_bytes, alloc.stats()["num_device_alloc"]) == (40 * MiB, 2)
    assert alloc.stats()["inactive_split.all.current"] == 0  # never counted for expandable
    (segment,) = alloc.segments()
    assert segment["total_size"] == 40 * MiB and segment["is_expandable"]
    alloc.check_invariants()


def test_the_small_pool_maps_2_mib_pages():
    alloc = make("expandable_segments:True", device_total_bytes=8 * GiB)
    alloc.malloc(1000)
    assert alloc.reserved_bytes == 2 * MiB


def test_any_remainder_of_512_bytes_or_more_is_split_even_in_the_large_pool():
    alloc = make("expandable_segments:True", device_total_bytes=8 * GiB)
    assert alloc.malloc(11 * MiB - 512).size == 11 * MiB - 512
    assert alloc.malloc(MiB + 512).size == MiB + 512


def test_best_fit_prefers_a_free_hole_over_the_growable_tail():
    alloc = make("expandable_segments:True", device_total_bytes=8 * GiB)
    a = alloc.malloc(10 * MiB)
    alloc.malloc(5 * MiB)  # [0, 10) a, [10, 15) b, [15, 20) free tail before unmapped pages
    alloc.free(a)  # free: the 10 MiB hole and the 5 MiB tail
    c = alloc.malloc(4 * MiB)  # the tail is smaller, but it can grow: the hole is the fit
    assert c.addr == a.addr


def test_empty_cache_unmaps_whole_free_pages_and_drops_an_empty_segment():
    alloc = make("expandable_segments:True", device_total_bytes=8 * GiB)
    a = alloc.malloc(3 * MiB)
    b = alloc.malloc(30 * MiB)
    alloc.free(a)
    alloc.empty_cache()  # [0, 3 MiB) holds no whole 20 MiB page: nothing unmapped
    assert alloc.reserved_bytes == 40 * MiB
    alloc.free(b)
    alloc.empty_cache()
    stats = alloc.stats()
    assert (alloc.reserved_bytes, stats["num_device_free"]) == (0, 1)
    assert alloc.segments() == []
    alloc.check_invariants()


def test_pages_that_do_not_fit_the_capacity_cause_an_out_of_memory():
    alloc = make("expandable_segments:True", capacity_bytes=50 * MiB)
    with pytest.raises(SimulatedOutOfMemory):
        alloc.malloc(45 * MiB)  # needs three 20 MiB pages
    assert alloc.reserved_bytes == 0
    assert alloc.malloc(35 * MiB).size == 35 * MiB  # two pages fit
    assert alloc.reserved_bytes == 40 * MiB


def test_each_stream_grows_its_own_range():
    alloc = make("expandable_segments:True", device_total_bytes=8 * GiB)
    a = alloc.malloc(3 * MiB, stream=0)
    b = alloc.malloc(3 * MiB, stream=1)
    assert abs(a.addr - b.addr) >= 9 * GiB  # each range spans 1 1/8 of the device's memory
    assert alloc.reserved_bytes == 40 * MiB
