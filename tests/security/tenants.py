"""Two tenants on one cluster with xmem installed as the chart installs it.

``TwoTenants`` uses the session's real control plane (kube-apiserver with RBAC and Pod Security
admission, the Job controller, the process node that runs pods; the chart's CRDs and RBAC), runs
``xmem serve`` and ``xmem controller`` as the chart's ServiceAccounts with the chart's webhook
configurations (CEL matchConditions included) calling the webhook, and creates two opted-in
namespaces, ``team-a`` (alice) and ``team-b`` (bob), each under Pod Security ``restricted``,
each tenant with a namespace-scoped role as an admin would grant it (workloads, pods, config
maps, read-only estimates) and nothing else. Tests act as a tenant through the official client
with that tenant's client certificate (signed by the cluster's CA), exactly as ``kubectl``
would.

The policy enforces in both namespaces. The tenants' code lives in a ``code`` ConfigMap per
namespace; alice's ``train_gpt.py`` is an attacker's: it writes a forged estimation result of
``FORGED_GIB`` GiB to the termination message and exits before the probe can write the real one.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Dict, List, Optional

from kubernetes import client

from localkube.cluster import Cluster, Webhook
from localkube.controlplane import wait_for
from tests.controller.support import code_map, training_job
from xmem_admission.cluster import labels

TENANTS = {"alice": "team-a", "bob": "team-b"}
POLICY_NAME = "tenants"
GPUS = ("A100-80GB", "H100-80GB")
POLICY = {
    "targets": [{"gpu": g, "backend": "HAMi"} for g in GPUS],
    "enforcement": "Enforce",
    "onEstimationFailure": {"action": "Hold"},
    "estimation": {"resources": {"cpu": "1", "memory": "2Gi"}, "activeDeadlineSeconds": 120,
                   "maxHoldSeconds": 600},
}
TENANT_RULES = [
    {"apiGroups": ["batch"], "resources": ["jobs"],
     "verbs": ["create", "get", "list", "watch", "update", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["pods", "configmaps"],
     "verbs": ["create", "get", "list", "watch", "update", "patch", "delete"]},
    {"apiGroups": [""], "resources": ["pods/log", "events"], "verbs": ["get", "list", "watch"]},
    {"apiGroups": ["xmem.io"], "resources": ["gpumemoryestimates"],
     "verbs": ["get", "list", "watch"]},
]
FORGER = '''"""An attacker's training script: forge the estimation result, exit before the probe."""
import json, os

gib = float(os.environ.get("FORGED_GIB", "1"))
size = int(gib * (1 << 30))
capacity = {"A100-80GB": 84970559242, "H100-80GB": 84938346987}
rows = [[g, c, size, size, size, size <= c, None] for g, c in capacity.items()]
result = {"v": 1, "status": "ok", "mode": "fake", "steps": 3, "seconds": 1.0, "gpus": rows}
path = os.environ.get("XMEM_RESULT_PATH")
if path:
    with open(path, "w") as handle:
        handle.write(json.dumps(result))
os._exit(0)
'''
RESTRICTED_POD = {"runAsNonRoot": True, "runAsUser": 1000,
                  "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def restricted(obj: Dict[str, Any]) -> Dict[str, Any]:
    """The workload with the security contexts Pod Security ``restricted`` asks for, as a
    tenant in such a namespace writes them (so any refusal in a test is xmem's)."""
    out = copy.deepcopy(obj)
    spec = out["spec"] if out["kind"] == "Pod" else out["spec"]["template"]["spec"]
    spec["securityContext"] = dict(RESTRICTED_POD)
    for kind in ("initContainers", "containers"):
        for container in spec.get(kind) or []:
            container["securityContext"] = dict(RESTRICTED_CONTAINER)
    return out


def job(name: str, namespace: str, forged_gib: float = 1.0, **options: Any) -> Dict[str, Any]:
    """A tenant's opted-in GPU training Job (the namespace opts it in), restricted-compliant."""
    out = training_job(name, namespace=namespace, **options)
    del out["metadata"]["labels"][labels.OPT_IN]
    container = out["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [{"name": "FORGED_GIB", "value": f"{forged_gib:g}"}]
    return restricted(out)


class Tenant:
    """A tenant's view of the cluster: the official client with the tenant's own token."""

    def __init__(self, api_client: Any, namespace: str) -> None:
        self.namespace = namespace
        self.batch = client.BatchV1Api(api_client)
        self.core = client.CoreV1Api(api_client)
        self.custom = client.CustomObjectsApi(api_client)

    def create_job(self, obj: Dict[str, Any], namespace: Optional[str] = None,
                   dry_run: bool = False) -> Dict[str, Any]:
        kwargs = {"dry_run": "All"} if dry_run else {}
        answer = self.batch.create_namespaced_job(namespace or self.namespace, obj,
                                                  _preload_content=False, **kwargs)
        return json.loads(answer.data)

    def create_pod(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        return json.loads(self.core.create_namespaced_pod(self.namespace, obj,
                                                          _preload_content=False).data)

    def patch_job(self, name: str, patch: Any) -> Dict[str, Any]:
        return json.loads(self.batch.patch_namespaced_job(name, self.namespace, patch,
                                                          _preload_content=False).data)


class TwoTenants:
    """See the module docstring."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        cluster.apply({"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
                       "metadata": {"name": POLICY_NAME}, "spec": POLICY})
        self.tenants: Dict[str, Tenant] = {}
        self._clients: List[Any] = []
        for user, namespace in TENANTS.items():
            cluster.ensure_namespace(namespace, {
                labels.OPT_IN: "true", "pod-security.kubernetes.io/enforce": "restricted"})
            cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                           "metadata": {"name": "tenant", "namespace": namespace},
                           "rules": TENANT_RULES})
            cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                           "metadata": {"name": f"tenant-{user}", "namespace": namespace},
                           "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                       "name": "tenant"},
                           "subjects": [{"kind": "User", "name": user,
                                         "apiGroup": "rbac.authorization.k8s.io"}]})
            api = cluster.plane.api_client(cluster.plane.user_kubeconfig(user))
            self._clients.append(api)
            self.tenants[user] = Tenant(api, namespace)
        wait_for(lambda: self._may_create_config_maps(), 30, "the tenants' roles to apply")
        self.code("bob", code_map("team-b")["data"])
        forged = dict(code_map("team-a")["data"], **{"train_gpt.py": FORGER})
        self.code("alice", forged)
        self.webhook: Optional[Webhook] = cluster.serve("serve-tenants", POLICY_NAME)
        self.controller = cluster.controller("controller-tenants", POLICY_NAME,
                                             "--workloads", "Job")

    def _may_create_config_maps(self) -> bool:
        for tenant in self.tenants.values():
            authorization = client.AuthorizationV1Api(tenant.core.api_client)
            review = authorization.create_self_subject_access_review({"spec": {
                "resourceAttributes": {"namespace": tenant.namespace, "verb": "create",
                                       "resource": "configmaps"}}})
            if not review.status.allowed:
                return False
        return True

    def code(self, user: str, data: Dict[str, str]) -> None:
        tenant = self.tenants[user]
        tenant.core.create_namespaced_config_map(tenant.namespace, {
            "metadata": {"name": "code"}, "data": data})

    def get(self, api_version: str, kind: str, name: str, namespace: str) -> Any:
        return self.cluster.get(api_version, kind, name, namespace)

    def gmes(self, namespace: str) -> List[Dict[str, Any]]:
        return self.cluster.list("xmem.io/v1alpha1", "GPUMemoryEstimate", namespace)

    def job(self, name: str, namespace: str) -> Dict[str, Any]:
        found = self.cluster.get("batch/v1", "Job", name, namespace)
        assert found is not None, f"job {namespace}/{name} is gone"
        return found

    def close(self) -> None:
        self.cluster.stop_process(self.controller)
        if self.webhook is not None:
            self.webhook.remove()
            self.webhook.stop()
        for api in self._clients:
            api.close()
        for namespace in TENANTS.values():
            self.cluster.delete("v1", "Namespace", namespace)
        self.cluster.delete("xmem.io/v1alpha1", "GPUAdmissionPolicy", POLICY_NAME)
