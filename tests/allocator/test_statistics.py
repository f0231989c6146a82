"""stats() reports every key torch.cuda.memory_stats() reports, with PyTorch's meaning."""

from __future__ import annotations

from .helpers import MiB, make

POOLS = ("all", "small_pool", "large_pool")
METRICS = ("current", "peak", "allocated", "freed")
STATS = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
         "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")


def test_every_memory_stats_key_is_present_and_sorted():
    stats = make().stats()
    expected = {f"{s}.{p}.{m}" for s in STATS for p in POOLS for m in METRICS}
    expected |= {f"{s}.{m}" for s in ("oversize_allocations", "oversize_segments")
                 for m in METRICS}
    expected |= {"num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                 "num_device_free", "max_split_size"}
    assert set(stats) == expected
    assert list(stats) == sorted(stats)


def test_current_peak_allocated_and_freed_follow_pytorch_s_stat_rules():
    alloc = make()
    a = alloc.malloc(3 * MiB)  # large pool, 20 MiB segment
    b = alloc.malloc(1000)  # small pool, 2 MiB segment, 1024-byte block
    alloc.free(a)
    s = alloc.stats()
    assert (s["allocation.all.current"], s["allocation.all.peak"],
            s["allocation.all.allocated"], s["allocation.all.freed"]) == (1, 2, 2, 1)
    assert (s["allocated_bytes.large_pool.current"], s["allocated_bytes.large_pool.peak"],
            s["allocated_bytes.large_pool.freed"]) == (0, 3 * MiB, 3 * MiB)
    assert (s["requested_bytes.small_pool.current"], s["allocated_bytes.small_pool.current"]) \
        == (1000, 1024)
    assert s["active_bytes.all.current"] == s["allocated_bytes.all.current"] == 1024
    assert (s["reserved_bytes.all.current"], s["segment.all.current"]) == (22 * MiB, 2)
    assert (s["inactive_split.small_pool.current"],
            s["inactive_split_bytes.small_pool.current"]) == (1, 2 * MiB - 1024)
    alloc.free(b)
    assert alloc.stats()["inactive_split.all.current"] == 0
