"""Kueue's DRA quota charged xmem's estimate, not a whole GPU, on the real
control plane with the real Kueue v0.19.0 (localkube/kueue.py).

Kueue counts DRA quota through ``resources.deviceClassMappings`` (apis/config/v1beta2,
configuration_types.go). With a ``capacity`` source (feature gate
``KueueDRAIntegrationConsumableCapacity``, alpha in v0.19 and off by default: turned on here)
a Workload is charged, per claim request of a mapped DeviceClass, the request's
``capacity.requests.memory`` rounded to the device's request policy, or, when the claim asks no
capacity, the device's default: the whole GPU (pkg/dra/capacity.go, ``chargeForDevice``).
Kueue reads the ResourceClaimTemplates a Workload's podSets name when it computes the Workload's
requests (pkg/dra/claims.go ``getClaimSpec``): a template that does not exist yet makes the
Workload inadmissible for the moment and Kueue retries.

A Job whose estimate is recorded is sized at its CREATE: the webhook writes the claim into the
Job's template (``resourceClaims`` naming ``<job>-xmem-<MiB>mi``) and the xmem controller makes
that template as soon as it sees the Job (``controller/dra_claims.py``, ``reconcile``). So the
Workload Kueue makes from the Job names a claim that asks the estimate, and the ClusterQueue's
``nvidia.com/gpu-memory`` quota is charged 18 GiB per job: two jobs fit a 40 GiB quota, the third
waits for quota (not for a device: the H200 has room for seven), and is admitted once one of the
two is gone.

Why that last step once failed (one run in three): Kueue makes a Job's Workload as the Job is
created, while the xmem controller makes the template when it sees the Job. When Kueue reads
first, the Workload reconciler writes ``Requeued=False`` (reason ``Inadmissible``, "failed to
get claim spec ... not found"); its retry that finds the template clears that condition on its
in-memory copy only. The scheduler's requeue after a failed attempt re-reads the Workload with
the condition, and when quota is released Kueue moves back only parked workloads whose backoff
expired, which ``Requeued=False`` never is (pkg/cache/queue: ``RequeueWorkload``,
``backoffWaitingTimeExpired``, Kueue v0.19.0). The controller now removes that stale condition
once it has made the job's templates (``controller/kueue_claims.py``). The test makes the race
certain: the jobs are created before the controller runs, so Kueue meets every template
missing.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Iterator, List, Optional

import pytest
from kubernetes import client

from localkube import dra as published
from localkube.cluster import CONTROLLER_SA, Cluster, render_chart
from localkube.controlplane import wait_for
from localkube.kueue import Kueue
from localkube.kwok import gpu_node
from tests.e2e_real.support import job, policy
from tests.e2e_real.test_kueue import CHECK, KUEUE_VALUES, V1B2, workload_of
from tests.support.estimates import record_dict
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller.admission_checks import CONTROLLER_NAME
from xmem_admission.cluster.controller.gme_store import KubeStore
from xmem_admission.cluster.kube.client import Kube
from xmem_admission.cluster.kube.quantity import GiB, parse_bytes
from xmem_admission.cluster.policy.store import EstimateRecord
from xmem_admission.contract import gpus

H200 = gpus.lookup("H200")
RESOURCE = "resource.k8s.io/v1"
GPU_MEMORY = "nvidia.com/gpu-memory"  # the ClusterQueue's resource for the class's memory
QUEUE, CLUSTER_QUEUE, NODE = "dra-queue", "gpu-dra", "dra-quota"
# Kueue's DRA mapping: the class gpu.nvidia.com counted by the devices' consumable "memory"
# (configuration_types.go DeviceClassMapping, DeviceClassCapacitySource).
DRA_RESOURCES = {"deviceClassMappings": [{
    "name": GPU_MEMORY, "deviceClassNames": ["gpu.nvidia.com"],
    "sources": [{"capacity": {
        "name": "memory", "driver": published.NVIDIA,
        "deviceSelector": {"cel": {
            "expression": f"device.attributes['{published.NVIDIA}'].type == 'gpu'"}}}}]}]}


@pytest.fixture(scope="module")
def dra_kueue(cluster: Cluster) -> Iterator[Kueue]:
    """Kueue with the DRA capacity source, a ClusterQueue of 40 GiB of GPU memory behind the
    xmem AdmissionCheck, and one kwok H200 node publishing its GPU as the NVIDIA driver does."""
    running = Kueue(cluster, gates={"KueueDRAIntegrationConsumableCapacity": True},
                    resources=DRA_RESOURCES).start()
    for obj in render_chart(KUEUE_VALUES):
        if obj["kind"] == "AdmissionCheck" or (obj["kind"] == "ClusterRole" and
                                               obj["metadata"]["name"] == CONTROLLER_SA):
            cluster.apply(obj)
    for klass in published.device_classes():
        cluster.apply(klass)
    cluster.apply(gpu_node(NODE, gpu="H200", labels={"pool": NODE}))
    cluster.apply(published.nvidia_slice(NODE, [published.nvidia_gpu(H200)]))
    cluster.apply({"apiVersion": V1B2, "kind": "ResourceFlavor",
                   "metadata": {"name": "dra-gpus"}})
    cluster.apply({"apiVersion": V1B2, "kind": "ClusterQueue",
                   "metadata": {"name": CLUSTER_QUEUE},
                   "spec": {"namespaceSelector": {},
                            "admissionChecksStrategy": {"admissionChecks": [{"name": CHECK}]},
                            "resourceGroups": [{
                                "coveredResources": ["cpu", "memory", GPU_MEMORY],
                                "flavors": [{"name": "dra-gpus", "resources": [
                                    {"name": "cpu", "nominalQuota": "64"},
                                    {"name": "memory", "nominalQuota": "256Gi"},
                                    {"name": GPU_MEMORY, "nominalQuota": "40Gi"}]}]}]}})
    try:
        yield running
    finally:
        running.stop()
        for slice_ in cluster.list(RESOURCE, "ResourceSlice"):
            if slice_["spec"].get("nodeName") == NODE:
                cluster.delete(RESOURCE, "ResourceSlice", slice_["metadata"]["name"])
        cluster.delete("v1", "Node", NODE)
        for obj in render_chart():  # the controller's rights as the other tests expect them
            if obj["kind"] == "ClusterRole" and obj["metadata"]["name"] == CONTROLLER_SA:
                cluster.apply(obj)


def _usage(cluster: Cluster, namespace: str, name: str) -> Optional[int]:
    """The GPU memory Kueue charged the Job's Workload once it reserved quota (None before)."""
    wl = workload_of(cluster, namespace, name) or {}
    admission = (wl.get("status") or {}).get("admission") or {}
    for assignment in admission.get("podSetAssignments") or []:
        used = (assignment.get("resourceUsage") or {}).get(GPU_MEMORY)
        if used is not None:
            return parse_bytes(used)
    return None


def _false(cluster: Cluster, namespace: str, name: str, kind: str) -> str:
    """The message of the Job's Workload's ``kind``=False condition ('' while it has none)."""
    wl = workload_of(cluster, namespace, name) or {}
    for condition in (wl.get("status") or {}).get("conditions") or []:
        if condition["type"] == kind and condition["status"] == "False":
            return str(condition.get("message") or "")
    return ""


def _pending_for_quota(cluster: Cluster, namespace: str, name: str) -> str:
    return _false(cluster, namespace, name, "QuotaReserved")


def _requeued_false(cluster: Cluster, namespace: str, name: str) -> str:
    return _false(cluster, namespace, name, "Requeued")


def test_kueue_charges_each_queued_job_its_estimated_gpu_memory_through_the_dra_mapping(
        xmem: Any, dra_kueue: Kueue) -> None:
    cluster = xmem.cluster
    cluster.apply(policy(xmem.policy_name, backend="DRA", gpus=("H200",), integration="Kueue",
                         dra={"driver": "Nvidia"}))
    cluster.apply({"apiVersion": V1B2, "kind": "LocalQueue",
                   "metadata": {"name": QUEUE, "namespace": xmem.namespace},
                   "spec": {"clusterQueue": CLUSTER_QUEUE}})
    xmem.serve(KUEUE_VALUES)
    batch = client.BatchV1Api(cluster.api)

    def body(name: str) -> Dict[str, Any]:
        out = job(name, xmem.namespace, node_selector={"pool": NODE})
        out["metadata"]["labels"][labels.KUEUE_QUEUE_NAME] = QUEUE
        return out

    # The fingerprint, from a dry run (the webhook answers it; nothing is created), and the
    # estimate a finished estimation would record for it: 17 GiB -> an 18 GiB request.
    probe = batch.create_namespaced_job(xmem.namespace, body("dra-quota-probe"),
                                        dry_run="All").to_dict()
    data = record_dict(probe["metadata"]["annotations"][labels.FINGERPRINT], {"H200": 17.0})
    data["workload"] = {"namespace": xmem.namespace, "kind": "Job", "name": "dra-quota-0"}
    KubeStore(Kube(cluster.api)).put(EstimateRecord.from_dict(data))

    def sized_at_create() -> bool:  # the webhook reads estimates from its own cache
        dry = batch.create_namespaced_job(xmem.namespace, body("dra-quota-probe"),
                                          dry_run="All").to_dict()
        return bool(dry["spec"]["template"]["spec"].get("resource_claims"))

    wait_for(sized_at_create, 60, "the webhook to see the recorded estimate", interval=0.5)
    names: List[str] = [f"dra-quota-{index}" for index in range(3)]
    for name in names:
        created = batch.create_namespaced_job(xmem.namespace, body(name)).to_dict()
        assert created["spec"]["suspend"] is True  # Kueue's webhook
        claims = created["spec"]["template"]["spec"]["resource_claims"]
        assert claims[0]["resource_claim_template_name"] == f"{name}-xmem-18432mi"
    # No controller yet, so no template: Kueue marks each Workload Requeued=False, naming it.
    for name in names:
        wait_for(lambda name=name: f"{name}-xmem-18432mi" in _requeued_false(
            cluster, xmem.namespace, name), 120, f"Kueue to find {name}'s template missing",
            interval=0.5)
    xmem.controller("", "--no-leader-election", "--kueue-controller-name", CONTROLLER_NAME)

    def charged() -> Optional[Dict[str, int]]:
        usage = {n: _usage(cluster, xmem.namespace, n) for n in names}
        got = {n: u for n, u in usage.items() if u is not None}
        return got if len(got) == 2 else None

    admitted = wait_for(charged, 180, "Kueue to reserve quota for two of the three jobs",
                        interval=0.5)
    assert set(admitted.values()) == {18 * GiB}, admitted
    (waiting,) = [n for n in names if n not in admitted]
    # The controller made the templates and took Kueue's stale condition off every Workload.
    for name in names:
        wait_for(lambda name=name: not _requeued_false(cluster, xmem.namespace, name), 60,
                 f"{name}'s Workload to lose its Requeued=False condition", interval=0.5)
    # The third stays without quota while two hold it: over several of Kueue's scheduling
    # attempts nothing is reserved for it. Kueue names the memory it lacks in QuotaReserved=False
    # once it writes that condition (not always within minutes in a loaded full run: two CI runs
    # timed out waiting for it, the Workload then carrying no QuotaReserved condition at all).
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert _usage(cluster, xmem.namespace, waiting) is None, "the third was charged too"
        time.sleep(0.5)
    message = _pending_for_quota(cluster, xmem.namespace, waiting)
    assert not message or GPU_MEMORY in message, message
    assert xmem.job(waiting)["spec"]["suspend"] is True

    # Admitted ones start and their pods get a share of the H200 of exactly the estimate.
    first = sorted(admitted)[0]
    pod = wait_for(lambda: next((p for p in xmem.pods(f"job-name={first}")
                                 if p["spec"].get("nodeName")), None), 120,
                   "the admitted job's pod to be scheduled")
    (status,) = pod["status"]["resourceClaimStatuses"]
    claim = cluster.get(RESOURCE, "ResourceClaim", status["resourceClaimName"], xmem.namespace)
    assert claim is not None
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert parse_bytes(result["consumedCapacity"]["memory"]) == 18 * GiB

    # One finishes (the Job is deleted): Kueue releases its 18 GiB when its Workload is deleted
    # (the Delete event requeues the ClusterQueue's inadmissible workloads, in batches of a
    # second), and the third is admitted.
    cluster.delete("batch/v1", "Job", first, xmem.namespace)
    wait_for(lambda: workload_of(cluster, xmem.namespace, first) is None, 120,
             "the first job's Workload to be deleted", interval=0.5)
    charged = wait_for(lambda: _usage(cluster, xmem.namespace, waiting), 60,
                       "the third job to be charged once quota is free", interval=0.5)
    assert charged == 18 * GiB
