"""At Pod CREATE, a sized workload's pod gets FallbackToLogsOnError on its GPU containers, and the
pod its workload's controller creates after an out-of-memory failure gets the request the xmem
controller recorded for the retry: by the owner's uid, in the pod's own namespace,
in each backend's form."""

from __future__ import annotations

from typing import Any, Dict

import pytest

from tests.support.builders import make_job, make_pod, review
from tests.support.estimates import record_for
from tests.support.harness import LocalWebhook, make_policy
from xmem_admission.cluster import backends, labels
from xmem_admission.cluster.kube.resources import gpu_containers
from xmem_admission.cluster.policy.model import BackendName
from xmem_admission.cluster.policy.store import RetryGrant
from xmem_admission.contract import gpus

OWNER_UID = "8f4d3c2e-1111-4222-8333-444455556666"  # make_pod(...).owned_by's uid
GiB = 1 << 30
GPUS = ("A100-80GB", "H100-80GB")


def _job_pod(namespace: str = "ml", request: int = 4 * GiB) -> Dict[str, Any]:
    """The pod the Job controller creates from a released Job's template."""
    return (make_pod("train-x1", namespace).owned_by("Job", "train").opt_in().gpus(1)
            .template_annotation(labels.REQUEST_BYTES, str(request))
            .template_annotation(labels.GPU_MODEL, "A100-80GB")
            .template_annotation(labels.ESTIMATE_BYTES, str(request - GiB)).obj())


def _grant(request: int, namespace: str = "ml", ooms: int = 1,
           gave_up: str | None = None) -> RetryGrant:
    return RetryGrant(namespace, OWNER_UID, "A100-80GB", request, ooms, gave_up=gave_up)


def _limits(pod: Dict[str, Any]) -> Dict[str, str]:
    return pod["spec"]["containers"][0]["resources"]["limits"]


def test_a_sized_pods_gpu_container_gets_fallback_to_logs_on_error(local: LocalWebhook):
    pod = _job_pod()
    pod["spec"]["containers"][0]["terminationMessagePolicy"] = "File"  # the API server's default
    patched = local.send(review(pod)).patched()
    assert patched["spec"]["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"


def test_a_pod_xmem_did_not_size_keeps_its_termination_message_policy(local: LocalWebhook):
    pod = make_pod("plain").owned_by("Job", "train").opt_in().gpus(1).obj()  # nothing recorded
    pod["spec"]["containers"][0]["terminationMessagePolicy"] = "File"
    answer = local.send(review(pod))
    assert answer.allowed
    assert answer.patched()["spec"]["containers"][0]["terminationMessagePolicy"] == "File"


def test_the_retry_grant_sizes_the_next_pod_and_a_second_pass_changes_nothing(local):
    local.webhook.store.put_retry(_grant(6 * GiB))
    first = local.send(review(_job_pod()))
    patched = first.patched()
    assert _limits(patched)["nvidia.com/gpumem"] == str(6 * 1024)
    annotations = patched["metadata"]["annotations"]
    assert annotations[labels.REQUEST_BYTES] == str(6 * GiB)
    assert annotations[labels.OOM_RETRY] == "1"
    assert any("4.0 -> 6.0 GiB" in w for w in first.warnings)
    again = local.send(review(patched))
    assert again.allowed and again.ops == []


def test_a_grant_no_larger_than_the_template_changes_nothing(local: LocalWebhook):
    local.webhook.store.put_retry(_grant(4 * GiB))
    patched = local.send(review(_job_pod())).patched()
    assert _limits(patched)["nvidia.com/gpumem"] == str(4 * 1024)
    assert labels.OOM_RETRY not in patched["metadata"]["annotations"]


def test_after_giving_up_the_next_pod_keeps_the_last_request_tried(local: LocalWebhook):
    local.webhook.store.put_retry(_grant(8 * GiB, ooms=3, gave_up="at the cap"))
    answer = local.send(review(_job_pod()))
    assert _limits(answer.patched())["nvidia.com/gpumem"] == str(8 * 1024)
    assert any("gave up: at the cap" in w for w in answer.warnings)


def test_a_grant_sizes_only_its_own_namespace_even_one_that_shares_estimates(local):
    local.use(make_policy(estimateSharing=[{"namespaces": ["ml", "other"]}]))
    local.webhook.store.put_retry(_grant(6 * GiB, namespace="other"))
    patched = local.send(review(_job_pod("ml"))).patched()
    assert _limits(patched)["nvidia.com/gpumem"] == str(4 * 1024)


def test_a_pod_a_tenant_creates_with_the_same_owner_gets_no_grant(local: LocalWebhook):
    local.webhook.store.put_retry(_grant(6 * GiB))
    answer = local.send(review(_job_pod(), user="alice"))
    assert "nvidia.com/gpumem" not in _limits(answer.patched())


def test_a_request_set_by_hand_in_the_backends_form_is_not_grown(local: LocalWebhook):
    local.webhook.store.put_retry(_grant(6 * GiB))
    pod = _job_pod()
    _limits(pod)["nvidia.com/gpumem"] = "5000"  # not what xmem writes for 4 GiB (4096)
    patched = local.send(review(pod)).patched()
    assert _limits(patched)["nvidia.com/gpumem"] == "5000"
    assert patched["metadata"]["annotations"][labels.REQUEST_BYTES] == str(4 * GiB)


@pytest.mark.parametrize("backend", ["HAMi", "Volcano", "GPUShare", "KAI", "MIGMixed",
                                     "MIGSingle"])
def test_a_repeat_jobs_pod_has_the_form_written_at_job_create_rewritten(local, backend):
    """A known fingerprint is sized at Job CREATE, backend form included, so the Job
    controller's pods carry it: the retry rewrites what xmem wrote there."""
    local.use(make_policy(backend=backend))
    job = make_job("train").opt_in().gpus(1).obj()
    local.record(record_for(job, {"A100-80GB": 3.0, "H100-80GB": 3.0}, GPUS))
    template = local.send(review(job)).patched()["spec"]["template"]
    request = int(template["metadata"]["annotations"][labels.REQUEST_BYTES])
    gpu = gpus.lookup(template["metadata"]["annotations"][labels.GPU_MODEL])
    form = backends.for_name(BackendName(backend))
    start = form.written_bytes(request, gpu)
    bigger = min(p.memory_bytes for p in gpu.mig_profiles if p.memory_bytes > (start or 0))
    local.webhook.store.put_retry(RetryGrant("ml", OWNER_UID, gpu.key, bigger, 1))
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": dict(
        template["metadata"], name="train-x1", namespace="ml", ownerReferences=[{
            "apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": OWNER_UID,
            "controller": True}]), "spec": template["spec"]}
    [(slot, before, _count)] = list(gpu_containers(pod))
    was = form.existing(pod, slot, before, gpu)
    assert was is not None and was.bytes_per_gpu == start  # the form from Job CREATE
    first = local.send(review(pod))
    patched = first.patched()
    [(slot, after, _count)] = list(gpu_containers(patched))
    now = form.existing(patched, slot, after, gpu)
    assert now is not None and now.bytes_per_gpu == form.written_bytes(bigger, gpu) > start
    assert patched["metadata"]["annotations"][labels.REQUEST_BYTES] == str(bigger)
    if backend == "MIGMixed":
        assert len([r for r in _limits(patched) if r.startswith("nvidia.com/mig-")]) == 1
    again = local.send(review(patched))
    assert again.allowed and again.ops == []


@pytest.mark.parametrize("backend", ["KAI", "MIGMixed"])
def test_the_grant_is_written_in_each_backends_form(local: LocalWebhook, backend: str):
    local.use(make_policy(backend=backend))
    a100 = gpus.lookup("A100-80GB")
    start = gpus.smallest_mig_profile(a100, 4 * GiB)
    assert start is not None
    bigger = min((p for p in a100.mig_profiles if p.memory_bytes > start.memory_bytes),
                 key=lambda p: (p.memory_bytes, p.compute_slices))
    local.webhook.store.put_retry(_grant(bigger.memory_bytes))
    patched = local.send(review(_job_pod())).patched()
    if backend == "KAI":
        assert patched["metadata"]["annotations"]["gpu-memory"] == str(
            -(-bigger.memory_bytes // (1 << 20)))
    else:
        assert _limits(patched).get(f"nvidia.com/mig-{bigger.name}") == "1"
        assert f"nvidia.com/mig-{start.name}" not in _limits(patched)
