"""The playground (``make playground``, ``localkube/playground.py``) as a user runs it: ``up``
builds or reuses the images, starts the control plane, the real node and the project, submits
the example jobs and prints a table; the opted-in jobs were held, estimated by pods on the real
node (the project's image and the training image, pulled from the node's registry with the
namespace's pull secret), released with a request and bound to kwok GPU nodes; ``down`` stops
every process and leaves nothing of the node on the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from tests.realnode.conftest import ENABLED, SKIP_REASON

if not ENABLED:
    pytest.skip(SKIP_REASON, allow_module_level=True)

from localkube import kubelet  # noqa: E402
from localkube.playground import EXAMPLES, NAMESPACE  # noqa: E402

pytestmark = pytest.mark.timeout(3600)

ROOT = Path(__file__).resolve().parents[2]


def _playground(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "localkube.playground", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _table(output: str) -> Dict[str, Dict[str, str]]:
    """The rows of the table ``up`` prints, by job (columns split on runs of spaces)."""
    lines = output.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("JOB "))
    columns = lines[header].lower().split()
    rows = {}
    for line in lines[header + 1:]:
        if not line.strip():
            break
        cells = [c for c in line.split("  ") if c.strip()]
        assert len(cells) == len(columns), line
        rows[cells[0].strip()] = dict(zip(columns, (c.strip() for c in cells)))
    return rows


def _alive(pids: List[int]) -> List[int]:
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()]


def test_a_playground_folder_too_deep_for_containerds_socket_is_refused_before_anything_starts(
        tmp_path: Path, node_built: None) -> None:
    root = tmp_path / ("deep-" * 16)
    up = _playground("up", str(root), timeout=120)
    assert up.returncode == 1
    assert "too deep" in up.stdout and "104 bytes" in up.stdout, up.stdout
    assert not (root / "run").exists()


def test_the_playground_estimates_its_example_jobs_on_the_real_node_and_stops_clean(
        tmp_path_factory: pytest.TempPathFactory, node_built: None) -> None:
    # containerd's sockets go under it: a short folder (see the test above)
    root = tmp_path_factory.mktemp("pg")
    up = _playground("up", str(root), timeout=3000)
    try:
        print(up.stdout)
        assert up.returncode == 0, f"{up.stdout}\n{up.stderr}\n" + (
            (root / "playground.log").read_text()[-4000:]
            if (root / "playground.log").exists() else "")
        rows = _table(up.stdout)
        assert set(rows) == {name for name, _, _ in EXAMPLES}
        for name, opted_in, _ in EXAMPLES:
            row = rows[name]
            assert row["node"].startswith(("a100-", "h100-")), row
            if opted_in:
                assert row["state"] == "released", row
                assert row["request"].startswith("nvidia.com/gpumem "), row
                assert row["gpu"] in ("A100-80GB", "H100-80GB"), row
            else:
                assert (row["state"], row["request"]) == ("admitted", "whole GPU"), row
        assert rows["gpt-small-again"]["estimate"] == rows["gpt-small"]["estimate"]
        assert int(rows["gpt-medium"]["estimate"].split()[0]) > \
            int(rows["gpt-small"]["estimate"].split()[0])

        info = json.loads((root / "ready").read_text())
        from kubernetes import client, config

        api = config.new_client_from_config(info["kubeconfig"])
        try:
            pods = client.CoreV1Api(api).list_namespaced_pod(
                NAMESPACE, label_selector="app.kubernetes.io/component=estimation").items
        finally:
            api.close()
        assert pods, "no estimation pod in the playground's namespace"
        registry = info["made"]["registry"]
        for pod in pods:
            assert pod.spec.node_name == "playground-node"
            assert pod.status.phase == "Succeeded", pod.status
            images = {s.name: s.image_id for s in
                      pod.status.init_container_statuses + pod.status.container_statuses}
            assert all(i.startswith(f"{registry}/") for i in images.values()), images
    finally:
        pids = [int(p.read_text()) for p in root.glob("**/run/*.pid") if p.read_text().strip()]
        down = _playground("down", str(root), timeout=600)
        print(down.stdout, down.stderr)
    assert down.returncode == 0 and "playground stopped" in down.stdout
    assert _alive(pids) == []
    made = info["made"]
    assert not Path(f"/sys/class/net/{made['bridge']}").exists()
    assert not any(Path(f"/sys/fs/cgroup/{c}{made['cgroup']}").exists()
                   for c in os.listdir("/sys/fs/cgroup"))
    assert not [m for m in kubelet.mount_points() if m.startswith(str(root))]
