"""Admission webhooks, called by the stand-in API server as kube-apiserver calls them.

``MutatingWebhookConfiguration`` and ``ValidatingWebhookConfiguration`` objects stored in the
stand-in are honoured for CREATE, UPDATE and DELETE of the main resource: rules (operations,
API groups, versions, resources, ``*``), ``namespaceSelector`` (on the namespace's labels),
``objectSelector`` (on the new or old object's labels), ``failurePolicy``, ``timeoutSeconds``,
``sideEffects`` on dry runs. The request is a real ``admission.k8s.io/v1`` AdmissionReview
POSTed over HTTPS to ``clientConfig.url``, verified with ``clientConfig.caBundle``; a JSONPatch
in the response is applied, warnings travel back to the client as ``Warning`` headers, and a
denial becomes the error a real server returns (``admission webhook "x" denied the request:
...``).

The review's ``userInfo`` is the requester's (``rbac.User``). Not modelled:
``clientConfig.service`` (no cluster DNS; use ``url``), ``matchConditions``, and reinvocation
(``reinvocationPolicy: IfNeeded`` is treated as ``Never``).
"""

from __future__ import annotations

import base64
import http.client
import json
import ssl
import urllib.parse
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

from tests.fakekube.merge import json_patch
from tests.fakekube.objects import Obj, Resource
from tests.fakekube.selectors import LabelSelector
from tests.fakekube.status import error


def _rule_matches(rule: Dict[str, Any], res: Resource, operation: str) -> bool:
    def hit(values: Any, value: str) -> bool:
        return isinstance(values, list) and ("*" in values or value in values)

    scope = rule.get("scope", "*")
    if scope == "Namespaced" and not res.namespaced or scope == "Cluster" and res.namespaced:
        return False
    return (hit(rule.get("operations"), operation) and hit(rule.get("apiGroups"), res.group)
            and hit(rule.get("apiVersions"), res.version)
            and hit(rule.get("resources"), res.plural))


def _selected(webhook: Dict[str, Any], obj: Optional[Obj], old: Optional[Obj],
              namespace_labels: Optional[Dict[str, str]]) -> bool:
    objects = [o for o in (obj, old) if o]
    selector = LabelSelector.from_object(webhook.get("objectSelector"))
    if not any(selector.matches((o.get("metadata") or {}).get("labels")) for o in objects):
        return False
    if namespace_labels is not None:
        ns_selector = LabelSelector.from_object(webhook.get("namespaceSelector"))
        if not ns_selector.matches(namespace_labels):
            return False
    return True


def _post(url: str, ca_bundle: Optional[str], body: bytes, timeout: float) -> Dict[str, Any]:
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "https":
        raise ValueError(f"webhook URL must be https, got {url!r}")
    context = ssl.create_default_context(
        cadata=base64.b64decode(ca_bundle).decode() if ca_bundle else None)
    connection = http.client.HTTPSConnection(parsed.hostname or "", parsed.port or 443,
                                             timeout=timeout, context=context)
    try:
        path = parsed.path + (f"?{parsed.query}" if parsed.query else "")
        connection.request("POST", path or "/", body, {"Content-Type": "application/json",
                                                        "Accept": "application/json"})
        response = connection.getresponse()
        data = response.read()
        if response.status != 200:
            raise ValueError(f"webhook answered HTTP {response.status}: {data[:200]!r}")
        return json.loads(data)
    finally:
        connection.close()


def _review(res: Resource, operation: str, obj: Optional[Obj], old: Optional[Obj],
            namespace: str, name: str, dry_run: bool, user: Dict[str, Any]) -> Dict[str, Any]:
    kind = {"group": res.group, "version": res.version, "kind": res.kind}
    resource = {"group": res.group, "version": res.version, "resource": res.plural}
    options_kind = {"CREATE": "CreateOptions", "UPDATE": "UpdateOptions",
                    "DELETE": "DeleteOptions"}[operation]
    return {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": str(uuid.uuid4()), "kind": kind, "resource": resource,
            "requestKind": kind, "requestResource": resource, "name": name,
            "namespace": namespace, "operation": operation, "userInfo": user,
            "object": obj, "oldObject": old, "dryRun": dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": options_kind},
        },
    }


def admit(
    configurations: List[Obj],
    mutating: bool,
    res: Resource,
    operation: str,
    obj: Optional[Obj],
    old: Optional[Obj],
    namespace_labels: Callable[[], Optional[Dict[str, str]]],
    dry_run: bool,
    user: Dict[str, Any],
) -> Tuple[Optional[Obj], List[str]]:
    """Run every matching webhook of the configurations (in name order); returns (object, warnings)."""
    warnings: List[str] = []
    for configuration in sorted(configurations, key=lambda c: c["metadata"]["name"]):
        for webhook in configuration.get("webhooks") or []:
            if not any(_rule_matches(r, res, operation) for r in webhook.get("rules") or []):
                continue
            labels = namespace_labels() if res.namespaced else None
            if not _selected(webhook, obj, old, labels):
                continue
            name = webhook.get("name", "")
            if dry_run and webhook.get("sideEffects") not in ("None", "NoneOnDryRun"):
                raise error(400, f'admission webhook "{name}" does not support dry run')
            meta = (obj or old or {}).get("metadata") or {}
            review = _review(res, operation, obj, old, meta.get("namespace", ""),
                             meta.get("name", ""), dry_run, user)
            config = webhook.get("clientConfig") or {}
            try:
                answer = _post(config.get("url", ""), config.get("caBundle"),
                               json.dumps(review).encode(), float(webhook.get("timeoutSeconds", 10)))
                response = answer["response"]
                if response.get("uid") != review["request"]["uid"]:
                    raise ValueError("response uid does not match the request uid")
            except (OSError, ValueError, KeyError, TypeError) as exc:
                if webhook.get("failurePolicy", "Fail") == "Ignore":
                    continue
                raise error(500, f'Internal error occurred: failed calling webhook "{name}": {exc}') from None
            warnings.extend(response.get("warnings") or [])
            if not response.get("allowed"):
                status = response.get("status") or {}
                code = int(status.get("code") or 403)
                message = status.get("message") or ""
                raise error(code, f'admission webhook "{name}" denied the request: {message}',
                            status.get("reason") or None)
            if mutating and response.get("patch"):
                if response.get("patchType") != "JSONPatch":
                    raise error(500, f'webhook "{name}" sent patchType {response.get("patchType")!r}')
                operations = json.loads(base64.b64decode(response["patch"]))
                obj = json_patch(obj, operations)
    return obj, warnings
