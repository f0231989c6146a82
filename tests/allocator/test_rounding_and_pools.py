"""Request rounding, pool choice, segment sizes and per-stream pools, each computed by hand."""

from __future__ import annotations

import pytest

from xmem_admission.contract.errors import AllocConfError

from .helpers import MiB, make


@pytest.mark.parametrize("size, rounded", [
    (1, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024), (3 * MiB + 1, 3 * MiB + 512),
])
def test_requests_round_up_to_multiples_of_512_bytes(size, rounded):
    assert make().round_size(size) == rounded


@pytest.mark.parametrize("size, rounded", [
    (1200, 1536),  # not above 512 * 4 = 2048: plain 512-byte rounding
    (3000, 3072),  # steps of [2048, 4096) in 4: 2048, 2560, 3072, 3584
    (5 * MiB + 1, 6 * MiB),  # steps of [4, 8) MiB: 4, 5, 6, 7 MiB
    (8 * MiB, 8 * MiB),  # a power of two stays
])
def test_four_power_of_two_divisions_round_to_the_next_step(size, rounded):
    assert make("roundup_power2_divisions:4").round_size(size) == rounded


def test_per_interval_divisions_apply_by_the_size_s_power_of_two_interval():
    alloc = make("roundup_power2_divisions:[256:1,512:2,>:8]")
    assert alloc.round_size(300 * MiB + 1) == 300 * MiB + 512  # interval 8: 1 = no rounding
    assert alloc.round_size(600 * MiB + 1) == 768 * MiB  # interval 9: halves of [512, 1024)
    assert alloc.round_size(1536 * MiB + 1) == 1664 * MiB  # interval 10: eighths of 1 GiB


def test_requests_up_to_1_mib_go_to_the_small_pool_with_2_mib_segments():
    alloc = make()
    block = alloc.malloc(MiB)
    assert block.pool.is_small and block.size == MiB
    stats = alloc.stats()
    assert stats["reserved_bytes.small_pool.current"] == 2 * MiB
    assert stats["segment.small_pool.current"] == 1
    assert stats["reserved_bytes.large_pool.current"] == 0


@pytest.mark.parametrize("size, segment", [
    (MiB + 1, 20 * MiB),  # 1-10 MiB requests get a 20 MiB (kLargeBuffer) segment
    (10 * MiB - 512, 20 * MiB),
    (10 * MiB, 10 * MiB),  # from 10 MiB on: rounded up to 2 MiB
    (11 * MiB, 12 * MiB),
    (100 * MiB + 1, 102 * MiB),
])
def test_large_requests_get_segments_by_pytorch_s_size_rule(size, segment):
    alloc = make()
    block = alloc.malloc(size)
    assert not block.pool.is_small
    assert alloc.reserved_bytes == segment
    assert alloc.stats()["reserved_bytes.large_pool.current"] == segment


def test_large_segment_size_changes_the_segment_of_1_to_10_mib_requests():
    alloc = make("large_segment_size_mb:32")
    alloc.malloc(2 * MiB)
    assert alloc.reserved_bytes == 32 * MiB


def test_streams_never_share_cached_blocks():
    alloc = make()
    alloc.free(alloc.malloc(12 * MiB, stream=0))
    block = alloc.malloc(12 * MiB, stream=7)
    assert block.stream == 7
    assert alloc.reserved_bytes == 24 * MiB  # a second segment, not the cached one
    again = alloc.malloc(12 * MiB, stream=0)
    assert alloc.reserved_bytes == 24 * MiB and again.stream == 0


def test_the_async_backend_cannot_be_simulated():
    with pytest.raises(AllocConfError, match="cudaMallocAsync"):
        make("backend:cudaMallocAsync")


def test_a_memory_fraction_needs_the_device_capacity():
    with pytest.raises(AllocConfError, match="needs the device's capacity"):
        make(memory_fraction=0.5)
    assert make(memory_fraction=0.5, capacity_bytes=1000 * MiB).allowed_bytes == 500 * MiB
    assert make(memory_fraction=1.0).allowed_bytes is None  # 1.0: no limit (PyTorch 2.10+)
