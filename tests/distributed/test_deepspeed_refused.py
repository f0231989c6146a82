"""What of DeepSpeed is still refused, with the reason naming the option, and what a DeepSpeed
engine outside the launcher looks like to the probe: a Hugging Face Trainer given a DeepSpeed
config dict under torchrun is traced through DeepSpeed's engine like a ``deepspeed`` launch;
offload to NVMe, pipeline engines, multi-node launches and ``accelerate launch
--use_deepspeed`` with a config file are refused, never estimated as something else. Real ``xmem estimate``
processes with the torch 2.15 environment (``NEWEST``: DeepSpeed 0.19.8)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.conftest import script
from tests.support.torch_envs import NEWEST

ROOT = Path(__file__).resolve().parents[2]


def estimate(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "xmem_admission.cli", "estimate", "--python", NEWEST.interpreter,
         "--json", "--gpu", "H100-80GB", "--", *command], cwd=ROOT, capture_output=True,
        text=True, timeout=600)


def refused(proc: subprocess.CompletedProcess, *words: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr  # refused, not crashed
    for word in words:
        assert word in proc.stderr, proc.stderr[-3000:]


def test_a_trainer_given_a_deepspeed_config_under_torchrun_is_traced_through_its_engine(
        tmp_path):
    proc = estimate("torchrun", "--nproc-per-node", "2", script("hf_deepspeed.py"), "--stage",
                    "2", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["mode"] == "fake"
    assert result["gpus"][0]["breakdown"]["optimizer_state"] > 0


def test_the_same_trainer_without_a_deepspeed_config_is_estimated(tmp_path):
    proc = estimate("torchrun", "--nproc-per-node", "2", script("hf_deepspeed.py"),
                    "--no-deepspeed", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    gpu = json.loads(proc.stdout)["gpus"][0]
    assert gpu["total_bytes"] > 0 and gpu["breakdown"]["communication"] > 0


def test_offload_to_nvme_is_refused_naming_the_option(tmp_path):
    proc = estimate("deepspeed", "--num_gpus", "4", script("deepspeed_trainer.py"),
                    "--deepspeed", script("deepspeed_nvme.json"), "--bf16", "--max_steps", "2",
                    "--report_to", "none", "--output_dir", str(tmp_path / "out"))
    refused(proc, "zero_optimization.offload_param to NVMe (device 'nvme')")


def test_a_deepspeed_pipeline_is_refused_as_its_ranks_hold_different_stages():
    refused(estimate("deepspeed", "--num_gpus", "2", script("deepspeed_pipeline.py")),
            "DeepSpeed pipeline-parallel jobs", "different stage")


@pytest.mark.parametrize("launcher, words", [
    (["deepspeed", "--hostfile", "/job/hostfile", "--num_gpus", "8"], ["--hostfile"]),
    (["deepspeed", "--num_nodes", "2", "--num_gpus", "8"], ["--num_nodes 2"]),
    (["deepspeed", "--include", "worker-0@worker-1"], ["worker-0@worker-1"]),
    (["deepspeed", "--autotuning", "tune", "--num_gpus", "4"], ["--autotuning runs many"]),
    (["accelerate", "launch", "--use_deepspeed", "--config_file", "ds.yaml",
      "--num_processes", "4"], ["with an Accelerate config file (ds.yaml)", "--zero_stage"]),
])
def test_launches_the_probe_cannot_trace_are_refused_naming_the_option(launcher, words):
    refused(estimate(*launcher, script("deepspeed_trainer.py")), *words)


def test_the_import_hook_patches_the_module_once_loaded_and_is_inert_after_the_run(
        tmp_path, monkeypatch):
    from xmem_admission.estimator.probe.distributed import _AfterImport
    from xmem_admission.estimator.probe.torch_patches import Patches

    (tmp_path / "xmem_hooked_demo.py").write_text("def initialize():\n    return 'real'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "xmem_hooked_demo", raising=False)
    hook, patches, seen = _AfterImport("xmem_hooked_demo"), Patches(), []
    try:
        hook.arm(patches, lambda module: seen.append(module.initialize()))
        added_meanwhile = object()
        sys.meta_path.append(added_meanwhile)  # a library's own finder, added during the run
        import xmem_hooked_demo  # noqa: F401

        assert seen == ["real"]  # ran right after the module's own code
    finally:
        patches.restore()
    assert added_meanwhile in sys.meta_path  # restoring the run kept it
    sys.meta_path.remove(added_meanwhile)
    assert hook.then is None  # disarmed: later imports are left alone
    assert hook.find_spec("xmem_hooked_demo") is None
    sys.meta_path.remove(hook)
