"""The allocator settings a program sets in its own environment before its first GPU tensor (as
Axolotl's CLI sets ``PYTORCH_ALLOC_CONF=expandable_segments:True``) are the ones its torch runs
with, so they are the ones simulated: the probe records them at the job's first GPU block."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "estimator" / "scripts"
MLP = ["--hidden", "640", "--batch", "96"]  # sizes whose peak differs with expandable segments


def estimate(tmp_path: Path, settings: Dict[str, str], *command: str) -> Dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    trace = tmp_path / "trace.json"
    proc = subprocess.run([sys.executable, "-m", "xmem_admission.cli", "estimate", "--json",
                           "--gpu", "H100-80GB", "--trace", str(trace), "--", "python", *command],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**env, **settings})
    assert proc.returncode == 0, proc.stderr
    (gpu,) = json.loads(proc.stdout)["gpus"]
    return {"total": gpu["total_bytes"], "meta": json.loads(trace.read_text())["meta"]}


def test_settings_the_program_gives_itself_are_simulated_as_if_the_environment_gave_them(
        tmp_path):
    import torch

    # the variable this torch reads: PYTORCH_ALLOC_CONF from 2.10 (torch_releases.py)
    release = tuple(int(n) for n in torch.__version__.split("+")[0].split(".")[:2])
    variable = "PYTORCH_ALLOC_CONF" if release >= (2, 10) else "PYTORCH_CUDA_ALLOC_CONF"
    own = estimate(tmp_path, {}, str(SCRIPTS / "sets_its_allocator.py"), variable)
    given = estimate(tmp_path, {variable: "expandable_segments:True"},
                     str(SCRIPTS / "tiny_mlp.py"), *MLP)
    plain = estimate(tmp_path, {}, str(SCRIPTS / "tiny_mlp.py"), *MLP)
    assert own["meta"]["alloc_conf_env"] == {variable: "expandable_segments:True"}
    assert plain["meta"]["alloc_conf_env"] == {}
    assert own["total"] == given["total"] != plain["total"]
