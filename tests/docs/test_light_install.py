"""The light install of the CLI: `pip install xmem-admission` brings no torch, and `xmem
estimate --python ENV/bin/python` traces with that environment's torch.

The CLI's own process here cannot import torch (nor any third-party package the light install
lacks); the interpreter it is pointed at has torch, as the user's training environment does.
"""

from __future__ import annotations

import json
import lzma
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import tomllib
import torch

ROOT = Path(__file__).resolve().parents[2]
# What the light install does not have: torch and everything the extras bring.
ABSENT = ("torch", "torchvision", "numpy", "matplotlib", "transformers", "fastapi", "uvicorn",
          "pydantic", "prometheus_client", "kubernetes", "yaml", "orjson")
TINY_GPT = ["--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "100",
            "--seq-len", "32", "--batch-size", "2"]


def xmem_without_torch(*args: str) -> subprocess.CompletedProcess:
    """``xmem ARGS`` in a process where importing torch (or any package in ABSENT) fails."""
    prelude = (f"import sys\nfor name in {ABSENT!r}:\n    sys.modules[name] = None\n"
               "from xmem_admission.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    return subprocess.run([sys.executable, "-c", prelude, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def _requirement_names(requirements: list) -> set:
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_light_install_requires_nothing_and_torch_comes_only_with_an_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == []
    extras = project["optional-dependencies"]
    assert "torch" in _requirement_names(extras["estimator"])
    assert "torch" not in _requirement_names(extras["server"])


def test_every_subcommand_shows_its_help_without_torch() -> None:
    for command in ("estimate", "gpus", "simulate", "replay", "serve", "controller", "bench"):
        result = xmem_without_torch(command, "--help")
        assert result.returncode == 0, (command, result.stderr[-2000:])
        assert f"usage: xmem {command}" in result.stdout


def test_gpus_runs_without_torch() -> None:
    result = xmem_without_torch("gpus", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    assert any(g["key"] == "H200" for g in json.loads(result.stdout)["gpus"])


def test_estimate_with_the_users_python_then_simulate_run_without_torch_in_xmem(tmp_path):
    trace = tmp_path / "trace.json"
    report = tmp_path / "report.html"
    result = xmem_without_torch("estimate", "--python", sys.executable, "--gpu", "H200",
                                "--json", "--trace", str(trace), "--report", str(report),
                                "--", "python", "examples/train_gpt.py", *TINY_GPT)
    assert result.returncode == 0, result.stderr[-3000:]
    estimate = json.loads(result.stdout)
    assert estimate["torch"] == torch.__version__  # the user's environment traced it
    assert estimate["gpus"][0]["gpu"] == "H200" and estimate["gpus"][0]["fits"]
    assert "<html" in report.read_text()[:500].lower()
    simulated = xmem_without_torch("simulate", str(trace), "--json")
    assert simulated.returncode == 0, simulated.stderr[-2000:]
    assert json.loads(simulated.stdout)["peak_reserved_bytes"] > 0


def test_replay_of_a_real_snapshot_runs_without_torch(tmp_path):
    with tarfile.open(ROOT / "bench" / "data" / "H200" / "snapshots-1.tar") as tar:
        member = tar.getmember("cnn-resnet50-b32-sgd.pickle.xz")
        packed = tar.extractfile(member)
        assert packed is not None
        snapshot = tmp_path / "snapshot.pickle"
        snapshot.write_bytes(lzma.decompress(packed.read()))
    result = xmem_without_torch("replay", str(snapshot), "--json")
    # 0: the simulator matched the snapshot, 1: it did not; either way it ran, torch-free.
    assert result.returncode in (0, 1), result.stderr[-2000:]
    assert json.loads(result.stdout)["segment_allocs_expected"] > 0
