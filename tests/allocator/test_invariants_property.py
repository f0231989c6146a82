"""Property tests: whatever the requests and settings, the allocator's books balance.

After every operation: segments do not overlap, blocks tile their segments, allocated + free
bytes inside segments == reserved, the statistics agree with a recount (``check_invariants``).
After freeing everything: every cudaMalloc'd segment is one free block again, and
``empty_cache`` gives all memory back.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xmem_admission.contract.errors import SimulatedOutOfMemory

from .helpers import GiB, KiB, MiB, make

CONFIGS = [
    "",
    "max_split_size_mb:40",
    "max_split_size_mb:24,max_non_split_rounding_mb:40",
    "roundup_power2_divisions:[1:4,64:8,>:2]",
    "expandable_segments:True",
    "garbage_collection_threshold:0.5",
    "large_segment_size_mb:32",
]

sizes = st.one_of(
    st.integers(1, 4 * KiB),
    st.integers(4 * KiB, 1 * MiB + 4 * KiB),
    st.integers(1 * MiB, 12 * MiB),
    st.integers(12 * MiB, 120 * MiB),
)
operations = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), sizes, st.sampled_from([0, 0, 0, 3])),
        st.tuples(st.just("free"), st.integers(0, 1 << 30), st.just(0)),
        st.tuples(st.just("empty_cache"), st.just(0), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conf=st.sampled_from(CONFIGS), ops=operations,
       capacity=st.one_of(st.none(), st.integers(40 * MiB, 1 * GiB)))
def test_the_books_balance_after_every_operation_and_freeing_everything_merges(conf, ops,
                                                                               capacity):
    kwargs = {"capacity_bytes": capacity, "device_total_bytes": 4 * GiB}
    if "garbage" in conf:
        kwargs["memory_fraction"] = 0.8
    alloc = make(conf, **kwargs)
    live = []
    for op, value, stream in ops:
        if op == "malloc":
            try:
                live.append(alloc.malloc(value, stream))
            except SimulatedOutOfMemory as oom:
                assert capacity is not None
                assert oom.reserved_bytes <= capacity
        elif op == "free" and live:
            alloc.free(live.pop(value % len(live)))
        elif op == "empty_cache":
            alloc.empty_cache()
        alloc.check_invariants()
        if capacity is not None:
            assert alloc.reserved_bytes <= capacity
    for block in live:
        alloc.free(block)
    alloc.check_invariants()
    stats = alloc.stats()
    assert stats["allocated_bytes.all.current"] == 0
    assert stats["inactive_split.all.current"] == 0
    for segment in alloc.segments():
        assert len(segment["blocks"]) == 1, "a wholly free segment must be one block again"
    alloc.empty_cache()
    assert alloc.reserved_bytes == 0 and alloc.segments() == []
    assert alloc.stats()["reserved_bytes.all.current"] == 0


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(sizes, st.booleans()), max_size=80))
def test_allocated_blocks_never_overlap_and_are_at_least_the_rounded_request(ops):
    alloc = make()
    live = []
    for size, keep in ops:
        block = alloc.malloc(size)
        assert block.size >= alloc.round_size(size)
        live.append(block)
        if not keep:
            alloc.free(live.pop(0))
        spans = sorted((b.addr, b.addr + b.size) for b in live)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
