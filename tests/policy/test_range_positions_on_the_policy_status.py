"""Where jobs land in their range rides the GPUAdmissionPolicy's status (``status.rangePositions``,
written by the controller): every reader of the policy, the webhook as the controller, narrows
with it; an older status without it learned nothing; a learned memory outside the allocator below
the catalogue's never takes the request under the point it is sized from plus the margin."""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

import pytest

from tests.support.estimates import record_dict
from xmem_admission.cluster.controller.learned_overhead import position_entries, status_entries
from xmem_admission.cluster.policy import api, range_position, sizing
from xmem_admission.cluster.policy.model import (
    LearnedOverhead,
    OverheadFigure,
    Policy,
    RangePosition,
    range_positions,
)
from xmem_admission.cluster.policy.range_position import Landing
from xmem_admission.cluster.policy.store import EstimateRecord

MiB, GiB = 1 << 20, 1 << 30
GPU, DRIVER = "H200", "580.159.04"
POINT, HIGH = 8 * GiB, 9 * GiB  # the record's estimate E and high end H; its own term: 300 MiB


def ranged_record() -> EstimateRecord:
    raw = record_dict("f" * 64, {GPU: POINT / GiB})
    raw["gpus"][0].update(high_bytes=HIGH, low_bytes=POINT - 16 * MiB)
    return EstimateRecord.from_dict(raw)


def policy_object(status: Optional[Dict[str, Any]] = None, **learned: Any) -> Dict[str, Any]:
    """A policy as the API server returns it: 10 % margin, requests rounded to 1 MiB."""
    spec: Dict[str, Any] = {"targets": [{"gpu": GPU, "backend": "HAMi"}],
                            "safetyMarginPercent": 10, "granularity": "1Mi"}
    if learned:
        spec["learnedOverhead"] = learned
    obj: Dict[str, Any] = {"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
                           "metadata": {"name": "default", "generation": 1}, "spec": spec}
    if status is not None:
        obj["status"] = status
    return obj


def position(percent: int, jobs: int = 6, namespaces: int = 2) -> Dict[str, Any]:
    return {"gpu": GPU, "positionPercent": percent, "jobs": jobs, "namespaces": namespaces,
            "above": 0}


def overhead(outside_mib: int) -> Dict[str, Any]:
    return {"gpu": GPU, "driverVersion": DRIVER, "outsideAllocatorBytes": outside_mib * MiB,
            "outsideAllocator": f"{outside_mib}Mi", "jobs": 6, "namespaces": 2}


def request_mib(obj: Dict[str, Any]) -> float:
    plan = sizing.plan(ranged_record(), Policy.from_object(obj).defaults)
    assert plan is not None
    return plan.request_bytes / MiB


def test_the_positions_the_controller_writes_are_read_back_with_the_policy():
    learned = range_position.learn(
        [Landing(GPU, ns, POINT, HIGH, POINT + GiB // 4 + i, 1.0e9 + i)
         for i, ns in enumerate(["a", "b", "a", "c", "b"])], LearnedOverhead(min_jobs=5))
    assert learned == (RangePosition(GPU, 26, 5, 3, 0),)  # 25 % and a few bytes: rounded up
    status = {"learnedOverhead": status_entries(()), "rangePositions": position_entries(learned)}
    for entry in status["rangePositions"]:
        api.RangePositionStatus.model_validate(entry)  # what the CRD's schema holds too
    policy = Policy.from_object(policy_object(status))
    assert policy.learned_overhead.positions == learned
    assert policy.for_namespace("any").learned_overhead.positions == learned


def test_every_reader_of_the_policy_narrows_alike_and_says_why():
    full = request_mib(policy_object())
    narrowed_obj = policy_object({"rangePositions": [position(25)]})
    plan = sizing.plan(ranged_record(), Policy.from_object(narrowed_obj).defaults)
    assert plan is not None
    # 8 GiB plus 10 %, plus a quarter of the 1 GiB range instead of all of it
    assert full == 10036  # ceil(8192 * 1.1 + 1024)
    assert plan.request_bytes / MiB == 9268  # ceil(8192 * 1.1 + 256)
    assert plan.narrowed == ("jobs with a range on H200 landed at most 25% of the way to its "
                             "high end (6 job(s) in 2 namespace(s)): the request covers "
                             "8.2 GiB of the range's 9.0 GiB")
    # passed in, the same positions give the same plan: the controller's path is the webhook's
    assert sizing.plan(ranged_record(), Policy.from_object(policy_object()).defaults,
                       positions=(RangePosition(GPU, 25, 6, 2),)) == plan


def test_an_older_status_without_positions_and_learning_off_cover_the_whole_range():
    full = request_mib(policy_object())
    older = policy_object({"learnedOverhead": [], "learned": "none yet"})
    assert Policy.from_object(older).learned_overhead.positions == ()
    assert request_mib(older) == full
    off = policy_object({"rangePositions": [position(0)]}, enabled=False)
    assert Policy.from_object(off).learned_overhead.positions != ()
    assert request_mib(off) == full


@pytest.mark.parametrize("change", [
    {"gpu": "not-a-gpu"},
    {"positionPercent": 101},
    {"positionPercent": -1},
    {"positionPercent": 0.25},
    {"positionPercent": "25"},
    {"positionPercent": True},
    {"jobs": 0},
    {"namespaces": 0},
    {"above": -1},
    {"surprise": 1},
])
def test_an_entry_that_is_not_well_formed_is_skipped_and_the_others_count(change):
    bad = dict(position(0), **change)
    good = dict(position(50), gpu="A100-80GB")
    assert range_positions({"rangePositions": [bad, good]}) == (
        RangePosition("A100-80GB", 50, 6, 2),)
    assert range_positions({"rangePositions": "25%"}) == ()
    assert range_positions(None) == ()


# Requests in MiB for E = 8192 MiB (its own term outside the allocator 300 MiB) with a range to
# H = 9216 MiB, margin 10 %, rounded up to 1 MiB. With a learned figure F the point sized from is
# S = E + F - 300; the narrowed high end is max(E, S) + p * (H - E), never above H + S - E nor
# more than maxCorrection under it; the request is S * 1.1 + (high - S). Its floor, the point
# sized from plus the margin, is ceil(S * 1.1).
@pytest.mark.parametrize("outside_mib, percent, max_correction, floor_mib, expected_mib", [
    (None, 25, "1Gi", 9012, 9268),   # the catalogue's term: 8192 * 1.1 + 256
    (100, 100, "1Gi", 8792, 9816),   # S 7992: 100 % narrows nothing, 7992 * 1.1 + 1024
    (100, 25, "1Gi", 8792, 9248),    # high 8192 + 256: 7992 * 1.1 + 456
    (100, 0, "1Gi", 8792, 8992),     # high 8192, the point E: 7992 * 1.1 + 200
    (1, 25, "1Gi", 8683, 9238),      # S 7893, high 8448: 7893 * 1.1 + 555
    (1, 0, "1Gi", 8683, 8982),       # high 8192: 7893 * 1.1 + 299
    (100, 0, "256Mi", 8792, 9560),   # high cut to 9016 - 256 = 8760: 7992 * 1.1 + 768
])
def test_with_a_negative_learned_correction_narrowing_stays_above_the_sized_point_and_margin(
        outside_mib, percent, max_correction, floor_mib, expected_mib):
    status: Dict[str, Any] = {"rangePositions": [position(percent)]}
    if outside_mib is not None:
        status["learnedOverhead"] = [overhead(outside_mib)]
    obj = policy_object(status, maxCorrection=max_correction)
    settings = Policy.from_object(obj).defaults
    plan = sizing.plan(ranged_record(), settings)
    assert plan is not None
    if outside_mib is not None:
        assert plan.overhead is not None and plan.overhead.correction_bytes == \
            (outside_mib - 300) * MiB < 0
    sized = plan.corrected_bytes or plan.estimate_bytes
    floor = sizing.size_request(sized, settings, settings.targets[0].gpu.capacity_bytes)
    assert floor == floor_mib * MiB
    assert plan.request_bytes == expected_mib * MiB >= floor
    whole: List[Dict[str, Any]] = copy.deepcopy(status["rangePositions"])
    whole[0]["positionPercent"] = 100
    assert request_mib(dict(obj, status=dict(status, rangePositions=whole))) >= expected_mib


def test_a_figure_below_the_catalogue_with_no_position_changes_nothing_but_the_point():
    obj = policy_object({"learnedOverhead": [overhead(100)]})
    settings = Policy.from_object(obj).defaults
    assert settings.learned_overhead.figures == (OverheadFigure(GPU, DRIVER, 100 * MiB, 6, 2),)
    assert request_mib(obj) == 9816  # 7992 * 1.1 + the whole 1024 MiB range
