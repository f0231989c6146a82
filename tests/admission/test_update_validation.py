"""UPDATE: only changes to what the policy governs are judged, and only the xmem controller may
change xmem.io/ annotations or release a held workload (the policy enforcing throughout)."""

from __future__ import annotations

import copy
from typing import Any, Dict

import pytest

from tests.support.builders import make_job, review
from tests.support.estimates import record_for
from tests.support.harness import HttpsWebhook, make_policy
from xmem_admission.cluster import labels
from xmem_admission.cluster.admission.trust import DEFAULT_CONTROLLER_USER

GPUS = ("A100-80GB", "H100-80GB")


def _hand_sized(served: HttpsWebhook) -> Dict[str, Any]:
    """A Job with a hand-set request below its recorded estimate, stored before the namespace
    was switched to Enforce."""
    served.use(make_policy(enforcement="Enforce"))
    job = make_job("low").opt_in().gpus(1).limit("nvidia.com/gpumem", "8000").obj()
    job["metadata"]["finalizers"] = ["foregroundDeletion"]
    served.record(record_for(job, {"A100-80GB": 11.7, "H100-80GB": 11.9}, GPUS))
    assert not served.send(review(job), endpoint="validate").allowed  # what a CREATE gets now
    return job


def _update(served: HttpsWebhook, old: Dict[str, Any], new: Dict[str, Any],
            user: str = "alice") -> Any:
    return served.send(review(new, operation="UPDATE", old=old, user=user), endpoint="validate")


@pytest.mark.parametrize("change", [
    lambda j: j["metadata"].pop("finalizers"),  # the garbage collector, foreground deletion
    lambda j: j["metadata"].setdefault("labels", {}).update(owner="alice"),  # kubectl label
    lambda j: j["metadata"].setdefault("annotations", {}).update(note="x"),  # kubectl annotate
], ids=["finalizer-removed", "labelled", "annotated"])
def test_a_metadata_only_update_of_a_workload_the_policy_would_refuse_passes(served, change):
    old = _hand_sized(served)
    new = copy.deepcopy(old)
    change(new)
    assert _update(served, old, new).allowed


def test_any_update_of_a_workload_being_deleted_passes(served):
    old = _hand_sized(served)
    new = copy.deepcopy(old)
    new["metadata"]["deletionTimestamp"] = "2026-01-31T12:00:00Z"
    new["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpumem"] = "10"
    assert _update(served, old, new).allowed


def test_an_update_that_changes_a_governed_part_is_judged(served):
    old = _hand_sized(served)
    new = copy.deepcopy(old)
    new["spec"]["template"]["metadata"].setdefault("labels", {})["tier"] = "gold"
    answer = _update(served, old, new)
    assert not answer.allowed and "nvidia.com/gpumem" in answer.status["message"]


def _held(served: HttpsWebhook) -> Dict[str, Any]:
    served.use(make_policy(enforcement="Enforce"))
    job = make_job("held").opt_in().gpus(1).obj()
    return served.send(review(job)).patched()


def test_only_the_controller_may_release_a_held_workload(served):
    old = _held(served)
    assert old["spec"]["suspend"] is True
    new = copy.deepcopy(old)
    new["spec"]["suspend"] = False
    refused = _update(served, old, new)
    assert not refused.allowed and "only the xmem controller releases it" in \
        refused.status["message"] and "spec.suspend" in refused.status["message"]
    assert _update(served, old, new, user=DEFAULT_CONTROLLER_USER).allowed


def test_only_the_controller_may_change_xmem_annotations(served):
    old = _held(served)
    for change in (
        lambda j: j["metadata"]["annotations"].pop(labels.HELD_REASON),
        lambda j: j["spec"]["template"]["metadata"].setdefault("annotations", {}).update(
            {labels.REQUEST_BYTES: "1"}),
    ):
        new = copy.deepcopy(old)
        change(new)
        answer = _update(served, old, new)
        assert not answer.allowed and "only the xmem controller changes this annotation" in \
            answer.status["message"]


def test_in_warn_mode_a_release_by_someone_else_is_a_warning(served):
    old = _held(served)
    served.use(make_policy())
    new = copy.deepcopy(old)
    new["spec"]["suspend"] = False
    answer = _update(served, old, new)
    assert answer.allowed and any("only the xmem controller releases it" in w
                                  for w in answer.warnings)
