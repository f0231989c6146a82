"""`xmem serve --help` and `xmem controller --help` say each option's default, and the
controller's usage says that --probe-image is required (unless its environment variable is set)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _help(command: str, **env: str) -> str:
    base = {"PATH": "/usr/bin:/bin", "HOME": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "xmem_admission.cli", command, "--help"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env=dict(base, **env))
    assert result.returncode == 0, result.stderr
    return " ".join(result.stdout.split())


def test_serve_help_shows_the_defaults_before_the_environment_variable() -> None:
    text = _help("serve")
    for shown in ("address to listen on (default: 0.0.0.0) [XMEM_HOST]",
                  "admission port (default: 8443) [XMEM_PORT]",
                  "(default: 8080) [XMEM_METRICS_PORT]", "(default: default) [XMEM_POLICY_NAME]",
                  "how much to log (default: info) [XMEM_LOG_LEVEL]"):
        assert shown in text
    # A switch and an unset option say no default.
    assert "(default: True)" not in text and "(default: None)" not in text


def test_an_environment_variable_becomes_the_default_the_help_shows() -> None:
    assert "(default: 9443) [XMEM_PORT]" in _help("serve", XMEM_PORT="9443")


def test_controller_help_shows_defaults_and_that_the_probe_image_is_required() -> None:
    text = _help("controller")
    assert " --probe-image IMAGE " in text.split("options:")[0]  # not in [brackets]
    assert "required unless XMEM_PROBE_IMAGE is set" in text
    assert "(default: 15.0)" in text  # --lease-duration
    assert "(default: Job,PyTorchJob,JobSet,TrainJob) [XMEM_WORKLOADS]" in text
    usage = _help("controller", XMEM_PROBE_IMAGE="registry.example.com/xmem:1").split("options:")[0]
    assert "[--probe-image IMAGE]" in usage
