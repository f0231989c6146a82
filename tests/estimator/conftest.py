from __future__ import annotations

import os

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")

H200 = {"name": "NVIDIA H200", "total_memory": 150_754_820_096, "compute_capability": [9, 0],
        "multi_processor_count": 132}


@pytest.fixture
def script():
    def path(name: str) -> str:
        return os.path.join(SCRIPTS, name)

    return path


@pytest.fixture
def probe_run(capfd):
    """Run the probe in this process (torch is already imported: fast)."""
    from xmem_admission.estimator.probe import runner

    def run(argv, mode="fake", steps=3, device=H200):
        result = runner.run(list(argv), mode, steps, device)
        out = capfd.readouterr().out
        return result, out

    return run
