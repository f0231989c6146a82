"""The PrometheusRule the chart renders, as a plain Prometheus rule file."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

import yaml

from tests.helm.chart import VALUE_SETS, one, render

# The value set whose PrometheusRule the tests load: the chart's defaults plus the rule enabled.
RULE_VALUES = VALUE_SETS["cert-manager"]


def rule_groups(values: Dict[str, Any] = RULE_VALUES) -> List[Dict[str, Any]]:
    return one(render(values), "PrometheusRule")["spec"]["groups"]


def write_rule_file(directory: Path, values: Dict[str, Any] = RULE_VALUES) -> Path:
    path = directory / "xmem-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule_groups(values)}, sort_keys=False))
    return path
