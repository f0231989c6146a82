"""`xmem estimate` end to end, as a user runs it: a real subprocess, real scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def xmem(*args: str, timeout: float = 300):
    return subprocess.run([sys.executable, "-m", "xmem_admission.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_json_output_is_one_object_with_a_result_per_gpu(script):
    proc = xmem("estimate", "--gpu", "A100-80GB,h200", "--json", "--",
                "python", script("tiny_mlp.py"), "--hidden", "64")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # nothing else on stdout: the script printed to stderr
    assert "step 0 loss" in proc.stderr
    assert data["mode"] == "fake" and data["steps"] == 3
    assert [g["gpu"] for g in data["gpus"]] == ["A100-80GB", "H200"]
    for g in data["gpus"]:
        assert g["total_bytes"] == g["peak_reserved_bytes"] + g["overhead_bytes"]
        assert g["recommended_request_bytes"] == pytest.approx(g["total_bytes"] * 1.05, abs=1)
        assert sum(g["breakdown"].values()) == g["total_bytes"]
        assert g["fits"] is True and g["mig_profile"] is not None
        assert g["peak_allocated_bytes"] <= g["peak_reserved_bytes"]
    # H200 (compute capability 9.0) has 32 MiB cuBLAS workspaces, the A100 8.125 MiB ones
    a100, h200 = data["gpus"]
    assert h200["breakdown"]["workspaces"] > a100["breakdown"]["workspaces"]


def test_a_decision_on_the_loss_falls_back_to_profile_mode_with_the_reason(script):
    proc = xmem("estimate", "--gpu", "A100-40GB", "--json", "--", "python",
                script("tiny_mlp.py"), "--decide-on-loss", "--hidden", "32")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["mode"] == "profile"
    assert "tiny_mlp.py" in data["fallback_reason"]


def test_a_job_that_fits_no_gpu_says_so_per_gpu_and_exits_3(script):
    proc = xmem("estimate", "--gpu", "RTX-4060,RTX-3060", "--mode", "fake", "--", "python",
                script("tiny_mlp.py"), "--batch", "4000000", "--hidden", "512", "--optimizer",
                "sgd")
    assert proc.returncode == 3, proc.stderr
    assert "RTX-4060: does not fit" in proc.stdout
    assert "RTX-3060: does not fit" in proc.stdout


def test_an_unknown_gpu_lists_the_choices(script):
    proc = xmem("estimate", "--gpu", "A200", "--", "python", script("tiny_mlp.py"))
    assert proc.returncode == 2
    assert "A100-80GB" in proc.stderr and "Traceback" not in proc.stderr


def test_a_missing_script_is_a_clear_error():
    proc = xmem("estimate", "--", "python", "no/such/train.py")
    assert proc.returncode == 2
    assert "script not found: no/such/train.py" in proc.stderr


def test_a_script_failing_before_its_first_step_shows_its_traceback(script):
    proc = xmem("estimate", "--gpu", "A100-40GB", "--", "python", script("raises.py"))
    assert proc.returncode == 2
    assert "ValueError: bad config" in proc.stderr
    assert "raises.py" in proc.stderr and "exit status 1" in proc.stderr


def test_a_script_failing_after_its_first_step_is_an_error_and_not_an_estimate(script):
    proc = xmem("estimate", "--gpu", "A100-40GB", "--json", "--steps", "3", "--", "python",
                script("raises_after_first_step.py"))
    assert proc.returncode == 2
    assert proc.stdout == ""  # no estimate from the one step it made
    assert "RuntimeError: corrupt record in shard 3 after 1 of 3 optimizer steps" in proc.stderr
    assert "raises_after_first_step.py" in proc.stderr and "exit status 1" in proc.stderr
    assert "before its first optimizer step" not in proc.stderr


def test_a_script_without_optimizer_step_is_a_clear_error(script):
    proc = xmem("estimate", "--gpu", "A100-40GB", "--", "python", script("no_step.py"))
    assert proc.returncode == 2
    assert "without an optimizer step" in proc.stderr


def test_a_script_too_slow_to_step_is_stopped_by_the_watchdog(tmp_path):
    slow = tmp_path / "slow.py"
    slow.write_text("import time\nimport torch\ntime.sleep(60)\n")
    proc = xmem("estimate", "--gpu", "A100-40GB", "--timeout", "5", "--", "python", str(slow))
    assert proc.returncode == 2
    assert "within 5 s" in proc.stderr


def test_a_bad_alloc_conf_is_rejected(script):
    proc = xmem("estimate", "--gpu", "A100-40GB", "--alloc-conf", "max_split_size_mb:abc",
                "--", "python", script("tiny_mlp.py"))
    assert proc.returncode == 2
    assert "max_split_size_mb" in proc.stderr and "Traceback" not in proc.stderr


def test_trace_and_plot_files_are_written(script, tmp_path):
    trace, plot = tmp_path / "t.json", tmp_path / "p.png"
    proc = xmem("estimate", "--gpu", "L40S", "--trace", str(trace), "--plot", str(plot), "--",
                "python", script("tiny_mlp.py"), "--hidden", "32")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(trace.read_text())["format"] == "xmem-trace"
    assert plot.read_bytes()[:4] == b"\x89PNG"
    sim = xmem("simulate", str(trace), "--json")
    assert sim.returncode == 0, sim.stderr
