"""bench/yardsticks/oom_replay.py: a made-up stream of jobs under HAMi-style enforcement, with and without
the OOM retry loop. Each job is a small allocator trace, simulated for real."""

from __future__ import annotations

import pytest

from bench.yardsticks import oom_replay as replay
from xmem_admission.cluster.policy import retry
from xmem_admission.cluster.policy.model import BackendName, Target
from xmem_admission.cluster.policy.sizing import size_request
from xmem_admission.contract import gpus, oom
from xmem_admission.estimator.allocator.simulate import simulate
from xmem_admission.estimator.trace import Trace

MIB, GIB = 2**20, 2**30
A100 = gpus.lookup("A100-40GB")
OUTSIDE = 512 * MIB
GPU = replay.basis_gpu(A100, A100.capacity_bytes, OUTSIDE)
SETTINGS = replay.default_settings(A100.key)


def training_trace(weights_gib: float = 4, activations_gib: float = 6, steps: int = 3) -> Trace:
    """Weights held throughout; each step's activations allocated in 8 pieces, then freed."""
    trace = Trace()
    trace.alloc(1, int(weights_gib * GIB), category="parameter")
    ident = 2
    for _ in range(steps):
        live = []
        for _ in range(8):
            trace.alloc(ident, int(activations_gib * GIB / 8), category="activation")
            live.append(ident)
            ident += 1
        for one in live:
            trace.free(one)
    return trace


def job(name: str, measured_over_estimate: float = 1.0, measured_oom: bool = False,
        predicted_oom: bool = False, stream: Trace | None = None) -> replay.Job:
    stream = stream if stream is not None else training_trace()
    peak = simulate(stream).peak_reserved_bytes
    estimate = peak + OUTSIDE
    return replay.Job(name, stream, peak, OUTSIDE, GPU, int(estimate * measured_over_estimate),
                      measured_oom, predicted_oom)


def test_a_job_under_its_request_runs_once_at_the_request_the_webhook_writes():
    fits = job("fits", measured_over_estimate=1.0)
    out = replay.replay(fits, SETTINGS)

    assert out.admitted and out.succeeded
    assert [a.request_bytes for a in out.attempts] == [
        size_request(fits.estimate_bytes, SETTINGS, GPU.capacity_bytes)]
    assert out.attempts[0].request_bytes > fits.measured_bytes  # the 5% margin


def test_a_job_over_its_request_fails_and_its_retry_is_sized_from_the_simulated_report():
    over = job("over", measured_over_estimate=1.2)
    first = size_request(over.estimate_bytes, SETTINGS, GPU.capacity_bytes)
    assert over.measured_bytes > first

    out = replay.replay(over, SETTINGS)

    requests = [a.request_bytes for a in out.attempts]
    assert out.attempts[0].failed and out.succeeded
    assert requests == sorted(set(requests)) and requests[0] == first
    assert requests[-1] >= over.measured_bytes > requests[-2]
    report = out.attempts[0].evidence
    assert report is not None and report.source == oom.PYTORCH and report.confirmed
    assert report.hami_limit_bytes == first  # HAMi-core's line names the request as the limit
    # the evidence is the job when it ran out: more than the request allowed, less than its peak
    assert first < report.need_bytes(GPU.overhead_bytes) <= over.measured_bytes
    rule = retry.rule_for(SETTINGS)
    grown = retry.grow(first, report, 1, Target(GPU, BackendName.HAMI), rule)
    assert isinstance(grown, retry.Retry) and requests[1] == grown.request_bytes
    assert out.attempts[0].next_step == grown.reason
    assert requests[1] % SETTINGS.granularity_bytes == 0


def test_without_the_loop_a_job_over_its_request_stays_failed():
    out = replay.replay(job("over", measured_over_estimate=1.2), SETTINGS, loop=False)

    assert len(out.attempts) == 1 and out.attempts[0].failed and not out.succeeded
    assert out.end_reason == replay.NO_LOOP


def test_a_job_that_never_fits_grows_to_the_gpu_and_ends_with_the_reason():
    never = job("never", measured_over_estimate=1.5, measured_oom=True)

    out = replay.replay(never, SETTINGS)

    requests = [a.request_bytes for a in out.attempts]
    assert all(a.failed for a in out.attempts) and not out.succeeded
    assert requests == sorted(set(requests)) and len(requests) >= 2
    assert max(requests) <= GPU.capacity_bytes
    assert "does not fit" in out.end_reason or "more than the most" in out.end_reason
    assert out.attempts[-1].next_step == out.end_reason


def fragmenting_trace() -> Trace:
    """Eight 512 MiB blocks freed, then two 3 GiB ones the cached blocks cannot serve: 10 GiB
    reserved at the peak, 6 GiB allocated."""
    trace = Trace()
    for ident in range(8):
        trace.alloc(ident, 512 * MIB, category="activation")
    for ident in range(8):
        trace.free(ident)
    trace.alloc(100, 3 * GIB, category="activation")
    trace.alloc(101, 3 * GIB, category="activation")
    return trace


def test_a_job_whose_cache_the_allocator_can_free_fails_only_under_the_measured_rule():
    cached = job("cached", measured_over_estimate=1.3, stream=fragmenting_trace())
    request = size_request(cached.estimate_bytes, SETTINGS, GPU.capacity_bytes)
    assert cached.measured_bytes > request

    measured = replay.replay(cached, SETTINGS, loop=False)
    allocator = replay.replay(cached, SETTINGS, loop=False, criterion=replay.Criterion.ALLOCATOR)

    assert measured.attempts[0].failed  # its device-wide peak is above the request...
    assert allocator.succeeded and allocator.attempts[0].request_bytes == request  # ...its
    # allocator frees the cached blocks and retries before it would raise


def test_under_the_allocator_rule_every_failure_leaves_the_allocators_figures():
    over = job("over", measured_over_estimate=1.2)

    out = replay.replay(over, SETTINGS, criterion=replay.Criterion.ALLOCATOR)

    failed = [a for a in out.attempts if a.failed]
    assert failed and out.succeeded
    assert all(a.evidence is not None and a.evidence.source == oom.PYTORCH for a in failed)


def test_a_job_whose_estimate_fits_no_gpu_is_refused_at_admission():
    out = replay.replay(job("huge", predicted_oom=True), SETTINGS)

    assert not out.admitted and out.attempts == []
    assert "refused at admission" in out.end_reason


def test_a_tail_without_the_allocator_figures_still_reads_as_an_oom_and_grows_by_the_factor():
    tail = replay.log_tail(None, 8 * GIB, OUTSIDE)
    report = oom.read(tail)

    assert report is not None and report.source == oom.CUDA_ERROR
    assert report.need_bytes() is None


def test_the_log_tail_reads_back_as_the_simulators_figures_rounded_up():
    stream = training_trace()
    report = replay.simulated_oom(stream, 8 * GIB, OUTSIDE)
    assert report is not None

    read = oom.read(replay.log_tail(report, 8 * GIB, OUTSIDE))

    assert read is not None and read.source == oom.PYTORCH
    assert read.exception == "torch.OutOfMemoryError"
    assert report.allocated_bytes <= read.allocated_bytes < report.allocated_bytes + 10 * MIB
    assert report.reserved_bytes <= read.reserved_bytes < report.reserved_bytes + 10 * MIB
    assert report.allocation_bytes <= read.asked_bytes < report.allocation_bytes + 10 * MIB
    assert read.hami_requested_bytes == report.reserved_bytes + OUTSIDE + report.allocation_bytes
    assert read.hami_limit_bytes == 8 * GIB


@pytest.mark.parametrize("size, shown", [(1024, "1024 bytes"), (1025, "1.00 KiB"),
                                         (MIB, "1024.00 KiB"), (MIB + 1, "1.00 MiB"),
                                         (GIB + GIB // 2, "1.50 GiB")])
def test_sizes_are_printed_as_c10_prints_them(size, shown):
    assert replay.format_size(size) == shown


def test_the_summary_counts_failures_attempts_and_memory_against_whole_gpus():
    stream = [job("fits"), job("over", measured_over_estimate=1.1),
              job("never", measured_over_estimate=1.5, measured_oom=True),
              job("huge", predicted_oom=True)]
    with_loop = [replay.replay(j, SETTINGS) for j in stream]
    without = [replay.replay(j, SETTINGS, loop=False) for j in stream]

    s = replay.summarise(stream, with_loop)
    n = replay.summarise(stream, without)

    assert (s.jobs, s.refused, s.failed_first, s.failed_after_retry) == (4, 1, 2, 1)
    assert (s.succeeded, s.gave_up) == (2, 1) and (n.succeeded, n.gave_up) == (1, 0)
    assert s.whole_gpu_bytes == 4 * GPU.capacity_bytes and s.whole_gpu_failed == 1
    assert s.requested_bytes == sum(a.request_bytes for o in with_loop for a in o.attempts)
    assert n.requested_bytes == sum(o.attempts[0].request_bytes for o in without if o.attempts)
    assert s.requested_bytes > n.requested_bytes
    assert sum(s.reasons.values()) == 1
