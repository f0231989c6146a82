"""Who the webhook believes (docs/security.md): the requester in the review's userInfo decides
whether xmem.io/ sizing annotations count and whether a Pod counts as owned; estimates size only
their own namespace (and the namespaces the policy shares them with)."""

from __future__ import annotations

import pytest

from tests.support.builders import make_job, make_pod, review
from tests.support.estimates import record_dict, record_for, workload_fingerprint
from tests.support.harness import LocalWebhook, make_policy
from xmem_admission.cluster import labels
from xmem_admission.cluster.admission.trust import DEFAULT_CONTROLLER_USER, JOB_CONTROLLER
from xmem_admission.cluster.admission.webhook import Webhook
from xmem_admission.cluster.policy.store import EstimateRecord

GPUS = ("A100-80GB", "H100-80GB")
ESTIMATE = {"A100-80GB": 10.0, "H100-80GB": 10.0}


def _sized_by_hand():
    return make_job("sneaky").opt_in().gpus(1).template_annotation(
        labels.REQUEST_BYTES, "1").template_annotation(labels.ESTIMATE_BYTES, "1").obj()


def test_a_tenants_sizing_annotations_are_stripped_and_the_job_held(local: LocalWebhook):
    patched = local.send(review(_sized_by_hand())).patched()
    assert patched["spec"]["suspend"] is True
    annotations = patched["spec"]["template"]["metadata"].get("annotations") or {}
    assert labels.REQUEST_BYTES not in annotations and labels.ESTIMATE_BYTES not in annotations


def test_with_a_record_they_are_replaced_by_what_the_record_gives(local: LocalWebhook):
    job = _sized_by_hand()
    local.record(record_for(job, ESTIMATE, GPUS))
    annotations = local.send(review(job)).patched()["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations[labels.REQUEST_BYTES]) >= 10 << 30


def test_under_deny_they_are_refused_naming_the_field(local: LocalWebhook):
    local.use(make_policy(untrustedAnnotations="Deny"))
    answer = local.send(review(_sized_by_hand()))
    assert not answer.allowed and answer.status["code"] == 403
    assert "spec.template.metadata.annotations[xmem.io/request-bytes]" in answer.status["message"]


def test_under_deny_what_xmem_writes_itself_passes_as_on_a_reinvocation(local: LocalWebhook):
    local.use(make_policy(untrustedAnnotations="Deny"))
    job = make_job("sized").opt_in().gpus(1).obj()
    local.record(record_for(job, ESTIMATE, GPUS))
    first = local.send(review(job))
    again = local.send(review(first.patched()))
    assert again.allowed and again.ops == []


def test_the_controller_may_write_them(local: LocalWebhook):
    answer = local.send(review(_sized_by_hand(), user=DEFAULT_CONTROLLER_USER))
    assert answer.allowed and "suspend" not in answer.patched()["spec"]  # taken as sized


@pytest.mark.parametrize("user, believed", [(JOB_CONTROLLER, True), ("alice", False),
                                            ("system:serviceaccount:team-a:default", False)])
def test_a_released_pods_request_counts_only_when_the_job_controller_created_it(
        local: LocalWebhook, user: str, believed: bool):
    pod = (make_pod("train-x1").owned_by("Job", "train").opt_in().gpus(1)
           .template_annotation(labels.REQUEST_BYTES, str(8 << 30))
           .template_annotation(labels.ESTIMATE_BYTES, str(7 << 30)).obj())
    limits = local.send(review(pod, user=user)).patched()["spec"]["containers"][0][
        "resources"]["limits"]
    assert ("nvidia.com/gpumem" in limits) is believed


def test_an_owner_reference_counts_only_on_a_pod_a_workload_controller_created(local):
    local.use(make_policy(enforcement="Enforce"))
    pod = make_pod("p").owned_by("ReplicaSet", "rs", api_version="apps/v1").opt_in().gpus(1).obj()
    by_controller = local.send(review(pod, user="system:serviceaccount:kube-system:"
                                                "replicaset-controller"))
    assert by_controller.allowed
    by_tenant = local.send(review(pod, user="alice"))
    assert not by_tenant.allowed and "bare Pod" in by_tenant.status["message"]


def test_without_a_controller_a_job_is_never_held(local: LocalWebhook):
    webhook = local.webhook
    local.webhook = Webhook(webhook.policy, webhook.store, webhook.metrics, clock=webhook.clock,
                            hold=False)
    answer = local.send(review(make_job("unheld").opt_in().gpus(1).obj()))
    assert answer.allowed and "suspend" not in answer.patched()["spec"]
    local.use(make_policy(enforcement="Enforce"))
    refused = local.send(review(make_job("unheld").opt_in().gpus(1).obj()))
    assert not refused.allowed and "no xmem controller runs" in refused.status["message"]


def test_an_estimate_sizes_only_its_own_namespace_and_those_shared_with_it(local: LocalWebhook):
    local.use(make_policy(estimateSharing=[{"namespaces": ["team-a", "team-a-dev"]}]))
    job = make_job("train", "team-a").opt_in().gpus(1).obj()
    data = record_dict(workload_fingerprint(job, GPUS), ESTIMATE)
    data["workload"] = {"namespace": "team-a", "kind": "Job", "name": "train"}
    local.record(EstimateRecord.from_dict(data))
    for namespace, sized in (("team-a", True), ("team-a-dev", True), ("team-b", False)):
        copy = make_job("train", namespace).opt_in().gpus(1).obj()
        patched = local.send(review(copy)).patched()
        assert (patched["spec"].get("suspend") is not True) is sized, namespace
