"""A DeepSpeed job is refused with the reason wherever the probe meets its engine: the Hugging
Face Trainer with a DeepSpeed config (ZeRO-2 through ``deepspeed.initialize``, ZeRO-3 through
``deepspeed.zero.Init`` while the model is built), not only the ``deepspeed`` launcher; a job that
merely imports DeepSpeed is estimated. Real DeepSpeed (the Makefile installs it into
``.venv/deepspeed``), real ``xmem estimate`` processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.distributed.conftest import script

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEEPSPEED = os.path.join(os.path.dirname(os.path.dirname(sys.executable)), "deepspeed")


def estimate(*command: str, tmp_path) -> subprocess.CompletedProcess:
    if not os.path.isdir(os.path.join(DEEPSPEED, "deepspeed")):
        pytest.fail(f"DeepSpeed is not installed in {DEEPSPEED}: run `make venv`")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, DEEPSPEED]))
    return subprocess.run(
        [sys.executable, "-m", "xmem_admission.cli", "estimate", "--json", "--gpu", "A100-40GB",
         "--", *command, "--out", str(tmp_path / "out")], cwd=ROOT, capture_output=True,
        text=True, env=env, timeout=600)


@pytest.mark.parametrize("stage", ["2", "3"])
def test_a_hugging_face_trainer_with_deepspeed_is_refused_with_the_reason(tmp_path, stage):
    proc = estimate("torchrun", "--nproc-per-node", "2", script("hf_deepspeed.py"),
                    "--stage", stage, tmp_path=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "not estimated: DeepSpeed jobs are not estimated" in proc.stderr
    assert "torchrun and FSDP" in proc.stderr
    assert "Traceback" not in proc.stderr  # refused, not crashed


def test_the_same_trainer_without_a_deepspeed_config_is_estimated(tmp_path):
    proc = estimate("torchrun", "--nproc-per-node", "2", script("hf_deepspeed.py"),
                    "--no-deepspeed", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    gpu = json.loads(proc.stdout)["gpus"][0]
    assert gpu["total_bytes"] > 0 and gpu["breakdown"]["communication"] > 0
