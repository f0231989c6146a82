"""With the policy's ``integration: Kueue``, a workload that names a Kueue queue is Kueue's to
hold: the webhook never writes its suspend flag (Kueue's AdmissionCheck waits for the estimate
instead), and Kueue may write the check's sizing annotations and unsuspend it. Workloads without
a queue, and every workload in ``Suspend`` mode, are held as before."""

from __future__ import annotations

import copy

import pytest

from tests.support.builders import make_job, make_pytorchjob, review
from tests.support.estimates import record_for
from tests.support.harness import LocalWebhook, make_policy
from xmem_admission.cluster import labels
from xmem_admission.cluster.admission.trust import DEFAULT_KUEUE_USERS

KUEUE = DEFAULT_KUEUE_USERS[0]
GPUS = ("A100-80GB", "H100-80GB")


def _queued(kind: str = "Job", suspended: bool = True):
    maker = make_job if kind == "Job" else make_pytorchjob
    return maker("train").opt_in().gpus(1).label(labels.KUEUE_QUEUE_NAME, "gpu-queue") \
        .suspended(suspended).obj()


def _suspend_ops(answer):
    return [op for op in answer.ops if op["path"].endswith("/suspend")
            or "held-reason" in op["path"] or "user-suspended" in op["path"]]


@pytest.mark.parametrize("kind", ["Job", "PyTorchJob"])
@pytest.mark.parametrize("suspended", [True, False])
def test_a_queued_workload_is_never_suspended_or_held_by_xmem(local: LocalWebhook, kind,
                                                              suspended):
    local.use(make_policy(integration="Kueue", enforcement="Enforce"))
    answer = local.send(review(_queued(kind, suspended)))
    assert answer.allowed
    assert _suspend_ops(answer) == []
    assert any("AdmissionCheck" in w for w in answer.warnings)
    validated = local.send(review(answer.patched()), endpoint="validate")
    assert validated.allowed, validated.status


def test_in_suspend_mode_the_same_workload_is_held(local: LocalWebhook):
    answer = local.send(review(_queued(suspended=False)))
    assert answer.patched()["spec"]["suspend"] is True
    assert labels.HELD_REASON in answer.patched()["metadata"]["annotations"]


def test_in_kueue_mode_a_workload_without_a_queue_is_held_as_before(local: LocalWebhook):
    local.use(make_policy(integration="Kueue"))
    answer = local.send(review(make_job("plain").opt_in().gpus(1).obj()))
    assert answer.patched()["spec"]["suspend"] is True


def test_a_known_estimate_sizes_a_queued_job_at_create_without_touching_suspend(local):
    local.use(make_policy(integration="Kueue"))
    job = _queued()
    local.record(record_for(job, {"A100-80GB": 10.0, "H100-80GB": 10.0}, GPUS))
    answer = local.send(review(job))
    assert _suspend_ops(answer) == []
    template = answer.patched()["spec"]["template"]
    assert int(template["metadata"]["annotations"][labels.REQUEST_BYTES]) >= 10 << 30


def _admitted_by(local: LocalWebhook, user: str):
    """Kueue's start of an admitted Job: the check's podSetUpdates in the template, unsuspended."""
    local.use(make_policy(integration="Kueue", enforcement="Enforce"))
    old = local.send(review(_queued())).patched()
    new = copy.deepcopy(old)
    new["spec"]["suspend"] = False
    new["spec"]["template"]["metadata"].setdefault("annotations", {}).update({
        labels.REQUEST_BYTES: str(12 << 30), labels.GPU_MODEL: "A100-80GB",
        labels.ESTIMATE_BYTES: str(11 << 30)})
    return local.send(review(new, operation="UPDATE", old=old, user=user), endpoint="validate")


def test_kueue_may_write_the_checks_sizing_and_unsuspend_a_queued_job(local: LocalWebhook):
    answer = _admitted_by(local, KUEUE)
    assert answer.allowed, answer.status


def test_a_tenant_may_not_write_the_sizing_into_a_queued_job(local: LocalWebhook):
    answer = _admitted_by(local, "alice")
    assert not answer.allowed
    assert "spec.template.metadata.annotations[xmem.io/request-bytes]" in answer.status["message"]
