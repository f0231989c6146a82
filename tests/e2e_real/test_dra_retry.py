"""A Job out of GPU memory under the ``DRA`` backend is retried with a claim for the grown
request, and the real kube-scheduler allocates it (the OOM retry loop's
request), on the real control plane (Kubernetes 1.36, DRA gates at their defaults).

A process node of the project's (``localkube.node``: it runs the pods bound to it as processes,
as tests/e2e_real/test_oom_retry.py does) carries a ResourceSlice published as HAMi's DRA driver
publishes an H200 (``localkube/dra.py``): shared, ``memory`` and ``cores`` capacity. No kubelet
plugin runs there, so a claim is allocated (the scheduler's part) and never prepared; the pod's
container (tests/e2e_real/scripts/oom_job.py) is given what its ``xmem.io/request-bytes`` says,
as HAMi-core would enforce the claim's ``memory``, and fails with PyTorch's CUDA OOM past it.

The estimate is fixed, as a finished estimation records it (``record_dict``): a 17 GiB peak plus
the policy's 5 % margin in 256 MiB steps is an 18 GiB request; the step needs 20 GiB.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Dict, Iterator, List, Optional

import pytest
from kubernetes import client

from localkube import dra as published
from localkube.controlplane import wait_for
from localkube.kwok import GPU_TAINT
from localkube.node import ProcessNode
from tests.e2e_real.support import oom_job, policy
from tests.support.estimates import record_dict
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller.gme_store import KubeStore
from xmem_admission.cluster.kube.client import Kube
from xmem_admission.cluster.kube.quantity import GiB, MiB, parse_bytes
from xmem_admission.cluster.policy.store import EstimateRecord
from xmem_admission.contract import gpus

H200 = gpus.lookup("H200")
RESOURCE = "resource.k8s.io/v1"
NODE = "dra-retry-process-node"
POOL = {"pool": "dra-retry"}


@pytest.fixture()
def dra_process_node(cluster: Any) -> Iterator[ProcessNode]:
    """A process node with no extended GPU resource at all: a pod lands there only through a
    claim allocated from its ResourceSlice (one H200 as HAMi's driver shares it)."""
    node = ProcessNode(cluster.plane, NODE, allocatable={
        "cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti"},
        labels=POOL, path_prefix=[os.path.dirname(sys.executable)], taints=[GPU_TAINT]).start()
    slice_ = published.hami_slice(NODE, [published.hami_gpu(H200)])
    try:
        for klass in published.device_classes():
            cluster.apply(klass)
        cluster.apply(slice_)
        yield node
    finally:
        node.stop()
        cluster.delete(RESOURCE, "ResourceSlice", slice_["metadata"]["name"])
        cluster.delete("v1", "Node", NODE)


def _pods(xmem: Any, name: str) -> List[Dict[str, Any]]:
    return sorted(xmem.pods(f"job-name={name}"), key=lambda p: p["metadata"]["creationTimestamp"])


def _template(pod: Dict[str, Any]) -> str:
    (entry,) = pod["spec"]["resourceClaims"]
    assert entry["name"] == "xmem-gpu"
    return str(entry["resourceClaimTemplateName"])


def _allocation(xmem: Any, pod: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The allocation result of the pod's claim, once the scheduler made one."""
    statuses = pod.get("status", {}).get("resourceClaimStatuses") or []
    if not statuses:
        return None
    claim = xmem.cluster.get(RESOURCE, "ResourceClaim", statuses[0]["resourceClaimName"],
                             xmem.namespace)
    allocation = ((claim or {}).get("status") or {}).get("allocation")
    return allocation["devices"]["results"][0] if allocation else None


def _gme_table(xmem: Any) -> Dict[str, Any]:
    """``kubectl get gme``: the API server renders the CRD's printer columns as a Table."""
    code, data = xmem.cluster.plane.request(
        "GET", f"/apis/xmem.io/v1alpha1/namespaces/{xmem.namespace}/gpumemoryestimates",
        accept="application/json;as=Table;g=meta.k8s.io;v=v1")
    assert code == 200, data
    table = json.loads(data)
    columns = [c["name"] for c in table["columnDefinitions"]]
    (row,) = table["rows"]
    return dict(zip(columns, row["cells"]))


def test_a_jobs_retry_after_a_gpu_oom_asks_a_claim_of_the_grown_request_and_gets_it(
        xmem: Any, dra_process_node: ProcessNode) -> None:
    cluster = xmem.cluster
    cluster.apply(policy(xmem.policy_name, backend="DRA", gpus=("H200",),
                         dra={"driver": "HAMi"}))
    xmem.serve()
    name = "dra-retry"
    body = oom_job(name, xmem.namespace, "H200", 20 * GiB, "HAMi", hold_seconds=60)
    body["spec"]["template"]["spec"]["nodeSelector"] = POOL
    created = client.BatchV1Api(cluster.api).create_namespaced_job(
        xmem.namespace, body).to_dict()
    assert created["spec"]["suspend"] is True
    data = record_dict(created["metadata"]["annotations"][labels.FINGERPRINT], {"H200": 17.0})
    data["workload"] = {"namespace": xmem.namespace, "kind": "Job", "name": name}
    KubeStore(Kube(cluster.api)).put(EstimateRecord.from_dict(data))
    xmem.controller("", "--no-leader-election")
    xmem.wait_released(name)

    # The first pod: a claim of the estimate's 18 GiB, allocated, and out of memory.
    first = wait_for(lambda: (lambda pods: pods[0] if pods and pods[0].get("status", {}).get(
        "phase") == "Failed" else None)(_pods(xmem, name)), 180, "the first pod to fail")
    assert _template(first) == f"{name}-xmem-18432mi"
    message = first["status"]["containerStatuses"][0]["state"]["terminated"]["message"]
    assert "torch.OutOfMemoryError: CUDA out of memory." in message, message

    # The retry: the controller made the template of the grown request (owned by the Job)
    # before it recorded the retry; the Job controller's next pod names it at its CREATE and
    # the scheduler allocates that much of the H200.
    second = wait_for(lambda: (lambda pods: pods[1] if len(pods) > 1 and pods[1].get(
        "status", {}).get("phase") == "Running" else None)(_pods(xmem, name)), 180,
        "the retry pod to run")
    grown = int(second["metadata"]["annotations"][labels.REQUEST_BYTES])
    assert grown > 18 * GiB and second["metadata"]["annotations"][labels.OOM_RETRY] == "1"
    assert _template(second) == f"{name}-xmem-{grown // MiB}mi"
    template = cluster.get(RESOURCE, "ResourceClaimTemplate", _template(second), xmem.namespace)
    assert template is not None
    assert template["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    exactly = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert parse_bytes(exactly["capacity"]["requests"]["memory"]) == grown
    result = wait_for(lambda: _allocation(xmem, second), 60, "the retry's claim allocation")
    assert result["device"] == "hami-gpu-0"
    assert parse_bytes(result["consumedCapacity"]["memory"]) == grown
    assert second["spec"]["nodeName"] == NODE

    # The GME says so: the retry entry carries the grown claim, and `kubectl get gme` shows the
    # claim the estimate's request becomes.
    [gme] = xmem.gmes()
    [entry] = gme["status"]["oomRetries"]
    assert entry["requestBytes"] == grown and entry["failedRequestBytes"] == 18 * GiB
    size = f"{grown // GiB}Gi" if grown % GiB == 0 else f"{grown // MiB}Mi"
    assert entry["claim"] == f"hami-core-gpu.project-hami.io memory={size} cores=0"
    row = wait_for(lambda: (lambda r: r if r.get("Claim") else None)(_gme_table(xmem)), 30,
                   "the Claim column")
    assert row["Claim"] == "hami-core-gpu.project-hami.io memory=18Gi cores=0"
    assert row["Request"] == "18.0Gi"
