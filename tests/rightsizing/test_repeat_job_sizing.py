"""A repeat job (same fingerprint, same namespace) is sized from its estimate corrected by what
its earlier runs used, within the policy's spec.rightSizing."""

from __future__ import annotations

from fractions import Fraction

import pytest

from xmem_admission.cluster.policy.model import Policy
from xmem_admission.cluster.policy.right_sizing import Run, correct
from xmem_admission.cluster.policy.sizing import size_request

GiB = 1 << 30
GPU = "A100-80GB"


def settings(**right_sizing):
    spec = {"targets": [{"gpu": GPU, "backend": "HAMi"}]}
    if right_sizing:
        spec["rightSizing"] = right_sizing
    return Policy.from_spec(spec).defaults


def run(peak_gib, estimate_gib=20.0, finished=100.0, completed=True, gpu=GPU):
    return Run(gpu, int(estimate_gib * GiB), int(peak_gib * GiB), completed, finished)


def test_a_job_without_earlier_runs_keeps_its_estimate():
    fixed = correct(20 * GiB, GPU, [], settings().right_sizing)

    assert fixed.estimate_bytes == 20 * GiB and fixed.runs == 0


def test_a_run_that_used_more_than_estimated_raises_the_next_request_by_its_ratio():
    policy = settings()
    fixed = correct(20 * GiB, GPU, [run(23), run(21, finished=50)], policy.right_sizing)

    assert fixed.ratio == Fraction(23, 20) and fixed.estimate_bytes == 23 * GiB
    assert "raised" in fixed.reason
    request = size_request(fixed.estimate_bytes, policy, 80 * GiB)
    assert request > size_request(20 * GiB, policy, 80 * GiB) and request >= 23 * GiB


def test_the_ratio_carries_over_to_a_new_estimate_of_the_same_job():
    fixed = correct(30 * GiB, GPU, [run(24, estimate_gib=20)], settings().right_sizing)

    assert fixed.estimate_bytes == 36 * GiB


def test_runs_that_used_less_lower_nothing_unless_the_policy_says_so():
    runs = [run(15), run(16, finished=90)]

    kept = correct(20 * GiB, GPU, runs, settings().right_sizing)
    lowered = correct(20 * GiB, GPU, runs, settings(lowerRequests=True).right_sizing)

    assert kept.estimate_bytes == 20 * GiB and "lowerRequests is false" in kept.reason
    assert lowered.estimate_bytes == 16 * GiB and "lowered" in lowered.reason


def test_a_run_that_did_not_complete_may_raise_but_never_lower():
    policy = settings(lowerRequests=True).right_sizing
    cut_short = [run(10, completed=False), run(15, finished=90)]

    assert correct(20 * GiB, GPU, cut_short, policy).estimate_bytes == 20 * GiB
    assert correct(20 * GiB, GPU, [run(22, completed=False)], policy).estimate_bytes == 22 * GiB


def test_only_the_latest_runs_the_policy_counts_are_used():
    runs = [run(30, finished=10), run(21, finished=20), run(22, finished=30)]

    assert correct(20 * GiB, GPU, runs, settings(runs=2).right_sizing).estimate_bytes == 22 * GiB
    assert correct(20 * GiB, GPU, runs, settings(runs=3).right_sizing).estimate_bytes == 30 * GiB


def test_runs_on_another_gpu_model_or_without_a_peak_do_not_count():
    runs = [run(30, gpu="H100-80GB"), run(0)]

    fixed = correct(20 * GiB, GPU, runs, settings().right_sizing)

    assert fixed.estimate_bytes == 20 * GiB and fixed.runs == 0


def test_runs_zero_turns_right_sizing_off():
    fixed = correct(20 * GiB, GPU, [run(30)], settings(runs=0).right_sizing)

    assert fixed.estimate_bytes == 20 * GiB and "off" in fixed.reason


def test_a_corrected_estimate_is_never_sized_past_the_gpu():
    policy = settings()
    fixed = correct(70 * GiB, GPU, [run(30, estimate_gib=20)], policy.right_sizing)

    assert fixed.estimate_bytes == 105 * GiB
    assert size_request(fixed.estimate_bytes, policy, 80 * GiB) == 80 * GiB


def test_an_estimate_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        correct(0, GPU, [], settings().right_sizing)
