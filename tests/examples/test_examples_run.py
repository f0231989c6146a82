"""The example training scripts run for real, as users run them: ``python examples/train_x.py``.

Each case is a subprocess on the CPU (CUDA hidden) with tiny shapes, so the whole file stays
within a few tens of seconds while still executing every feature the estimator must handle:
several optimizers, autocast in bf16 and fp16 with a GradScaler, activation checkpointing,
gradient accumulation, grouped-query attention and auxiliary-logit models.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import List

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LOSS_LINE = re.compile(r"^step (\d+)/(\d+) loss (\S+)$", re.MULTILINE)

GPT_TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "100",
            "--seq-len", "32", "--batch-size", "2"]


def run_example(script: str, args: List[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONHASHSEED="0")
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args],
        capture_output=True, text=True, timeout=300, env=env, cwd=EXAMPLES.parent,
    )


def losses(result: subprocess.CompletedProcess, steps: int) -> List[float]:
    assert result.returncode == 0, result.stderr
    found = LOSS_LINE.findall(result.stdout)
    assert [(int(s), int(n)) for s, n, _ in found] == [(i, steps) for i in range(1, steps + 1)]
    values = [float(v) for _, _, v in found]
    assert all(math.isfinite(v) and v > 0 for v in values)
    return values


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "resnet18", "--optimizer", "sgd"],
        ["--model", "mobilenet_v3_small", "--optimizer", "AdamW", "--amp", "bf16"],
        # GoogLeNet returns auxiliary logits while training.
        ["--model", "googlenet", "--optimizer", "RMSprop", "--image-size", "64"],
    ],
    ids=["resnet18-sgd", "mobilenet-adamw-bf16", "googlenet-aux-rmsprop"],
)
def test_the_cnn_example_trains_any_torchvision_classifier_and_prints_each_loss(args):
    result = run_example(
        "train_cnn.py",
        ["--batch-size", "2", "--image-size", "32", "--num-classes", "10", "--steps", "2", *args],
    )
    losses(result, 2)


def test_the_gpt_example_starts_near_uniform_loss_and_counts_its_parameters():
    result = run_example("train_gpt.py", [*GPT_TINY, "--kv-heads", "2", "--steps", "2",
                                          "--optimizer", "sgd"])
    first = losses(result, 2)[0]
    assert abs(first - math.log(100)) < 0.2  # small init: predictions start near uniform
    # embed + 2 x (2 norms, q, k, v with 2 of 4 heads, o, SwiGLU 3 x 64 x 256) + norm + head
    hidden, head_dim, inter = 64, 16, 256
    block = 2 * hidden + hidden * 4 * head_dim + 2 * hidden * 2 * head_dim \
        + 4 * head_dim * hidden + 3 * hidden * inter
    expected = 100 * hidden + 2 * block + hidden + hidden * 100
    assert f"model: {expected:,} parameters" in result.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--optimizer", "Adam", "--amp", "bf16", "--grad-ckpt", "--grad-accum", "2"],
        ["--optimizer", "adagrad", "--amp", "fp16", "--kv-heads", "1"],
        ["--optimizer", "RMSPROP", "--grad-ckpt", "--intermediate", "96"],
    ],
    ids=["adam-bf16-ckpt-accum", "adagrad-fp16-gradscaler-mqa", "rmsprop-ckpt-intermediate"],
)
def test_the_gpt_example_runs_with_mixed_precision_checkpointing_and_accumulation(args):
    losses(run_example("train_gpt.py", [*GPT_TINY, "--steps", "2", *args]), 2)


def test_the_same_seed_gives_the_same_losses():
    args = [*GPT_TINY, "--steps", "2", "--grad-accum", "2"]
    assert losses(run_example("train_gpt.py", args), 2) == losses(
        run_example("train_gpt.py", args), 2
    )


def load_example(script: str) -> ModuleType:
    """Import an example as a module (its ``main`` does not run), to call its argument parser."""
    spec = importlib.util.spec_from_file_location(f"example_{Path(script).stem}", EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "script, args, message",
    [
        ("train_cnn.py", ["--model", "resnet19"], "unknown torchvision classifier 'resnet19'"),
        ("train_cnn.py", ["--optimizer", "lamb"], "invalid choice: 'lamb'"),
        ("train_gpt.py", ["--hidden", "60", "--heads", "8"], "must be a multiple of --heads"),
        ("train_gpt.py", ["--heads", "4", "--kv-heads", "3", "--hidden", "64"],
         "must be a multiple of --kv-heads"),
        ("train_gpt.py", ["--hidden", "36", "--heads", "4"], "even head size"),
        ("train_gpt.py", ["--grad-accum", "0"], "--grad-accum must be at least 1"),
    ],
)
def test_bad_arguments_stop_the_examples_with_a_clear_message(script, args, message, capsys):
    with pytest.raises(SystemExit) as info:
        load_example(script).parse_args(args)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_gpt_example_defaults_follow_the_documented_rules():
    args = load_example("train_gpt.py").parse_args(["--hidden", "4096", "--heads", "32"])
    assert args.kv_heads == 32
    assert args.intermediate == 11008  # Llama-2-7B's width from the 8/3 rule
    assert args.steps == 10


def test_the_examples_do_not_depend_on_xmem():
    for script in ("train_cnn.py", "train_gpt.py"):
        source = (EXAMPLES / script).read_text()
        assert "xmem_admission" not in source
        assert 'if __name__ == "__main__":\n    main()' in source
