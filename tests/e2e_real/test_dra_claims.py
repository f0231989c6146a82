"""GPU memory as a DRA claim, allocated by the real kube-scheduler (Kubernetes 1.36, DRA gates at
their defaults: consumable capacity and partitionable devices are beta and on).

kwok GPU nodes carry ResourceSlices published as the drivers publish them (``localkube/dra.py``:
dra-driver-nvidia-gpu in its ConsumableShares ``memory`` mode, its MIG devices, HAMi's driver);
no kubelet plugin runs on a kwok node, so a claim is allocated (the scheduler's part) and never
prepared (the plugin's part), and kwok's pod-ready stage plays the pod Running.

Estimates are fixed, as a finished estimation would record them (a GPUMemoryEstimate for the
workloads' fingerprint, ``tests.support.estimates.record_dict``): an 17 GiB peak plus the
policy's 5 % margin in 256 MiB steps is an 18 GiB request, 7 of which fit an H200's 143,771 MiB
and 8 do not.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Dict, Iterator, List, Optional, Tuple

import pytest
from kubernetes import client

from localkube import dra as published
from localkube import dra_plugin
from localkube.controlplane import wait_for
from localkube.kwok import gpu_node
from tests.e2e_real.support import job, policy
from tests.e2e_real.test_kueue import KUEUE_VALUES, QUEUE, V1B2, kueue  # noqa: F401 - fixture
from tests.support.estimates import record_dict
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller.admission_checks import CONTROLLER_NAME
from xmem_admission.cluster.controller.gme_store import KubeStore
from xmem_admission.cluster.kube.client import Kube
from xmem_admission.cluster.kube.quantity import GiB, parse_bytes
from xmem_admission.cluster.policy.store import EstimateRecord
from xmem_admission.contract import gpus

H200, A100 = gpus.lookup("H200"), gpus.lookup("A100-80GB")
RESOURCE = "resource.k8s.io/v1"


@pytest.fixture(autouse=True)
def _no_devices_left(cluster: Any) -> Iterator[None]:
    """Each test's kwok node and ResourceSlice go with it: other tests judge the whole
    cluster's devices."""
    yield
    for slice_ in cluster.list(RESOURCE, "ResourceSlice"):
        node = slice_["spec"].get("nodeName") or ""
        if node.startswith("dra-"):
            cluster.delete(RESOURCE, "ResourceSlice", slice_["metadata"]["name"])
            cluster.delete("v1", "Node", node)


def _setup(xmem: Any, node: str, slice_: Dict[str, Any], gpu: str, **dra: Any) -> None:
    cluster = xmem.cluster
    for klass in published.device_classes():
        cluster.apply(klass)
    cluster.apply(gpu_node(node, gpu=gpu, labels={"pool": node}))
    cluster.apply(slice_)
    cluster.apply(policy(xmem.policy_name, backend="DRA", gpus=(gpu,), dra=dra))
    xmem.serve()


def _held_jobs(xmem: Any, node: str, count: int, gpu: str, peak_gib: float) -> List[str]:
    """``count`` identical Jobs (one fingerprint), held by the webhook, then their estimate
    recorded as a finished estimation records it."""
    batch = client.BatchV1Api(xmem.cluster.api)
    names, fingerprint = [], ""
    for index in range(count):
        name = f"{node}-{index}"
        created = batch.create_namespaced_job(
            xmem.namespace, job(name, xmem.namespace, node_selector={"pool": node})).to_dict()
        assert created["spec"]["suspend"] is True
        fingerprint = created["metadata"]["annotations"][labels.FINGERPRINT]
        names.append(name)
    data = record_dict(fingerprint, {gpu: peak_gib})
    data["workload"] = {"namespace": xmem.namespace, "kind": "Job", "name": names[0]}
    KubeStore(Kube(xmem.cluster.api)).put(EstimateRecord.from_dict(data))
    return names


def _pod(xmem: Any, name: str) -> Optional[Dict[str, Any]]:
    pods = xmem.pods(f"job-name={name}")
    return pods[0] if pods else None


def _allocation(xmem: Any, pod: Dict[str, Any]) -> Dict[str, Any]:
    """The allocation result of the pod's claim (made by the resourceclaim controller)."""
    statuses = pod.get("status", {}).get("resourceClaimStatuses") or []
    assert statuses, pod.get("status")
    claim = xmem.cluster.get(RESOURCE, "ResourceClaim", statuses[0]["resourceClaimName"],
                             xmem.namespace)
    assert claim is not None
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    return result


@pytest.mark.parametrize("driver, slice_of", [
    ("Nvidia", lambda node: published.nvidia_slice(node, [published.nvidia_gpu(H200)])),
    ("HAMi", lambda node: published.hami_slice(node, [published.hami_gpu(H200)])),
])
def test_seven_jobs_of_18_gib_share_one_h200_and_the_eighth_waits_for_one_to_finish(
        xmem: Any, driver: str, slice_of: Any) -> None:
    node = f"dra-{driver.lower()}"
    _setup(xmem, node, slice_of(node), "H200", driver=driver)
    names = _held_jobs(xmem, node, 8, "H200", 17.0)
    xmem.controller("", "--no-leader-election")
    for name in names:
        xmem.wait_released(name)
    template = xmem.cluster.get(RESOURCE, "ResourceClaimTemplate", f"{names[0]}-xmem-18432mi",
                                xmem.namespace)
    assert template is not None, "the controller made no ResourceClaimTemplate"
    exactly = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert parse_bytes(exactly["capacity"]["requests"]["memory"]) == 18 * GiB
    assert template["metadata"]["ownerReferences"][0]["name"] == names[0]

    def placed() -> Optional[List[Dict[str, Any]]]:
        pods = [_pod(xmem, n) for n in names]
        if not all(pods):
            return None
        bound = [p for p in pods if p and p["spec"].get("nodeName")]
        return bound if len(bound) == 7 else None

    # up to the scheduler's podMaxInUnschedulablePodsDuration (5 min, its default) and a bit:
    # a pod it set aside before its claim existed is retried by then at the latest
    bound = wait_for(placed, 330, "seven pods to be scheduled")
    assert {p["spec"]["nodeName"] for p in bound} == {node}
    results = [_allocation(xmem, p) for p in bound]
    assert {r["device"] for r in results} == {d["name"] for d in slice_of(node)["spec"]["devices"]}
    assert all(parse_bytes(r["consumedCapacity"]["memory"]) == 18 * GiB for r in results)
    assert len({r["shareID"] for r in results}) == 7
    waiting = [n for n in names if not (_pod(xmem, n) or {}).get("spec", {}).get("nodeName")]
    assert len(waiting) == 1
    wait_for(lambda: (_pod(xmem, bound[0]["metadata"]["labels"]["job-name"]) or {}).get(
        "status", {}).get("phase") == "Running", 60, "kwok to run a pod with a claim")

    # One finishes (kwok plays no completion: the Job is deleted, its pod and claim go with it).
    xmem.cluster.delete("batch/v1", "Job", bound[0]["metadata"]["labels"]["job-name"],
                        xmem.namespace)
    wait_for(lambda: (_pod(xmem, waiting[0]) or {}).get("spec", {}).get("nodeName"), 180,
             "the eighth pod to be scheduled once a share is free")


def test_a_job_sized_at_creation_from_a_recorded_estimate_gets_its_template_and_a_share(
        xmem: Any) -> None:
    """Never held: the webhook writes the claim into the Job's template at CREATE, and the
    controller makes the template its pods reference as soon as it sees the Job."""
    node = "dra-cached"
    _setup(xmem, node, published.nvidia_slice(node, [published.nvidia_gpu(H200)]), "H200",
           driver="Nvidia")
    (first,) = _held_jobs(xmem, node, 1, "H200", 17.0)  # records the estimate
    xmem.controller("", "--no-leader-election")
    xmem.wait_released(first)
    body = job(f"{node}-again", xmem.namespace, node_selector={"pool": node})
    created = client.BatchV1Api(xmem.cluster.api).create_namespaced_job(
        xmem.namespace, body).to_dict()
    assert not created["spec"].get("suspend")
    claims = created["spec"]["template"]["spec"]["resource_claims"]
    assert claims[0]["resource_claim_template_name"] == f"{node}-again-xmem-18432mi"
    pod = wait_for(lambda: (_pod(xmem, f"{node}-again") or {}).get("spec", {}).get(
        "nodeName") and _pod(xmem, f"{node}-again"), 120, "the pod sized at creation to be scheduled")
    assert parse_bytes(_allocation(xmem, pod)["consumedCapacity"]["memory"]) == 18 * GiB


def test_a_job_that_fits_a_1g_20gb_mig_device_gets_one(xmem: Any) -> None:
    node = "dra-mig"
    slice_ = published.nvidia_slice(node, [
        published.nvidia_mig(A100, "1g.20gb", start=0, slices=2),
        published.nvidia_mig(A100, "3g.40gb", start=4, slices=4)])
    _setup(xmem, node, slice_, "A100-80GB", driver="NvidiaMIG", pinProduct=False)
    (name,) = _held_jobs(xmem, node, 1, "A100-80GB", 14.0)  # 15 GiB request with the margin
    xmem.controller("", "--no-leader-election")
    xmem.wait_released(name)
    pod = wait_for(lambda: (_pod(xmem, name) or {}).get("spec", {}).get("nodeName") and
                   _pod(xmem, name), 180, "the MIG pod to be scheduled")
    assert _allocation(xmem, pod)["device"] == "gpu-0-mig-1g20gb-0"


def test_a_class_without_a_shareable_device_releases_without_a_claim_and_says_why(
        xmem: Any) -> None:
    node = "dra-whole"
    whole = published.nvidia_gpu(H200, shared=False)
    _setup(xmem, node, published.nvidia_slice(node, [whole]), "H200", driver="Nvidia")
    (name,) = _held_jobs(xmem, node, 1, "H200", 17.0)
    xmem.controller("", "--no-leader-election")
    released = xmem.wait_released(name)
    why = released["metadata"]["annotations"]["xmem.io/dra-unsatisfiable"]
    assert "has no shareable device" in why
    assert labels.REQUEST_BYTES not in (released["spec"]["template"]["metadata"].get(
        "annotations") or {})
    assert xmem.cluster.list(RESOURCE, "ResourceClaimTemplate", xmem.namespace) == []
    events = wait_for(lambda: [e for e in xmem.events(name)
                               if e["reason"] == "NoShareableDevice"], 30, "the Warning Event")
    assert "released as written" in events[0]["message"]
    pod = wait_for(lambda: _pod(xmem, name), 60, "the Job's pod")
    assert not pod["spec"].get("resourceClaims")


def test_with_fallback_hold_a_job_waits_held_until_a_shareable_device_appears(xmem: Any) -> None:
    node = "dra-later"
    whole = published.nvidia_gpu(H200, shared=False)
    _setup(xmem, node, published.nvidia_slice(node, [whole]), "H200", driver="Nvidia",
           fallback="Hold")
    (name,) = _held_jobs(xmem, node, 1, "H200", 17.0)
    xmem.controller("", "--no-leader-election")
    events = wait_for(lambda: [e for e in xmem.events(name)
                               if e["reason"] == "NoShareableDevice"], 60, "the Warning Event")
    assert "kept held until" in events[0]["message"]
    held = xmem.job(name)
    assert held["spec"]["suspend"] is True
    assert "has no shareable device" in held["metadata"]["annotations"][
        "xmem.io/dra-unsatisfiable"]
    xmem.cluster.apply(published.nvidia_slice(node, [published.nvidia_gpu(H200)]))
    released = xmem.wait_released(name, timeout=60)
    assert "xmem.io/dra-unsatisfiable" not in released["metadata"]["annotations"]
    pod = wait_for(lambda: (_pod(xmem, name) or {}).get("spec", {}).get("nodeName") and
                   _pod(xmem, name), 120, "the pod to be scheduled on the shared GPU")
    assert parse_bytes(_allocation(xmem, pod)["consumedCapacity"]["memory"]) == 18 * GiB


def test_a_job_kueue_admits_after_the_admission_check_gets_its_claim_sized(
        xmem: Any, kueue: Any) -> None:  # noqa: F811 - the fixture imported above
    """Kueue holds the Job; the xmem AdmissionCheck hands the request over as podSetUpdates;
    the pod gets the claim at its CREATE and the controller makes its template. (Kueue's quota
    here is still counted in nvidia.com/gpu: its DRA quota is not charged the estimate.)"""
    node = "dra-kueue"
    cluster = xmem.cluster
    for klass in published.device_classes():
        cluster.apply(klass)
    cluster.apply(gpu_node(node, gpu="H200", labels={"pool": node}))
    cluster.apply(published.nvidia_slice(node, [published.nvidia_gpu(H200)]))
    cluster.apply(policy(xmem.policy_name, backend="DRA", gpus=("H200",), integration="Kueue",
                         dra={"driver": "Nvidia"}))
    cluster.apply({"apiVersion": V1B2, "kind": "LocalQueue",
                   "metadata": {"name": QUEUE, "namespace": xmem.namespace},
                   "spec": {"clusterQueue": "gpu"}})
    xmem.serve(KUEUE_VALUES)
    body = job(node, xmem.namespace, node_selector={"pool": node})
    body["metadata"]["labels"][labels.KUEUE_QUEUE_NAME] = QUEUE
    created = client.BatchV1Api(cluster.api).create_namespaced_job(xmem.namespace, body).to_dict()
    data = record_dict(created["metadata"]["annotations"][labels.FINGERPRINT], {"H200": 17.0})
    data["workload"] = {"namespace": xmem.namespace, "kind": "Job", "name": node}
    KubeStore(Kube(cluster.api)).put(EstimateRecord.from_dict(data))
    xmem.controller("", "--no-leader-election", "--kueue-controller-name", CONTROLLER_NAME)
    pod = wait_for(lambda: (_pod(xmem, node) or {}).get("spec", {}).get("nodeName") and
                   _pod(xmem, node), 180, "the pod Kueue admitted to be scheduled")
    assert pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] == \
        f"{node}-xmem-18432mi"
    assert parse_bytes(_allocation(xmem, pod)["consumedCapacity"]["memory"]) == 18 * GiB


def test_example_driver_claims_are_released_and_warned_to_take_a_whole_device_each(
        xmem: Any) -> None:
    """sigs.k8s.io/dra-example-driver's shared GPUs publish ``compute`` 100 with default 100:
    xmem's claim asks none, so each takes a whole device. Both Jobs are released with their
    claims (they can be allocated), a Warning Event says they will not share, and the scheduler
    indeed puts one on the 80Gi device and leaves the other unschedulable."""
    node = "dra-example"
    xmem.cluster.apply(dra_plugin.device_class())
    _setup(xmem, node, published.example_slice(node, [published.example_gpu()]), "H200",
           driver="Nvidia", deviceClass=dra_plugin.DRIVER, pinProduct=False)
    names = _held_jobs(xmem, node, 2, "H200", 17.0)
    xmem.controller("", "--no-leader-election")
    def warned(name: str) -> List[Dict[str, Any]]:
        return [e for e in xmem.events(name) if e["reason"] == "ClaimTakesWholeDevice"]

    for name in names:
        released = xmem.wait_released(name)
        assert "xmem.io/dra-unsatisfiable" not in released["metadata"]["annotations"]
        events = wait_for(partial(warned, name), 30, f"the Warning Event on {name}")
        assert events[0]["type"] == "Warning"
        assert "claims of DeviceClass gpu.example.com take the whole `compute` (100) of a " \
               "device: its request policy's default" in events[0]["message"]
        assert "released with its claim" in events[0]["message"]
    template = xmem.cluster.get(RESOURCE, "ResourceClaimTemplate", f"{names[0]}-xmem-18432mi",
                                xmem.namespace)
    assert template is not None, "the controller made no ResourceClaimTemplate"
    exactly = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert exactly["capacity"]["requests"] == {"memory": str(18 * GiB)}

    def placed() -> Optional[Tuple[Dict[str, Any], Dict[str, Any]]]:
        pods = [_pod(xmem, n) for n in names]
        bound = [p for p in pods if p and p["spec"].get("nodeName")]
        waiting = [p for p in pods if p and not p["spec"].get("nodeName") and any(
            c.get("type") == "PodScheduled" and c.get("reason") == "Unschedulable"
            for c in p.get("status", {}).get("conditions") or [])]
        return (bound[0], waiting[0]) if len(bound) == 1 and len(waiting) == 1 else None

    bound, _waiting = wait_for(placed, 180, "one pod on the device and the other unschedulable")
    result = _allocation(xmem, bound)
    assert result["device"] == "gpu-0"
    assert parse_bytes(result["consumedCapacity"]["memory"]) == 18 * GiB
    assert result["consumedCapacity"]["compute"] == "100"  # the default, the whole

    # A repeat Job sized at its CREATE from the recorded estimate: its template is made at once,
    # and the same Warning says so.
    again = client.BatchV1Api(xmem.cluster.api).create_namespaced_job(
        xmem.namespace, job(f"{node}-again", xmem.namespace, node_selector={"pool": node}))
    assert not again.to_dict()["spec"].get("suspend")
    events = wait_for(partial(warned, f"{node}-again"), 60,
                      "the Warning Event on the Job sized at its creation")
    assert "take the whole `compute` (100) of a device" in events[0]["message"]
    assert "its pods' claims can be allocated" in events[0]["message"]
    # Said once per workload: the released Jobs' own pass of the claims reconcile (their
    # templates exist by then) adds none.
    assert [len(warned(n)) for n in names] == [1, 1]
