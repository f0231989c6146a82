"""The real API server behind the small interface these tests use.

``tests/kube`` states what a client (the product's ``kube`` package, the official client) sees of
an API server (concurrency, patches, watches, deletion, admission). It runs against a real
control plane of its own with only the garbage-collector, namespace and service-account
controllers and no scheduler, so a Job stays a Job.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import yaml

from localkube.controlplane import ControlPlane, wait_for

CONTROLLERS = ("garbage-collector-controller,namespace-controller,serviceaccount-controller,"
               "serviceaccount-token-controller")
ROOT = Path(__file__).resolve().parents[2]


class ApiStatusError(Exception):
    """A refusal of ``RealServer.create``: the Status's code, reason and message."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message


class RealServer:
    """A real control plane seen through the tests' small interface."""

    def __init__(self, plane: ControlPlane) -> None:
        self.plane = plane
        self.url = plane.server
        self.ca_pem = plane._authority().pem
        self._client = plane.api_client()

    def api_client(self) -> Any:
        return self.plane.api_client()

    def wait_for(self, predicate: Callable[[], Any], timeout: float = 30.0,
                 what: str = "condition") -> Any:
        return wait_for(predicate, timeout, what, interval=0.05)

    def create(self, obj: Dict[str, Any], namespace: Optional[str] = None) -> Dict[str, Any]:
        """POST the object as any HTTP client could (no client-side checks); a refusal raises
        ``ApiStatusError`` with the server's code, reason and message."""
        from kubernetes import dynamic

        resource = dynamic.DynamicClient(self._client).resources.get(
            api_version=obj["apiVersion"], kind=obj["kind"])
        ns = (namespace or obj["metadata"].get("namespace") or "default") \
            if resource.namespaced else None
        code, data = self.plane.request("POST", resource.path(namespace=ns), obj)
        if code >= 400:
            status = json.loads(data)
            raise ApiStatusError(code, status.get("reason", ""), status.get("message", ""))
        created: Dict[str, Any] = json.loads(data)
        if obj["kind"] == "CustomResourceDefinition":
            self._established(obj["metadata"]["name"])
        return created

    def apply_file(self, path: str) -> List[Dict[str, Any]]:
        docs = yaml.safe_load_all((ROOT / path).read_text() if not Path(path).is_absolute()
                                  else Path(path).read_text())
        return [self.create(doc) for doc in docs if doc]

    def _established(self, name: str) -> None:
        from kubernetes import client

        api = client.ApiextensionsV1Api(self._client)
        wait_for(lambda: any(c.type == "Established" and c.status == "True" for c in
                             api.read_custom_resource_definition(name).status.conditions or []),
                 30, f"CRD {name} to be Established")
        # Established comes a moment before the first object can be created: wait for a list.
        group, plural = name.split(".", 1)[1], name.split(".", 1)[0]
        version = api.read_custom_resource_definition(name).spec.versions[0].name
        wait_for(lambda: self.plane.request("GET", f"/apis/{group}/{version}/{plural}")[0] == 200,
                 30, f"{plural} to be served")

    def reset(self) -> None:
        """Leave the cluster fresh: an empty ``default`` namespace, no
        webhook configurations, no custom resource definitions, no extra namespace."""
        from kubernetes import client

        core = client.CoreV1Api(self._client)
        batch = client.BatchV1Api(self._client)
        registration = client.AdmissionregistrationV1Api(self._client)
        extensions = client.ApiextensionsV1Api(self._client)
        for item in registration.list_mutating_webhook_configuration().items:
            registration.delete_mutating_webhook_configuration(item.metadata.name)
        for item in registration.list_validating_webhook_configuration().items:
            registration.delete_validating_webhook_configuration(item.metadata.name)
        for item in extensions.list_custom_resource_definition().items:
            extensions.delete_custom_resource_definition(item.metadata.name)
        for job in batch.list_namespaced_job("default").items:
            if job.metadata.finalizers:
                batch.patch_namespaced_job(job.metadata.name, "default",
                                           {"metadata": {"finalizers": None}})
        batch.delete_collection_namespaced_job("default", propagation_policy="Background")
        core.delete_collection_namespaced_pod("default", grace_period_seconds=0)
        for namespace in core.list_namespace().items:
            if namespace.metadata.name not in ("default", "kube-system", "kube-public",
                                               "kube-node-lease"):
                core.delete_namespace(namespace.metadata.name)
        wait_for(lambda: not batch.list_namespaced_job("default").items
                 and not core.list_namespaced_pod("default").items
                 and not extensions.list_custom_resource_definition().items
                 and len(core.list_namespace().items) == 4, 60, "a clean cluster")

    def compact(self) -> None:
        """Compact etcd's history up to its current revision (through etcd's own JSON gateway,
        as ``etcdctl compact`` does over gRPC), so older resourceVersions are gone."""
        import urllib.request

        def post(path: str, body: Dict[str, Any]) -> Dict[str, Any]:
            request = urllib.request.Request(
                f"http://127.0.0.1:{self.plane.etcd_port}{path}", json.dumps(body).encode(),
                {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as answer:  # noqa: S310 - loopback
                result: Dict[str, Any] = json.loads(answer.read())
                return result

        revision = int(post("/v3/kv/range", {"key": "Lw=="})["header"]["revision"])  # "/"
        post("/v3/kv/compaction", {"revision": revision, "physical": True})

    def close(self) -> None:
        self._client.close()
