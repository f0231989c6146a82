"""The project on a real node: the real control plane with the chart's objects (``Cluster``), a
real kubelet for its CPU pods (``RealNode``) whose registry requires authentication, kwok GPU
nodes, and images pushed into that registry, with the project's image as the controller's
``--probe-image``. Shared by ``tests/realnode`` and ``bench/cluster/realnode_release.py``.

``NodeCluster(root, sandbox_image, probe_image, images).start()`` starts it and pushes every
image (``images``: role -> local podman reference; ``pushed[role]`` is its reference in the
registry); ``namespace(name)`` makes an opted-in namespace with the registry's pull secret, the
code ConfigMap and a policy of its own, and starts its webhook and controller; ``stop()`` stops
everything (the node removes what it made).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

from localkube.cluster import Cluster, Webhook
from localkube.controlplane import ControlPlane, wait_for
from localkube.kubelet import RealNode
from localkube.kwok import gpu_node
from tests.e2e_real.support import code_map, policy
from xmem_admission.cluster import labels

PULL_SECRET = "registry-credentials"
GPU_POOL = {"pool": "real-node-gpus"}
ESTIMATION = {"resources": {"cpu": "1", "memory": "3Gi"}, "activeDeadlineSeconds": 600}


@dataclass
class Tenant:
    """One namespace's webhook and controller."""

    name: str
    webhook: Webhook
    controller: Any


@dataclass
class NodeCluster:
    root: Path
    sandbox_image: str
    probe_image: str
    images: Mapping[str, str]
    gpu_nodes: int = 2
    auth: Tuple[str, str] = field(default_factory=lambda: ("xmem-tests", secrets.token_hex(8)))
    pushed: Dict[str, str] = field(default_factory=dict)
    push_seconds: Dict[str, float] = field(default_factory=dict)
    tenants: List[Tenant] = field(default_factory=list)

    def start(self) -> NodeCluster:
        started: Dict[str, RealNode] = {}

        def start_node(plane: ControlPlane) -> RealNode:
            node = RealNode(plane, self.root / "node", registry_auth=self.auth)
            started["node"] = node
            try:
                return node.start(self.sandbox_image)
            except BaseException:
                node.stop()
                raise

        self.cluster = Cluster(self.root / "plane", start_node=start_node)
        try:
            self.cluster.start()
            self.node = started["node"]
            for role, reference in [("probe", self.probe_image), *self.images.items()]:
                began = time.monotonic()
                self.pushed[role] = self.node.registry.push(reference, f"xmem/{role}:test")
                self.push_seconds[role] = time.monotonic() - began
            self.cluster.probe_image = self.pushed["probe"]
            for i in range(self.gpu_nodes):
                self.cluster.apply(gpu_node(f"real-node-gpu-{i}", labels=dict(GPU_POOL)))
        except BaseException:
            self.cluster.stop()
            raise
        return self

    def stop(self) -> None:
        for tenant in list(self.tenants):
            self.leave(tenant)
        self.cluster.stop()

    def namespace(self, name: str, estimation: Optional[Dict[str, Any]] = None) -> Tenant:
        cluster = self.cluster
        cluster.ensure_namespace(name, {labels.OPT_IN: "true"})
        wait_for(lambda: cluster.get("v1", "ServiceAccount", "default", name), 30,
                 f"the default service account of {name}")
        cluster.apply(dict(self.node.registry.pull_secret(PULL_SECRET),
                           metadata={"name": PULL_SECRET, "namespace": name}))
        cluster.apply(code_map(name))
        cluster.apply(policy(name, estimation=dict(estimation or ESTIMATION)))
        tenant = Tenant(name, cluster.serve(f"serve-{name}", name),
                        cluster.controller(f"controller-{name}", name))
        self.tenants.append(tenant)
        return tenant

    def leave(self, tenant: Tenant) -> None:
        self.cluster.stop_process(tenant.controller)
        tenant.webhook.remove()
        tenant.webhook.stop()
        self.cluster.delete("v1", "Namespace", tenant.name)
        self.tenants.remove(tenant)


def pod_spec(obj: Dict[str, Any]) -> Dict[str, Any]:
    """The GPU pod template's spec of a Job or a PyTorchJob (its master)."""
    if obj["kind"] == "PyTorchJob":
        return dict(obj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"])
    return dict(obj["spec"]["template"]["spec"])


def in_image(obj: Dict[str, Any], image: str, command: Optional[List[str]] = None,
             args: Optional[List[str]] = None) -> Dict[str, Any]:
    """``obj`` (from ``tests.e2e_real.support``) pulling ``image`` with the pull secret, its
    GPU pods held to the kwok GPU nodes."""
    template = (obj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
                if obj["kind"] == "PyTorchJob" else obj["spec"]["template"])
    spec = template["spec"]
    spec["imagePullSecrets"] = [{"name": PULL_SECRET}]
    spec["nodeSelector"] = dict(GPU_POOL)
    container = spec["containers"][0]
    container["image"] = image
    if command is not None:
        container["command"] = command
    if args is not None:
        container["args"] = args
    return obj


def estimate_of(cluster: Cluster, namespace: str, kind: str, name: str) -> Dict[str, Any]:
    """The GPUMemoryEstimate owned by workload ``kind/name``; {} while there is none."""
    for gme in cluster.list("xmem.io/v1alpha1", "GPUMemoryEstimate", namespace):
        refs = gme["metadata"].get("ownerReferences") or []
        if any(r["kind"] == kind and r["name"] == name for r in refs):
            return gme
    return {}


def estimation_pod(cluster: Cluster, namespace: str, gme: Dict[str, Any]) -> Dict[str, Any]:
    """The latest estimation pod of an estimate; {} while there is none."""
    pods = [p for p in cluster.list("v1", "Pod", namespace,
                                    "app.kubernetes.io/component=estimation")
            if any(r["uid"] == gme["metadata"]["uid"]
                   for r in p["metadata"].get("ownerReferences") or [])]
    return pods[-1] if pods else {}


def container_statuses(pod: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    status = pod.get("status") or {}
    return {s["name"]: s for s in (status.get("initContainerStatuses") or [])
            + (status.get("containerStatuses") or [])}


def diagnostics(cluster: Cluster, namespace: str) -> str:
    """Events, estimates' status and the controller's log, for a failed wait."""
    events = "\n".join(f"{e['involvedObject']['name']}: {e['reason']}: {e['message']}"
                       for e in cluster.list("v1", "Event", namespace))
    gmes = json.dumps([g.get("status") for g in
                       cluster.list("xmem.io/v1alpha1", "GPUMemoryEstimate", namespace)],
                      indent=1)
    return (f"events:\n{events}\nestimates:\n{gmes}\ncontroller log:\n"
            f"{cluster.log(f'controller-{namespace}')[-3000:]}")
