"""Validation of emitted objects against the schemas the real API server would apply.

- Built-in kinds: the official Kubernetes OpenAPI schemas shipped by ``kubernetes-validate``, for
  every minor version this project supports (1.30 to 1.35), in their strict form (unknown fields
  rejected, as ``kubectl --validate=strict`` and server-side field validation do).
- Custom resources (PyTorchJob, GPUAdmissionPolicy): the CRD's openAPIV3Schema, read the way
  the API server reads it (OpenAPI 3.0 dialect turned into JSON Schema, unknown fields refused,
  by the walk that writes the chart's values.schema.json: ``policy.schema.json_schema_of``).

Validators are built once per schema: ``kubernetes_validate.validate`` re-reads a 1.2 MB
definitions file on every call, which would dominate the test time.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from pathlib import Path
from typing import Any, Dict, Iterable, Mapping

import jsonschema
import kubernetes_validate
import yaml
from referencing import Registry, Resource

from xmem_admission.cluster.policy.schema import json_schema_of

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
VERSIONS = ("1.30", "1.31", "1.32", "1.33", "1.34", "1.35")
PYTORCHJOB_CRD = ROOT / "tests" / "data" / "crds" / "kubeflow.org_pytorchjobs.yaml"
POLICY_CRD = ROOT / "helm" / "xmem-admission" / "crds" / "gpuadmissionpolicies.xmem.io.yaml"


def _schema_dir(version: str) -> Path:
    return SCHEMAS / f"v{version}.0-local-strict"


@functools.cache
def _registry(version: str) -> Registry:
    with open(_schema_dir(version) / "_definitions.json", encoding="utf-8") as handle:
        definitions = json.load(handle)
    return Resource.from_contents(definitions) @ Registry()


@functools.cache
def _validator(version: str, name: str) -> jsonschema.Validator:
    with open(_schema_dir(version) / f"{name}.json", encoding="utf-8") as handle:
        schema = json.load(handle)
    registry = Resource.from_contents(schema) @ _registry(version)
    return jsonschema.Draft202012Validator(schema, registry=registry)


def _file_name(api_version: str, kind: str) -> str:
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    return f"{kind.lower()}-{group_version}"


def validate_builtin(obj: Mapping[str, Any], versions: Iterable[str] = VERSIONS) -> None:
    """Validate a built-in object (Job, Pod, ...) against every supported Kubernetes version."""
    name = _file_name(obj["apiVersion"], obj["kind"])
    for version in versions:
        try:
            _validator(version, name).validate(obj)
        except jsonschema.ValidationError as exc:
            raise AssertionError(
                f"Kubernetes {version} rejects this {obj['kind']}: "
                f"{'.'.join(map(str, exc.absolute_path))}: {exc.message}"
            ) from None


def validate_pod_spec(spec: Mapping[str, Any], versions: Iterable[str] = VERSIONS) -> None:
    for version in versions:
        try:
            _validator(version, "podspec-v1").validate(spec)
        except jsonschema.ValidationError as exc:
            raise AssertionError(
                f"Kubernetes {version} rejects this PodSpec: "
                f"{'.'.join(map(str, exc.absolute_path))}: {exc.message}"
            ) from None


@functools.cache
def crd_validator(path: str) -> jsonschema.Validator:
    with open(path, encoding="utf-8") as handle:
        crd = yaml.safe_load(handle)
    schema = json_schema_of(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"],
                            descriptions=False)
    return jsonschema.Draft202012Validator(schema)


def crd_schema(path: Path) -> Dict[str, Any]:
    """The raw openAPIV3Schema of a CRD file (first version)."""
    with open(path, encoding="utf-8") as handle:
        crd = yaml.safe_load(handle)
    return copy.deepcopy(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])


def validate_custom(obj: Mapping[str, Any], crd: Path) -> None:
    errors = sorted(crd_validator(str(crd)).iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        first = errors[0]
        raise AssertionError(
            f"{crd.name} rejects this {obj.get('kind')}: "
            f"{'.'.join(map(str, first.absolute_path))}: {first.message}"
        )


def validate_pytorchjob(obj: Mapping[str, Any]) -> None:
    """The published PyTorchJob CRD, plus every replica's PodSpec against Kubernetes' own."""
    validate_custom(obj, PYTORCHJOB_CRD)
    for replica in obj["spec"]["pytorchReplicaSpecs"].values():
        validate_pod_spec(replica["template"]["spec"])


def validate_object(obj: Mapping[str, Any]) -> None:
    """Whatever the kind: the schema the API server would use for it."""
    if obj.get("kind") == "PyTorchJob":
        validate_pytorchjob(obj)
    else:
        validate_builtin(obj)
