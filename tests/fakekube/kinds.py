"""The kinds the stand-in API server serves, with the defaulting and validation a real one does.

Built-in kinds are checked against the official OpenAPI schemas (``kubernetes-validate``, strict:
an unknown field is an error here, where a real server would drop it with a warning, so a
controller that writes a misspelt field fails its tests instead of losing data in production)
plus the semantic rules the controller and webhook could trip over: name syntax, label syntax,
container names, Job's restart policy, what may change in a Pod's spec (almost nothing) and in a
Job's pod template (only labels, annotations, node selector, affinity, tolerations and
scheduling gates, and only while it is suspended and has never started: Kubernetes 1.27+).

Custom resources are served once their ``CustomResourceDefinition`` exists: the CRD's
``openAPIV3Schema`` defaults missing fields (``default``), prunes unknown ones (unless
``x-kubernetes-preserve-unknown-fields``; with ``fieldValidation=Strict`` they are an error
instead) and validates what is left, with ``nullable`` and ``x-kubernetes-int-or-string``.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from tests.fakekube.objects import Obj, Resource
from tests.fakekube.status import error, invalid

CORE = [
    Resource("", "v1", "Namespace", "namespaces", False, status=True, short_names=("ns",)),
    Resource("", "v1", "Pod", "pods", True, status=True, short_names=("po",),
             subresources=("log", "binding")),
    Resource("", "v1", "Event", "events", True, short_names=("ev",)),
    Resource("", "v1", "ConfigMap", "configmaps", True, short_names=("cm",)),
    Resource("", "v1", "Secret", "secrets", True),
    Resource("", "v1", "ServiceAccount", "serviceaccounts", True, short_names=("sa",)),
    # batch/v1 Jobs orphan their pods unless told otherwise (the Job strategy's
    # DefaultGarbageCollectionPolicy for batch/v1); kubectl asks for Background explicitly.
    Resource("batch", "v1", "Job", "jobs", True, status=True, default_propagation="Orphan"),
    Resource("coordination.k8s.io", "v1", "Lease", "leases", True),
    Resource("apiextensions.k8s.io", "v1", "CustomResourceDefinition",
             "customresourcedefinitions", False, status=True, short_names=("crd", "crds")),
    Resource("admissionregistration.k8s.io", "v1", "MutatingWebhookConfiguration",
             "mutatingwebhookconfigurations", False),
    Resource("admissionregistration.k8s.io", "v1", "ValidatingWebhookConfiguration",
             "validatingwebhookconfigurations", False),
]

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUALIFIED = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")

JOB_TEMPLATE_MUTABLE_SPEC = ("nodeSelector", "affinity", "tolerations", "schedulingGates")
JOB_SPEC_MUTABLE = ("suspend", "parallelism", "activeDeadlineSeconds", "ttlSecondsAfterFinished",
                    "completions", "backoffLimit", "backoffLimitPerIndex", "maxFailedIndexes",
                    "managedBy")


def cluster_resource_for_crd(crd: Obj) -> List[Resource]:
    """The resources a CustomResourceDefinition makes the server serve (one per served version)."""
    spec = crd["spec"]
    names = spec["names"]
    out = []
    for version in spec["versions"]:
        if not version.get("served", True):
            continue
        schema = (version.get("schema") or {}).get("openAPIV3Schema") or {"type": "object",
                                                                             "x-kubernetes-preserve-unknown-fields": True}
        out.append(Resource(
            spec["group"], version["name"], names["kind"], names["plural"],
            spec.get("scope", "Namespaced") == "Namespaced",
            status="status" in (version.get("subresources") or {}),
            short_names=tuple(names.get("shortNames") or ()), schema=schema,
        ))
    return out


# --- defaulting -----------------------------------------------------------------------------


def _default_pod_spec(spec: Dict[str, Any]) -> None:
    spec.setdefault("restartPolicy", "Always")
    spec.setdefault("dnsPolicy", "ClusterFirst")
    spec.setdefault("schedulerName", "default-scheduler")
    spec.setdefault("terminationGracePeriodSeconds", 30)
    spec.setdefault("securityContext", {})
    for group in ("initContainers", "containers"):
        for container in spec.get(group) or []:
            if not isinstance(container, dict):
                continue
            container.setdefault("terminationMessagePath", "/dev/termination-log")
            container.setdefault("terminationMessagePolicy", "File")
            image = str(container.get("image", ""))
            tag = image.rsplit("/", 1)[-1]
            latest = ":" not in tag or tag.endswith(":latest")
            container.setdefault("imagePullPolicy", "Always" if latest and "@" not in image
                                 else "IfNotPresent")
            container.setdefault("resources", {})
            limits = container["resources"].get("limits") or {}
            requests = container["resources"].setdefault("requests", {}) if limits else \
                container["resources"].get("requests")
            if limits and requests is not None:
                for name, value in limits.items():
                    requests.setdefault(name, value)  # requests default to limits


def default(res: Resource, obj: Obj) -> None:
    """Scheme defaulting: what the server fills in before admission sees the object."""
    obj.setdefault("apiVersion", res.api_version)
    obj.setdefault("kind", res.kind)
    obj.setdefault("metadata", {})
    if res.kind == "Pod":
        spec = obj.setdefault("spec", {})
        _default_pod_spec(spec)
        spec.setdefault("serviceAccountName", "default")
        spec.setdefault("enableServiceLinks", True)
        spec.setdefault("priority", 0)
    elif res.kind == "Job":
        spec = obj.setdefault("spec", {})
        spec.setdefault("parallelism", 1)
        spec.setdefault("completions", 1)
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("completionMode", "NonIndexed")
        spec.setdefault("suspend", False)
        spec.setdefault("podReplacementPolicy", "TerminatingOrFailed")
        template = spec.setdefault("template", {})
        _default_pod_spec(template.setdefault("spec", {}))
    elif res.kind == "Namespace":
        obj.setdefault("spec", {}).setdefault("finalizers", ["kubernetes"])
        obj.setdefault("status", {}).setdefault("phase", "Active")
        obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = \
            obj["metadata"].get("name", "")
    elif res.kind == "Secret":
        obj.setdefault("type", "Opaque")
    elif res.schema is not None:
        apply_schema_defaults(res.schema, obj)


def prepare_create(res: Resource, obj: Obj) -> None:
    """What the strategy does after admission on create: status reset, Job selector and labels."""
    if res.status and res.kind != "Namespace":
        obj.pop("status", None)  # status is written through its subresource only
    if res.kind == "Pod":
        obj["status"] = {"phase": "Pending", "qosClass": _qos(obj["spec"])}
    if res.kind == "Job":
        uid = obj["metadata"]["uid"]
        name = obj["metadata"]["name"]
        spec = obj["spec"]
        if not spec.get("manualSelector"):
            spec["selector"] = {"matchLabels": {"batch.kubernetes.io/controller-uid": uid}}
            labels = spec["template"].setdefault("metadata", {}).setdefault("labels", {})
            labels.update({"batch.kubernetes.io/controller-uid": uid, "controller-uid": uid,
                           "batch.kubernetes.io/job-name": name, "job-name": name})
        obj["status"] = {}
    if res.kind == "CustomResourceDefinition":
        names = obj["spec"]["names"]
        obj["status"] = {
            "acceptedNames": names, "storedVersions": [
                v["name"] for v in obj["spec"]["versions"] if v.get("storage")],
            "conditions": [{"type": t, "status": "True", "reason": r, "message": m,
                            "lastTransitionTime": obj["metadata"]["creationTimestamp"]}
                           for t, r, m in (("NamesAccepted", "NoConflicts", "no conflicts found"),
                                           ("Established", "InitialNamesAccepted",
                                            "the initial names have been accepted"))],
        }


def _qos(spec: Dict[str, Any]) -> str:
    containers = spec.get("containers") or []
    limits = [(c.get("resources") or {}).get("limits") or {} for c in containers]
    requests = [(c.get("resources") or {}).get("requests") or {} for c in containers]
    if not any(limits) and not any(requests):
        return "BestEffort"
    if all(lim.get("cpu") and lim.get("memory") and req.get("cpu", lim["cpu"]) == lim["cpu"]
           and req.get("memory", lim["memory"]) == lim["memory"]
           for lim, req in zip(limits, requests)):
        return "Guaranteed"
    return "Burstable"


# --- validation -----------------------------------------------------------------------------


def _meta_causes(res: Resource, obj: Obj) -> List[Dict[str, str]]:
    m = obj.get("metadata") or {}
    causes = []
    name = m.get("name", "")
    pattern = _DNS_LABEL if res.kind in ("Namespace",) else _DNS_SUBDOMAIN
    if not name or len(name) > 253 or not pattern.match(name):
        causes.append({"field": "metadata.name", "message": f"Invalid value: {name!r}: a "
                       "lowercase RFC 1123 subdomain must consist of lower case alphanumeric "
                       "characters, '-' or '.'"})
    for key, value in (m.get("labels") or {}).items():
        prefix, _, short = key.rpartition("/")
        if not short or len(short) > 63 or not _QUALIFIED.match(short) or (
                prefix and not _DNS_SUBDOMAIN.match(prefix)):
            causes.append({"field": "metadata.labels", "message": f"Invalid value: {key!r}"})
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            causes.append({"field": "metadata.labels", "message": f"Invalid value: {value!r}: "
                           "a valid label must be an empty string or consist of alphanumeric "
                           "characters, '-', '_' or '.', at most 63 characters"})
    size = sum(len(k) + len(str(v)) for k, v in (m.get("annotations") or {}).items())
    if size > 256 * 1024:
        causes.append({"field": "metadata.annotations", "message": "Too long: must have at most "
                       "262144 bytes"})
    return causes


def _pod_spec_causes(spec: Dict[str, Any], where: str) -> List[Dict[str, str]]:
    causes = []
    containers = spec.get("containers") or []
    if not containers:
        causes.append({"field": f"{where}.containers", "message": "Required value"})
    volumes = {v.get("name") for v in spec.get("volumes") or []}
    seen = set()
    for group in ("initContainers", "containers"):
        for index, c in enumerate(spec.get(group) or []):
            at = f"{where}.{group}[{index}]"
            name = c.get("name", "")
            if not _DNS_LABEL.match(name) or len(name) > 63:
                causes.append({"field": f"{at}.name", "message": f"Invalid value: {name!r}"})
            if name in seen:
                causes.append({"field": f"{at}.name", "message": f"Duplicate value: {name!r}"})
            seen.add(name)
            if not c.get("image"):
                causes.append({"field": f"{at}.image", "message": "Required value"})
            for e_index, env in enumerate(c.get("env") or []):
                if not _ENV_NAME.match(env.get("name", "")):
                    causes.append({"field": f"{at}.env[{e_index}].name",
                                   "message": f"Invalid value: {env.get('name')!r}"})
            for m_index, mount in enumerate(c.get("volumeMounts") or []):
                if mount.get("name") not in volumes:
                    causes.append({"field": f"{at}.volumeMounts[{m_index}].name",
                                   "message": f"Not found: {mount.get('name')!r}"})
    if spec.get("restartPolicy") not in ("Always", "OnFailure", "Never"):
        causes.append({"field": f"{where}.restartPolicy", "message": "Unsupported value"})
    deadline = spec.get("activeDeadlineSeconds")
    if deadline is not None and deadline <= 0:
        causes.append({"field": f"{where}.activeDeadlineSeconds",
                       "message": "Invalid value: must be greater than 0"})
    return causes


def _schema_causes(obj: Obj, version: str) -> List[Dict[str, str]]:
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

    try:
        kubernetes_validate.validate(obj, version, strict=True)
    except ValidationError as exc:
        path = ".".join(str(p) for p in exc.path) or "<root>"
        return [{"field": path, "message": exc.message, "reason": "FieldValueInvalid"}]
    except SchemaNotFoundError:
        return []
    return []


def validate(res: Resource, obj: Obj, schema_version: str, strict_fields: bool = False) -> None:
    """Reject an object a real server would reject (422 Invalid with its causes)."""
    causes = _meta_causes(res, obj)
    if res.builtin:
        causes += _schema_causes(obj, schema_version)
    else:
        causes += validate_custom(res, obj, strict_fields)
    if res.kind == "Pod":
        causes += _pod_spec_causes(obj.get("spec") or {}, "spec")
    elif res.kind == "Job":
        template = (obj.get("spec") or {}).get("template") or {}
        causes += _pod_spec_causes(template.get("spec") or {}, "spec.template.spec")
        policy = (template.get("spec") or {}).get("restartPolicy")
        if policy not in ("Never", "OnFailure"):
            causes.append({"field": "spec.template.spec.restartPolicy",
                           "message": f'Unsupported value: "{policy}": supported values: '
                           '"OnFailure", "Never"'})
    elif res.kind == "Event":
        if not obj.get("involvedObject"):
            causes.append({"field": "involvedObject", "message": "Required value"})
        if obj.get("type") not in (None, "", "Normal", "Warning"):
            causes.append({"field": "type", "message": "Unsupported value"})
    if causes:
        raise invalid(res.kind, res.group, (obj.get("metadata") or {}).get("name", ""), causes)


def validate_update(res: Resource, old: Obj, new: Obj) -> None:
    """The immutability rules of updates (``ValidateUpdate`` of each strategy)."""
    name = new["metadata"]["name"]
    if res.kind == "Pod":
        a, b = _strip_pod_mutable(old.get("spec") or {}), _strip_pod_mutable(new.get("spec") or {})
        if a != b:
            raise invalid("Pod", "", name, [{"field": "spec", "reason": "FieldValueForbidden",
                                             "message": "Forbidden: pod updates may not change "
                                             "fields other than `spec.containers[*].image`, "
                                             "`spec.initContainers[*].image`, "
                                             "`spec.activeDeadlineSeconds`, `spec.tolerations` "
                                             "(only additions to existing tolerations)"}])
    elif res.kind == "Job":
        _validate_job_update(old, new)


def _strip_pod_mutable(spec: Dict[str, Any]) -> Dict[str, Any]:
    out = {k: v for k, v in spec.items()
           if k not in ("activeDeadlineSeconds", "tolerations", "schedulingGates", "nodeName")}
    for group in ("containers", "initContainers"):
        if group in out:
            out[group] = [{k: v for k, v in c.items() if k != "image"} for c in out[group]]
    return out


def _validate_job_update(old: Obj, new: Obj) -> None:
    name = new["metadata"]["name"]
    old_spec, new_spec = old.get("spec") or {}, new.get("spec") or {}
    causes = []
    for key in set(old_spec) | set(new_spec):
        if key in JOB_SPEC_MUTABLE or key == "template":
            continue
        if old_spec.get(key) != new_spec.get(key):
            causes.append({"field": f"spec.{key}", "message": "field is immutable"})
    old_t, new_t = old_spec.get("template") or {}, new_spec.get("template") or {}
    if old_t != new_t:
        started = bool((old.get("status") or {}).get("startTime"))
        suspended = old_spec.get("suspend") is True
        strip = _strip_template if suspended and not started else (lambda t: t)
        if strip(old_t) != strip(new_t):
            causes.append({"field": "spec.template", "message": "Invalid value: field is "
                           "immutable" + ("" if suspended and not started else
                                          " (only a suspended Job that never started may change "
                                          "its template's scheduling directives)")})
    if causes:
        raise invalid("Job", "batch", name, causes)


def _strip_template(template: Dict[str, Any]) -> Tuple[Any, Any]:
    meta = {k: v for k, v in (template.get("metadata") or {}).items()
            if k not in ("labels", "annotations")}
    spec = {k: v for k, v in (template.get("spec") or {}).items()
            if k not in JOB_TEMPLATE_MUTABLE_SPEC}
    return meta, spec


# --- custom resources: structural schema ------------------------------------------------------


def apply_schema_defaults(schema: Dict[str, Any], value: Any) -> None:
    """Fill ``default`` values of an openAPIV3Schema into an object, depth first."""
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key == "metadata":
                continue
            if key not in value and "default" in sub:
                import copy

                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                apply_schema_defaults(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                if key not in (schema.get("properties") or {}):
                    apply_schema_defaults(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_schema_defaults(schema["items"], item)


def prune(schema: Dict[str, Any], value: Any, path: str, unknown: List[str]) -> Any:
    """Drop fields the schema does not know; their paths go to ``unknown``."""
    if schema.get("x-kubernetes-preserve-unknown-fields") and not schema.get("properties"):
        return value
    if isinstance(value, dict) and (schema.get("type") == "object" or "properties" in schema):
        properties = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        out = {}
        for key, sub in value.items():
            at = f"{path}.{key}" if path else key
            if key in properties:
                out[key] = sub if key == "metadata" and not path else prune(properties[key], sub, at, unknown)
            elif isinstance(extra, dict):
                out[key] = prune(extra, sub, at, unknown)
            elif extra is True or schema.get("x-kubernetes-preserve-unknown-fields"):
                out[key] = sub
            elif not path and key in ("apiVersion", "kind"):
                out[key] = sub
            else:
                unknown.append(at)
        return out
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [prune(schema["items"], item, f"{path}[{i}]", unknown) for i, item in enumerate(value)]
    return value


def to_json_schema(schema: Any) -> Any:
    """OpenAPI v3 (Kubernetes flavour) to JSON Schema: nullable, int-or-string, no formats."""
    if isinstance(schema, list):
        return [to_json_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: to_json_schema(v) for k, v in schema.items()
           if not k.startswith("x-kubernetes-") and k not in ("nullable", "format", "default",
                                                               "description", "example")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if "properties" in out:
        out["properties"] = {k: to_json_schema(v) for k, v in schema["properties"].items()}
    return out


def validate_custom(res: Resource, obj: Obj, strict_fields: bool) -> List[Dict[str, str]]:
    """Prune (or, with fieldValidation=Strict, reject) unknown fields, then validate the rest."""
    import jsonschema

    assert res.schema is not None
    unknown: List[str] = []
    pruned = prune(res.schema, obj, "", unknown)
    if unknown and strict_fields:
        return [{"field": f, "message": f'unknown field "{f}"', "reason": "FieldValueInvalid"}
                for f in unknown]
    obj.clear()
    obj.update(pruned)
    body = {k: v for k, v in obj.items() if k != "metadata"}
    validator = jsonschema.Draft4Validator(to_json_schema(
        {**res.schema, "properties": {k: v for k, v in (res.schema.get("properties") or {}).items()
                                      if k != "metadata"}}))
    causes = []
    for err in sorted(validator.iter_errors(body), key=lambda e: list(e.path)):
        path = ".".join(str(p) for p in err.path) or "<root>"
        causes.append({"field": path, "message": err.message})
    return causes


def unknown_field_warnings(res: Resource, obj: Obj) -> List[str]:
    """The ``unknown field`` warnings a real server sends with fieldValidation=Warn."""
    if res.schema is None:
        return []
    unknown: List[str] = []
    prune(res.schema, obj, "", unknown)
    return [f'unknown field "{f}"' for f in unknown]


def check_namespace_scope(res: Resource, namespace: Optional[str], obj: Obj) -> None:
    """The body's namespace must match the path's (or be empty)."""
    m = obj.setdefault("metadata", {})
    if res.namespaced:
        body_ns = m.get("namespace")
        if body_ns and body_ns != namespace:
            raise error(400, "the namespace of the provided object does not match the namespace "
                        "sent on the request")
        m["namespace"] = namespace
    else:
        m.pop("namespace", None)
