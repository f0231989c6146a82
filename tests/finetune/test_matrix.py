"""The fine-tuning jobs a shared cluster runs most, estimated as a user runs them.

Each job is a script in ``tests/finetune/scripts`` written as its library's documentation writes
it (Transformers ``Trainer`` with PEFT LoRA, a full fine-tune, ``torch.compile``, TRL's SFT, DPO
and GRPO trainers), on a tiny Llama checkpoint made locally (``conftest.llama_checkpoint``), run
through ``xmem estimate --python <torch 2.15 env> --json --gpu H100-80GB,H200`` in the default
mode. What a user sees is asserted: exit status 0, ``"mode": "fake"`` (no fallback to real
execution), the model's parameters, gradients and optimizer state on the GPU at the second step
(counted from the checkpoint's own safetensors header and the job's recipe, never from the
probe). The peak against the same job run for real on the CPU is the benchmark's figure
(``bench/coverage/finetune_matrix.py``), not a test's.

A job the probe cannot estimate in fake mode today is in ``FAILS_TODAY`` with the exact failure:
it runs as ``xfail(strict=True)``, so the change that fixes it turns it into an XPASS, and its
line is deleted.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple, Union

import pytest

from tests.estimator.trace_counts import live_by_category_at
from tests.support.torch_envs import NEWEST
from xmem_admission.estimator.trace import Trace

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
ITEMSIZE = {"bfloat16": 2, "float32": 4}
SAFETENSORS_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}


@dataclass(frozen=True)
class Job:
    """One fine-tuning job and what its GPU must hold, from its recipe.

    ``weights``: the dtype the script's model is loaded in. Transformers 5's ``from_pretrained``
    without ``dtype`` takes the checkpoint's (``dtype=None`` becomes ``"auto"``, which reads
    ``config.dtype``: transformers/modeling_utils.py, ``from_pretrained`` and ``_get_dtype``), bf16
    here; TRL loading a model from its path defaults to float32
    (trl/trainer/utils.py, ``create_model_from_path``: ``kwargs.get("dtype", "float32")``).
    ``lora``: a LoRA adapter of rank 16 on q/k/v/o_proj; PEFT keeps adapter weights in float32
    even on a bf16 model (peft/tuners/tuners_utils.py, ``cast_adapter_dtype``), so adapter
    parameters, their gradients and Adam moments are float32. ``copies``: models held on the GPU
    (DPO without PEFT keeps a second copy as its reference).
    """

    id: str
    script: str
    args: Tuple[str, ...] = ()
    weights: str = "bfloat16"
    lora: bool = False
    copies: int = 1
    batch: int = 2


JOBS = [
    Job("trainer_lora", "trainer_lora.py", lora=True),
    Job("trainer_full", "trainer_full.py"),
    Job("trainer_compile", "trainer_compile.py", weights="float32"),
    Job("compile_loop", "trainer_compile.py", ("--style", "loop"), weights="float32"),
    Job("sft", "trl_sft.py", weights="float32", lora=True),
    Job("sft_packing", "trl_sft.py", ("--packing",), weights="float32", lora=True),
    Job("sft_padding_free", "trl_sft.py", ("--padding-free",), weights="float32", lora=True),
    Job("sft_completion_only", "trl_sft.py", ("--completion-only",), weights="float32",
        lora=True),
    Job("sft_liger", "trl_sft.py", ("--liger",), weights="float32", lora=True),
    Job("dpo_lora", "trl_dpo.py", lora=True),
    Job("dpo_full", "trl_dpo.py", ("--no-peft",), copies=2),
    Job("grpo", "trl_grpo.py", weights="float32", batch=4),
]

# Every job that fails today, with the exact failure: delete a line when its job passes.
FAILS_TODAY: Dict[str, str] = {}


def params(jobs, failing):
    """One pytest parameter per job; a job in ``failing`` is a strict xfail with its failure."""
    return [pytest.param(job, id=job.id,
                         marks=[pytest.mark.xfail(strict=True, reason=failing[job.id])]
                         if job.id in failing else [])
            for job in jobs]


# -- what the GPU must hold, from the checkpoint and the recipe -----------------------------------

def checkpoint_tensors(checkpoint: Path) -> Dict[str, Tuple[str, Tuple[int, ...]]]:
    """Name -> (dtype, shape) of every tensor in the checkpoint, from its safetensors header
    (an 8-byte little-endian length, then that much JSON)."""
    with open(checkpoint / "model.safetensors", "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    return {name: (entry["dtype"], tuple(entry["shape"]))
            for name, entry in header.items() if name != "__metadata__"}


def numel(shape: Tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def expected_state(checkpoint: Path, job: Job) -> Dict[str, int]:
    """Bytes of parameters (with buffers), gradients and optimizer state on the GPU at a step.

    The rotary embedding holds two float32 buffers of head_dim / 2 each, ``inv_freq`` and
    ``original_inv_freq`` (transformers/models/llama/modeling_llama.py, LlamaRotaryEmbedding).
    The optimizer is AdamW: exp_avg and exp_avg_sq of each trainable parameter's size and dtype.
    The Trainer's default since torch 2.8 is the fused one (transformers/training_args.py:
    ``default_optim = "adamw_torch_fused"``), which also keeps a 4-byte float32 ``step`` per
    parameter on its device (torch/optim/adamw.py and optimizer.py, ``_get_scalar_dtype``); the
    compiled loop's own ``torch.optim.AdamW`` takes the foreach path, whose ``step`` is a host
    tensor.
    """
    config = json.loads((checkpoint / "config.json").read_text())
    tensors = checkpoint_tensors(checkpoint)
    base = sum(numel(shape) for _, shape in tensors.values())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    buffers = 2 * (head_dim // 2) * 4
    model = base * ITEMSIZE[job.weights] + buffers
    if job.lora:
        r, hidden = 16, config["hidden_size"]
        q_out = config["num_attention_heads"] * head_dim
        kv_out = config["num_key_value_heads"] * head_dim
        # A is r x in, B is out x r, for q, k, v (in: hidden) and o (in: q_out, out: hidden)
        per_layer = r * (hidden + q_out) + 2 * r * (hidden + kv_out) + r * (q_out + hidden)
        trainable_numel = per_layer * config["num_hidden_layers"]
        trainable_bytes = trainable_numel * 4
        trainable_tensors = 8 * config["num_hidden_layers"]
        parameters = job.copies * model + trainable_bytes
    else:
        trainable_bytes = base * ITEMSIZE[job.weights]
        trainable_tensors = len(tensors)
        parameters = job.copies * model
    fused = job.id != "compile_loop"
    return {"parameter": parameters, "gradient": trainable_bytes,
            "optimizer_state": 2 * trainable_bytes + (4 * trainable_tensors if fused else 0)}


# -- running xmem estimate as a user does -----------------------------------------------------------

def estimate(checkpoint: Path, job: Job, trace: Path, mode: Optional[str] = None) -> dict:
    command = [sys.executable, "-m", "xmem_admission.cli", "estimate", "--python",
               NEWEST.interpreter, "--json", "--gpu", "H100-80GB,H200", "--trace", str(trace)]
    if mode is not None:
        command += ["--mode", mode]
    command += ["--", "python", str(SCRIPTS / job.script), "--model", str(checkpoint),
                "--batch-size", str(job.batch), "--seq-len", "64", *job.args]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


Estimates = Dict[str, Union[Tuple[dict, Path], AssertionError]]


@pytest.fixture(scope="module")
def fake_estimates() -> Estimates:
    """Each job's default-mode estimate and its trace (or its failure), made once."""
    return {}


def fake_estimate(cache: Estimates, checkpoint: Path, job: Job,
                  folder: Path) -> Tuple[dict, Path]:
    if job.id not in cache:
        trace = folder / "fake.json"
        try:
            cache[job.id] = (estimate(checkpoint, job, trace), trace)
        except AssertionError as failure:
            cache[job.id] = failure
    entry = cache[job.id]
    if isinstance(entry, AssertionError):
        raise entry
    return entry


@pytest.mark.parametrize("job", params(JOBS, FAILS_TODAY))
def test_a_fine_tuning_job_is_estimated_in_fake_mode_with_its_model_state(
        llama_checkpoint, fake_estimates, tmp_path, job):
    result, trace = fake_estimate(fake_estimates, llama_checkpoint, job, tmp_path)
    assert result["mode"] == "fake", result.get("fallback_reason")
    assert "fallback_reason" not in result
    assert result["steps"] == 3
    live = live_by_category_at(Trace.load(str(trace)), "step 2")
    want = expected_state(llama_checkpoint, job)
    assert {k: live.get(k, 0) for k in want} == want


def test_grpos_estimate_bounds_the_same_job_run_with_real_values(llama_checkpoint, fake_estimates,
                                                                 tmp_path):
    """GRPO's generation is a bound in fake mode (every completion at its maximum length, a
    stand-in token): the job traced with real values (profile mode: real sampling, TRL's Triton
    kernels in Triton's interpreter) needs no more, and on this checkpoint the bound is tight
    (a random model's completions rarely sample the end token: they run to the maximum too)."""
    (job,) = [j for j in JOBS if j.id == "grpo"]
    fake, _ = fake_estimate(fake_estimates, llama_checkpoint, job, tmp_path)
    real = estimate(llama_checkpoint, job, tmp_path / "profile.json", mode="profile")
    assert real["mode"] == "profile"
    for bound, measured in zip(fake["gpus"], real["gpus"]):
        assert bound["gpu"] == measured["gpu"]
        assert measured["peak_allocated_bytes"] <= bound["peak_allocated_bytes"]
        assert measured["total_bytes"] <= bound["total_bytes"] <= 1.01 * measured["total_bytes"]
