"""Kubeflow Trainer v2 TrainJobs and JobSets sized by xmem, end to end on the real control plane
with the real JobSet v0.12.0 and Trainer v2.3.0 controllers (the ``trainer`` fixture,
localkube/trainer.py) and, for the queued case, the real Kueue v0.19.0.

A TrainJob carries no pod template: the webhook holds it, the controller resolves what its pods
will run from the ``torch-distributed`` ClusterTrainingRuntime Trainer ships plus the TrainJob's
own trainer fields, estimates rank 0 of the torchrun world Trainer sets up (2 nodes x 4
processes: 8), and releases it with its sizing in a runtime patch of its own; Trainer makes the
JobSet, JobSet the Job, the Job controller the pods, and the webhook sizes each pod at its
CREATE (HAMi's ``nvidia.com/gpumem`` per GPU, or a DRA claim).
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional

import pytest
from kubernetes import client

from localkube import dra as published
from localkube.controlplane import wait_for
from localkube.jobset import API_VERSION as JOBSET_API
from localkube.jobset import JOBSET_NAME_LABEL
from localkube.kueue import Kueue
from localkube.kwok import gpu_node
from localkube.trainer import API_VERSION as TRAINER_API
from localkube.trainer import TORCH_RUNTIME
from tests.distributed.conftest import script
from tests.e2e_real.support import IMAGE, TINY_GPT, policy
from tests.e2e_real.test_kueue import CHECK, KUEUE_VALUES, V1B2, our_check
from tests.support.estimates import record_dict
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller.admission_checks import CONTROLLER_NAME
from xmem_admission.cluster.controller.gme_store import KubeStore
from xmem_admission.cluster.integrations.trainjob import KUEUE_MANAGER, MANAGER
from xmem_admission.cluster.kube.client import Kube
from xmem_admission.cluster.kube.quantity import GiB, MiB, ceil_div, parse_bytes
from xmem_admission.cluster.policy.store import EstimateRecord
from xmem_admission.contract import gpus

H200 = gpus.lookup("H200")
RESOURCE = "resource.k8s.io/v1"
# The controller releases these kinds (localkube's default leaves out the two whose CRDs only
# the training stack installs).
KINDS = ("--workloads", "Job,JobSet,TrainJob")


def _ddp_map(cluster: Any, namespace: str) -> None:
    with open(script("ddp_train.py"), encoding="utf-8") as handle:
        cluster.apply({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": "ddp", "namespace": namespace},
                       "data": {"ddp_train.py": handle.read()}})


def _trainjob(name: str, namespace: str, gpus_per_node: int = 4,
              queue: str = "") -> Dict[str, Any]:
    """2 nodes x 4 processes of a DDP script on the torch runtime Trainer ships; the script
    comes from a ConfigMap mounted through a runtime patch of the user's own."""
    meta: Dict[str, Any] = {"name": name, "namespace": namespace,
                            "labels": {labels.OPT_IN: "true"}}
    if queue:
        meta["labels"][labels.KUEUE_QUEUE_NAME] = queue
    return {"apiVersion": TRAINER_API, "kind": "TrainJob", "metadata": meta, "spec": {
        "runtimeRef": {"name": TORCH_RUNTIME},
        "trainer": {
            "image": IMAGE,
            "command": ["torchrun", "/ddp/ddp_train.py", "--layers", "2", "--width", "128"],
            "numNodes": 2, "numProcPerNode": 4,
            "resourcesPerNode": {"limits": {"nvidia.com/gpu": str(gpus_per_node), "cpu": "4",
                                            "memory": "16Gi"}}},
        "runtimePatches": [{"manager": "example.com/ml-team", "trainingRuntimeSpec": {
            "template": {"spec": {"replicatedJobs": [{"name": "node", "template": {"spec": {
                "template": {"spec": {
                    "volumes": [{"name": "ddp", "configMap": {"name": "ddp"}}],
                    "containers": [{"name": "node", "volumeMounts": [
                        {"name": "ddp", "mountPath": "/ddp"}]}]}}}}}]}}}}]}}


def _custom(cluster: Any) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(cluster.api)


def _get(cluster: Any, namespace: str, name: str) -> Dict[str, Any]:
    found = cluster.get(TRAINER_API, "TrainJob", name, namespace)
    assert found is not None, f"TrainJob {name} is gone"
    return found


def _released(cluster: Any, namespace: str, name: str, timeout: float = 300) -> Dict[str, Any]:
    def released() -> Optional[Dict[str, Any]]:
        obj = _get(cluster, namespace, name)
        return None if labels.HELD_REASON in (obj["metadata"].get("annotations") or {}) \
            else obj
    return wait_for(released, timeout, f"TrainJob {name} to be released", interval=0.5)


def _pods(cluster: Any, namespace: str, name: str, count: int = 2) -> List[Dict[str, Any]]:
    def made() -> Optional[List[Dict[str, Any]]]:
        pods = cluster.list("v1", "Pod", namespace, f"{JOBSET_NAME_LABEL}={name}")
        return pods if len(pods) == count else None
    return wait_for(made, 120, f"the {count} pods of TrainJob {name}'s JobSet")


def _node_container(pod: Dict[str, Any]) -> Dict[str, Any]:
    (found,) = [c for c in pod["spec"]["containers"] if c["name"] == "node"]
    return found


def _runtime_patches(obj: Dict[str, Any], manager: str) -> List[Dict[str, Any]]:
    return [p for p in obj["spec"].get("runtimePatches") or [] if p.get("manager") == manager]


def _stop(cluster: Any, namespace: str, *names: str) -> None:
    """Pods that would really run torchrun on the process node are not wanted: the TrainJobs
    go (their JobSets and pods with them)."""
    for name in names:
        cluster.delete(TRAINER_API, "TrainJob", name, namespace)


def test_a_two_node_by_four_process_trainjob_is_estimated_as_rank_0_of_8_and_its_pods_sized(
        xmem: Any, trainer: Any) -> None:
    cluster = xmem.cluster
    _ddp_map(cluster, xmem.namespace)
    xmem.serve()
    xmem.controller("", *KINDS)
    probes = xmem.record_estimation_pods()  # a succeeded one is deleted once recorded
    created = _custom(cluster).create_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", xmem.namespace, "trainjobs",
        _trainjob("ddp", xmem.namespace))
    assert created["spec"]["suspend"] is True
    assert labels.HELD_REASON in created["metadata"]["annotations"]
    # Held: Trainer makes the JobSet suspended as the TrainJob is, and no pod runs.
    suspended = wait_for(lambda: cluster.get(JOBSET_API, "JobSet", "ddp", xmem.namespace), 60,
                         "Trainer to make the suspended JobSet")
    assert suspended["spec"]["suspend"] is True
    assert cluster.list("v1", "Pod", xmem.namespace, f"{JOBSET_NAME_LABEL}=ddp") == []

    obj = _released(cluster, xmem.namespace, "ddp")
    assert obj["spec"]["suspend"] is False
    [probe] = probes.seen()
    env = {e["name"]: e.get("value") for e in probe["spec"]["containers"][0]["env"]}
    assert (env["WORLD_SIZE"], env["RANK"], env["PET_NNODES"], env["PET_NPROC_PER_NODE"],
            env["PET_NODE_RANK"]) == ("8", "0", "2", "4", "0")
    assert probe["spec"]["containers"][0]["image"] == IMAGE
    [main] = probe["status"]["containerStatuses"]
    assert main["state"]["terminated"]["reason"] == "Completed", main
    [gme] = xmem.gmes()
    request = int(gme["status"]["requestBytes"])

    # xmem's sizing travels in one runtime patch of its own; the user's is kept.
    [own] = _runtime_patches(obj, MANAGER)
    assert _runtime_patches(obj, "example.com/ml-team")
    [entry] = own["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod_meta = entry["template"]["spec"]["template"]["metadata"]
    assert int(pod_meta["annotations"][labels.REQUEST_BYTES]) == request

    jobset = wait_for(lambda: cluster.get(JOBSET_API, "JobSet", "ddp", xmem.namespace), 60,
                      "Trainer to make the JobSet")
    assert [o["kind"] for o in jobset["metadata"]["ownerReferences"]] == ["TrainJob"]
    pods = _pods(cluster, xmem.namespace, "ddp")
    for pod in pods:
        limits = _node_container(pod)["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "4"
        assert limits["nvidia.com/gpumem"] == str(ceil_div(request, MiB))  # per GPU, HAMi
        assert pod["metadata"]["annotations"][labels.REQUEST_BYTES] == str(request)

    # The same TrainJob again, under another name: the estimate is shared, no second probe.
    _custom(cluster).create_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", xmem.namespace, "trainjobs",
        _trainjob("ddp-again", xmem.namespace))
    _released(cluster, xmem.namespace, "ddp-again", timeout=60)
    assert len(probes.seen()) == 1
    probes.stop()
    for pod in _pods(cluster, xmem.namespace, "ddp-again"):
        assert _node_container(pod)["resources"]["limits"]["nvidia.com/gpumem"] == \
            str(ceil_div(request, MiB))
    assert len(xmem.gmes()) == 1
    _stop(cluster, xmem.namespace, "ddp", "ddp-again")


@pytest.fixture()
def _dra_node(cluster: Any) -> Iterator[str]:
    node = "dra-trainjob"
    for klass in published.device_classes():
        cluster.apply(klass)
    cluster.apply(gpu_node(node, gpu="H200", labels={"pool": node}))
    cluster.apply(published.nvidia_slice(node, [published.nvidia_gpu(H200, minor=m)
                                                for m in range(4)]))
    yield node
    for slice_ in cluster.list(RESOURCE, "ResourceSlice"):
        if slice_["spec"].get("nodeName") == node:
            cluster.delete(RESOURCE, "ResourceSlice", slice_["metadata"]["name"])
    cluster.delete("v1", "Node", node)


def _record(xmem: Any, name: str, gpu: str, peak_gib: float) -> None:
    """The estimate a finished estimation records, for the held TrainJob's fingerprint."""
    held = _get(xmem.cluster, xmem.namespace, name)
    data = record_dict(held["metadata"]["annotations"][labels.FINGERPRINT], {gpu: peak_gib})
    data["workload"] = {"namespace": xmem.namespace, "kind": "TrainJob", "name": name}
    KubeStore(Kube(xmem.cluster.api)).put(EstimateRecord.from_dict(data))


def test_a_trainjobs_pods_get_a_dra_claim_of_the_estimate(
        xmem: Any, trainer: Any, _dra_node: str) -> None:
    cluster = xmem.cluster
    cluster.apply(policy(xmem.policy_name, backend="DRA", gpus=("H200",),
                         dra={"driver": "Nvidia"}))
    xmem.serve()
    body = _trainjob("ddp-dra", xmem.namespace)
    _custom(cluster).create_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", xmem.namespace, "trainjobs", body)
    _record(xmem, "ddp-dra", "H200", 17.0)  # 18 GiB with the policy's margin
    xmem.controller("", "--no-leader-election", *KINDS)
    _released(cluster, xmem.namespace, "ddp-dra", timeout=120)
    for pod in _pods(cluster, xmem.namespace, "ddp-dra"):
        [claim] = pod["spec"]["resourceClaims"]
        template = cluster.get(RESOURCE, "ResourceClaimTemplate",
                               claim["resourceClaimTemplateName"], xmem.namespace)
        assert template is not None, claim
        exactly = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]
        assert parse_bytes(exactly["capacity"]["requests"]["memory"]) == 18 * GiB
        assert exactly["count"] == 4
        container = _node_container(pod)
        assert "nvidia.com/gpu" not in (container["resources"].get("limits") or {})
        assert container["resources"]["claims"] == [{"name": claim["name"]}]
    _stop(cluster, xmem.namespace, "ddp-dra")


def test_a_trainjob_whose_estimate_fits_no_gpu_is_released_with_the_reason(
        xmem: Any, trainer: Any) -> None:
    cluster = xmem.cluster
    cluster.apply(policy(xmem.policy_name, gpus=("A100-80GB",),
                         onEstimationFailure={"action": "Release"}))
    xmem.serve()
    _custom(cluster).create_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", xmem.namespace, "trainjobs",
        _trainjob("too-big", xmem.namespace))
    _record(xmem, "too-big", "A100-80GB", 300.0)
    xmem.controller("", "--no-leader-election", *KINDS)
    obj = _released(cluster, xmem.namespace, "too-big", timeout=120)
    assert not _runtime_patches(obj, MANAGER)
    events = wait_for(lambda: [e for e in xmem.events("too-big")
                               if e["reason"] == "EstimationFailed"], 60, "the Warning Event")
    assert "FitsNoGPU" in events[0]["message"] and "fits no GPU" in events[0]["message"]
    _stop(cluster, xmem.namespace, "too-big")


def test_a_jobset_with_two_replicated_jobs_of_different_images_gets_an_estimate_per_template(
        xmem: Any, trainer: Any) -> None:
    cluster = xmem.cluster
    xmem.serve()
    xmem.controller("", *KINDS)
    recorder = xmem.record_estimation_pods()  # a succeeded one is deleted once recorded

    def replicated(name: str, image: str, **sizes: str) -> Dict[str, Any]:
        args = list(TINY_GPT)
        for option, value in sizes.items():
            args[args.index(f"--{option}") + 1] = value
        return {"name": name, "replicas": 1, "template": {"spec": {
            "parallelism": 1, "completions": 1, "backoffLimit": 0, "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "train", "image": image,
                                "command": ["python", "/app/train_gpt.py"], "args": args,
                                "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "4",
                                                         "memory": "16Gi"}},
                                "volumeMounts": [{"name": "code", "mountPath": "/app"}]}],
                "volumes": [{"name": "code", "configMap": {"name": "code"}}]}}}}}

    body = {"apiVersion": JOBSET_API, "kind": "JobSet",
            "metadata": {"name": "two", "namespace": xmem.namespace,
                         "labels": {labels.OPT_IN: "true"}},
            "spec": {"replicatedJobs": [
                replicated("small", IMAGE),
                # GPT-2's vocabulary and width: well above the policy's 1 GiB minimum request.
                replicated("wide", "pytorch/pytorch:2.4.1-cuda12.1-cudnn9-runtime",
                           layers="2", hidden="768", heads="12", vocab="50257")]}}
    created = _custom(cluster).create_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", xmem.namespace, "jobsets", body)
    assert created["spec"]["suspend"] is True

    def released() -> Optional[Dict[str, Any]]:
        obj = cluster.get(JOBSET_API, "JobSet", "two", xmem.namespace)
        return obj if obj and labels.HELD_REASON not in (
            obj["metadata"].get("annotations") or {}) else None
    obj = wait_for(released, 300, "the JobSet to be released", interval=0.5)
    assert obj["spec"]["suspend"] is False
    requests = {}
    for job in obj["spec"]["replicatedJobs"]:
        annotations = job["template"]["spec"]["template"]["metadata"]["annotations"]
        requests[job["name"]] = int(annotations[labels.REQUEST_BYTES])
    probes = recorder.seen()
    recorder.stop()
    assert {p["spec"]["containers"][0]["image"] for p in probes} == {
        IMAGE, "pytorch/pytorch:2.4.1-cuda12.1-cudnn9-runtime"}
    assert len(xmem.gmes()) == 2
    assert requests["wide"] > requests["small"], requests
    cluster.delete(JOBSET_API, "JobSet", "two", xmem.namespace)


@pytest.fixture(scope="module")
def training_kueue(cluster: Any, trainer: Any) -> Iterator[Kueue]:
    """Kueue with its TrainJob and JobSet integrations, the chart's AdmissionCheck and a
    ClusterQueue behind it."""
    from localkube.cluster import CONTROLLER_SA, render_chart
    running = Kueue(cluster, frameworks=("batch/job", "jobset.x-k8s.io/jobset",
                                         "trainer.kubeflow.org/trainjob")).start()
    # The worst case for kueue issue 15210: Kueue's TrainJob defaulting webhook (which appends
    # its runtime patch each time it runs) reinvoked whenever a later webhook changes the
    # TrainJob. The release registers it with reinvocationPolicy Never; here it is IfNeeded, so
    # a second Kueue patch would mean xmem's webhook changed a queued TrainJob.
    for doc in running.webhook_configurations():
        if doc["kind"] != "MutatingWebhookConfiguration":
            continue
        for webhook in doc["webhooks"]:
            if "trainjob" in webhook["clientConfig"]["url"]:
                webhook["reinvocationPolicy"] = "IfNeeded"
        cluster.apply(doc)
    for obj in render_chart(KUEUE_VALUES):
        if obj["kind"] == "AdmissionCheck" or (obj["kind"] == "ClusterRole" and
                                               obj["metadata"]["name"] == CONTROLLER_SA):
            cluster.apply(obj)
    cluster.apply({"apiVersion": V1B2, "kind": "ResourceFlavor",
                   "metadata": {"name": "train-nodes"}})
    cluster.apply({"apiVersion": V1B2, "kind": "ClusterQueue", "metadata": {"name": "train"},
                   "spec": {"namespaceSelector": {},
                            "admissionChecksStrategy": {"admissionChecks": [{"name": CHECK}]},
                            "resourceGroups": [{
                                "coveredResources": ["cpu", "memory", "nvidia.com/gpu"],
                                "flavors": [{"name": "train-nodes", "resources": [
                                    {"name": "cpu", "nominalQuota": "64"},
                                    {"name": "memory", "nominalQuota": "256Gi"},
                                    {"name": "nvidia.com/gpu", "nominalQuota": "16"}]}]}]}})
    try:
        yield running
    finally:
        running.stop()
        for obj in render_chart():
            if obj["kind"] == "ClusterRole" and obj["metadata"]["name"] == CONTROLLER_SA:
                cluster.apply(obj)


def test_a_queued_trainjob_is_admitted_by_the_check_with_its_pods_sized_and_one_kueue_patch(
        xmem: Any, training_kueue: Kueue) -> None:
    cluster = xmem.cluster
    _ddp_map(cluster, xmem.namespace)
    cluster.apply(policy(xmem.policy_name, integration="Kueue"))
    cluster.apply({"apiVersion": V1B2, "kind": "LocalQueue",
                   "metadata": {"name": "train", "namespace": xmem.namespace},
                   "spec": {"clusterQueue": "train"}})
    xmem.serve(KUEUE_VALUES)
    xmem.controller("", "--no-leader-election", "--kueue-controller-name", CONTROLLER_NAME,
                    *KINDS)
    created = _custom(cluster).create_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", xmem.namespace, "trainjobs",
        _trainjob("queued", xmem.namespace, queue="train"))
    assert created["spec"]["suspend"] is True  # Kueue's webhook
    assert labels.HELD_REASON not in (created["metadata"].get("annotations") or {})
    assert not _runtime_patches(created, MANAGER)

    ready = wait_for(lambda: our_check(cluster, xmem.namespace, "queued"), 300,
                     "our check to be Ready", interval=0.5)
    [update] = ready["podSetUpdates"]
    request = int(update["annotations"][labels.REQUEST_BYTES])
    assert update["name"] == "node"
    pods = _pods(cluster, xmem.namespace, "queued")
    for pod in pods:
        assert _node_container(pod)["resources"]["limits"]["nvidia.com/gpumem"] == \
            str(ceil_div(request, MiB))
    started = _get(cluster, xmem.namespace, "queued")
    assert started["spec"]["suspend"] is False
    # Kueue's own patch once (its defaulting webhook ran once), xmem's none: the sizing came
    # through Kueue's podSetUpdates.
    assert len(_runtime_patches(started, KUEUE_MANAGER)) == 1, started["spec"]["runtimePatches"]
    managers = [p.get("manager") for p in started["spec"]["runtimePatches"]]
    assert len(managers) == len(set(managers)), managers
    assert not _runtime_patches(started, MANAGER)
    _stop(cluster, xmem.namespace, "queued")
