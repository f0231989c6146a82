"""The GPUAdmissionPolicy CRD and the chart's values.schema.json policy part are generated from the
policy's typed models (``python -m xmem_admission.cluster.policy.schema``): the committed files are
the generated ones, and a drift planted in either is found, named and repaired by --write."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List

import pytest
import yaml

from xmem_admission.cluster.policy import api, schema


def chart_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "chart"
    shutil.copytree(schema.CHART, copy)
    return copy


def test_the_committed_crd_and_values_schema_are_the_generated_ones() -> None:
    assert schema.drift() == [], "\n".join(schema.drift()[:40])


def test_a_hand_edit_of_the_values_schema_is_found_and_the_check_fails(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chart = chart_copy(tmp_path)
    path = chart / schema.VALUES_SCHEMA
    values = json.loads(path.read_text())
    spec = values["properties"]["policy"]["properties"]["spec"]["properties"]
    spec["safetyMarginPercent"]["maximum"] = 200
    path.write_text(json.dumps(values, indent=2) + "\n")
    assert schema.main(["--chart", str(chart), "--check"]) == 1
    out = capsys.readouterr().out
    changed = [line.replace(" ", "") for line in out.splitlines()]
    assert '-"maximum":200,' in changed and '+"maximum":100,' in changed, out
    assert schema.main(["--chart", str(chart), "--write"]) == 0
    assert schema.main(["--chart", str(chart), "--check"]) == 0


def crd_spec(path: Path) -> Any:
    crd = yaml.safe_load(path.read_text())
    return crd, crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


def rules_in(node: Any) -> List[Dict[str, Any]]:
    if isinstance(node, list):
        return [r for n in node for r in rules_in(n)]
    if not isinstance(node, dict):
        return []
    return list(node.get("x-kubernetes-validations", [])) + \
        [r for k, v in node.items() if k != "x-kubernetes-validations" for r in rules_in(v)]


def test_a_hand_edit_of_the_crd_is_found_and_the_check_fails(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chart = chart_copy(tmp_path)
    path = chart / schema.CRD_FILE
    crd, spec = crd_spec(path)
    [rule] = spec["properties"]["onEstimationFailure"]["x-kubernetes-validations"]
    wanted = rule["rule"]
    rule["rule"] = "true"
    path.write_text(schema.render_crd(crd))
    assert schema.main(["--chart", str(chart), "--check"]) == 1
    out = capsys.readouterr().out
    assert any(line.startswith("-") and "rule: 'true'" in line for line in out.splitlines()), out
    assert schema.main(["--chart", str(chart), "--write"]) == 0
    assert schema.main(["--chart", str(chart), "--check"]) == 0
    assert crd_spec(path)[1]["properties"]["onEstimationFailure"][
        "x-kubernetes-validations"][0]["rule"] == wanted


def test_every_cross_field_rule_of_the_models_is_a_cel_rule_in_the_crd() -> None:
    models = [api.OnEstimationFailureSpec, api.TolerationSpec, api.DraSpec, api.PrometheusSpec,
              api.LearnedOverheadSpec, api.PolicySpec]
    rules = [rule for model in models for rule in model.rules]
    committed = rules_in(crd_spec(schema.CHART / schema.CRD_FILE)[1])
    for rule in rules:
        assert {"rule": rule.cel, "message": rule.message, "fieldPath": "." + rule.field} \
            .items() <= next(r for r in committed if r["rule"] == rule.cel).items()
    spec = schema.spec_schema()
    # An override may inherit defaultRequest from spec: the rule is spec's alone (PolicySpec's
    # own rule covers overrides), and an override sets no defaults.
    override = spec["properties"]["overrides"]["items"]["properties"]
    assert "x-kubernetes-validations" not in override["onEstimationFailure"]
    assert "default" not in override["safetyMarginPercent"]
    assert "x-kubernetes-validations" in \
        override["estimation"]["properties"]["placement"]["properties"]["tolerations"]["items"]


def nodes(node: Any, path: str = "spec") -> List[Any]:
    """Every schema node under ``node`` with its path."""
    out = [(path, node)]
    for key, child in (node.get("properties") or {}).items():
        out += nodes(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        out += nodes(node["items"], f"{path}[]")
    return out


def test_every_enum_value_of_the_policy_is_pascal_case() -> None:
    """Kubernetes' API conventions: enum values are PascalCase (a toleration's empty effect,
    every effect, is core/v1's own)."""
    pascal = re.compile(r"^[A-Z][A-Za-z0-9]*$")
    enums = [(path, node["enum"]) for path, node in nodes(schema.spec_schema()) if "enum" in node]
    assert len(enums) > 10
    wrong = [(path, value) for path, values in enums for value in values
             if not pascal.match(value) and not (path.endswith(".effect") and value == "")]
    assert not wrong, wrong


def test_every_percentage_of_the_policy_is_an_integer() -> None:
    percents = [(path, node.get("type")) for path, node in nodes(schema.spec_schema())
                if path.endswith("Percent") or path.endswith(".percentile")
                or path.endswith(".cores")]
    assert len(percents) >= 8, percents
    assert all(kind == "integer" for _, kind in percents), percents
