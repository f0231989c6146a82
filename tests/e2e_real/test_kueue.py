"""xmem in a cluster that queues jobs with Kueue, on the real control plane with the real Kueue
controller (localkube/kueue.py; built by `make tools`): a ClusterQueue lists the chart's
AdmissionCheck, a LocalQueue feeds it. A Job submitted to the queue is suspended by Kueue's own
webhook (never by ours), estimated on the process node while its check is Pending, admitted by
Kueue with our podSetUpdates, unsuspended by Kueue, and its pod, created by the real Job
controller, carries the backend's request on a kwok GPU node. A PyTorchJob is admitted with the
updates in its replica template: the training operator is not built, so no pod is created for it
and the test stops at the PyTorchJob Kueue unsuspended. A job whose estimate fits no GPU is
Rejected with the reason and Kueue deactivates it. The same scenarios without Kueue (``Suspend``
mode) are the other tests of tests/e2e_real.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Dict, Iterator, List, Optional

import pytest
from kubernetes import client

from localkube.cluster import CONTROLLER_SA, Cluster, render_chart
from localkube.controlplane import wait_for
from localkube.kueue import Kueue
from localkube.kwok import gpu_node
from tests.e2e_real.support import job, oom_job, policy, pytorchjob
from tests.support.estimates import record_dict
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller.admission_checks import CONTROLLER_NAME
from xmem_admission.cluster.controller.gme_store import KubeStore
from xmem_admission.cluster.kube.client import Kube
from xmem_admission.cluster.kube.quantity import MiB, ceil_div
from xmem_admission.cluster.policy.store import EstimateRecord

KUEUE_VALUES = {"kueue": {"enabled": True}}
CHECK = "xmem-gpu-memory"  # the chart's default admissionCheckName
QUEUE = "gpu-queue"
V1B2 = "kueue.x-k8s.io/v1beta2"


@pytest.fixture(scope="module")
def kueue(cluster: Cluster) -> Iterator[Kueue]:
    """Kueue, the chart's AdmissionCheck and its controller RBAC, a flavor and a ClusterQueue."""
    running = Kueue(cluster).start()
    chart = render_chart(KUEUE_VALUES)
    for obj in chart:
        if obj["kind"] == "AdmissionCheck" or (obj["kind"] == "ClusterRole" and
                                               obj["metadata"]["name"] == CONTROLLER_SA):
            cluster.apply(obj)
    cluster.apply({"apiVersion": V1B2, "kind": "ResourceFlavor",
                   "metadata": {"name": "gpu-nodes"}})
    cluster.apply({"apiVersion": V1B2, "kind": "ClusterQueue", "metadata": {"name": "gpu"},
                   "spec": {"namespaceSelector": {},
                            "admissionChecksStrategy": {"admissionChecks": [{"name": CHECK}]},
                            "resourceGroups": [{
                                "coveredResources": ["cpu", "memory", "nvidia.com/gpu",
                                                     "nvidia.com/gpumem"],
                                "flavors": [{"name": "gpu-nodes", "resources": [
                                    {"name": "cpu", "nominalQuota": "64"},
                                    {"name": "memory", "nominalQuota": "256Gi"},
                                    {"name": "nvidia.com/gpu", "nominalQuota": "8"},
                                    # HAMi's MiB (docs/kueue.md): what 8 A100-80GB hold
                                    {"name": "nvidia.com/gpumem",
                                     "nominalQuota": str(8 * 81920)}]}]}]}})
    for index in range(2):
        cluster.apply(gpu_node(f"kueue-gpu-{index}", labels={"pool": "kueue"}))
    try:
        yield running
    finally:
        running.stop()
        for obj in render_chart():  # the controller's rights as the other tests expect them
            if obj["kind"] == "ClusterRole" and obj["metadata"]["name"] == CONTROLLER_SA:
                cluster.apply(obj)


@pytest.fixture()
def queued(xmem, kueue):
    """The test's namespace in Kueue mode, with a LocalQueue and the webhook running."""
    xmem.cluster.apply(policy(xmem.namespace, integration="Kueue", enforcement="Enforce"))
    xmem.cluster.apply({"apiVersion": V1B2, "kind": "LocalQueue",
                        "metadata": {"name": QUEUE, "namespace": xmem.namespace},
                        "spec": {"clusterQueue": "gpu"}})
    xmem.serve(KUEUE_VALUES)
    return xmem


class History:
    """Every value a workload's suspend flag took, from a watch started before its CREATE, with
    whether Kueue's Workload for it was admitted when each value was seen."""

    def __init__(self, cluster: Cluster, api_version: str, kind: str, namespace: str,
                 name: str, path: List[str]) -> None:
        self.cluster, self.namespace, self.name, self.path = cluster, namespace, name, path
        self.resource = cluster.resource(api_version, kind)
        self.seen: List[Dict[str, Any]] = []
        self._stop = threading.Event()
        # From the list's resourceVersion on: the CREATE that follows cannot be missed.
        self._since = self.resource.get(namespace=namespace).metadata.resourceVersion
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for event in self.cluster.dynamic().watch(
                self.resource, namespace=self.namespace, resource_version=self._since,
                field_selector=f"metadata.name={self.name}", timeout=600):
            value: Any = event["raw_object"]
            for part in self.path:
                value = (value or {}).get(part)
            if not self.seen or self.seen[-1]["suspend"] != value:
                self.seen.append({"suspend": value, "admitted": admitted(
                    self.cluster, self.namespace, self.name)})
            if self._stop.is_set():
                break

    def stop(self) -> List[Dict[str, Any]]:
        self._stop.set()
        return self.seen


def workload_of(cluster: Cluster, namespace: str, owner: str) -> Optional[Dict[str, Any]]:
    for wl in cluster.list(V1B2, "Workload", namespace):
        if any(r.get("name") == owner for r in wl["metadata"].get("ownerReferences") or []):
            return wl
    return None


def admitted(cluster: Cluster, namespace: str, owner: str) -> bool:
    wl = workload_of(cluster, namespace, owner) or {}
    return any(c["type"] == "Admitted" and c["status"] == "True"
               for c in (wl.get("status") or {}).get("conditions") or [])


def our_check(cluster: Cluster, namespace: str, owner: str,
              states: tuple = ("Ready",)) -> Optional[Dict[str, Any]]:
    wl = workload_of(cluster, namespace, owner) or {}
    for check in (wl.get("status") or {}).get("admissionChecks") or []:
        if check["name"] == CHECK and check["state"] in states:
            return dict(check)
    return None


def suspend_managers(obj: Dict[str, Any], parent: str) -> List[str]:
    """The field managers that own the suspend flag under ``parent`` (managedFields)."""
    out = []
    for entry in obj["metadata"].get("managedFields") or []:
        fields = json.dumps(entry.get("fieldsV1") or {})
        if f'"f:{parent}"' in fields and '"f:suspend"' in fields:
            out.append(f"{entry['manager']}/{entry['operation']}")
    return out


def test_a_queued_job_is_estimated_then_admitted_by_kueue_and_its_pod_sized(queued):
    xmem, cluster = queued, queued.cluster
    xmem.controller("", "--kueue-controller-name", CONTROLLER_NAME)
    check = wait_for(lambda: [c for c in (cluster.get(V1B2, "AdmissionCheck", CHECK) or {}).get(
        "status", {}).get("conditions", []) if c["type"] == "Active" and c["status"] == "True"],
        60, "our AdmissionCheck to be Active")
    assert check
    history = History(cluster, "batch/v1", "Job", xmem.namespace, "train", ["spec", "suspend"])
    body = job("train", xmem.namespace, node_selector={"pool": "kueue"})
    body["metadata"]["labels"][labels.KUEUE_QUEUE_NAME] = QUEUE
    created = client.BatchV1Api(cluster.api).create_namespaced_job(xmem.namespace, body).to_dict()
    assert created["spec"]["suspend"] is True  # Kueue's webhook, not ours
    assert labels.HELD_REASON not in (created["metadata"].get("annotations") or {})

    ready = wait_for(lambda: our_check(cluster, xmem.namespace, "train"), 300,
                     "our check to be Ready", interval=0.5)
    [update] = ready["podSetUpdates"]
    request = int(update["annotations"][labels.REQUEST_BYTES])
    assert update["name"] == "main" and update["annotations"][labels.GPU_MODEL] == "A100-80GB"
    assert "estimated" in ready["message"]

    def started() -> Optional[Dict[str, Any]]:
        obj = xmem.job("train")
        return obj if obj["spec"].get("suspend") is False else None
    running = wait_for(started, 120, "Kueue to start the job")
    annotations = running["spec"]["template"]["metadata"]["annotations"]
    assert annotations[labels.REQUEST_BYTES] == str(request)

    def training_pod() -> Optional[Dict[str, Any]]:
        pods = xmem.pods("job-name=train")
        return pods[0] if pods and pods[0]["spec"].get("nodeName") else None
    pod = wait_for(training_pod, 90, "the Job controller's pod to be scheduled")
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpumem"] == str(ceil_div(request, MiB))  # HAMi, at Pod CREATE
    assert pod["spec"]["nodeName"].startswith("kueue-gpu-")

    seen = history.stop()
    # Suspended at CREATE, unsuspended once, after Kueue admitted the Workload; nothing else.
    assert [s["suspend"] for s in seen] == [True, False], seen
    assert seen[-1]["admitted"], seen
    owners = suspend_managers(running, "spec")
    assert any(m.startswith("kueue") for m in owners), owners
    assert [e for e in xmem.gmes()]  # recorded, as in Suspend mode

    # The same job again: its fingerprint is known, so the check is Ready without estimating.
    [before] = xmem.gmes()
    again = dict(body, metadata=dict(body["metadata"], name="train-again"))
    client.BatchV1Api(cluster.api).create_namespaced_job(xmem.namespace, again)
    wait_for(lambda: our_check(cluster, xmem.namespace, "train-again"), 60,
             "the repeat job's check to be Ready")
    [after] = xmem.gmes()  # not estimated again: the same estimate, the same attempt
    assert (after["metadata"]["uid"], after["status"].get("attempt", 1),
            after["status"]["completionTime"]) == (before["metadata"]["uid"],
                                                   before["status"].get("attempt", 1),
                                                   before["status"]["completionTime"])


def test_a_queued_pytorchjob_is_admitted_with_the_updates_in_its_replica_template(queued):
    """The training operator is not built: Kueue admits the PyTorchJob, writes our
    podSetUpdates into the Master template and unsuspends it; no pod follows."""
    xmem, cluster = queued, queued.cluster
    xmem.controller("", "--kueue-controller-name", CONTROLLER_NAME)
    history = History(cluster, "kubeflow.org/v1", "PyTorchJob", xmem.namespace, "ddp",
                      ["spec", "runPolicy", "suspend"])
    body = pytorchjob("ddp", xmem.namespace)
    body["metadata"]["labels"][labels.KUEUE_QUEUE_NAME] = QUEUE
    created = cluster.resource("kubeflow.org/v1", "PyTorchJob").create(
        body=body, namespace=xmem.namespace).to_dict()
    assert created["spec"]["runPolicy"]["suspend"] is True  # Kueue's webhook

    ready = wait_for(lambda: our_check(cluster, xmem.namespace, "ddp"), 300,
                     "our check to be Ready", interval=0.5)
    [update] = ready["podSetUpdates"]
    assert update["name"] == "master"

    def started() -> Optional[Dict[str, Any]]:
        obj = cluster.get("kubeflow.org/v1", "PyTorchJob", "ddp", xmem.namespace) or {}
        return obj if obj["spec"]["runPolicy"].get("suspend") is False else None
    running = wait_for(started, 120, "Kueue to start the PyTorchJob")
    master = running["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]
    assert master["annotations"][labels.REQUEST_BYTES] == \
        update["annotations"][labels.REQUEST_BYTES]
    seen = history.stop()
    assert [s["suspend"] for s in seen] == [True, False] and seen[-1]["admitted"], seen


def test_a_job_whose_estimate_fits_no_gpu_is_rejected_with_the_reason(queued):
    xmem, cluster = queued, queued.cluster
    body = job("huge", xmem.namespace, node_selector={"pool": "kueue"})
    body["metadata"]["labels"][labels.KUEUE_QUEUE_NAME] = QUEUE
    created = client.BatchV1Api(cluster.api).create_namespaced_job(xmem.namespace, body).to_dict()
    # Recorded after CREATE (the webhook would refuse a known misfit at once): a run that
    # finished meanwhile, 300 GiB on every target.
    data = record_dict(created["metadata"]["annotations"][labels.FINGERPRINT],
                       {"A100-80GB": 300.0, "H100-80GB": 300.0})
    data["workload"] = {"namespace": xmem.namespace, "kind": "Job", "name": "huge"}
    KubeStore(Kube(cluster.api)).put(EstimateRecord.from_dict(data))
    xmem.controller("", "--kueue-controller-name", CONTROLLER_NAME)

    rejected = wait_for(lambda: our_check(cluster, xmem.namespace, "huge", ("Rejected",)), 120,
                        "our check to be Rejected")
    assert "fits no GPU" in rejected["message"] and "300" in rejected["message"]

    def deactivated() -> bool:
        wl = workload_of(cluster, xmem.namespace, "huge") or {}
        return (wl.get("spec") or {}).get("active") is False
    wait_for(deactivated, 60, "Kueue to deactivate the Workload")
    assert xmem.job("huge")["spec"]["suspend"] is True
    name = (workload_of(cluster, xmem.namespace, "huge") or {})["metadata"]["name"]
    events = wait_for(lambda: [e for e in xmem.events(name)
                               if e["reason"] == "AdmissionCheckRejected"], 30,
                      "Kueue's AdmissionCheckRejected event")
    assert "fits no GPU" in events[0]["message"]


def test_with_kueue_running_a_job_outside_any_queue_is_still_held_and_released_by_xmem(
        xmem, kueue):
    """The ``Suspend`` mode beside Kueue: a Job without a queue-name label is not Kueue's
    (manageJobsWithoutQueueName is false), so xmem holds it, estimates it and releases it."""
    cluster = xmem.cluster
    xmem.serve()
    xmem.controller("", "--kueue-controller-name", CONTROLLER_NAME)
    created = client.BatchV1Api(cluster.api).create_namespaced_job(
        xmem.namespace, job("plain", xmem.namespace, node_selector={"pool": "kueue"})).to_dict()
    assert created["spec"]["suspend"] is True
    assert created["metadata"]["annotations"][labels.HELD_REASON] == "AwaitingEstimate"
    released = xmem.wait_released("plain")
    assert released["spec"]["suspend"] is False
    assert labels.REQUEST_BYTES in released["spec"]["template"]["metadata"]["annotations"]
    assert workload_of(cluster, xmem.namespace, "plain") is None  # Kueue left it alone


def _retried_bigger(xmem: Any, name: str) -> Dict[str, Any]:
    """The queued Job's Workload as Kueue admitted it, after its retry succeeded; checks that
    the retry's pod asks for more GPU memory of the same one GPU and that Kueue's admission is
    what it was, never evicted."""
    cluster = xmem.cluster
    admission = wait_for(lambda: (workload_of(cluster, xmem.namespace, name) or {}).get(
        "status", {}).get("admission"), 300, f"Kueue to admit {name}", interval=0.5)
    wait_for(lambda: (xmem.job(name).get("status") or {}).get("succeeded"), 240,
             f"the retry of {name} to succeed")
    first, second = sorted(xmem.pods(f"job-name={name}"),
                           key=lambda p: p["metadata"]["creationTimestamp"])
    limits = [p["spec"]["containers"][0]["resources"]["limits"] for p in (first, second)]
    assert int(limits[1]["nvidia.com/gpumem"]) > int(limits[0]["nvidia.com/gpumem"])
    assert [lim["nvidia.com/gpu"] for lim in limits] == ["1", "1"]
    wl = workload_of(cluster, xmem.namespace, name) or {}
    assert wl["status"]["admission"] == admission
    conditions = {c["type"]: c["status"] for c in wl["status"].get("conditions") or []}
    assert conditions.get("Evicted") != "True", conditions
    usage = dict(admission["podSetAssignments"][0]["resourceUsage"])
    usage["first-pod-gpumem"] = limits[0]["nvidia.com/gpumem"]
    return usage


def test_a_queued_job_out_of_gpu_memory_is_retried_bigger_within_what_kueue_admitted(
        queued, gpu_process_node):
    """Kueue admits a workload for its pod templates' resources when it reserves quota, and
    cannot resize an admitted one. A first-time job's template carries no GPU memory (the
    backend writes it at Pod CREATE), so its retry needs nothing Kueue reserved; a repeat job,
    sized at its CREATE, was charged its first request of nvidia.com/gpumem, and the retry asks
    for more than that charge: xmem lets it (docs/kueue.md: the count of GPUs, unchanged, is
    the binding quota, and memory per GPU never passes one GPU's capacity). Either way the Job
    stays admitted, never evicted or requeued, and its second pod asks for more."""
    xmem, cluster = queued, queued.cluster
    xmem.controller("", "--kueue-controller-name", CONTROLLER_NAME)
    for name in ("oom", "oom-again"):
        body = oom_job(name, xmem.namespace, "A100-80GB", int(1.2 * (1 << 30)), "HAMi")
        body["metadata"]["labels"][labels.KUEUE_QUEUE_NAME] = QUEUE
        created = client.BatchV1Api(cluster.api).create_namespaced_job(xmem.namespace, body)
        limits = created.spec.template.spec.containers[0].resources.limits
        usage = _retried_bigger(xmem, name)
        assert usage["nvidia.com/gpu"] == "1"
        if name == "oom":  # first time: no GPU memory in the template, none charged
            assert "nvidia.com/gpumem" not in limits and "nvidia.com/gpumem" not in usage
        else:  # sized at CREATE: charged the first pod's request, not the retry's
            assert limits["nvidia.com/gpumem"] == usage["nvidia.com/gpumem"] == \
                usage["first-pod-gpumem"]
