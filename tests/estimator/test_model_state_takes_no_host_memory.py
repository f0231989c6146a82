"""Fake mode keeps model state shape-only: an optimizer's state, made like each parameter
(Adam's ``zeros_like(p)`` moments), takes no host memory, however large the model."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.estimator.conftest import H200

MiB = 2**20


def probe_peak_rss(script: str, tmp_path, *args: str) -> int:
    """The probe's peak RSS, run in a process of its own as ``xmem estimate`` runs it."""
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, "-m", "xmem_admission.estimator.probe.runner", "--out",
                    str(out), "--device-json", json.dumps(H200), "--", "python", script, *args],
                   check=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["status"] == "ok", result["reason"] + result["traceback"]
    return int(result["peak_rss_bytes"])


def test_adam_moments_of_a_large_model_take_no_host_memory_in_fake_mode(script, tmp_path):
    # 32 layers of 2048 x 2048 fp32: 1 GiB of Adam moments on the GPU, none on the host
    small = probe_peak_rss(script("wide_layers.py"), tmp_path, "--depth", "1")
    large = probe_peak_rss(script("wide_layers.py"), tmp_path, "--depth", "32")
    assert large - small < 128 * MiB, (small / MiB, large / MiB)
