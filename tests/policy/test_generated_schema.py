"""The chart's values.schema.json policy part is generated from the GPUAdmissionPolicy CRD
(``python -m xmem_admission.cluster.policy.schema``): the committed file is the generated one,
and a drift planted on either side is found and named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from xmem_admission.cluster.policy import schema


def chart_copy(tmp_path: Path) -> Path:
    copy = tmp_path / "chart"
    shutil.copytree(schema.CHART, copy)
    return copy


def test_the_committed_values_schema_is_the_generated_one() -> None:
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


def test_a_crd_change_not_regenerated_into_the_values_schema_is_found(tmp_path: Path) -> None:
    chart = chart_copy(tmp_path)
    path = chart / schema.CRD_FILE
    crd = yaml.safe_load(path.read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec["properties"]["targets"]["items"]["properties"]["backend"]["enum"].append("nvshare")
    path.write_text(yaml.safe_dump(crd))
    assert any('"nvshare"' in line for line in schema.drift(chart))
    assert schema.main(["--chart", str(chart), "--check"]) == 1
    schema.main(["--chart", str(chart), "--write"])
    values = json.loads((chart / schema.VALUES_SCHEMA).read_text())
    backend = values["properties"]["policy"]["properties"]["spec"]["properties"]["targets"][
        "items"]["properties"]["backend"]
    assert "nvshare" in backend["enum"]
