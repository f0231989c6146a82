"""garbage_collection_threshold: with a memory fraction, the oldest cached blocks go first."""

from __future__ import annotations

from .helpers import MiB, make


def _age_blocks(alloc):
    """Four 100 MiB segments on stream 0; A and B cached early, C and D cached later.

    get_free_block calls (the GC clock, shared by every stream's large pool): A-D miss (1-4);
    three 50 MiB requests on stream 1 (5-7) advance the clock without touching stream 0.
    """
    a, b, c, d = (alloc.malloc(100 * MiB) for _ in range(4))
    alloc.free(a)
    alloc.free(b)  # cached at clock 4
    for _ in range(3):
        alloc.free(alloc.malloc(50 * MiB, stream=1))  # last one cached at clock 7
    alloc.free(c)
    alloc.free(d)  # cached at clock 7
    return a, b, c, d


def test_gc_frees_the_blocks_older_than_the_average_before_calling_cudamalloc():
    # allowed = 0.5 * 2000 = 1000 MiB; GC threshold = 0.4 * 1000 = 400 MiB.
    alloc = make("garbage_collection_threshold:0.4", capacity_bytes=2000 * MiB,
                 memory_fraction=0.5)
    a, b, c, d = _age_blocks(alloc)
    assert alloc.reserved_bytes == 450 * MiB
    # Call 8 misses; 450 > 400, so GC reclaims >= 50 MiB. Ages: A 4, B 4, C 1, D 1, the
    # stream-1 block 1; average 11 / 5 = 2.2: A and B go (200 MiB), then cudaMalloc.
    alloc.malloc(200 * MiB)
    assert alloc.stats()["num_device_free"] == 2
    sizes = {s["address"]: s["total_size"] for s in alloc.segments()}
    # A and B were adjacent: the new 200 MiB segment reuses their freed address range.
    assert b.addr not in sizes and sizes[a.addr] == 200 * MiB
    assert sizes[c.addr] == sizes[d.addr] == 100 * MiB
    assert alloc.reserved_bytes == 450 * MiB
    alloc.check_invariants()


def test_gc_stays_off_without_a_memory_fraction():
    alloc = make("garbage_collection_threshold:0.4", capacity_bytes=2000 * MiB)
    _age_blocks(alloc)
    alloc.malloc(200 * MiB)
    assert alloc.stats()["num_device_free"] == 0
    assert alloc.reserved_bytes == 650 * MiB


def test_gc_does_nothing_below_its_threshold():
    alloc = make("garbage_collection_threshold:0.5", capacity_bytes=2000 * MiB,
                 memory_fraction=0.5)
    _age_blocks(alloc)  # 450 MiB reserved <= 500 MiB threshold
    alloc.malloc(200 * MiB)
    assert alloc.stats()["num_device_free"] == 0
