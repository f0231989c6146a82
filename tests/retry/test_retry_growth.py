"""After an OOM the next pod asks for more, by the stated rule, up to the cap, and a workload that
cannot fit ends with a reason."""

from __future__ import annotations

from typing import Optional, Union

import pytest

from xmem_admission.cluster.policy.model import BackendName, Target
from xmem_admission.cluster.policy.retry import GiveUp, Retry, RetryRule, grow
from xmem_admission.contract import gpus, oom

GiB, MiB = 1 << 30, 1 << 20
H100 = Target(gpus.lookup("H100-80GB"), BackendName.HAMI)
A100_MIG = Target(gpus.lookup("A100-80GB"), BackendName.MIG_MIXED)
A100_MIG_SINGLE = Target(gpus.lookup("A100-80GB"), BackendName.MIG_SINGLE)
RULE = RetryRule(safety_margin_percent=5, growth_percent=50, granularity_bytes=256 * MiB,
                 minimum_request_bytes=GiB)
CAPPED = RetryRule(safety_margin_percent=5, growth_percent=50, granularity_bytes=256 * MiB,
                   cap_bytes=30 * GiB)


def in_use(used: int, asked: int) -> oom.CudaOOM:
    return oom.CudaOOM(oom.PYTORCH, in_use_bytes=used, asked_bytes=asked)


NO_FIGURES = oom.CudaOOM(oom.CUDA_ERROR)


def profile(target: Target, name: str) -> gpus.MigProfile:
    return next(p for p in target.gpu.mig_profiles if p.name == name)


@pytest.mark.parametrize("previous, report, ooms, rule, expected", [
    # a first OOM with figures: need 21 GiB * 1.05 = 22.05 GiB, up to the 256 MiB step
    (20 * GiB, in_use(20 * GiB, GiB), 1, RULE, 22 * GiB + 256 * MiB),
    # evidence below the request that failed: at least the margin over it
    (20 * GiB, in_use(9 * GiB, GiB), 1, RULE, 21 * GiB),
    # a repeated OOM: 1.5 x the last request (33.375 GiB) beats the evidence
    (22 * GiB + 256 * MiB, in_use(22 * GiB, 512 * MiB), 2, RULE, 33 * GiB + 512 * MiB),
    # ... unless the evidence says more
    (20 * GiB, in_use(40 * GiB, 2 * GiB), 3, RULE, 44 * GiB + 256 * MiB),
    # no figures (CUDA error: out of memory): the growth factor at once
    (16 * GiB, NO_FIGURES, 1, RULE, 24 * GiB),
    (16 * GiB, None, 1, RULE, 24 * GiB),
    # the cap stops growth
    (22 * GiB + 256 * MiB, NO_FIGURES, 2, CAPPED, 30 * GiB),
    # a tiny request grows at least by one granule and to the policy's minimum
    (256 * MiB, in_use(100 * MiB, MiB), 1, RULE, GiB),
    (4 * GiB, oom.CudaOOM(oom.PYTORCH, in_use_bytes=4 * GiB - 512 * MiB, asked_bytes=MiB), 1,
     RetryRule(0, 50, 256 * MiB), 4 * GiB + 256 * MiB),
])
def test_the_next_request_follows_the_stated_rule(
        previous: int, report: Optional[oom.CudaOOM], ooms: int, rule: RetryRule,
        expected: int) -> None:
    answer = grow(previous, report, ooms, H100, rule)
    assert isinstance(answer, Retry), answer
    assert answer.request_bytes == expected
    assert answer.request_bytes > previous
    assert answer.mig_profile is None


def test_repeated_ooms_grow_geometrically_and_end_at_the_cap() -> None:
    requests = [8 * GiB]
    answer: Union[Retry, GiveUp] = grow(requests[-1], NO_FIGURES, 1, H100, CAPPED)
    while isinstance(answer, Retry):
        requests.append(answer.request_bytes)
        answer = grow(requests[-1], NO_FIGURES, len(requests), H100, CAPPED)
    assert requests == [8 * GiB, 12 * GiB, 18 * GiB, 27 * GiB, 30 * GiB]
    assert isinstance(answer, GiveUp)
    assert "ran out of GPU memory at 30.0 GiB" in answer.reason
    assert "H100-80GB (30.0 GiB)" in answer.reason


def test_growth_never_passes_the_gpus_capacity() -> None:
    capacity = H100.gpu.capacity_bytes
    answer = grow(70 * GiB, NO_FIGURES, 2, H100, RULE)
    assert isinstance(answer, Retry) and answer.request_bytes == capacity
    assert "(capped)" in answer.reason
    again = grow(capacity, NO_FIGURES, 3, H100, RULE)
    assert isinstance(again, GiveUp) and "it does not fit" in again.reason


def test_evidence_beyond_the_ceiling_ends_the_workload_at_once() -> None:
    answer = grow(20 * GiB, in_use(25 * GiB, 8 * GiB), 1, H100, CAPPED)
    assert isinstance(answer, GiveUp)
    assert "needing at least 33.0 GiB" in answer.reason and "(30.0 GiB)" in answer.reason


def test_reserved_memory_counts_the_gpus_memory_outside_the_allocator() -> None:
    report = oom.CudaOOM(oom.PYTORCH, reserved_bytes=20 * GiB, asked_bytes=GiB)
    answer = grow(20 * GiB, report, 1, H100, RULE)
    assert isinstance(answer, Retry)
    assert answer.need_bytes == 21 * GiB + H100.gpu.overhead_bytes
    assert "evidence" in answer.reason and "5% margin" in answer.reason


def test_a_hami_line_alone_sizes_from_hamis_usage() -> None:
    report = oom.CudaOOM(oom.HAMI, hami_requested_bytes=11 * GiB, hami_limit_bytes=10 * GiB,
                         confirmed=False)
    answer = grow(10 * GiB, report, 1, H100, RULE)
    assert isinstance(answer, Retry) and answer.request_bytes == 11 * GiB + 768 * MiB  # 11.55


@pytest.mark.parametrize("target", [A100_MIG, A100_MIG_SINGLE])
def test_mig_goes_to_the_next_profile_up(target: Target) -> None:
    small = profile(target, "1g.10gb")
    answer = grow(9 * GiB, in_use(9 * GiB, 512 * MiB), 1, target, RULE)
    assert isinstance(answer, Retry)
    # 1g.20gb before 2g.20gb: the same memory on fewer compute slices
    assert answer.mig_profile == "1g.20gb"
    assert answer.request_bytes == profile(target, "1g.20gb").memory_bytes > small.memory_bytes
    assert gpus.smallest_mig_profile(target.gpu, answer.request_bytes) == profile(target,
                                                                                 "1g.20gb")
    # a request that was already a whole slice moves up even when 1.5 x fits the same memory
    bigger = grow(profile(target, "1g.20gb").memory_bytes, NO_FIGURES, 2, target, RULE)
    assert isinstance(bigger, Retry) and bigger.mig_profile == "3g.40gb"


def test_mig_ends_at_the_largest_profile_within_the_cap() -> None:
    answer = grow(25 * GiB, NO_FIGURES, 2, A100_MIG, CAPPED)  # cap 30 GiB: 1g.20gb at most
    assert isinstance(answer, GiveUp) and "A100-80GB (19.5 GiB)" in answer.reason
    top = profile(A100_MIG, "7g.80gb")
    at_top = grow(top.memory_bytes - GiB, NO_FIGURES, 1, A100_MIG, RULE)
    assert isinstance(at_top, GiveUp) and "no larger slice" in at_top.reason
    tiny = RetryRule(5, 50, 256 * MiB, cap_bytes=GiB)
    nothing = grow(512 * MiB, NO_FIGURES, 1, A100_MIG, tiny)
    assert isinstance(nothing, GiveUp) and "no MIG slice" in nothing.reason


@pytest.mark.parametrize("previous, ooms", [(0, 1), (GiB, 0)])
def test_impossible_inputs_are_refused(previous: int, ooms: int) -> None:
    with pytest.raises(ValueError):
        grow(previous, None, ooms, H100, RULE)


def test_a_rule_without_growth_is_refused() -> None:
    with pytest.raises(ValueError):
        RetryRule(5, 0, 256 * MiB)
