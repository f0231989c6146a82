"""The GPUAdmissionPolicy CRD and the chart's ``values.schema.json`` policy part, generated.

One path: the typed models of ``policy.api`` -> the CRD's ``openAPIV3Schema`` for ``spec``
(types, bounds, enums, defaults, descriptions, and the models' cross-field rules as CEL
``x-kubernetes-validations``) -> the chart's ``values.schema.json`` ``policy.spec`` (the same
node in the JSON Schema dialect Helm checks values with). Neither file is edited by hand; the
CRD's frame (names, printer columns, status) is ``CRD_FRAME`` below.

    python -m xmem_admission.cluster.policy.schema --check   # exit 1 and a diff when stale
    python -m xmem_admission.cluster.policy.schema --write   # regenerate both files
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from xmem_admission.cluster.policy import api

CHART = Path(__file__).resolve().parents[4] / "helm" / "xmem-admission"
CRD_FILE = "crds/gpuadmissionpolicies.xmem.io.yaml"
VALUES_SCHEMA = "values.schema.json"
SPEC_DESCRIPTION = ("GPUAdmissionPolicy spec (generated from the policy's models by python -m "
                    "xmem_admission.cluster.policy.schema --write; the CRD's CEL rules and the "
                    "GPU catalogue are checked in the cluster)")
CRD_HEADER = """\
# GPUAdmissionPolicy: the cluster admin's policy for xmem-admission (cluster-scoped).
# GENERATED from src/xmem_admission/cluster/policy/api.py (its models) and the frame in
# policy/schema.py: do not edit; run python -m xmem_admission.cluster.policy.schema --write.
# The same object, saved as YAML, is what `xmem serve --policy FILE.yaml` reads.
"""

# Everything of the CRD but the schemas of spec and status: names, printer columns.
CRD_FRAME = """
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: gpuadmissionpolicies.xmem.io
  labels:
    app.kubernetes.io/name: xmem-admission
spec:
  group: xmem.io
  scope: Cluster
  names:
    kind: GPUAdmissionPolicy
    listKind: GPUAdmissionPolicyList
    plural: gpuadmissionpolicies
    singular: gpuadmissionpolicy
    shortNames: [gap]
    categories: [xmem]
  versions:
    - name: v1alpha1
      served: true
      storage: true
      subresources:
        status: {}
      additionalPrinterColumns:
        - name: Targets
          type: string
          jsonPath: .spec.targets
        - name: Enforcement
          type: string
          jsonPath: .spec.enforcement
        - name: Accepted
          type: string
          description: Whether the controller could load the newest generation.
          jsonPath: .status.conditions[?(@.type=="Accepted")].status
        - name: Reason
          type: string
          jsonPath: .status.conditions[?(@.type=="Accepted")].reason
        - name: Learned
          type: string
          description: What finished runs taught, per GPU model (the memory outside the allocator per driver, and where jobs land in their range).
          jsonPath: .status.learned
        - name: Age
          type: date
          jsonPath: .metadata.creationTimestamp
      schema:
        openAPIV3Schema:
          type: object
          required: [spec]
          properties:
            apiVersion: {type: string}
            kind: {type: string}
            metadata: {type: object}
            spec: {}
            status: {}
"""


DROP = object()  # what a key's rewrite returns to leave the key out
NAMED = ("properties", "patternProperties")  # maps from names to nodes, not nodes themselves


def rewrite(node: Any, key: Callable[[str, Any], Any] = lambda _, value: value,
            close: Callable[[Dict[str, Any], Dict[str, Any]], Any] = lambda _, out: out,
            enter: Callable[[Dict[str, Any]], Dict[str, Any]] = lambda node: node) -> Any:
    """A schema tree rewritten from one dialect to another, bottom-up: the one walk of this
    module (and of the tests' CRD validators). A list is rewritten item by item; an object is
    first passed to ``enter`` (which may replace it), then key by key: each node of a ``NAMED``
    map is rewritten (a field's name is never taken for a keyword), any other key's value goes
    through ``key(name, value)``, which gives the value to keep (rewritten in its turn) or
    ``DROP``; ``close(node, out)`` makes the result from the object entered and its keys
    rewritten."""

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(n) for n in node]
        if not isinstance(node, dict):
            return node
        node = enter(node)
        out: Dict[str, Any] = {}
        for name, value in node.items():
            if name in NAMED and isinstance(value, dict):
                out[name] = {field: walk(child) for field, child in value.items()}
                continue
            value = key(name, value)
            if value is not DROP:
                out[name] = walk(value)
        return close(node, out)

    return walk(node)


def _words(text: Any) -> str:
    return " ".join(str(text).split())


def _openapi(node: Any, defs: Dict[str, Any]) -> Any:
    """A pydantic JSON Schema node as a Kubernetes structural schema node: references inlined,
    optional (nullable) fields as plain ones, OpenAPI 3.0's boolean exclusive bounds, no titles,
    no defaults of objects or lists (the API server defaults the fields of an object present)."""

    def enter(node: Dict[str, Any]) -> Dict[str, Any]:
        node = dict(node)
        ref = node.pop("$ref", None)
        if ref is not None:
            target = dict(defs[ref.rsplit("/", 1)[-1]])
            if "enum" in target:  # an enum's docstring describes the Python class, not the field
                target = {"type": target["type"], "enum": target["enum"]}
            node = {**target, **node}
        options = node.get("anyOf")
        if options and {"type": "null"} in options:
            rest = [o for o in options if o != {"type": "null"}]
            del node["anyOf"]
            if len(rest) == 1:
                node = {**rest[0], **node}
            else:
                node["anyOf"] = rest
            if node.get("default", 0) is None:
                del node["default"]
            if "$ref" in node:
                return enter(node)
        return node

    def key(name: str, value: Any) -> Any:
        if name == "title" or (name == "additionalProperties" and value is False) or \
                (name == "default" and isinstance(value, (dict, list))):
            return DROP
        return _words(value) if name == "description" else value

    def close(_: Dict[str, Any], out: Dict[str, Any]) -> Dict[str, Any]:
        for bound, limit in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if bound in out and not isinstance(out[bound], bool):
                out[limit] = out[bound]
                out[bound] = True
        required = out.get("required")
        if required is not None:
            out["required"] = [r for r in required if r in out.get("properties", {})]
        return _ordered(out)

    return rewrite(node, key, close, enter)


_ORDER = ("type", "x-kubernetes-int-or-string", "anyOf", "pattern", "enum", "minimum",
          "exclusiveMinimum", "maximum", "exclusiveMaximum", "minLength", "maxLength",
          "minItems", "default", "description", "required", "x-kubernetes-list-type",
          "x-kubernetes-list-map-keys", "x-kubernetes-validations", "additionalProperties",
          "items", "properties")


def _ordered(node: Dict[str, Any]) -> Dict[str, Any]:
    """Keys in a reader's order: what it is, its bounds, its default, then what it holds."""
    rank = {k: i for i, k in enumerate(_ORDER)}
    return {k: node[k] for k in sorted(node, key=lambda k: (rank.get(k, len(_ORDER)), k))}


def _without(node: Any) -> Any:
    """An override's node: no defaults (an unset field keeps the value ``spec`` resolved), no
    rule that reads a field the override may inherit."""

    def key(name: str, value: Any) -> Any:
        if name == "default":
            return DROP
        if name == "x-kubernetes-validations":
            return [r for r in value if not r.get(api.INHERITED)] or DROP
        return value

    return rewrite(node, key)


def _strip_marks(node: Any) -> Any:
    return rewrite(node, lambda name, value: DROP if name == api.INHERITED else value)


def spec_schema() -> Dict[str, Any]:
    """The CRD's ``openAPIV3Schema.properties.spec``, generated from ``api.PolicySpec``."""
    raw = api.PolicySpec.model_json_schema(by_alias=True)
    defs = raw.pop("$defs", {})
    spec: Dict[str, Any] = _openapi(raw, defs)
    overrides = spec["properties"]["overrides"]
    overrides["items"] = _without(overrides["items"])
    out: Dict[str, Any] = _strip_marks(spec)
    return out


def crd() -> Dict[str, Any]:
    import yaml  # server extra; imported where used

    out: Dict[str, Any] = yaml.safe_load(CRD_FRAME)
    [version] = out["spec"]["versions"]
    root = version["schema"]["openAPIV3Schema"]
    spec = spec_schema()
    root["description"] = spec["description"]
    root["properties"]["spec"] = spec
    root["properties"]["status"] = _openapi(*api.status_schema())
    return out


def render_crd(obj: Dict[str, Any]) -> str:
    import yaml

    text: str = yaml.safe_dump(obj, sort_keys=False, width=100, allow_unicode=True)
    return CRD_HEADER + text


def json_schema_of(node: Any, descriptions: bool = True) -> Any:
    """A CRD schema node in the JSON Schema dialect Helm checks values with (and the tests
    validate custom resources with): unknown fields refused (unless the node preserves them),
    OpenAPI 3.0's boolean exclusive bounds as numbers, ``nullable`` as a type that admits null,
    no defaults (values may leave a field out: the API server defaults it), no Kubernetes
    extensions; descriptions on one line, or none."""

    def key(name: str, value: Any) -> Any:
        if name == "default" or name.startswith("x-kubernetes-"):
            return DROP
        if name == "description":
            return _words(value) if descriptions else DROP
        return value

    def close(node: Dict[str, Any], out: Dict[str, Any]) -> Dict[str, Any]:
        for bound, limit in (("exclusiveMaximum", "maximum"), ("exclusiveMinimum", "minimum")):
            if out.get(bound) is True:
                out[bound] = out.pop(limit)
            elif out.get(bound) is False:
                out.pop(bound)
        if node.get("nullable") and "type" in out:
            out["type"] = [out["type"], "null"]
            out.pop("nullable", None)
        if "properties" in out and "additionalProperties" not in out and \
                not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
        return out

    return rewrite(node, key, close)


def generated_values(values_schema: Dict[str, Any]) -> Dict[str, Any]:
    """``values_schema`` with its ``policy.spec`` generated from the models (through the CRD's
    node: one path)."""
    out = copy.deepcopy(values_schema)
    spec = json_schema_of(spec_schema())
    spec["description"] = SPEC_DESCRIPTION
    out["properties"]["policy"]["properties"]["spec"] = spec
    return out


def render_values(schema: Dict[str, Any]) -> str:
    return json.dumps(schema, indent=2) + "\n"


def wanted(chart: Path = CHART) -> Dict[str, str]:
    """Each generated file's relative path and the text it should hold."""
    values = json.loads((chart / VALUES_SCHEMA).read_text(encoding="utf-8"))
    return {CRD_FILE: render_crd(crd()), VALUES_SCHEMA: render_values(generated_values(values))}


def drift(chart: Path = CHART) -> List[str]:
    """The unified diffs between the committed files and the generated ones."""
    lines: List[str] = []
    for name, text in wanted(chart).items():
        path = chart / name
        have = path.read_text(encoding="utf-8") if path.exists() else ""
        lines += difflib.unified_diff(have.splitlines(), text.splitlines(),
                                      f"{path} (committed)", f"{path} (generated)", lineterm="")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xmem_admission.cluster.policy.schema",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--chart", type=Path, default=CHART, help="the chart's directory")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1, with a diff, when stale")
    mode.add_argument("--write", action="store_true", help="write the CRD and values.schema.json")
    args = parser.parse_args(argv)
    lines = drift(args.chart)
    if args.write:
        for name, text in wanted(args.chart).items():
            path = args.chart / name
            stale = not path.exists() or path.read_text(encoding="utf-8") != text
            path.write_text(text, encoding="utf-8")
            print(f"{path}: {'regenerated' if stale else 'already up to date'}")
        return 0
    if lines:
        print("\n".join(lines))
        print(f"\n{args.chart / CRD_FILE} or {args.chart / VALUES_SCHEMA} is stale: run python -m "
              "xmem_admission.cluster.policy.schema --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
