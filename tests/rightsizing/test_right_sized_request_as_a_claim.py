"""Under the ``DRA`` backend a repeat job's request corrected by its earlier runs
(right-sizing) is the request its claim asks: sized at the Job's CREATE the
template it names is the corrected one's; held and released by the controller, the template the
controller makes asks the corrected memory."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List

from tests.support.builders import make_job, review
from tests.support.estimates import record_for
from tests.support.harness import LocalWebhook, make_policy
from xmem_admission.cluster.backends import dra
from xmem_admission.cluster.controller import dra_claims
from xmem_admission.cluster.controller.gate import plans_for
from xmem_admission.cluster.integrations import for_kind
from xmem_admission.cluster.policy.model import Policy
from xmem_admission.cluster.policy.sizing import size_request
from xmem_admission.cluster.policy.store import EstimateRecord, Run, WorkloadRef
from xmem_admission.contract import gpus

GiB, MiB = 1 << 30, 1 << 20
H200 = gpus.lookup("H200")
JOB = for_kind("batch", "v1", "Job")


def _policy(**right_sizing: Any) -> Policy:
    spec: Dict[str, Any] = {"dra": {"driver": "Nvidia"}}
    if right_sizing:
        spec["rightSizing"] = right_sizing
    return make_policy("DRA", ("H200",), **spec)


def _job() -> Dict[str, Any]:
    return make_job("train").opt_in().gpus(1).obj()


def _record(runs: List[Run]) -> EstimateRecord:
    record = record_for(_job(), {"H200": 20}, ("H200",))
    return dataclasses.replace(record, runs=tuple(runs),
                               workload=WorkloadRef("ml", "Job", "train"))


def _corrected(peak_gib: float, policy: Policy) -> int:
    settings = policy.defaults
    return size_request(int(peak_gib * GiB), settings, H200.capacity_bytes)


def test_a_repeat_job_sized_at_creation_names_the_template_of_its_corrected_request() -> None:
    policy = _policy()
    webhook = LocalWebhook(policy)
    webhook.record(_record([Run("H200", 20 * GiB, 25 * GiB, True, 1.0e9)]))
    answer = webhook.send(review(_job()))
    assert answer.allowed
    template = answer.patched()["spec"]["template"]
    corrected = _corrected(25, policy)
    assert corrected > _corrected(20, policy)
    assert template["spec"]["resourceClaims"] == [
        {"name": dra.CLAIM, "resourceClaimTemplateName": f"train-xmem-{corrected // MiB}mi"}]
    assert any("right-sized by earlier runs" in w for w in answer.warnings), answer.warnings


def test_a_held_repeat_job_is_released_with_a_template_asking_the_lowered_request() -> None:
    """lowerRequests: runs that all completed under their estimate give memory back, and the
    claim the controller makes asks the lowered figure, not the estimate's."""
    policy = _policy(lowerRequests=True)
    job = _job()
    job["metadata"].update(uid="job-uid")
    record = _record([Run("H200", 20 * GiB, 14 * GiB, True, 1.0e9)])
    plans, misfit = plans_for(JOB, job, record, policy.for_namespace("ml"))
    assert misfit == ""
    [(plan, settings, count)] = dra_claims.dra_plans(JOB, job, plans)
    lowered = _corrected(14, policy)
    assert plan.request_bytes == lowered < _corrected(20, policy)
    body = dra.claim_template("ml", job, plan.request_bytes, count, plan.target.gpu, settings)
    assert body["metadata"]["name"] == f"train-xmem-{lowered // MiB}mi"
    exactly = body["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert exactly["capacity"]["requests"]["memory"] == str(lowered // MiB * MiB)
