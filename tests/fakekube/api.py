"""The verbs of the stand-in API server: create, get, list, update, patch, delete, bind, log.

Each verb runs the steps the real request path runs, in the real order: decode and default,
mutating admission, Pod Security admission for pods (``podsecurity``), the strategy's
preparation (uids, Job selectors, status reset), validation (schemas and semantic rules),
validating admission, then the write with its concurrency check.
Updates and patches without a resourceVersion precondition are retried on a concurrent write,
as the registry's ``GuaranteedUpdate`` does; with one, a stale version is a 409 Conflict.
``apiserver`` maps HTTP onto these methods; tests may call them directly to seed a cluster.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Callable, Dict, List, Optional, Tuple

from tests.fakekube import kinds, merge, podsecurity, rbac, webhooks
from tests.fakekube.objects import Obj, Resource, Storage, clone, generate_name, meta, now
from tests.fakekube.rbac import ADMIN, User
from tests.fakekube.selectors import LabelSelector, field_selector
from tests.fakekube.status import error, not_found

LogSource = Callable[[str, str, str, Dict[str, str]], Optional[bytes]]

PATCH_TYPES = {
    "application/json-patch+json": "json",
    "application/merge-patch+json": "merge",
    "application/strategic-merge-patch+json": "strategic",
    "application/apply-patch+yaml": "apply",
    "application/apply-patch+cbor": "apply",
}


class Api:
    """The stand-in's resource handlers over one ``Storage``."""

    def __init__(self, schema_version: str = "1.30") -> None:
        self.schema_version = schema_version
        self.storage = Storage()
        self._by_path: Dict[Tuple[str, str, str], Resource] = {}  # (group, version, plural)
        self.log_source: Optional[LogSource] = None
        for res in kinds.CORE + rbac.RESOURCES:
            self.register(res)
        for name in ("default", "kube-system", "kube-public"):
            self.create(self.resource("", "v1", "namespaces"), None, {"metadata": {"name": name}})

    # --- kinds ------------------------------------------------------------------------------

    def register(self, res: Resource) -> None:
        self._by_path[(res.group, res.version, res.plural)] = res
        self.storage.resources[res.key] = res

    def resource(self, group: str, version: str, plural: str) -> Resource:
        res = self._by_path.get((group, version, plural))
        if res is None:
            gv = f"{group}/{version}" if group else version
            raise error(404, f"the server could not find the requested resource ({plural} {gv})")
        return res

    def resources(self) -> List[Resource]:
        return list(self._by_path.values())

    def kind(self, api_version: str, kind: str) -> Resource:
        """The resource serving an apiVersion/kind (to create objects from manifests)."""
        for res in self._by_path.values():
            if res.api_version == api_version and res.kind == kind:
                return res
        raise error(404, f"no kind {kind!r} is registered for version {api_version!r}")

    # --- helpers ----------------------------------------------------------------------------

    def _namespace_labels(self, namespace: str) -> Optional[Dict[str, str]]:
        ns = self.storage.find(self.resource("", "v1", "namespaces"), "", namespace)
        return dict((ns or {}).get("metadata", {}).get("labels") or {})

    def _require_namespace(self, res: Resource, namespace: Optional[str]) -> None:
        if res.namespaced and namespace is not None:
            if self.storage.find(self.resource("", "v1", "namespaces"), "", namespace) is None:
                raise not_found("namespaces", "", namespace)

    def _admit(self, mutating: bool, res: Resource, operation: str, obj: Optional[Obj],
               old: Optional[Obj], namespace: str, dry_run: bool,
               user: User = ADMIN) -> Tuple[Optional[Obj], List[str]]:
        plural = "mutatingwebhookconfigurations" if mutating else "validatingwebhookconfigurations"
        configs, _ = self.storage.list(self.resource("admissionregistration.k8s.io", "v1", plural), None)
        if not configs or res.group == "admissionregistration.k8s.io":
            return obj, []
        return webhooks.admit(configs, mutating, res, operation, obj, old,
                              lambda: self._namespace_labels(namespace), dry_run, user.info())

    def _check_body(self, res: Resource, body: Any) -> Obj:
        if not isinstance(body, dict):
            raise error(400, "the body of the request must be a JSON object")
        for key, want in (("apiVersion", res.api_version), ("kind", res.kind)):
            if body.get(key) not in (None, want):
                raise error(400, f"{key} {body.get(key)!r} does not match the endpoint's {want!r}")
        return body

    def _check_owners(self, res: Resource, obj: Obj) -> None:
        refs = meta(obj).get("ownerReferences") or []
        causes = []
        for index, ref in enumerate(refs):
            for key in ("apiVersion", "kind", "name", "uid"):
                if not ref.get(key):
                    causes.append({"field": f"metadata.ownerReferences[{index}].{key}",
                                   "message": "Required value"})
        if sum(1 for r in refs if r.get("controller")) > 1:
            causes.append({"field": "metadata.ownerReferences", "message": "Invalid value: only "
                           "one reference can have Controller set to true"})
        if causes:
            from tests.fakekube.status import invalid

            raise invalid(res.kind, res.group, meta(obj).get("name", ""), causes)

    # --- verbs ------------------------------------------------------------------------------

    def create(self, res: Resource, namespace: Optional[str], body: Any,
               params: Optional[Dict[str, str]] = None,
               user: User = ADMIN) -> Tuple[Obj, List[str]]:
        params = params or {}
        obj = clone(self._check_body(res, body))
        kinds.check_namespace_scope(res, namespace, obj)
        self._require_namespace(res, namespace)
        m = meta(obj)
        if not m.get("name"):
            if not m.get("generateName"):
                raise error(422, "metadata.name: Required value: name or generateName is required",
                            "Invalid")
            m["name"] = generate_name(m["generateName"], lambda n: self.storage.find(
                res, namespace or "", n) is not None)
        for server_field in ("uid", "resourceVersion", "creationTimestamp", "deletionTimestamp",
                             "generation"):
            m.pop(server_field, None)
        dry_run = params.get("dryRun") == "All"
        kinds.default(res, obj)
        warnings = kinds.unknown_field_warnings(res, obj) if params.get("fieldValidation") != "Ignore" else []
        mutated, more = self._admit(True, res, "CREATE", obj, None, namespace or "", dry_run, user)
        assert mutated is not None
        obj, warnings = mutated, warnings + more
        if res.kind == "Pod" and namespace:
            level = (self._namespace_labels(namespace) or {}).get(podsecurity.LABEL)
            found = podsecurity.violations(level, obj)
            if found:
                raise error(403, f'pods "{meta(obj).get("name", "")}" is forbidden: violates '
                            f'PodSecurity "{level}:latest": ' + ", ".join(dict.fromkeys(found)))
        import uuid

        meta(obj)["uid"] = str(uuid.uuid4())
        meta(obj)["creationTimestamp"] = now()
        kinds.prepare_create(res, obj)
        kinds.validate(res, obj, self.schema_version, params.get("fieldValidation") == "Strict")
        self._check_owners(res, obj)
        _, more = self._admit(False, res, "CREATE", obj, None, namespace or "", dry_run, user)
        warnings += more
        if dry_run:
            return obj, warnings
        stored = self.storage.insert(res, obj)
        if res.kind == "CustomResourceDefinition":
            for served in kinds.cluster_resource_for_crd(stored):
                self.register(served)
        return stored, warnings

    def get(self, res: Resource, namespace: Optional[str], name: str) -> Obj:
        return self.storage.get(res, namespace or "", name)

    def list(self, res: Resource, namespace: Optional[str],
             params: Optional[Dict[str, str]] = None) -> Obj:
        params = params or {}
        labels = LabelSelector.parse(params.get("labelSelector"))
        fields = field_selector(params.get("fieldSelector"), res.kind)
        items, rv = self.storage.list(res, namespace)
        items = [o for o in items if labels.matches(o["metadata"].get("labels")) and fields(o)]
        body: Dict[str, Any] = {"kind": f"{res.kind}List", "apiVersion": res.api_version,
                                "metadata": {"resourceVersion": str(rv)}}
        start = 0
        token = params.get("continue")
        if token:
            try:
                state = json.loads(base64.b64decode(token))
                start = int(state["start"])
            except (ValueError, KeyError, TypeError):
                raise error(400, f"invalid continue token {token!r}") from None
        limit = int(params.get("limit") or 0)
        if limit > 0:
            page = items[start:start + limit]
            if start + limit < len(items):
                body["metadata"]["continue"] = base64.b64encode(
                    json.dumps({"start": start + limit, "rv": rv}).encode()).decode()
                body["metadata"]["remainingItemCount"] = len(items) - start - limit
            items = page
        body["items"] = items
        return body

    def update(self, res: Resource, namespace: Optional[str], name: str, body: Any,
               params: Optional[Dict[str, str]] = None,
               subresource: str = "", user: User = ADMIN) -> Tuple[Obj, List[str]]:
        body = self._check_body(res, body)
        body_meta = body.get("metadata") or {}
        if body_meta.get("name") not in (None, name):
            raise error(400, f"the name of the object ({body_meta.get('name')}) does not match "
                        f"the name on the URL ({name})")
        precondition = body_meta.get("resourceVersion") or None
        return self._write(res, namespace, name, lambda current: clone(body), precondition,
                           params or {}, subresource, user)

    def patch(self, res: Resource, namespace: Optional[str], name: str, raw: bytes,
              content_type: str, params: Optional[Dict[str, str]] = None,
              subresource: str = "", user: User = ADMIN) -> Tuple[Obj, List[str]]:
        kind = PATCH_TYPES.get(content_type.split(";")[0].strip())
        if kind is None or kind == "apply":
            raise error(415, f"the body of the request was in an unknown format - accepted media "
                        f"types include: {', '.join(t for t, k in PATCH_TYPES.items() if k != 'apply')}"
                        f" (server-side apply is not modelled by this stand-in)")
        if kind == "strategic" and not res.builtin:
            raise error(415, "strategic merge patch is not supported for custom resources; use "
                        "application/merge-patch+json or application/json-patch+json")
        try:
            patch = json.loads(raw or b"null")
        except ValueError as exc:
            raise error(400, f"the patch is not JSON: {exc}") from None
        precondition = None
        if isinstance(patch, dict):
            precondition = (patch.get("metadata") or {}).get("resourceVersion") or None

        def apply(current: Obj) -> Obj:
            if kind == "json":
                out = merge.json_patch(current, patch)
            elif kind == "merge":
                out = merge.json_merge(current, patch)
            else:
                out = merge.strategic_merge(current, patch)
            if not isinstance(out, dict):
                raise error(422, "the patch must leave an object")
            return out

        return self._write(res, namespace, name, apply, precondition, params or {}, subresource,
                           user)

    def _write(self, res: Resource, namespace: Optional[str], name: str,
               change: Callable[[Obj], Obj], precondition: Optional[str],
               params: Dict[str, str], subresource: str,
               user: User = ADMIN) -> Tuple[Obj, List[str]]:
        if subresource not in ("", "status") or (subresource == "status" and not res.status):
            raise error(404, f"the server could not find the requested resource ({subresource})")
        dry_run = params.get("dryRun") == "All"
        for _attempt in range(20):  # GuaranteedUpdate: retry on a concurrent write
            current = self.storage.get(res, namespace or "", name)
            new = change(clone(current))
            new_meta = meta(new)
            given = new_meta.get("resourceVersion")
            if precondition is None and given and given != current["metadata"]["resourceVersion"]:
                precondition = given  # a JSON patch that sets it is a precondition too
            kinds.check_namespace_scope(res, namespace, new)
            if new_meta.get("name") != name:
                raise error(400, "the name of the object does not match the name on the URL")
            if res.status and subresource == "status":
                status = new.get("status")
                new = clone(current)
                if status is None:
                    new.pop("status", None)
                else:
                    new["status"] = status
            elif res.status:
                if "status" in current:
                    new["status"] = current["status"]
                else:
                    new.pop("status", None)
            new["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            kinds.default(res, new)
            warnings: List[str] = []
            if not subresource:
                mutated, warnings = self._admit(True, res, "UPDATE", new, current,
                                                namespace or "", dry_run, user)
                assert mutated is not None
                new = mutated
            kinds.validate(res, new, self.schema_version, params.get("fieldValidation") == "Strict")
            kinds.validate_update(res, current, new)
            self._check_owners(res, new)
            if not subresource:
                _, more = self._admit(False, res, "UPDATE", new, current, namespace or "", dry_run,
                                      user)
                warnings += more
            if dry_run:
                return new, warnings
            if precondition and precondition != current["metadata"]["resourceVersion"]:
                from tests.fakekube.status import STALE, conflict

                raise conflict(res.plural, res.group, name, STALE)
            try:
                stored = self.storage.update(res, new, current["metadata"]["resourceVersion"])
            except Exception as exc:
                if getattr(exc, "code", None) == 409 and precondition is None:
                    continue
                raise
            return stored, warnings
        raise error(409, f"too many concurrent writes to {res.plural} {name!r}", "Conflict")

    def delete(self, res: Resource, namespace: Optional[str], name: str, body: Any,
               params: Optional[Dict[str, str]] = None, user: User = ADMIN) -> Obj:
        params = params or {}
        options = body if isinstance(body, dict) else {}
        propagation = options.get("propagationPolicy") or params.get("propagationPolicy")
        if propagation is None and "orphanDependents" in options:
            propagation = "Orphan" if options["orphanDependents"] else "Background"
        grace = options.get("gracePeriodSeconds", params.get("gracePeriodSeconds"))
        if params.get("dryRun") == "All" or options.get("dryRun") == ["All"]:
            return self.get(res, namespace, name)
        current = self.storage.get(res, namespace or "", name)
        self._admit(False, res, "DELETE", None, current, namespace or "", False, user)
        return self.storage.delete(res, namespace or "", name, propagation,
                                   options.get("preconditions"),
                                   None if grace is None else int(grace))

    def delete_collection(self, res: Resource, namespace: Optional[str], body: Any,
                          params: Optional[Dict[str, str]] = None, user: User = ADMIN) -> Obj:
        listing = self.list(res, namespace, params)
        for item in listing["items"]:
            try:
                self.delete(res, item["metadata"].get("namespace"), item["metadata"]["name"],
                            body, params, user)
            except Exception as exc:  # already gone: deletecollection does not fail on that
                if getattr(exc, "code", None) != 404:
                    raise
        return listing

    # --- pod subresources -------------------------------------------------------------------

    def bind(self, namespace: str, name: str, body: Any) -> Obj:
        """``pods/binding``: what the scheduler does to put a pod on a node."""
        pods = self.resource("", "v1", "pods")
        target = (body or {}).get("target") or {}
        if target.get("kind", "Node") != "Node" or not target.get("name"):
            raise error(400, "binding target must be a Node with a name")

        def assign(current: Obj) -> Obj:
            node = current["spec"].get("nodeName")
            if node:
                raise error(409, f'pod {name} is already assigned to node "{node}"', "Conflict")
            current["spec"]["nodeName"] = target["name"]
            return current

        with self.storage.lock:
            current = self.storage.get(pods, namespace, name)
            if "deletionTimestamp" in current["metadata"]:
                raise error(409, f"pod {name} is being deleted, cannot be assigned to a host",
                            "Conflict")
            self.storage.update(pods, assign(current), current["metadata"]["resourceVersion"])
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "code": 201}

    def log(self, namespace: str, name: str, params: Dict[str, str]) -> bytes:
        """``pods/log``: served by the kubelet that runs the pod, as the API server proxies it."""
        pod = self.get(self.resource("", "v1", "pods"), namespace, name)
        containers = [c["name"] for c in pod["spec"].get("containers") or []]
        init = [c["name"] for c in pod["spec"].get("initContainers") or []]
        container = params.get("container")
        if not container:
            if len(containers) != 1:
                raise error(400, f"a container name must be specified for pod {name}, choose one "
                            f"of: [{' '.join(containers)}]")
            container = containers[0]
        if container not in containers + init:
            raise error(400, f"container {container} is not valid for pod {name}")
        data = self.log_source(namespace, name, container, params) if self.log_source else None
        if data is None:
            reason = "ContainerCreating"
            for status in (pod.get("status") or {}).get("containerStatuses") or []:
                if status.get("name") == container:
                    reason = ((status.get("state") or {}).get("waiting") or {}).get("reason", reason)
            raise error(400, f'container "{container}" in pod "{name}" is waiting to start: {reason}')
        return data
