"""Per test, a namespace, a policy, the webhook and the controller as processes, on the session's
one real control plane (the ``cluster`` fixture of tests/conftest.py).
"""

from __future__ import annotations

import itertools
import os
import re
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import pytest

from localkube.cluster import Cluster, Webhook
from localkube.controlplane import wait_for
from localkube.kwok import GPU_TAINT
from localkube.node import ProcessNode
from tests.e2e_real.support import GPU_POOL, code_map, policy
from xmem_admission.cluster import labels

_counter = itertools.count()


@dataclass
class Xmem:
    """The webhook and controller of one test, and the namespace and policy it runs in."""

    cluster: Cluster
    namespace: str
    policy_name: str
    webhook: Optional[Webhook] = None
    controllers: List[Any] = field(default_factory=list)

    def serve(self, values: Optional[Dict[str, Any]] = None) -> Webhook:
        self.webhook = self.cluster.serve(f"serve-{self.namespace}", self.policy_name, values)
        return self.webhook

    def controller(self, name: str = "", *extra: str, kubeconfig: Any = None) -> Any:
        name = name or f"controller-{self.namespace}-{len(self.controllers)}"
        process = self.cluster.controller(name, self.policy_name, *extra, kubeconfig=kubeconfig)
        self.controllers.append(process)
        return process

    def job(self, name: str) -> Dict[str, Any]:
        found = self.cluster.get("batch/v1", "Job", name, self.namespace)
        assert found is not None, f"job {name} is gone"
        return found

    def wait_released(self, name: str, timeout: float = 180) -> Dict[str, Any]:
        def released() -> Optional[Dict[str, Any]]:
            obj = self.job(name)
            return None if labels.HELD_REASON in (obj["metadata"].get("annotations") or {}) \
                else obj
        return wait_for(released, timeout, f"job {name} to be released", interval=0.3)

    def pods(self, selector: str) -> List[Dict[str, Any]]:
        return self.cluster.list("v1", "Pod", self.namespace, selector)

    def estimation_pods(self) -> List[Dict[str, Any]]:
        return self.pods("app.kubernetes.io/component=estimation")

    def record_estimation_pods(self) -> PodRecorder:
        """Watch this namespace's estimation pods from now on (the controller deletes a
        succeeded one once its result is recorded): ``seen()`` gives each as last seen."""
        return PodRecorder(self.cluster, self.namespace)

    def gmes(self) -> List[Dict[str, Any]]:
        return self.cluster.list("xmem.io/v1alpha1", "GPUMemoryEstimate", self.namespace)

    def events(self, name: str) -> List[Dict[str, Any]]:
        return [e for e in self.cluster.list("v1", "Event", self.namespace)
                if e["involvedObject"]["name"] == name]


class PodRecorder:
    """Every estimation pod of a namespace as a watch last showed it, deleted ones included
    (a DELETED event carries the pod's final state)."""

    def __init__(self, cluster: Cluster, namespace: str) -> None:
        from kubernetes import client, watch

        self._api = client.CoreV1Api(cluster.api)
        self._watch = watch.Watch()
        self._pods: Dict[str, Dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._listed = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(namespace,), daemon=True)
        self._thread.start()
        assert self._listed.wait(30), "the estimation pod watch did not start"

    def _run(self, namespace: str) -> None:
        listing = self._api.list_namespaced_pod(
            namespace, label_selector="app.kubernetes.io/component=estimation")
        for pod in listing.items:
            self._keep(pod)
        self._listed.set()
        for event in self._watch.stream(
                self._api.list_namespaced_pod, namespace,
                label_selector="app.kubernetes.io/component=estimation",
                resource_version=listing.metadata.resource_version, timeout_seconds=3600):
            self._keep(event["object"])

    def _keep(self, pod: Any) -> None:
        obj = self._api.api_client.sanitize_for_serialization(pod)
        with self._lock:
            self._pods[obj["metadata"]["name"]] = obj

    def seen(self) -> List[Dict[str, Any]]:
        with self._lock:
            return list(self._pods.values())

    def stop(self) -> None:
        self._watch.stop()


@pytest.fixture(scope="session")
def gpu_process_node(cluster: Cluster) -> Iterator[ProcessNode]:
    """A process node that advertises GPUs in every backend's resources (HAMi's vGPUs and
    gpumem, MIG slices of the A100s): pods the scheduler binds to it run as processes, as on
    the cluster's own process node, so a training container really runs and really fails."""
    allocatable = {"cpu": "64", "memory": "512Gi", "pods": "110", "ephemeral-storage": "1Ti",
                   "nvidia.com/gpu": "40", "nvidia.com/gpumem": str(4 * 81920)}
    for profile in ("1g.5gb", "1g.10gb", "2g.10gb", "3g.20gb", "1g.20gb", "2g.20gb", "3g.40gb"):
        allocatable[f"nvidia.com/mig-{profile}"] = "7"
    # Tainted as GPU nodes are (kwok's too): only pods tolerating it land here, so the CPU pods
    # of tests that run after this fixture started (estimation pods among them) stay on the
    # cluster's own process node, in whatever order the tests run.
    node = ProcessNode(cluster.plane, "xmem-gpu-process-node", allocatable=allocatable,
                       labels=GPU_POOL, path_prefix=[os.path.dirname(sys.executable)],
                       taints=[GPU_TAINT]).start()
    try:
        yield node
    finally:
        node.stop()
        cluster.delete("v1", "Node", node.name)


@pytest.fixture()
def xmem(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Xmem]:
    """A fresh opted-in namespace with the code ConfigMap, and a GPUAdmissionPolicy of the
    test's own, named after the namespace (tests change it with ``cluster.apply``)."""
    stem = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    namespace = f"t{next(_counter)}-{stem}"
    cluster.ensure_namespace(namespace, {labels.OPT_IN: "true"})
    wait_for(lambda: cluster.get("v1", "ServiceAccount", "default", namespace), 30,
             f"the default service account of {namespace}")
    cluster.apply(code_map(namespace))
    cluster.apply(policy(namespace))
    handle = Xmem(cluster, namespace, namespace)
    try:
        yield handle
    finally:
        for process in handle.controllers:
            if process.poll() is None:
                cluster.stop_process(process)
        if handle.webhook is not None:
            handle.webhook.remove()
            handle.webhook.stop()
        cluster.delete("v1", "Namespace", namespace)

