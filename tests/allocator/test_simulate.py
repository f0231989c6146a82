"""simulate(): peaks, the per-category breakdown at each peak, the timeline, OOM and bad traces."""

from __future__ import annotations

import pytest

from xmem_admission.contract.errors import TraceError
from xmem_admission.estimator.allocator.alloc_conf import parse_alloc_conf
from xmem_admission.estimator.allocator.simulate import simulate
from xmem_admission.estimator.trace import Category, Trace

from .helpers import MiB


def _training_like() -> Trace:
    trace = Trace()
    trace.alloc(1, 3 * MiB, category=Category.PARAMETER)  # 20 MiB segment: 3 used
    trace.alloc(2, 5 * MiB, category=Category.ACTIVATION)  # split from the same segment
    trace.free(2)
    trace.alloc(3, 3 * MiB, category=Category.GRADIENT)
    return trace


def test_peaks_and_the_breakdown_at_each_peak_are_computed_by_hand():
    result = simulate(_training_like())
    assert (result.peak_allocated_bytes, result.peak_reserved_bytes) == (8 * MiB, 20 * MiB)
    assert (result.peak_allocated_event, result.peak_reserved_event) == (1, 0)
    at_alloc = result.allocated_by_category_at_peak_allocated
    assert (at_alloc["parameter"], at_alloc["activation"], at_alloc["gradient"]) == \
        (3 * MiB, 5 * MiB, 0)
    at_res = result.allocated_by_category_at_peak_reserved
    assert (at_res["parameter"], at_res["activation"]) == (3 * MiB, 0)
    assert set(at_res) >= {c.value for c in Category}
    assert result.oom is None and result.num_events == 4
    assert result.stats["allocated_bytes.all.current"] == 6 * MiB
    assert result.timeline is None


def test_the_timeline_samples_every_change():
    result = simulate(_training_like(), timeline=True)
    assert result.timeline == [(0, 3 * MiB, 20 * MiB), (1, 8 * MiB, 20 * MiB),
                               (2, 3 * MiB, 20 * MiB), (3, 6 * MiB, 20 * MiB)]


def test_an_out_of_memory_stops_the_replay_with_the_peaks_reached_before_it():
    trace = Trace()
    trace.alloc(1, 25 * MiB)
    trace.alloc(2, 10 * MiB)  # 26 + 10 MiB > 30 MiB
    trace.alloc(3, 1)
    result = simulate(trace, capacity_bytes=30 * MiB)
    assert result.oom is not None
    assert (result.oom.event_index, result.oom.requested_bytes, result.oom.stream) == (1, 10 * MiB, 0)
    assert (result.oom.allocated_bytes, result.oom.reserved_bytes) == (26 * MiB, 26 * MiB)
    assert result.num_events == 2
    assert result.peak_reserved_bytes == 26 * MiB
    assert "out of memory" in result.oom.message
    assert result.to_dict()["oom"]["event_index"] == 1


def test_configuration_changes_the_result():
    trace = Trace()
    trace.alloc(1, 3 * MiB)
    assert simulate(trace).peak_reserved_bytes == 20 * MiB
    conf = parse_alloc_conf("expandable_segments:True")
    assert simulate(trace, conf, device_total_bytes=8 << 30).peak_reserved_bytes == 20 * MiB
    assert simulate(trace, parse_alloc_conf("large_segment_size_mb:64")).peak_reserved_bytes == \
        64 * MiB


def test_zero_byte_allocations_never_reach_the_allocator():
    trace = Trace()
    trace.alloc(1, 0)
    trace.free(1)
    result = simulate(trace)
    assert result.peak_reserved_bytes == 0 and result.stats["num_device_alloc"] == 0


def test_empty_cache_events_release_cached_segments_and_unknown_categories_are_kept():
    trace = Trace()
    trace.alloc(1, 12 * MiB, category="kv_cache")
    trace.free(1)
    trace.empty_cache()
    trace.mark("step 1")
    result = simulate(trace, timeline=True)
    assert result.stats["reserved_bytes.all.current"] == 0
    assert result.allocated_by_category_at_peak_reserved["kv_cache"] == 12 * MiB
    assert result.timeline[-1] == (2, 0, 0)


def test_a_free_of_an_unknown_id_is_a_trace_error():
    trace = Trace()
    trace.alloc(1, 100)
    trace.free(2)
    with pytest.raises(TraceError, match="event 1: free of id 2"):
        simulate(trace)


def test_a_live_id_cannot_be_allocated_twice():
    trace = Trace()
    trace.alloc(1, 100)
    trace.alloc(1, 100)
    with pytest.raises(TraceError, match="already live"):
        simulate(trace)
