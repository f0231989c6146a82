"""A TrainJob whose pod runs out of GPU memory is retried with a larger request, on the real
control plane with the real Trainer v2.3.0 and JobSet v0.12.0 controllers (the ``trainer``
fixture) and the GPU process node, where the pod's container really runs and really fails.

Trainer makes a JobSet of the TrainJob, JobSet a Job, the Job controller the pod: the pod's
controlling owner is the Job, two owners below the TrainJob xmem holds. The controller walks
pod -> Job -> JobSet -> TrainJob (``integrations.held_owner``), records the OOM on the
TrainJob's estimate with an Event on the TrainJob, and lists the Job in the entry's
``podOwners``, by whose uid the webhook finds the grant at the next pod's CREATE. JobSet
defaults its pods to ``restartPolicy: OnFailure``: the controller deletes the pod that would
restart in place, and the Job makes a new one, sized bigger. The step
(tests/e2e_real/scripts/oom_job.py) needs 1.2 GiB: the first pod's request (the policy's 1 GiB
minimum) fails it, the retry fits and the TrainJob completes.
"""

from __future__ import annotations

from typing import Any, Dict, List

from kubernetes import client

from localkube.controlplane import wait_for
from localkube.jobset import JOBSET_NAME_LABEL
from localkube.kwok import GPU_TOLERATION
from localkube.trainer import API_VERSION as TRAINER_API
from localkube.trainer import TORCH_RUNTIME
from tests.e2e_real.support import GPU_POOL, IMAGE, policy
from tests.e2e_real.test_oom_retry import _condition as _true
from tests.e2e_real.test_oom_retry import _entry, _request
from tests.support.estimates import record_dict
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller.gme_store import KubeStore
from xmem_admission.cluster.kube.client import Kube
from xmem_admission.cluster.kube.quantity import GiB, MiB
from xmem_admission.cluster.policy.store import EstimateRecord

GPU = "A100-80GB"
NEED = int(1.2 * GiB)
KINDS = ("--workloads", "Job,JobSet,TrainJob")


def _trainjob(name: str, namespace: str) -> Dict[str, Any]:
    """One node, one GPU, running the OOM script on the GPU process node (placement and the
    code ConfigMap through a runtime patch of the user's own)."""
    def field(path: str) -> Dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}

    return {"apiVersion": TRAINER_API, "kind": "TrainJob",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {labels.OPT_IN: "true"}},
            "spec": {
                "runtimeRef": {"name": TORCH_RUNTIME},
                "trainer": {
                    "image": IMAGE, "command": ["python", "/app/oom_job.py"], "numNodes": 1,
                    "env": [{"name": "NEED_BYTES", "value": str(NEED)},
                            {"name": "ENFORCER", "value": "HAMi"},
                            {"name": "GRANTED_BYTES", "valueFrom": field(
                                f"metadata.annotations['{labels.REQUEST_BYTES}']")}],
                    "resourcesPerNode": {"limits": {"nvidia.com/gpu": "1", "cpu": "4",
                                                    "memory": "16Gi"}}},
                "runtimePatches": [{"manager": "example.com/ml-team", "trainingRuntimeSpec": {
                    "template": {"spec": {"replicatedJobs": [{"name": "node", "template": {
                        "spec": {"template": {"spec": {
                            "nodeSelector": GPU_POOL, "tolerations": [GPU_TOLERATION],
                            "volumes": [{"name": "code", "configMap": {"name": "code"}}],
                            "containers": [{"name": "node", "volumeMounts": [
                                {"name": "code", "mountPath": "/app"}]}]}}}}}]}}}}]}}


def _get(cluster: Any, namespace: str, name: str) -> Dict[str, Any]:
    found = cluster.get(TRAINER_API, "TrainJob", name, namespace)
    assert found is not None, f"TrainJob {name} is gone"
    return found


def test_a_trainjob_whose_pod_runs_out_of_gpu_memory_is_retried_with_a_larger_request(
        xmem: Any, trainer: Any, gpu_process_node: Any) -> None:
    cluster = xmem.cluster
    cluster.apply(policy(xmem.policy_name, gpus=(GPU,)))
    xmem.serve()
    created = client.CustomObjectsApi(cluster.api).create_namespaced_custom_object(
        "trainer.kubeflow.org", "v1alpha1", xmem.namespace, "trainjobs",
        _trainjob("oom", xmem.namespace))
    assert created["spec"]["suspend"] is True
    # The estimate a finished estimation records: a small model, sized at the 1 GiB minimum.
    held = _get(cluster, xmem.namespace, "oom")
    data = record_dict(held["metadata"]["annotations"][labels.FINGERPRINT], {GPU: 0.5})
    data["workload"] = {"namespace": xmem.namespace, "kind": "TrainJob", "name": "oom"}
    KubeStore(Kube(cluster.api)).put(EstimateRecord.from_dict(data))
    xmem.controller("", "--no-leader-election", *KINDS)

    def pods() -> List[Dict[str, Any]]:
        found = cluster.list("v1", "Pod", xmem.namespace, f"{JOBSET_NAME_LABEL}=oom")
        return sorted(found, key=lambda p: p["metadata"]["creationTimestamp"])

    done = wait_for(lambda: (lambda obj: obj if _true(obj, "Complete") or _true(obj, "Failed")
                             else None)(_get(cluster, xmem.namespace, "oom")),
                    300, "the TrainJob to end", interval=1.0)
    assert _true(done, "Complete"), done.get("status")
    uid = done["metadata"]["uid"]
    entry = _entry(xmem, uid)
    assert entry is not None, [g.get("status") for g in xmem.gmes()]
    assert entry["workload"] == {"kind": "TrainJob", "name": "oom", "uid": uid}
    assert entry["ooms"] == 1 and entry["failedRequestBytes"] == 1 * GiB
    assert entry["requestBytes"] > entry["failedRequestBytes"]
    # The grant goes by the Job that JobSet made for the TrainJob: its pods' controlling owner.
    [job] = [j for j in cluster.list("batch/v1", "Job", xmem.namespace)
             if j["metadata"]["labels"].get(JOBSET_NAME_LABEL) == "oom"]
    assert entry["podOwners"] == [job["metadata"]["uid"]]
    # The pod that ran out was deleted (it would have restarted in place at the same size);
    # the Job's next pod asked for the retry's request and succeeded.
    assert wait_for(lambda: cluster.get("v1", "Pod", entry["pod"], xmem.namespace) is None,
                    60, "the pod that ran out to be gone")
    [survivor] = [p for p in pods() if p["metadata"]["name"] != entry["pod"]]
    assert survivor["status"]["phase"] == "Succeeded"
    assert _request(survivor) == entry["requestBytes"]
    assert survivor["metadata"]["annotations"][labels.OOM_RETRY] == "1"
    [node] = [c for c in survivor["spec"]["containers"] if c["name"] == "node"]
    assert int(node["resources"]["limits"]["nvidia.com/gpumem"]) * MiB >= _request(survivor)
    # What the user sees on the TrainJob: the OOM and its retry, then the OOM avoided.
    events = wait_for(lambda: (lambda found: found if "OutOfGPUMemoryAvoided" in found
                               else None)({e["reason"]: e["message"]
                                           for e in xmem.events("oom")}),
                      60, "the TrainJob's Events")
    assert "ran out of GPU memory" in events["OutOfGPUMemory"]
    assert "its next pod is sized bigger" in events["OutOfGPUMemory"]
    assert "completed after 1 CUDA out-of-memory failure(s)" in events["OutOfGPUMemoryAvoided"]
    assert wait_for(lambda: (_entry(xmem, uid) or {}).get("outcome"), 60,
                    "the outcome on the estimate") == "Completed"
    cluster.delete(TRAINER_API, "TrainJob", "oom", xmem.namespace)
