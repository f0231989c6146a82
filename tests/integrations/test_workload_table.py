"""Every integration x backend x policy, end to end over HTTPS (table-driven).

For each case: a workload with a recorded estimate is created; the patch the webhook returns is
applied with the jsonpatch library; the result must carry the request in the backend's form,
validate against the API server's schemas (Kubernetes 1.30-1.35; the published PyTorchJob CRD),
pass /validate, and reinvoking /mutate on it must give an empty patch.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

import pytest

from tests.support.builders import make_job, make_jobset, make_pod, make_pytorchjob, review
from tests.support.estimates import record_for
from tests.support.harness import HttpsWebhook, make_policy
from tests.support.schemas import validate_object
from xmem_admission.cluster import labels
from xmem_admission.cluster.policy import sizing
from xmem_admission.cluster.policy.model import Policy

GPUS = ("A100-80GB", "H100-80GB")
ESTIMATE = {"A100-80GB": 11.7, "H100-80GB": 11.9}
MiB = 1 << 20

WORKLOADS: Dict[str, Callable[[], Dict[str, Any]]] = {
    "Job": lambda: make_job("train").opt_in().gpus(1).obj(),
    "PyTorchJob": lambda: make_pytorchjob("ddp").opt_in().workers(3).gpus(1).obj(),
    "Pod": lambda: make_pod("notebook").opt_in().gpus(1).obj(),
    "JobSet": lambda: make_jobset("ddp").opt_in().gpus(1).replicas("workers", 3).obj(),
}

# (policy fields, request in MiB for an 11.7 GiB estimate on A100-80GB)
POLICIES = {
    # 11.7 * 1.05 = 12.285 GiB -> multiple of 256 MiB above: 12800 MiB
    "defaults": ({}, 12800),
    # 11.7 * 1.05 * 0.90 = 11.0565 GiB -> 11520 MiB
    "overcommit-10": ({"overcommitPercent": 10}, 11520),
    # 11.7 GiB, no margin, whole GiB -> 12 GiB
    "no-margin-1Gi": ({"safetyMarginPercent": 0, "granularity": "1Gi"}, 12288),
}


def templates(obj: Dict[str, Any]) -> List[Dict[str, Any]]:
    if obj["kind"] == "Job":
        return [obj["spec"]["template"]]
    if obj["kind"] == "PyTorchJob":
        return [r["template"] for r in obj["spec"]["pytorchReplicaSpecs"].values()]
    if obj["kind"] == "JobSet":
        return [j["template"]["spec"]["template"] for j in obj["spec"]["replicatedJobs"]]
    return [obj]


def validate_workload(obj: Dict[str, Any]) -> None:
    """The API server's schema for the kind; a JobSet's replicated Jobs are batch/v1 Job
    templates (JobTemplateSpec in jobset_types.go), each checked as the Job the JobSet
    controller makes of it."""
    if obj["kind"] != "JobSet":
        validate_object(obj)
        return
    assert isinstance(obj["spec"].get("suspend", False), bool)
    for job in obj["spec"]["replicatedJobs"]:
        validate_object({"apiVersion": "batch/v1", "kind": "Job",
                         "metadata": {"name": f"{obj['metadata']['name']}-{job['name']}-0",
                                      "namespace": obj["metadata"]["namespace"]},
                         "spec": job["template"]["spec"]})


def expect_backend_form(backend: str, template: Dict[str, Any], mib: int) -> None:
    """The request in the backend's own form and unit (src/xmem_admission/cluster/backends)."""
    limits = template["spec"]["containers"][0]["resources"]["limits"]
    annotations = template["metadata"].get("annotations", {})
    if backend == "Annotation":
        assert limits["nvidia.com/gpu"] == "1"
        assert not any(k.startswith(("nvidia.com/gpumem", "volcano", "aliyun")) for k in limits)
    elif backend == "HAMi":
        assert limits["nvidia.com/gpu"] == "1" and limits["nvidia.com/gpumem"] == str(mib)
    elif backend == "Volcano":
        assert "nvidia.com/gpu" not in limits
        assert limits["volcano.sh/vgpu-number"] == "1"
        assert limits["volcano.sh/vgpu-memory"] == str(mib)
    elif backend == "GPUShare":
        assert "nvidia.com/gpu" not in limits
        assert limits["aliyun.com/gpu-mem"] == str(-(-mib // 1024))  # whole GiB, rounded up
    elif backend == "KAI":
        assert "nvidia.com/gpu" not in limits
        assert annotations["gpu-memory"] == str(mib)
    elif backend == "MIGMixed":
        # 11-12.5 GiB: A100-80GB's smallest slice that holds it is 1g.20gb (lgip 19.5 GiB)
        assert "nvidia.com/gpu" not in limits and limits["nvidia.com/mig-1g.20gb"] == "1"
    elif backend == "MIGSingle":
        assert limits["nvidia.com/gpu"] == "1"
        terms = template["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert terms == [{"matchExpressions": [
            {"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": [str(mib - 1)]}]}]
    else:  # pragma: no cover
        raise AssertionError(backend)
    assert annotations[labels.REQUEST_BYTES] == str(mib * MiB)
    assert annotations[labels.GPU_MODEL] == "A100-80GB"


BACKENDS = ("Annotation", "HAMi", "Volcano", "GPUShare", "KAI", "MIGMixed", "MIGSingle")


@pytest.mark.parametrize("policy_name", sorted(POLICIES))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", sorted(WORKLOADS))
def test_a_workload_with_an_estimate_gets_its_request_in_the_backend_form(
    served: HttpsWebhook, kind: str, backend: str, policy_name: str
) -> None:
    fields, mib = POLICIES[policy_name]
    served.use(make_policy(backend, GPUS, **fields))
    workload = WORKLOADS[kind]()
    served.record(record_for(workload, ESTIMATE, GPUS))

    answer = served.send(review(workload))
    assert answer.allowed, answer.status
    patched = answer.patched()
    for template in templates(patched):
        expect_backend_form(backend, template, mib)
    if kind != "Pod":
        assert patched["metadata"]["annotations"][labels.FINGERPRINT]
        assert all(t["metadata"]["labels"][labels.OPT_IN] == "true" for t in templates(patched))
        suspended = patched["spec"].get("suspend") or patched["spec"].get("runPolicy", {}).get("suspend")
        assert not suspended
    validate_workload(patched)

    assert served.send(review(patched)).ops == []
    checked = served.send(review(patched), endpoint="validate")
    assert checked.allowed and checked.warnings == []


def _held_pod(backend: str) -> Dict[str, Any]:
    """A pod as the Job controller creates it once the controller released its held Job."""
    policy: Policy = make_policy(backend, GPUS)
    settings = policy.for_namespace("ml")
    target = settings.targets[0]
    plan = sizing.Plan(target, int(11.7 * (1 << 30)),
                       sizing.size_request(int(11.7 * (1 << 30)), settings, target.gpu.capacity_bytes))
    builder = make_pod("train-x7k2p").owned_by("Job", "train").opt_in().gpus(1)
    for key, value in plan.annotations().items():
        builder.template_annotation(key, value)
    return builder.obj()


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_pod_of_a_released_job_turns_the_annotation_into_the_backend_form(
    served: HttpsWebhook, backend: str
) -> None:
    served.use(make_policy(backend, GPUS))
    pod = _held_pod(backend)
    answer = served.send(review(pod))
    patched = answer.patched()
    expect_backend_form(backend, patched, 12800)
    validate_object(patched)
    assert served.send(review(patched)).ops == []


@pytest.mark.parametrize("kind", ["Job", "PyTorchJob", "JobSet"])
def test_a_held_workload_is_suspended_where_its_kind_keeps_the_flag(
    served: HttpsWebhook, kind: str
) -> None:
    workload = WORKLOADS[kind]()
    patched = served.send(review(workload)).patched()
    if kind in ("Job", "JobSet"):
        assert patched["spec"]["suspend"] is True
    else:
        assert patched["spec"]["runPolicy"]["suspend"] is True
        assert patched["spec"]["runPolicy"]["cleanPodPolicy"] == "None"
    assert all(t["metadata"]["labels"][labels.OPT_IN] == "true" for t in templates(patched))
    validate_workload(patched)


def test_a_workload_its_owner_had_suspended_is_marked_so_the_controller_leaves_it(
    served: HttpsWebhook,
) -> None:
    job = make_job("paused").opt_in().gpus(1).suspended().obj()
    patched = served.send(review(job)).patched()
    assert patched["metadata"]["annotations"][labels.USER_SUSPENDED] == "true"
    assert patched["spec"]["suspend"] is True


def test_fields_kubernetes_does_not_know_survive_the_patch(served: HttpsWebhook) -> None:
    job = (
        make_job("future").opt_in().gpus(1)
        .field(("spec", "someFutureField"), {"nested": [1, 2, {"deep": True}]})
        .field(("spec", "template", "spec", "x-vendor/option"), "kept")
        .obj()
    )
    served.record(record_for(job, ESTIMATE, GPUS))
    patched = served.send(review(job)).patched()
    assert patched["spec"]["someFutureField"] == {"nested": [1, 2, {"deep": True}]}
    assert patched["spec"]["template"]["spec"]["x-vendor/option"] == "kept"
    assert patched["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpumem"] == "12800"


def test_cpu_sidecars_keep_their_resources_and_gpu_sidecars_get_a_request(served: HttpsWebhook) -> None:
    job = make_job("side").opt_in().gpus(1).sidecar("logger").sidecar("viz", gpus=1).obj()
    served.record(record_for(job, ESTIMATE, GPUS))
    containers = served.send(review(job)).patched()["spec"]["template"]["spec"]["containers"]
    assert containers[0]["resources"]["limits"]["nvidia.com/gpumem"] == "12800"
    assert "resources" not in containers[1]
    assert containers[2]["resources"]["limits"]["nvidia.com/gpumem"] == "12800"


def test_the_schema_checks_used_here_reject_what_the_api_server_would() -> None:
    from tests.support.schemas import validate_builtin, validate_pytorchjob

    bad_job = make_job("bad").gpus(1).field(("spec", "suspend"), "yes").obj()
    with pytest.raises(AssertionError, match="Kubernetes 1.30 rejects this Job: spec.suspend"):
        validate_builtin(bad_job)
    typo = make_job("typo").gpus(1).field(("spec", "template", "spec", "nodeSelecter"), {}).obj()
    with pytest.raises(AssertionError, match="rejects this Job"):
        validate_builtin(typo)
    bad_ptj = make_pytorchjob("bad").gpus(1).suspended().obj()
    bad_ptj["spec"]["runPolicy"]["suspend"] = "yes"
    with pytest.raises(AssertionError, match="rejects this PyTorchJob: spec.runPolicy.suspend"):
        validate_pytorchjob(bad_ptj)
    no_containers = make_pytorchjob("empty").obj()
    no_containers["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"] = "x"
    with pytest.raises(AssertionError, match="PodSpec"):
        validate_pytorchjob(no_containers)
