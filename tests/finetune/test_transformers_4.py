"""Fine-tunes written for transformers 4.x load their checkpoint in fake mode too: the project's
own environment has transformers 4.51.3, whose ``from_pretrained`` builds the model under
accelerate-style empty weights (``register_empty_parameter`` rebuilds each parameter by its
type), then reads the safetensors file for its header only."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.finetune.conftest import make

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "finetune" / "scripts"


def test_a_transformers_4_checkpoint_is_loaded_and_fine_tuned_in_fake_mode(tmp_path):
    import transformers

    assert transformers.__version__.startswith("4."), transformers.__version__
    checkpoint = make(tmp_path / "tiny-llama", "tiny", sys.executable)
    proc = subprocess.run(
        [sys.executable, "-m", "xmem_admission.cli", "estimate", "--json", "--gpu", "H100-80GB",
         "--", "python", str(SCRIPTS / "checkpoint_full.py"), "--model", str(checkpoint)],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert result["mode"] == "fake", result.get("fallback_reason")
    config = json.loads((checkpoint / "config.json").read_text())
    # every weight of the bf16 checkpoint on the GPU (the header's sizes), whatever else is there
    header = (checkpoint / "model.safetensors").read_bytes()
    length = int.from_bytes(header[:8], "little")
    weights = sum(end - begin for name, entry in json.loads(header[8:8 + length]).items()
                  if name != "__metadata__" for begin, end in [entry["data_offsets"]])
    assert config["torch_dtype"] in ("bfloat16", "float32")
    assert result["gpus"][0]["breakdown"]["parameters"] >= weights
