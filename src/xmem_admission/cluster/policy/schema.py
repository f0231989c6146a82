"""The chart's ``values.schema.json`` policy part, generated from the GPUAdmissionPolicy CRD.

The CRD's ``openAPIV3Schema`` (``helm/xmem-admission/crds/``) is the schema of a policy's spec:
the API server applies it, with its CEL rules (``x-kubernetes-validations``), to every policy
applied. The chart's ``values.schema.json`` checks ``policy.spec`` at ``helm install`` with the
same fields, types, enums and bounds: its ``properties.policy.properties.spec`` is this module's
output, never edited by hand. The CEL rules and the GPU catalogue stay the API server's and the
controller's to check (a values schema has no cross-field rules; the catalogue grows with the
webhook, not with a CRD that ``helm upgrade`` never updates).

    python -m xmem_admission.cluster.policy.schema --check   # exit 1 and a diff when stale
    python -m xmem_admission.cluster.policy.schema --write   # regenerate values.schema.json
"""

from __future__ import annotations

import argparse
import copy
import difflib
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

CHART = Path(__file__).resolve().parents[4] / "helm" / "xmem-admission"
CRD_FILE = "crds/gpuadmissionpolicies.xmem.io.yaml"
VALUES_SCHEMA = "values.schema.json"
SPEC_DESCRIPTION = ("GPUAdmissionPolicy spec (generated from the CRD by python -m "
                    "xmem_admission.cluster.policy.schema --write; the CRD's CEL rules and the "
                    "GPU catalogue are checked in the cluster)")


def values_schema_of(node: Any) -> Any:
    """A CRD schema node in the JSON Schema dialect Helm checks values with: unknown fields
    refused, OpenAPI 3.0's boolean exclusive bounds as numbers, no defaults (values may leave a
    field out: the API server defaults it), no Kubernetes extensions."""
    if isinstance(node, list):
        return [values_schema_of(n) for n in node]
    if not isinstance(node, dict):
        return node
    out: Dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {k: values_schema_of(v) for k, v in value.items()}
        elif key == "default" or key.startswith("x-kubernetes-"):
            continue
        elif key == "description":
            out[key] = " ".join(str(value).split())
        else:
            out[key] = values_schema_of(value)
    for bound, limit in (("exclusiveMaximum", "maximum"), ("exclusiveMinimum", "minimum")):
        if out.get(bound) is True:
            out[bound] = out.pop(limit)
        elif out.get(bound) is False:
            out.pop(bound)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def crd_spec(chart: Path = CHART) -> Dict[str, Any]:
    import yaml  # server extra; imported where used

    crd = yaml.safe_load((chart / CRD_FILE).read_text(encoding="utf-8"))
    [version] = crd["spec"]["versions"]
    spec: Dict[str, Any] = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec


def generated(values_schema: Dict[str, Any], chart: Path = CHART) -> Dict[str, Any]:
    """``values_schema`` with its ``policy.spec`` generated from the chart's CRD."""
    out = copy.deepcopy(values_schema)
    spec = values_schema_of(crd_spec(chart))
    spec["description"] = SPEC_DESCRIPTION
    out["properties"]["policy"]["properties"]["spec"] = spec
    return out


def render(schema: Dict[str, Any]) -> str:
    return json.dumps(schema, indent=2) + "\n"


def drift(chart: Path = CHART) -> List[str]:
    """The unified diff between the committed values.schema.json and the generated one."""
    path = chart / VALUES_SCHEMA
    text = path.read_text(encoding="utf-8")
    wanted = render(generated(json.loads(text), chart))
    return list(difflib.unified_diff(text.splitlines(), wanted.splitlines(),
                                     f"{path} (committed)", f"{path} (generated)", lineterm=""))


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xmem_admission.cluster.policy.schema",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--chart", type=Path, default=CHART, help="the chart's directory")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1, with a diff, when stale")
    mode.add_argument("--write", action="store_true", help="write values.schema.json")
    args = parser.parse_args(argv)
    lines = drift(args.chart)
    if args.write:
        path = args.chart / VALUES_SCHEMA
        path.write_text(render(generated(json.loads(path.read_text(encoding="utf-8")),
                                         args.chart)), encoding="utf-8")
        print(f"{path}: {'regenerated' if lines else 'already up to date'}")
        return 0
    if lines:
        print("\n".join(lines))
        print(f"\n{args.chart / VALUES_SCHEMA} is stale: run python -m "
              "xmem_admission.cluster.policy.schema --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
