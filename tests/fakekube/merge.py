"""The three patch types the API server accepts, applied as it applies them.

- ``application/json-patch+json`` (RFC 6902): a list of operations, applied with ``jsonpatch``;
  a failed ``test`` or a path that does not exist is a 422, as on a real server.
- ``application/merge-patch+json`` (RFC 7386): maps merge recursively, ``null`` deletes a key,
  every list is replaced whole.
- ``application/strategic-merge-patch+json``: built-in kinds only (a custom resource answers 415,
  as on a real server). Lists of objects with a patch merge key are merged item by item (the
  merge keys and ``patchStrategy: merge`` lists of the core and batch API types, by field name;
  the names do not collide across the types the stand-in serves); other lists are replaced.
  Directives: ``$patch: replace|delete|merge`` in maps and list items,
  ``$deleteFromPrimitiveList/<field>``, ``$setElementOrder/<field>`` (accepted, order kept as
  is) and ``$retainKeys``.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional

from tests.fakekube.status import error

# Field name -> merge key of its list items (patchMergeKey in k8s.io/api types.go).
MERGE_KEYS: Dict[str, str] = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "env": "name", "volumes": "name", "volumeMounts": "mountPath",
    "volumeDevices": "devicePath", "ports": "containerPort", "imagePullSecrets": "name",
    "ownerReferences": "uid", "conditions": "type", "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey", "resourceClaims": "name",
    "containerStatuses": "name", "initContainerStatuses": "name",
    "ephemeralContainerStatuses": "name", "schedulingGates": "name", "podIPs": "ip",
    "readinessGates": "conditionType",
}
# Lists of scalars with patchStrategy merge: items are added, not replacing the list.
MERGE_PRIMITIVES = {"finalizers"}

DELETE_FROM = "$deleteFromPrimitiveList/"
ELEMENT_ORDER = "$setElementOrder/"


def json_merge(target: Any, patch: Any) -> Any:
    """RFC 7386 merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = json_merge(out.get(key), value)
    return out


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 JSON patch; a malformed or failing patch is a 422 like a real server's."""
    import jsonpatch

    if not isinstance(operations, list):
        raise error(400, "json patch must be a list of operations")
    try:
        return jsonpatch.JsonPatch(operations).apply(target)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException, KeyError,
            IndexError, TypeError) as exc:
        raise error(422, f"the server rejected our request due to an error in our request: {exc}") from None


def strategic_merge(target: Any, patch: Any, field: Optional[str] = None) -> Any:
    """Strategic merge patch of ``patch`` onto ``target`` (neither is modified)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if not isinstance(target, dict):
        target = {}
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    out = dict(target)
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key in ("$patch", "$retainKeys") or key.startswith(ELEMENT_ORDER):
            continue
        if key.startswith(DELETE_FROM):
            name = key[len(DELETE_FROM):]
            drop = set(value or [])
            out[name] = [v for v in out.get(name) or [] if v not in drop]
            continue
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list):
            out[key] = _merge_list(out.get(key), value, key)
        elif isinstance(value, dict):
            merged = strategic_merge(out.get(key), value, key)
            if merged is None:
                out.pop(key, None)
            else:
                out[key] = merged
        else:
            out[key] = value
    if isinstance(retain, list):
        out = {k: v for k, v in out.items() if k in retain}
    return out


def _merge_list(current: Any, patch: List[Any], field: str) -> List[Any]:
    current = list(current) if isinstance(current, list) else []
    if field in MERGE_PRIMITIVES:
        return current + [v for v in patch if v not in current]
    key = MERGE_KEYS.get(field)
    if key is None or not all(isinstance(item, dict) for item in patch):
        return [copy.deepcopy(v) for v in patch if not (isinstance(v, dict) and v.get("$patch"))]
    if any(item.get("$patch") == "replace" for item in patch):
        return [copy.deepcopy(v) for v in patch if v.get("$patch") != "replace"]
    out = [copy.deepcopy(item) for item in current]
    for item in patch:
        if key not in item:
            raise error(422, f"map: {item} does not contain declared merge key: {key}")
        index = next((i for i, old in enumerate(out)
                      if isinstance(old, dict) and old.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                out.pop(index)
            continue
        if index is None:
            out.append(strategic_merge({}, item))
        else:
            out[index] = strategic_merge(out[index], item)
    return out
