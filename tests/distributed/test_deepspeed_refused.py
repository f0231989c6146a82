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
