"""Under the ``DRA`` backend a retry after a GPU OOM is a claim for the grown request: a pod's
``resourceClaims`` cannot change after creation, so the retry pod is pointed at its CREATE at the
workload's ResourceClaimTemplate for the grown request, which the controller makes (owned by the
workload) before it records the retry; with no device of the class that could hold it, the retry
ends with that reason instead of a claim that waits forever."""

from __future__ import annotations

from typing import Any, Dict, List

from localkube import dra as published
from tests.backends.test_dra_device_view import view
from tests.retry.test_oom_is_recorded_per_workload import NOW, WORKLOAD, _failure, _pod
from tests.support.builders import make_job, make_pod, review
from tests.support.estimates import workload_fingerprint
from tests.support.harness import LocalWebhook, make_policy
from xmem_admission.cluster import labels
from xmem_admission.cluster.backends import dra
from xmem_admission.cluster.controller import dra_claims, oom_retries
from xmem_admission.cluster.integrations import for_kind
from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.policy import retry
from xmem_admission.cluster.policy.model import BackendName, Policy, Settings, Target
from xmem_admission.cluster.policy.store import RetryGrant
from xmem_admission.contract import gpus, oom

GiB, MiB = 1 << 30, 1 << 20
OWNER_UID = "8f4d3c2e-1111-4222-8333-444455556666"  # make_pod(...).owned_by's uid
H200, A100 = gpus.lookup("H200"), gpus.lookup("A100-80GB")
JOB = for_kind("batch", "v1", "Job")


def _policy(gpu: str = "H200", **dra_spec: Any) -> Policy:
    return make_policy("DRA", (gpu,), dra=dra_spec or {"driver": "HAMi"})


def _job_pod(request: int) -> Dict[str, Any]:
    """The pod the Job controller makes from a released Job's template (no claim yet)."""
    return (make_pod("train-x1").owned_by("Job", "train").opt_in().gpus(1)
            .template_annotation(labels.REQUEST_BYTES, str(request))
            .template_annotation(labels.ESTIMATE_BYTES, str(request - GiB))
            .template_annotation(labels.GPU_MODEL, "H200").obj())


def _webhook(request: int, **dra_spec: Any) -> LocalWebhook:
    local = LocalWebhook(_policy(**dra_spec))
    local.store.put_retry(RetryGrant("ml", OWNER_UID, "H200", request, 1))
    return local


def _claims(pod: Dict[str, Any]) -> List[Dict[str, Any]]:
    return pod["spec"].get("resourceClaims") or []


def test_a_retried_pod_points_its_claim_at_the_template_of_the_grown_request() -> None:
    local = _webhook(22 * GiB)
    answer = local.send(review(_job_pod(18 * GiB)))
    pod = answer.patched()
    assert _claims(pod) == [{"name": dra.CLAIM, "resourceClaimTemplateName": "train-xmem-22528mi"}]
    assert pod["spec"]["containers"][0]["resources"]["claims"] == [{"name": dra.CLAIM}]
    assert pod["metadata"]["annotations"][labels.REQUEST_BYTES] == str(22 * GiB)
    assert any("18.0 -> 22.0 GiB" in w for w in answer.warnings), answer.warnings
    assert local.send(review(pod)).ops == []


def test_a_pod_that_carries_the_first_claim_from_its_jobs_creation_is_pointed_at_the_grown_one(
) -> None:
    """A repeat Job sized at its CREATE carries the claim in its template: its retry pod's
    entry is rewritten (at Pod CREATE, the one moment it may change)."""
    pod = _job_pod(18 * GiB)
    pod["spec"]["resourceClaims"] = [{"name": dra.CLAIM,
                                      "resourceClaimTemplateName": "train-xmem-18432mi"}]
    pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": dra.CLAIM}]
    del pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    local = _webhook(22 * GiB)
    answer = local.send(review(pod))
    patched = answer.patched()
    assert _claims(patched) == [{"name": dra.CLAIM,
                                 "resourceClaimTemplateName": "train-xmem-22528mi"}]
    assert patched["metadata"]["annotations"][labels.OOM_RETRY] == "1"
    assert any("DRA claim hami-core-gpu.project-hami.io: memory 22528Mi" in w
               for w in answer.warnings), answer.warnings
    assert local.send(review(patched)).ops == []


def test_a_claim_that_does_not_match_the_pods_request_was_set_by_hand_and_is_not_grown() -> None:
    pod = _job_pod(18 * GiB)
    pod["spec"]["resourceClaims"] = [{"name": dra.CLAIM,
                                      "resourceClaimTemplateName": "train-xmem-20480mi"}]
    pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": dra.CLAIM}]
    answer = _webhook(22 * GiB).send(review(pod))
    patched = answer.patched() if answer.ops else pod
    assert _claims(patched)[0]["resourceClaimTemplateName"] == "train-xmem-20480mi"
    assert labels.OOM_RETRY not in (patched["metadata"].get("annotations") or {})


def _released_job(request: int) -> Dict[str, Any]:
    job = make_job("train").opt_in().gpus(1).obj()
    job["metadata"].update(uid="job-uid", namespace="ml")
    job["spec"]["template"]["metadata"].setdefault("annotations", {}).update(
        {labels.REQUEST_BYTES: str(request), labels.GPU_MODEL: "H200"})
    return job


def _settings(policy: Policy) -> Settings:
    return policy.for_namespace("ml")


def test_the_controller_makes_the_workloads_template_for_the_grown_request() -> None:
    job = _released_job(18 * GiB)
    settings = _settings(_policy())
    wanted = dra_claims.retry_plans(JOB, job, settings, "H200", 22 * GiB)
    assert [(plan.request_bytes, count) for plan, _dra, count in wanted] == [(22 * GiB, 1)]
    plan, settings_dra, count = wanted[0]
    body = dra.claim_template("ml", job, plan.request_bytes, count, plan.target.gpu,
                              settings_dra)
    assert body["metadata"]["name"] == "train-xmem-22528mi"
    assert body["metadata"]["ownerReferences"][0]["uid"] == "job-uid"
    requests = body["spec"]["spec"]["devices"]["requests"][0]["exactly"]["capacity"]["requests"]
    assert requests == {"memory": str(22 * GiB), "cores": "0"}
    # A retry computed for another GPU model than the template's makes nothing.
    assert dra_claims.retry_plans(JOB, job, settings, "A100-80GB", 22 * GiB) == []


def test_a_retry_no_device_of_the_class_could_hold_ends_with_that_reason() -> None:
    settings = _settings(_policy())
    target = settings.targets[0]
    decision = oom_retries.decide(None, WORKLOAD, _pod(), 18 * GiB, _failure(), target,
                                  settings, NOW)
    assert isinstance(decision.outcome, retry.Retry)
    ended = oom_retries.unplaceable(decision, 18 * GiB, "DeviceClass hami-core-gpu.project-hami"
                                    ".io has no shareable device")
    assert isinstance(ended.outcome, retry.GiveUp) and ended.counted
    assert ended.entry is not None and ended.entry["requestBytes"] == 18 * GiB
    assert ended.entry["gaveUp"].startswith(
        f"retry at {gib(decision.outcome.request_bytes)} GiB: no device of the policy's DeviceClass")
    assert "has no shareable device" in ended.entry["gaveUp"]
    assert ended.entry["message"] == ended.entry["gaveUp"]


def test_under_dra_mig_a_retry_selects_the_next_larger_slice_as_published() -> None:
    """A MIG device is not shared: growing the bytes within the same slice would change
    nothing, so the retry asks for a device of the next larger slice size. The request stays
    below that slice's memory as the driver publishes it (whole MiB), which the selector's
    lower bound must not exceed."""
    mig = Policy.from_spec({"targets": [{"gpu": "A100-80GB", "backend": "DRA"}],
                            "dra": {"driver": "NvidiaMIG", "pinProduct": False},
                            "granularity": "256Mi"}).for_namespace("ml")
    target = mig.targets[0]
    report = oom.CudaOOM(oom.PYTORCH, in_use_bytes=15 * GiB, asked_bytes=512 * MiB)
    grown = retry.grow(15 * GiB, report, 1, target, retry.rule_for(mig))
    assert isinstance(grown, retry.Retry) and grown.mig_profile == "3g.40gb"
    small = next(p for p in A100.mig_profiles if p.name == "1g.20gb")
    assert small.memory_bytes < grown.request_bytes <= 40186 * MiB
    slices = view([published.nvidia_slice("gpu-b", [
        published.nvidia_mig(A100, "1g.20gb", start=0, slices=2),
        published.nvidia_mig(A100, "3g.40gb", start=4, slices=4)])])
    assert target.dra is not None
    assert slices.capacity(target.dra, A100, grown.request_bytes) == (None, "")
    only_small = view([published.nvidia_slice("gpu-b", [
        published.nvidia_mig(A100, "1g.20gb", start=0, slices=2)])])
    assert only_small.capacity(target.dra, A100, grown.request_bytes)[0] is None
    assert "no MIG device" in only_small.capacity(target.dra, A100, grown.request_bytes)[1]


def test_a_mig_backend_outside_dra_still_asks_the_slices_own_memory() -> None:
    target = Target(A100, BackendName.MIG_MIXED)
    grown = retry.grow(15 * GiB, None, 1, target, retry.RetryRule(5, 50, 256 * MiB))
    assert isinstance(grown, retry.Retry)
    assert grown.request_bytes == next(p for p in A100.mig_profiles
                                       if p.name == grown.mig_profile).memory_bytes


def _claim_only_pod(request: int, template: str) -> Dict[str, Any]:
    """A pod from a Job template the webhook sized at the Job's CREATE under ``DRA``: its GPU
    container asks xmem's claim and no longer ``nvidia.com/gpu``."""
    pod = _job_pod(request)
    pod["spec"]["resourceClaims"] = [{"name": dra.CLAIM, "resourceClaimTemplateName": template}]
    container = pod["spec"]["containers"][0]
    container["resources"]["claims"] = [{"name": dra.CLAIM}]
    del container["resources"]["limits"]["nvidia.com/gpu"]
    container["terminationMessagePolicy"] = "File"  # the API server's default
    return pod


def test_a_pod_whose_gpu_is_only_xmems_claim_still_gets_its_oom_read_from_the_log_tail() -> None:
    """Without it a repeat Job's pods would go unseen by the retry loop: PyTorch writes no
    termination message."""
    local = LocalWebhook(_policy())
    pod = _claim_only_pod(18 * GiB, "train-xmem-18432mi")
    patched = local.send(review(pod)).patched()
    assert patched["spec"]["containers"][0]["terminationMessagePolicy"] == \
        "FallbackToLogsOnError"
    assert _claims(patched) == _claims(pod)


def test_a_workloads_fingerprint_is_the_same_before_and_after_its_gpus_become_a_claim() -> None:
    """The controller and the webhook key estimates by the fingerprint, which counts GPUs: a
    claim for two GPUs counts two, as the ``nvidia.com/gpu: 2`` it replaced."""
    job = make_job("train").opt_in().gpus(2).obj()
    before = workload_fingerprint(job, ("H200",))
    template = job["spec"]["template"]
    template["spec"]["resourceClaims"] = [
        {"name": dra.CLAIM, "resourceClaimTemplateName": "train-xmem-18432mi-x2"}]
    container = template["spec"]["containers"][0]
    container["resources"]["claims"] = [{"name": dra.CLAIM}]
    del container["resources"]["limits"]["nvidia.com/gpu"]
    assert workload_fingerprint(job, ("H200",)) == before
