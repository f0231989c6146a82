"""Ground truth from a real GPU: measure a matrix of training jobs, then check the estimator on it.

Two halves, because they run on different machines:

**Measuring** (default; on a CUDA machine): runs every job of ``MATRIX`` (the ``examples/``
scripts: CNNs at several batch sizes and optimizers, GPT/Llama-style models from 134M to 6.7B
parameters in fp32 and bf16/fp16 autocast, activation checkpointing, gradient accumulation,
``expandable_segments:True``, and one job sized to run out of memory), each in its own process
(``gpu_truth_runner.py``: fresh CUDA context, empty caching allocator), one at a time, and writes
under ``--out``:

- ``measurements.jsonl``: one JSON object per job (schema ``xmem-gpu-truth-measurement/1``):
  the job (script, args, env, steps), the NVML device peak minus the level before CUDA was
  initialised (``measured_total_bytes``, context included), the context alone, the allocator's
  ``max_memory_reserved`` / ``max_memory_allocated``, OOM or error, versions, GPU name and
  capacity, wall time, and where its snapshot is;
- ``snapshots-N.tar``: the jobs' ``torch.cuda.memory._dump_snapshot()`` pickles, each
  xz-compressed, packed into at most ``MAX_ARCHIVES`` archives of at most ``ARCHIVE_LIMIT`` bytes
  (the device machine returns at most 8 files of 16 MiB);
- ``jobs.log``: what each job printed (its tail);
- ``conv_workspaces.jsonl``: after the matrix, with ``CONV_BUDGET_S`` of the budget kept for
  it, the bytes each cuDNN convolution call holds beyond its outputs, shape by shape
  (``bench/convolution/conv_workspaces.py``: the convolutions of GPUMemNet's CNN jobs, for the workspace
  rule).

This half imports only the standard library here, and the runner only torch and NVML's binding,
because the GPU machine has Python 3.12, torch, torchvision and nvidia-ml-py and no xmem.
It prints its time plan first, and stops starting jobs when ``--budget-s`` would be exceeded.

``--matrix finetune`` measures the fine-tuning jobs instead (``FINETUNE_MATRIX``: the
``tests/finetune/scripts`` jobs on a Llama-shaped checkpoint the harness builds first, with
``tests/finetune/conftest.py``, where the jobs run); bench/data/README.md says what travels with
them to the GPU machine.

**Estimating** (``--estimate``; here, on the CPU): for every measured job runs the real
``xmem estimate --json --gpu <the measured GPU>`` in a subprocess with the job's environment,
replays each snapshot through ``xmem replay --json``, writes ``bench/data/<gpu-key>/truth.jsonl``
(one row per job) and ``summary.json`` beside it, copies the measurements and archives there, and
prints the error table: median, p90 and worst under-estimate of the total and of the reserved
peak. Exit status 0, or 1 when an estimate failed or a replay did not match, 2 on bad input.

**Dry run** (``--dry-run``): both halves on the CPU with tiny jobs (no CUDA, no NVML: GPU fields
are zeros and rows say ``dry_run: true``), into ``--out`` or a temporary directory, never under
``bench/data/``. CI runs it (``tests/bench/test_gpu_truth.py``).

Usage::

    python bench/yardsticks/gpu_truth.py --plan                      # the matrix and its time plan
    python3 bench/yardsticks/gpu_truth.py --out DIR                  # measure (GPU machine)
    .venv/bin/python bench/yardsticks/gpu_truth.py --estimate --measurements DIR/measurements.jsonl
    .venv/bin/python bench/yardsticks/gpu_truth.py --dry-run [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import lzma
import math
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).resolve().with_name("gpu_truth_runner.py")
DATA = ROOT / "bench" / "data"
GPT_SCRIPT = "examples/train_gpt.py"
CNN_SCRIPT = "examples/train_cnn.py"
FINETUNE_SCRIPTS = "tests/finetune/scripts"
# The fine-tuning jobs load a Llama-shaped checkpoint that tests/finetune/conftest.py writes
# (``--shape tiny|bench``): built where the jobs run (on the GPU machine before the first job, in
# the estimating half again: the estimate reads its shapes, which a rebuild gives alike), and
# named in a job's arguments by CHECKPOINT.
CHECKPOINT_BUILDER = ROOT / "tests" / "finetune" / "conftest.py"
CHECKPOINT = "{checkpoint}"
SCHEMA = "xmem-gpu-truth-measurement/1"
TRUTH_SCHEMA = "xmem-gpu-truth/1"
MEASUREMENTS = "measurements.jsonl"

# Optimizer steps per job, on the GPU and in `xmem estimate --steps` alike: the estimator's
# default (3), enough for the optimizer state to exist and the allocator's cache to settle.
STEPS = 3
DRY_RUN_STEPS = 2
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
# The device machine returns at most 8 files of 16 MiB each (/work/.library/device/README.md,
# Limits): measurements.jsonl, jobs.log and conv_workspaces.jsonl take three, the archives at
# most five, each kept 1 MiB under the limit for tar headers and slack.
MAX_ARCHIVES = 5
ARCHIVE_LIMIT = 15 * 2**20
LOG_TAIL_CHARS = 20_000  # per job, so that jobs.log stays far below 16 MiB
CONV_SCRIPT = ROOT / "bench" / "convolution" / "conv_workspaces.py"
CONV_WORKSPACES = "conv_workspaces.jsonl"
FIT_OUTSIDE = ROOT / "bench" / "fits" / "fit_outside.py"
# Seconds of the budget kept for the convolution shapes after the matrix (120 shapes, six calls
# each; the largest shapes come last and are the ones a short budget leaves out).
CONV_BUDGET_S = 60.0

# --- Time plan -----------------------------------------------------------------------------------
# Planning figures, not GPU facts the estimator uses; each run records every job's real wall_s.
# Per-process start: interpreter, `import torch` (+ torchvision), CUDA context, lazy kernel
# loading, snapshot dump. An assumption, to be replaced by the measured wall_s of small jobs.
PLAN_START_S = 8.0
# The same for a fine-tuning job, whose imports (transformers, peft, trl, accelerate) and
# checkpoint load take 12-15 s of a tiny job's 18 s on this project's 2-core machine (py-spy of
# `xmem estimate` of tests/finetune/scripts/trainer_lora.py, bench/coverage/README.md): assumed
# 30 s there, with the 0.83B checkpoint's load.
PLAN_FINETUNE_START_S = 30.0
# A GRPO step generates its completions one token at a time: 512 steps of the 0.83B model, its
# weights read once a step (1.7 GB at about 3 TB/s, device KINDS.md's copy rate, is 0.6 ms), in
# practice bounded by Python's per-step overhead, assumed 20 ms: about 10 s per optimizer step.
PLAN_GENERATION_S_PER_STEP = 10.0
# Building a model on the host (nn.Linear's init, then the example's normal_ init): 8.3 ns per
# parameter measured here (GPT 411M built in 3.4 s with torch's 2 CPU threads); the device
# machine has 16 cores, so this is an upper bound there.
PLAN_BUILD_S_PER_PARAM = 8.3e-9
# Host-to-device copy of the fp32 model from pageable memory: 10 GB/s assumed (well under PCIe
# Gen5 x16's 64 GB/s nominal; pageable copies run far below the link rate).
PLAN_H2D_BYTES_PER_S = 10e9
# Matrix rates: bf16 788 TFLOP/s measured on this workplace's H200 (device KINDS.md, 8192^3
# product); fp32 without TF32 (torch's default) 67 TFLOP/s (H200.md, datasheet). Training steps
# of these sizes reach a fraction of peak: 30% assumed.
PLAN_BF16_FLOPS = 788e12
PLAN_FP32_FLOPS = 67e12
PLAN_EFFICIENCY = 0.30


def _plan_rate(amp: Optional[str]) -> float:
    return (PLAN_BF16_FLOPS if amp in ("bf16", "fp16") else PLAN_FP32_FLOPS) * PLAN_EFFICIENCY


class HarnessError(Exception):
    """Bad input or an unusable environment: one clear message, exit status 2."""


# --- The matrix ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GptShape:
    """A decoder shape for examples/train_gpt.py; the parameter count follows its GPT class."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    kv_heads: Optional[int] = None
    intermediate: Optional[int] = None

    @property
    def mlp_width(self) -> int:
        """train_gpt.llama_intermediate(): 8/3 * hidden rounded up to a multiple of 256."""
        if self.intermediate is not None:
            return self.intermediate
        width = int(2 * 4 * self.hidden / 3)
        return 256 * ((width + 255) // 256)

    @property
    def parameters(self) -> int:
        """Untied embedding and LM head, per block q/k/v/o + SwiGLU + two RMSNorms, final norm."""
        h, kv = self.hidden, (self.kv_heads or self.heads)
        kv_width = kv * (h // self.heads)
        block = 2 * h * h + 2 * h * kv_width + 3 * h * self.mlp_width + 2 * h
        return 2 * self.vocab * h + self.layers * block + h

    def args(self) -> List[str]:
        out = ["--layers", str(self.layers), "--hidden", str(self.hidden), "--heads",
               str(self.heads), "--vocab", str(self.vocab)]
        if self.kv_heads is not None:
            out += ["--kv-heads", str(self.kv_heads)]
        if self.intermediate is not None:
            out += ["--intermediate", str(self.intermediate)]
        return out

    def label(self) -> str:
        n = self.parameters
        if n >= 1e9:
            return f"{n / 1e9:.1f}b"
        return f"{round(n / 1e6)}m" if n >= 1e6 else f"{round(n / 1e3)}k"


# GPT-2-style widths (GPT-3 paper, table 2.1: 125M 12x768, 350M 24x1024, 760M 24x1536,
# 1.3B 24x2048, 2.7B 32x2560) with this example's untied head and SwiGLU MLP, so the counts
# come out higher; a Llama-3.2-1B-like GQA shape; and Llama-2-7B (32x4096, MLP 11008, vocab
# 32000, Llama 2 paper).
GPT_SMALL = GptShape(12, 768, 12, 32000)
GPT_MEDIUM = GptShape(24, 1024, 16, 50257)
GPT_LARGE = GptShape(24, 1536, 16, 50257)
GPT_XL = GptShape(24, 2048, 16, 50257)
GPT_2_7B = GptShape(32, 2560, 32, 50257)
LLAMA_1B_GQA = GptShape(16, 2048, 32, 32000, kv_heads=8, intermediate=8192)
LLAMA_7B = GptShape(32, 4096, 32, 32000, intermediate=11008)

# Forward GFLOPs per 224x224 image: torchvision's weights metadata (meta["_ops"]).
CNN_GFLOPS = {"resnet18": 1.814, "resnet50": 4.089, "vit_b_16": 17.564,
              "efficientnet_b0": 0.386, "mobilenet_v3_large": 0.217}
# Parameters: the same metadata (meta["num_params"]).
CNN_PARAMS = {"resnet18": 11_689_512, "resnet50": 25_557_032,
              "vit_b_16": 86_567_656, "efficientnet_b0": 5_288_548,
              "mobilenet_v3_large": 5_483_032}


@dataclass(frozen=True)
class Job:
    """One training run: which example, with which arguments and environment, and what to expect.

    ``expect``: "fits" (must run to completion on the target GPU), "oom" (sized to run out of
    memory), "edge" (the estimate is within a hair of the capacity: measured for what it teaches,
    run last, counted as neither).
    """

    name: str
    script: str
    args: Tuple[str, ...]
    parameters: int
    step_flops: float  # per optimizer step, for the time plan
    amp: Optional[str] = None
    env: Dict[str, str] = field(default_factory=dict)
    expect: str = "fits"
    note: str = ""
    # How the script is told its number of optimizer steps.
    steps_flag: str = "--steps"
    # The shape of the checkpoint CHECKPOINT in ``args`` stands for (tests/finetune/conftest.py).
    checkpoint: Optional[str] = None
    # Arguments added in a dry run only (a script that needs to be told to train on the CPU).
    dry_args: Tuple[str, ...] = ()
    start_s: float = PLAN_START_S
    extra_s_per_step: float = 0.0

    def planned_seconds(self) -> float:
        """Start + host build + copy + steps, from the planning figures above."""
        build = self.parameters * PLAN_BUILD_S_PER_PARAM
        copy = self.parameters * 4 / PLAN_H2D_BYTES_PER_S
        steps = STEPS * (self.step_flops / _plan_rate(self.amp) + self.extra_s_per_step)
        if self.expect == "oom":
            # Dies in its first forward pass: a third of one step.
            steps = self.step_flops / 3 / _plan_rate(self.amp)
        return self.start_s + build + copy + steps

    def arguments(self, steps: int, checkpoint: Optional[Path] = None,
                  dry_run: bool = False) -> List[str]:
        """The script's arguments for ``steps`` optimizer steps, CHECKPOINT replaced by the
        folder ``checkpoint`` where given."""
        return script_arguments(self.args, self.steps_flag, steps, checkpoint,
                                self.dry_args if dry_run else ())

    def command(self, steps: int) -> List[str]:
        """The training command (script relative to the repo root) as a user would type it."""
        return ["python", self.script, *self.arguments(steps)]


def script_arguments(args: Sequence[str], steps_flag: str, steps: int,
                     checkpoint: Optional[Path] = None, extra: Sequence[str] = ()) -> List[str]:
    """A job's script arguments (a Job's or a measured row's): ``args`` with CHECKPOINT replaced
    by the folder ``checkpoint`` where given, then ``extra``, then the steps."""
    named = [str(checkpoint) if a == CHECKPOINT and checkpoint else a for a in args]
    return named + list(extra) + [steps_flag, str(steps)]


def cnn_job(model: str, batch: int, optimizer: str, amp: Optional[str] = None,
            env: Optional[Dict[str, str]] = None, suffix: str = "") -> Job:
    args = ["--model", model, "--batch-size", str(batch), "--optimizer", optimizer]
    if amp:
        args += ["--amp", amp]
    name = f"cnn-{model}-b{batch}-{optimizer}" + (f"-{amp}" if amp else "") + suffix
    # Training step = forward + backward, about three forwards.
    flops = 3 * CNN_GFLOPS[model] * 1e9 * batch
    return Job(name, CNN_SCRIPT, tuple(args), CNN_PARAMS[model], flops, amp, dict(env or {}))


def gpt_job(shape: GptShape, batch: int, *, seq: int = 1024, optimizer: str = "adamw",
            amp: Optional[str] = None, ckpt: bool = False, accum: int = 1,
            env: Optional[Dict[str, str]] = None, expect: str = "fits", family: str = "gpt",
            suffix: str = "", note: str = "") -> Job:
    args = shape.args() + ["--seq-len", str(seq), "--batch-size", str(batch),
                           "--optimizer", optimizer]
    if amp:
        args += ["--amp", amp]
    if ckpt:
        args += ["--grad-ckpt"]
    if accum > 1:
        args += ["--grad-accum", str(accum)]
    name = (f"{family}-{shape.label()}-{amp or 'fp32'}-b{batch}"
            + (f"x{accum}" if accum > 1 else "") + (f"-s{seq}" if seq != 1024 else "")
            + f"-{optimizer}" + ("-ckpt" if ckpt else "") + suffix)
    # 6 FLOPs per parameter per token (forward + backward) plus causal attention's
    # 12 * layers * hidden * seq per token; checkpointing adds one more forward (x 4/3).
    tokens = batch * seq * accum
    per_token = 6 * shape.parameters + 12 * shape.layers * shape.hidden * seq
    flops = tokens * per_token * (4 / 3 if ckpt else 1)
    return Job(name, GPT_SCRIPT, tuple(args), shape.parameters, flops, amp, dict(env or {}),
               expect, note)


MATRIX: Tuple[Job, ...] = (
    # CNNs: batch sizes 32/64/128, five optimizers, bf16 autocast, expandable segments.
    cnn_job("resnet18", 32, "sgd"),
    cnn_job("resnet50", 32, "sgd"),
    cnn_job("resnet50", 128, "sgd"),
    cnn_job("resnet50", 64, "adam"),
    cnn_job("resnet50", 64, "adamw", amp="bf16"),
    cnn_job("resnet50", 64, "sgd", env=EXPANDABLE, suffix="-expandable"),
    cnn_job("vit_b_16", 32, "adamw"),
    cnn_job("efficientnet_b0", 64, "rmsprop"),
    cnn_job("mobilenet_v3_large", 128, "adagrad"),
    # GPT/Llama-style decoders, 134M to 6.7B parameters.
    gpt_job(GPT_SMALL, 8),
    gpt_job(GPT_SMALL, 8, amp="bf16"),
    gpt_job(GPT_SMALL, 8, amp="fp16"),
    gpt_job(GPT_SMALL, 8, accum=4),
    gpt_job(GPT_SMALL, 16, amp="bf16", ckpt=True),
    gpt_job(GPT_MEDIUM, 8, amp="bf16"),
    gpt_job(GPT_MEDIUM, 4, optimizer="sgd", amp="bf16"),
    gpt_job(GPT_LARGE, 8, amp="bf16", env=EXPANDABLE, suffix="-expandable"),
    gpt_job(GPT_XL, 4),
    gpt_job(GPT_XL, 8, amp="bf16", ckpt=True),
    gpt_job(GPT_XL, 8, amp="bf16", env=EXPANDABLE, suffix="-expandable"),
    gpt_job(LLAMA_1B_GQA, 4, seq=2048, amp="bf16", family="llama-gqa"),
    gpt_job(GPT_2_7B, 4, amp="bf16", accum=2),
    gpt_job(LLAMA_7B, 1, seq=4096, amp="bf16", env=EXPANDABLE, family="llama",
            suffix="-expandable"),
    # Sized to run out of memory: its activations alone are several times the card.
    gpt_job(GPT_XL, 32, seq=2048, expect="oom"),
    # The same Llama-2-7B shape with the default allocator: the estimator puts it within 0.3 GiB
    # of an H200's capacity (AdamW's foreach temporaries plus the cache's fragmentation), so
    # which side of the line it lands on is worth one measurement; run last, when time remains.
    gpt_job(LLAMA_7B, 1, seq=4096, amp="bf16", family="llama", expect="edge",
            note="estimate within 0.3 GiB of the capacity"),
)

# The fine-tuning matrix (--matrix finetune): the jobs of tests/finetune/test_matrix.py and
# bench/coverage/finetune_matrix.py as a user runs them, on the ~0.83B checkpoint (its "bench"
# shape: a TinyLlama-like layout) at the sizes bench/coverage/README.md times them with. Each
# runs in the GPU machine's own Python; trl, bitsandbytes, datasets and peft travel as wheels
# (bench/data/README.md, "Fine-tuning rows").
FINETUNE_SHAPE = GptShape(16, 2048, 32, 32000, kv_heads=8, intermediate=5632)


def finetune_job(name: str, script: str, *args: str, tokens: int, full: bool = False,
                 steps_flag: str = "--max-steps", generation: bool = False,
                 positional: bool = False, shape: str = "bench",
                 parameters: int = FINETUNE_SHAPE.parameters) -> Job:
    """A script of tests/finetune/scripts on the checkpoint; ``tokens`` per optimizer step.
    A LoRA job computes no weight gradients: 4 FLOPs per parameter and token, not 6."""
    model = [CHECKPOINT] if positional else ["--model", CHECKPOINT]
    flops = (6 if full else 4) * parameters * tokens
    return Job(f"ft-{name}", f"{FINETUNE_SCRIPTS}/{script}", tuple(model + list(args)),
               parameters, flops, "bf16", steps_flag=steps_flag, checkpoint=shape,
               dry_args=() if positional else ("--cpu",), start_s=PLAN_FINETUNE_START_S,
               extra_s_per_step=PLAN_GENERATION_S_PER_STEP if generation else 0.0)


FINETUNE_MATRIX: Tuple[Job, ...] = (
    finetune_job("trainer-lora", "trainer_lora.py", "--batch-size", "4", "--seq-len", "1024",
                 tokens=4 * 1024),
    finetune_job("qlora-trainer", "bnb_qlora_trainer.py", "--batch-size", "2", "--seq-len",
                 "512", tokens=2 * 512, steps_flag="--steps", positional=True),
    finetune_job("sft-lora", "trl_sft.py", "--batch-size", "4", "--seq-len", "1024",
                 tokens=4 * 1024),
    finetune_job("dpo-lora", "trl_dpo.py", "--batch-size", "4", "--seq-len", "1024",
                 tokens=2 * 4 * 1024),
    finetune_job("grpo", "trl_grpo.py", "--batch-size", "4", "--seq-len", "1024",
                 tokens=4 * 1024, full=True, generation=True),
    finetune_job("trainer-full", "trainer_full.py", "--batch-size", "4", "--seq-len", "1024",
                 tokens=4 * 1024, full=True),
    # last: Inductor compiles the model first, a time the plan does not count
    finetune_job("trainer-compile", "trainer_compile.py", "--batch-size", "4", "--seq-len",
                 "1024", tokens=4 * 1024, full=True),
)

# Tiny jobs for --dry-run: every code path of the harness (plain fp32, autocast, accumulation,
# activation checkpointing, a job environment carrying an allocator option) in a few seconds of
# CPU each. Both are GPT jobs: the harness treats every script alike, and the CNN example's
# torchvision import alone would double the dry run's time.
_TINY = GptShape(2, 64, 4, 128)
DRY_RUN_MATRIX: Tuple[Job, ...] = (
    gpt_job(_TINY, 2, seq=32, family="tiny-gpt"),
    gpt_job(_TINY, 2, seq=32, amp="bf16", accum=2, ckpt=True, env=EXPANDABLE, family="tiny-gpt",
            suffix="-expandable"),
)
# The fine-tuning dry run: one Trainer + LoRA job on the tests' tiny checkpoint, on the CPU.
DRY_RUN_FINETUNE_MATRIX: Tuple[Job, ...] = (
    finetune_job("trainer-lora-tiny", "trainer_lora.py", "--batch-size", "2", "--seq-len", "64",
                 tokens=2 * 64, shape="tiny", parameters=170_000),
)
MATRICES = {"main": (MATRIX, DRY_RUN_MATRIX), "finetune": (FINETUNE_MATRIX, DRY_RUN_FINETUNE_MATRIX)}


def build_checkpoint(shape: str, folder: Path, python: str) -> Path:
    """The Llama-shaped checkpoint of ``shape`` written into ``folder`` by ``python`` (which
    needs transformers and tokenizers); a failed build is a HarnessError naming its last line."""
    target = folder / f"llama-{shape}"
    try:
        proc = subprocess.run([python, str(CHECKPOINT_BUILDER), "--shape", shape, str(target)],
                              capture_output=True, text=True, cwd=ROOT, timeout=1800)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise HarnessError(f"building the {shape} checkpoint with {python} failed: {exc}") \
            from None
    if proc.returncode != 0:
        raise HarnessError(f"building the {shape} checkpoint with {python} failed (exit "
                           f"{proc.returncode}): {_error_line(proc.stderr)}")
    return target


def plan_table(jobs: Sequence[Job]) -> str:
    """The matrix with each job's planned seconds and the total, printed before measuring."""
    width = max(len(j.name) for j in jobs)
    lines = [f"{'job':<{width}}  {'expect':<6}  {'params':>7}  {'plan s':>6}"]
    for j in jobs:
        lines.append(f"{j.name:<{width}}  {j.expect:<6}  {_count(j.parameters):>7}  "
                     f"{j.planned_seconds():>6.1f}")
    total = sum(j.planned_seconds() for j in jobs)
    fits = sum(j.expect == "fits" for j in jobs)
    lines.append(f"{len(jobs)} jobs ({fits} expected to fit), planned total {total:.0f} s "
                 f"({total / 60:.1f} min)")
    return "\n".join(lines)


def _count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.0f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


# --- Measuring half ------------------------------------------------------------------------------


class SnapshotPacker:
    """Adds xz-compressed snapshots to ``snapshots-N.tar`` archives as jobs finish.

    Each archive is closed before it would pass ``limit`` bytes and a new one started, up to
    ``max_archives``; a snapshot that fits nowhere is left out and the job's row says so. Members
    are written as they come, so a run stopped half-way keeps the snapshots taken so far.
    """

    def __init__(self, out: Path, limit: int = ARCHIVE_LIMIT,
                 max_archives: int = MAX_ARCHIVES) -> None:
        self.out, self.limit, self.max_archives = out, limit, max_archives
        self.archives: List[Path] = []
        self._tar: Optional[tarfile.TarFile] = None
        self._size = 0

    @staticmethod
    def _tar_bytes(size: int) -> int:
        """A member's footprint: 512-byte header plus data padded to 512 bytes."""
        return 512 + 512 * math.ceil(size / 512)

    @staticmethod
    def _file_bytes(members: int) -> int:
        """The archive's size once closed: two zero blocks end it, and tarfile pads the whole
        to a multiple of its 10240-byte record (tarfile.RECORDSIZE)."""
        return tarfile.RECORDSIZE * math.ceil((members + 1024) / tarfile.RECORDSIZE)

    def add(self, job: str, raw: bytes) -> Dict[str, Any]:
        """Compress one snapshot and store it; returns the row's ``snapshot`` object."""
        data = lzma.compress(raw, preset=3)  # preset 3: ~all of preset 6's ratio, 4x faster
        member = f"{job}.pickle.xz"
        need = self._tar_bytes(len(data))
        if self._file_bytes(need) > self.limit:
            raise HarnessError(f"{len(data)} bytes compressed, over the {self.limit}-byte limit "
                               f"of one archive")
        if self._tar is None or self._file_bytes(self._size + need) > self.limit:
            if len(self.archives) >= self.max_archives:
                raise HarnessError(f"all {self.max_archives} archives are full")
            self.close()
            path = self.out / f"snapshots-{len(self.archives) + 1}.tar"
            self.archives.append(path)
            self._tar = tarfile.open(path, "w", format=tarfile.USTAR_FORMAT)
            self._size = 0
        info = tarfile.TarInfo(member)
        info.size = len(data)
        info.mtime = int(time.time())
        self._tar.addfile(info, io.BytesIO(data))
        self._tar.fileobj.flush()
        self._size += need
        return {"archive": self.archives[-1].name, "member": member, "raw_bytes": len(raw),
                "compressed_bytes": len(data)}

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None


def read_snapshot(archive: Path, member: str) -> bytes:
    """The decompressed snapshot pickle of one job, from its archive."""
    try:
        with tarfile.open(archive, "r") as tar:
            handle = tar.extractfile(member)
            if handle is None:
                raise HarnessError(f"{archive}: {member} is not a file")
            return lzma.decompress(handle.read())
    except FileNotFoundError:
        raise HarnessError(f"{archive}: no such archive (it belongs next to the measurements "
                           f"file)") from None
    except KeyError:
        raise HarnessError(f"{archive}: has no member {member}") from None
    except (tarfile.TarError, lzma.LZMAError, EOFError) as exc:
        raise HarnessError(f"{archive}: cannot read {member}: {exc}") from None


def _preflight(dry_run: bool) -> Dict[str, Any]:
    """Check the machine can measure before spending GPU time; returns what NVML says."""
    for path in (RUNNER, ROOT / GPT_SCRIPT, ROOT / CNN_SCRIPT, CONV_SCRIPT):
        if not path.is_file():
            raise HarnessError(f"{path} is missing: run from a full checkout of the repository")
    if importlib.util.find_spec("torch") is None:
        raise HarnessError(f"{sys.executable} cannot import torch: run the measuring half with "
                           f"the interpreter that has PyTorch")
    if dry_run:
        return {}
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        raise HarnessError("the measuring half needs NVML's Python binding (pip package "
                           "nvidia-ml-py, module pynvml); --dry-run runs without it") from None
    try:
        pynvml.nvmlInit()  # shut down by measure() after the last job
    except pynvml.NVMLError as exc:
        raise HarnessError(f"NVML cannot start ({exc}): no NVIDIA driver or GPU here; use "
                           f"--dry-run on a machine without one") from None
    if pynvml.nvmlDeviceGetCount() < 1:
        raise HarnessError("NVML sees no GPU")
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    try:
        others = len(pynvml.nvmlDeviceGetComputeRunningProcesses(handle))
    except pynvml.NVMLError:  # not supported in some virtual machines: unknown, not zero
        others = -1
    info = {"gpu": str(pynvml.nvmlDeviceGetName(handle)),
            "used_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).used),
            "other_processes": others, "nvml": pynvml, "handle": handle}
    if others > 0:
        print(f"warning: {others} other process(es) use the GPU: NVML measures the whole "
              f"device, so their changes would count", flush=True)
    return info


# A job's memory is back with the driver once its process has been reaped, normally at once; the
# next job's baseline is taken only when the device is back within 64 MiB of its idle level (a
# tolerance far below any job's footprint), waiting at most 15 s.
IDLE_TOLERANCE_BYTES = 64 * 2**20
IDLE_WAIT_S = 15.0


def _wait_idle(nvml: Dict[str, Any]) -> float:
    """Wait until the GPU's used memory is back to its idle level; returns the seconds waited."""
    started = time.monotonic()
    while time.monotonic() - started < IDLE_WAIT_S:
        used = int(nvml["nvml"].nvmlDeviceGetMemoryInfo(nvml["handle"]).used)
        if used <= nvml["used_bytes"] + IDLE_TOLERANCE_BYTES:
            break
        time.sleep(0.1)
    return round(time.monotonic() - started, 2)


def run_job(job: Job, work: Path, log: Any, *, dry_run: bool, steps: int, timeout: float,
            interval: float, python: str = sys.executable,
            checkpoint: Optional[Path] = None) -> Dict[str, Any]:
    """One job in a fresh process under the runner (started by ``python``); returns its
    measurement row (no snapshot). ``checkpoint``: the folder CHECKPOINT stands for."""
    result_path, snapshot_path = work / f"{job.name}.json", work / f"{job.name}.pickle"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **job.env)
    if dry_run:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU even on a GPU machine
    command = [python, str(RUNNER), "--result", str(result_path), "--snapshot",
               str(snapshot_path), "--interval", str(interval)] + (["--dry-run"] if dry_run else []) \
        + [str(ROOT / job.script), "--", *job.arguments(steps, checkpoint, dry_run)]
    started = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              cwd=ROOT, env=env)
        output, code, timed_out = proc.stdout + proc.stderr, proc.returncode, False
    except subprocess.TimeoutExpired as exc:
        output = "".join(_decode(s) for s in (exc.stdout, exc.stderr))
        code, timed_out = None, True
    log.write(f"===== {job.name} (runner exit {code}) =====\n{output[-LOG_TAIL_CHARS:]}\n")
    log.flush()
    row: Dict[str, Any] = {
        "job": job.name, "script": job.script, "args": list(job.args), "env": dict(job.env),
        "steps": steps, "expect": job.expect, "parameters": job.parameters,
        "planned_s": round(job.planned_seconds(), 1), "steps_flag": job.steps_flag,
        "checkpoint": job.checkpoint,
    }
    if result_path.is_file():
        row.update(json.loads(result_path.read_text()))
    else:
        why = (f"killed after {timeout:.0f} s (time budget)" if timed_out else
               f"the runner failed (exit {code}): {_last_line(output)}")
        row.update(schema=SCHEMA, dry_run=dry_run, oom=False, error=why, gpu_name=None,
                   measured_total_bytes=0, max_memory_reserved_bytes=0,
                   max_memory_allocated_bytes=0, context_bytes=0, device="unknown",
                   wall_s=round(time.perf_counter() - started, 3))
    row["snapshot"] = None
    return row


def _decode(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def _error_line(stderr: str) -> str:
    """The CLI's own "xmem ...: error: ..." line (a traceback may follow it), else the last."""
    for line in stderr.splitlines():
        if line.startswith("xmem") and ": error: " in line:
            return line[line.index(": error: ") + 9:][:300]
    return _last_line(stderr)


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else "no output"


def measure(jobs: Sequence[Job], out: Path, *, dry_run: bool, budget_s: float,
            interval: float = 0.005, conv_budget_s: float = CONV_BUDGET_S,
            python: str = sys.executable) -> List[Dict[str, Any]]:
    """Run every job that fits the time budget less ``conv_budget_s``, then the convolution
    shapes in what is left; write measurements, archives, the shapes' file and the log.
    ``python`` runs the jobs (and builds the checkpoint the fine-tuning jobs load)."""
    nvml = _preflight(dry_run)
    steps = DRY_RUN_STEPS if dry_run else STEPS
    out.mkdir(parents=True, exist_ok=True)
    print(plan_table(jobs), flush=True)
    if nvml:
        print(f"GPU: {nvml['gpu']}, {nvml['used_bytes'] / 2**20:.0f} MiB in use before any job",
              flush=True)
    packer = SnapshotPacker(out)
    rows: List[Dict[str, Any]] = []
    started = time.monotonic()
    deadline = started + max(budget_s - conv_budget_s, 0.0)
    with tempfile.TemporaryDirectory(prefix="gpu-truth-") as tmp, \
            open(out / "jobs.log", "w") as log, open(out / MEASUREMENTS, "w") as sink:
        checkpoints: Dict[str, Path] = {}
        for index, job in enumerate(jobs, 1):
            if job.checkpoint and job.checkpoint not in checkpoints:
                built = time.monotonic()
                checkpoints[job.checkpoint] = build_checkpoint(job.checkpoint, Path(tmp), python)
                print(f"the {job.checkpoint} checkpoint built in {time.monotonic() - built:.0f} s",
                      flush=True)
            remaining = deadline - time.monotonic()
            if job.planned_seconds() > remaining:
                print(f"[{index}/{len(jobs)}] {job.name}: skipped, planned "
                      f"{job.planned_seconds():.0f} s > {max(remaining, 0):.0f} s left",
                      flush=True)
                continue
            waited = _wait_idle(nvml) if nvml else 0.0
            row = run_job(job, Path(tmp), log, dry_run=dry_run, steps=steps,
                          timeout=deadline - time.monotonic(), interval=interval, python=python,
                          checkpoint=checkpoints.get(job.checkpoint or ""))
            row["idle_wait_s"] = waited
            snapshot = Path(tmp) / f"{job.name}.pickle"
            if row.pop("snapshot_file", None) and snapshot.is_file():
                try:
                    row["snapshot"] = packer.add(job.name, snapshot.read_bytes())
                except HarnessError as exc:
                    row["snapshot_error"] = f"not kept: {exc}"
                snapshot.unlink()
            sink.write(json.dumps(row, sort_keys=True) + "\n")
            sink.flush()
            rows.append(row)
            print(f"[{index}/{len(jobs)}] {_progress(row)}", flush=True)
        if conv_budget_s > 0:
            measure_convs(out / CONV_WORKSPACES, log, dry_run=dry_run,
                          budget_s=started + budget_s - time.monotonic())
    packer.close()
    if nvml:
        nvml["nvml"].nvmlShutdown()
    measured = sum(1 for r in rows if not r.get("error"))
    print(f"measured {measured} of {len(jobs)} jobs into {out} "
          f"({len(packer.archives)} snapshot archive(s))", flush=True)
    return rows


def _sibling(path: Path) -> Any:
    """A script beside this file as a module (this file runs as a script or is imported from
    ``bench``, so neither can be imported by name)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure_convs(target: Path, log: Any, *, dry_run: bool, budget_s: float) -> None:
    """``conv_workspaces.py`` over its shapes in a process of its own (a fresh allocator);
    a dry run measures the first three on the CPU."""
    command = [sys.executable, str(CONV_SCRIPT), "--dry-run" if dry_run else "--measure",
               "--out", str(target), "--budget-s", str(max(budget_s - 15.0, 1.0))]
    command += ["--limit", "3"] if dry_run else []
    try:
        proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                              timeout=max(budget_s, 5.0))
        output, code = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        output = "".join(_decode(s) for s in (exc.stdout, exc.stderr))
        code = None
    log.write(f"===== convolution workspaces (exit {code}) =====\n{output[-LOG_TAIL_CHARS:]}\n")
    print(f"convolution workspaces: {_last_line(output)}", flush=True)


def _progress(row: Dict[str, Any]) -> str:
    what = ("OOM" if row.get("oom") else f"ERROR {row['error']}" if row.get("error") else "ok")
    return (f"{row['job']}: {what} in {row.get('wall_s', 0):.1f} s (plan {row['planned_s']:.0f}); "
            f"NVML total {_gib(row.get('measured_total_bytes', 0))}, reserved peak "
            f"{_gib(row.get('max_memory_reserved_bytes', 0))}, allocated peak "
            f"{_gib(row.get('max_memory_allocated_bytes', 0))}, context "
            f"{row.get('context_bytes', 0) / 2**20:.0f} MiB, {row.get('optimizer_steps', 0)} steps")


def _gib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


# --- Reading measurements ------------------------------------------------------------------------

_INT, _STR, _BOOL = "an integer", "a string", "true or false"
REQUIRED: Dict[str, str] = {
    "schema": _STR, "job": _STR, "script": _STR, "args": "a list of strings",
    "env": "an object of strings", "steps": _INT, "expect": _STR, "dry_run": _BOOL,
    "device": _STR, "measured_total_bytes": _INT, "max_memory_reserved_bytes": _INT,
    "max_memory_allocated_bytes": _INT, "context_bytes": _INT, "oom": _BOOL,
}
EXPECTS = ("fits", "oom", "edge")


def _type_ok(value: Any, kind: str) -> bool:
    if kind == _INT:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    if kind == _STR:
        return isinstance(value, str) and bool(value)
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == "a list of strings":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str)
                                           for k, v in value.items())


def load_measurements(path: Path) -> List[Dict[str, Any]]:
    """Read and check a measurements file; every problem names the file, line and field."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HarnessError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise HarnessError(f"{path}: is a directory; give the {MEASUREMENTS} file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HarnessError(f"{path}: cannot read: {exc}") from None
    rows: List[Dict[str, Any]] = []
    seen: Dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise HarnessError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise HarnessError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key, kind in REQUIRED.items():
            if key not in row:
                raise HarnessError(f"{where}: missing field {key!r}")
            if not _type_ok(row[key], kind):
                raise HarnessError(f"{where}: field {key!r} must be {kind}, got "
                                   f"{json.dumps(row[key])[:60]}")
        if row["schema"] != SCHEMA:
            raise HarnessError(f"{where}: schema {row['schema']!r} is not {SCHEMA!r}")
        if row["expect"] not in EXPECTS:
            raise HarnessError(f"{where}: expect must be one of {', '.join(EXPECTS)}")
        if row["steps"] < 1:
            raise HarnessError(f"{where}: steps must be at least 1")
        for key, kind in (("steps_flag", _STR), ("checkpoint", _STR)):
            if row.get(key) is not None and not _type_ok(row[key], kind):
                raise HarnessError(f"{where}: field {key!r} must be {kind} or null, got "
                                   f"{json.dumps(row[key])[:60]}")
        if row.get("checkpoint") and CHECKPOINT not in row["args"]:
            raise HarnessError(f"{where}: a row with a 'checkpoint' names it in 'args' as "
                               f"{CHECKPOINT}")
        name = row["gpu_name"] if "gpu_name" in row else None
        if not row["dry_run"] and not (isinstance(name, str) and name):
            raise HarnessError(f"{where}: a GPU row needs the measured 'gpu_name'")
        if row["job"] in seen:
            raise HarnessError(f"{where}: job {row['job']!r} already on line {seen[row['job']]}")
        seen[row["job"]] = number
        script = (ROOT / row["script"]).resolve()
        if not script.is_relative_to(ROOT) or not script.is_file():
            raise HarnessError(f"{where}: script {row['script']!r} is not a file of this "
                               f"repository")
        snapshot = row.get("snapshot")
        if snapshot is not None and not (isinstance(snapshot, dict) and all(
                isinstance(snapshot.get(k), str) and snapshot.get(k)
                for k in ("archive", "member"))):
            raise HarnessError(f"{where}: 'snapshot' must be null or name an archive and member")
        rows.append(row)
    if not rows:
        raise HarnessError(f"{path}: no measurements in the file")
    for key, what in (("dry_run", "dry-run and GPU rows"), ("gpu_name", "rows of several GPUs")):
        values = {json.dumps(r.get(key)) for r in rows}
        if len(values) > 1:
            raise HarnessError(f"{path}: mixes {what} ({', '.join(sorted(values))}); one file "
                               f"holds one run")
    return rows


# --- Estimating half -----------------------------------------------------------------------------


def _xmem(*args: str) -> List[str]:
    """The real CLI, in the interpreter running this harness (which has xmem installed)."""
    return [sys.executable, "-m", "xmem_admission.cli", *args]


def row_arguments(row: Dict[str, Any], checkpoint: Optional[Path] = None) -> List[str]:
    """A measured row's script arguments, its steps included (rows written before the field
    existed were told theirs by ``--steps``)."""
    return script_arguments(row["args"], row.get("steps_flag") or "--steps", row["steps"],
                            checkpoint)


def run_estimate(row: Dict[str, Any], gpu: str, python: Optional[str] = None,
                 checkpoint: Optional[Path] = None) -> Dict[str, Any]:
    """`xmem estimate --json` on the measured job, with its environment; the GPU's entry.
    ``python``: trace with that interpreter (``xmem estimate --python``), e.g. one with the
    torch that ran on the GPU; ``checkpoint``: the folder the row's CHECKPOINT stands for."""
    interpreter = ["--python", python] if python else []
    command = _xmem("estimate", "--gpu", gpu, "--json", "--steps", str(row["steps"]),
                    *interpreter, "--", "python", row["script"], *row_arguments(row, checkpoint))
    env = dict(os.environ, **row["env"])
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode not in (0, 3):
        return {"estimate_error": f"xmem estimate exited {proc.returncode}: "
                                  f"{_error_line(proc.stderr)}"}
    data = json.loads(proc.stdout)
    entry = data["gpus"][0]
    high = entry.get("high_bytes") or entry["total_bytes"]
    return {
        "estimated_total_bytes": entry["total_bytes"],
        # the range (an older xmem's output has none: the point for both ends), the OOM call
        # on it, and the request the default policy gives the job (bench/yardsticks/paper/request_sizes.py)
        "estimated_low_bytes": entry.get("low_bytes") or entry["total_bytes"],
        "estimated_high_bytes": high,
        "estimated_fit": entry.get("fit"),
        "request_bytes": _request(entry["total_bytes"], high, gpu),
        "estimated_reserved_peak_bytes": entry["peak_reserved_bytes"],
        "estimated_allocated_peak_bytes": entry["peak_allocated_bytes"],
        "estimated_overhead_bytes": entry["overhead_bytes"],
        "estimated_fits": entry["fits"],
        "estimated_oom": entry["oom"] is not None or not entry["fits"],
        "estimate_breakdown": entry["breakdown"],
        "estimate_mode": data["mode"],
        "estimate_fallback_reason": data.get("fallback_reason"),
        "estimate_seconds": round(data["seconds"], 2),
        "estimate_torch": data.get("torch"),
        "estimated_overhead": entry.get("overhead"),
        "capacity_bytes": entry["capacity_bytes"],
    }


def _request(total: int, high: int, gpu: str) -> int:
    """The request the default policy gives an estimate (``bench/yardsticks/paper/request_sizes.py``)."""
    if str(ROOT) not in sys.path:  # that module imports the bench package by name
        sys.path.insert(0, str(ROOT))
    return int(importlib.import_module("bench.yardsticks.paper.request_sizes").request_bytes(total, high, gpu))


def run_replay(archive: Path, member: str, tmp: Path) -> Dict[str, Any]:
    """`xmem replay --json` on one recorded snapshot; the comparison, or why it could not run."""
    pickle_path = tmp / member.replace(".xz", "")
    try:
        pickle_path.write_bytes(read_snapshot(archive, member))
    except HarnessError as exc:
        return {"error": str(exc)}
    proc = subprocess.run(_xmem("replay", "--json", str(pickle_path)), capture_output=True,
                          text=True, cwd=ROOT)
    pickle_path.unlink()
    if proc.returncode not in (0, 1):
        return {"error": _error_line(proc.stderr)}
    data = json.loads(proc.stdout)
    keys = ("match", "events", "segment_allocs_expected", "segment_allocs_matched",
            "segment_allocs_extra", "ooms_expected", "ooms_matched", "reserved_expected_bytes",
            "reserved_simulated_bytes")
    out = {k: data[k] for k in keys}
    out["mismatches"] = data["mismatches"][:5]
    return out


def gpu_key(name: str) -> str:
    """The catalogue's key for a GPU name (bench/data/<key>/), or a clear error."""
    from xmem_admission.contract.errors import UnknownGPUError
    from xmem_admission.contract.gpus import lookup

    try:
        return lookup(name).key
    except UnknownGPUError as exc:
        raise HarnessError(f"GPU {name!r} is not in the catalogue: {exc}") from None


def _under(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def estimate(measurements: Path, *, truth: Optional[Path], gpu: Optional[str],
             only: Optional[Sequence[str]] = None, workers: int = 1,
             python: Optional[str] = None) -> Tuple[List[Dict[str, Any]], int]:
    """The estimating half: truth rows written, table printed; returns (rows, exit status)."""
    rows = load_measurements(measurements)
    all_rows = rows
    dry_run = rows[0]["dry_run"]
    target = gpu or rows[0].get("gpu_name")
    if not target:
        raise HarnessError(f"{measurements}: the rows name no GPU (a dry run): pass --gpu")
    key = gpu_key(target)
    # The fine-tuning rows are a run of their own: their folder beside the main matrix's.
    finetune = any(r.get("checkpoint") for r in rows)
    folder = DATA / key / "finetune" if finetune else DATA / key
    if truth is None:
        truth = measurements.parent / "truth.jsonl" if dry_run else folder / "truth.jsonl"
    if dry_run and _under(truth, DATA):
        raise HarnessError(f"{truth}: dry-run rows are never written under {DATA}; give "
                           f"--truth elsewhere")
    if only:
        unknown = sorted(set(only) - {r["job"] for r in rows})
        if unknown:
            raise HarnessError(f"--only: no such job in {measurements}: {', '.join(unknown)}")
        rows = [r for r in rows if r["job"] in only]
    truth.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu-truth-replay-") as tmp, \
            ThreadPoolExecutor(max_workers=workers) as pool:
        shapes = sorted({r["checkpoint"] for r in rows if r.get("checkpoint") and _estimated(r)})
        checkpoints = {shape: build_checkpoint(shape, Path(tmp), python or sys.executable)
                       for shape in shapes}
        # Each job is two subprocesses (xmem estimate, xmem replay): threads only wait on them.
        futures = [pool.submit(_truth_for, row, target, measurements.parent, Path(tmp), python,
                               checkpoints.get(row.get("checkpoint") or ""))
                   for row in rows]
        out_rows = []
        for index, future in enumerate(futures, 1):
            out = future.result()
            out_rows.append(out)
            print(f"[{index}/{len(rows)}] {out['job']}: estimated "
                  f"{_gib(out.get('estimated_total_bytes'))}"
                  + (f" ({out['estimate_error']})" if out.get("estimate_error") else ""),
                  flush=True)
    if not dry_run and gpu_key(rows[0]["gpu_name"]) == key:
        score_leave_one_out(out_rows, all_rows)
    with open(truth, "w") as fh:
        for out in out_rows:
            fh.write(json.dumps(out, sort_keys=True) + "\n")
    summary = summarise(out_rows)
    convs = measurements.parent / CONV_WORKSPACES
    if convs.is_file():
        shapes = _sibling(CONV_SCRIPT)
        table, summary["conv_workspaces"] = shapes.compare(shapes.load_rows(convs))
    (truth.parent / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    if not dry_run and measurements.parent.resolve() != truth.parent.resolve():
        shutil.copyfile(measurements, truth.parent / MEASUREMENTS)
        for name in sorted({r["snapshot"]["archive"] for r in rows if r.get("snapshot")}):
            shutil.copyfile(measurements.parent / name, truth.parent / name)
        if convs.is_file():
            shutil.copyfile(convs, truth.parent / CONV_WORKSPACES)
    print(error_table(out_rows, summary))
    if convs.is_file():
        print("\nConvolution workspaces (bench/convolution/conv_workspaces.py):\n" + table)
    print(f"wrote {truth} and {truth.parent / 'summary.json'}")
    failed = (summary["measurement_failures"] or summary["estimate_failures"]
              or summary["replay"]["mismatched"])
    return out_rows, 1 if failed else 0


def score_leave_one_out(out_rows: List[Dict[str, Any]],
                        measured: Sequence[Dict[str, Any]]) -> None:
    """Score each job's total with the overhead fitted on the *other* rows of the same run
    (``fit_outside.py``), never with a figure fitted on itself: the catalogue's figure for this
    GPU was fitted on these rows. The estimate's own figures stay in the row
    (``estimated_total_catalogue_bytes``, ``estimated_overhead_bytes``)."""
    loo = _sibling(FIT_OUTSIDE).leave_one_out(measured)
    for out in out_rows:
        fitted = loo.get(out["job"])
        total = out.get("estimated_total_bytes")
        if fitted is None or total is None:
            continue
        out["estimated_total_catalogue_bytes"] = total
        out["scored_overhead_bytes"] = fitted
        shift = fitted - out["estimated_overhead_bytes"]
        out["estimated_total_bytes"] = total + shift
        if out.get("estimated_high_bytes") is not None:  # the range and request move with it
            out["estimated_low_bytes"] += shift
            out["estimated_high_bytes"] += shift
            out["request_bytes"] = _request(out["estimated_total_bytes"],
                                            out["estimated_high_bytes"], out["estimated_for_gpu"])
        _add_errors(out)


def _estimated(row: Dict[str, Any]) -> bool:
    """Whether a measured row is estimated: it ran, or it ran out of memory (a failed
    measurement is not)."""
    return bool(row["oom"] or not row.get("error"))


def _truth_for(row: Dict[str, Any], target: str, folder: Path, tmp: Path,
               python: Optional[str] = None, checkpoint: Optional[Path] = None
               ) -> Dict[str, Any]:
    """One job's truth row: the measurement, the estimate, the replay, the errors."""
    out = _truth_row(row, target)
    if not _estimated(row):
        out["estimate_error"] = "not estimated: the measurement failed"
    else:
        out.update(run_estimate(row, target, python, checkpoint))
    snapshot = row.get("snapshot")
    if snapshot:
        out["replay"] = run_replay(folder / snapshot["archive"], snapshot["member"], tmp)
    _add_errors(out)
    return out


def _truth_row(row: Dict[str, Any], target: str) -> Dict[str, Any]:
    """The measured side of a truth row (the measured fields, then the context)."""
    return {
        "schema": TRUTH_SCHEMA,
        "gpu_name": row.get("gpu_name") or target,
        "estimated_for_gpu": target,
        "job": row["job"],
        "dry_run": row["dry_run"],
        "expect": row["expect"],
        "measured_total_bytes": row["measured_total_bytes"],
        "measured_reserved_peak_bytes": row["max_memory_reserved_bytes"],
        "measured_allocated_peak_bytes": row["max_memory_allocated_bytes"],
        "measured_context_bytes": row["context_bytes"],
        "measured_oom": row["oom"],
        "measured_error": row.get("error") if not row["oom"] else None,
        "measured_device": row["device"],
        "gpu_total_memory_bytes": row.get("gpu_total_memory_bytes"),
        "command": ["python", row["script"], *row_arguments(row)],
        "env": row["env"],
        "torch_version": row.get("torch_version"),
        "cuda_version": row.get("cuda_version"),
        "driver_version": row.get("driver_version"),
        "replay": None,
    }


def _add_errors(out: Dict[str, Any]) -> None:
    """Relative errors (estimate - measured) / measured; None where nothing was measured."""
    for what in ("total", "reserved_peak"):
        measured = out[f"measured_{what}_bytes"]
        estimated = out.get(f"estimated_{what}_bytes")
        usable = (measured > 0 and estimated is not None and not out["measured_oom"]
                  and not out["measured_error"])
        out[f"error_{what}"] = round((estimated - measured) / measured, 6) if usable else None


def _p90(values: List[float]) -> float:
    """Nearest-rank 90th percentile: the smallest value with at least 90% of them at or below."""
    ordered = sorted(values)
    return ordered[max(math.ceil(0.9 * len(ordered)) - 1, 0)]


def summarise(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Error statistics over the jobs that ran to completion and were estimated."""
    summary: Dict[str, Any] = {
        "jobs": len(rows),
        "measurement_failures": sum(1 for r in rows if r["measured_error"]),
        "estimate_failures": sum(1 for r in rows
                                 if r.get("estimate_error") and not r["measured_error"]),
    }
    for what in ("total", "reserved_peak"):
        errors = [(r[f"error_{what}"], r["job"]) for r in rows if r[f"error_{what}"] is not None]
        if not errors:
            summary[what] = None
            continue
        magnitudes = [abs(e) for e, _ in errors]
        worst = min(errors)
        summary[what] = {
            "jobs": len(errors),
            "median_abs_error": statistics.median(magnitudes),
            "p90_abs_error": _p90(magnitudes),
            "worst_under_estimate": worst[0] if worst[0] < 0 else None,
            "worst_under_estimate_job": worst[1] if worst[0] < 0 else None,
            "under_estimates": sum(1 for e, _ in errors if e < 0),
        }
    # jobs that ran to completion whose measured total passed the request the default policy
    # gives them: under HAMi, KAI or MIG each fails at its first try
    ran = [r for r in rows if r.get("request_bytes") is not None and not r["measured_oom"]
           and not r["measured_error"] and r["measured_total_bytes"] > 0]
    summary["requests"] = {
        "jobs": len(ran),
        "over_request": sorted(r["job"] for r in ran
                               if r["measured_total_bytes"] > r["request_bytes"]),
        "median_request_over_measured": statistics.median(
            r["request_bytes"] / r["measured_total_bytes"] - 1 for r in ran) if ran else None,
    }
    ooms = [r for r in rows if r["measured_oom"] or r["expect"] == "oom"]
    summary["oom"] = [{"job": r["job"], "measured_oom": r["measured_oom"],
                       "estimated_oom": r.get("estimated_oom")} for r in ooms]
    replays = [r["replay"] for r in rows if r.get("replay")]
    summary["replay"] = {
        "snapshots": len(replays),
        "matched": sum(1 for p in replays if p.get("match") is True),
        "mismatched": sum(1 for p in replays if p.get("match") is False),
        "not_replayed": sum(1 for p in replays if "error" in p),
    }
    return summary


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{value * 100:+.1f}%"


def error_table(rows: Sequence[Dict[str, Any]], summary: Dict[str, Any]) -> str:
    """Per-job table, then the statistics; what could not be computed says why."""
    head = ("job", "measured total", "estimated total", "error", "measured reserved",
            "estimated reserved", "error", "OOM meas/est", "replay")
    table = [head]
    for r in rows:
        replay = r.get("replay")
        replay_text = ("-" if not replay else "not replayed" if "error" in replay else
                       "match" if replay["match"] else "MISMATCH")
        oom = f"{'yes' if r['measured_oom'] else 'no'}/" + (
            "-" if r.get("estimated_oom") is None else "yes" if r["estimated_oom"] else "no")
        table.append((r["job"] + (" [dry run]" if r["dry_run"] else ""),
                      _gib(r["measured_total_bytes"]), _gib(r.get("estimated_total_bytes")),
                      _pct(r["error_total"]), _gib(r["measured_reserved_peak_bytes"]),
                      _gib(r.get("estimated_reserved_peak_bytes")), _pct(r["error_reserved_peak"]),
                      oom, replay_text))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    lines.append("")
    for what, label in (("total", "total (NVML peak - level before CUDA)"),
                        ("reserved_peak", "reserved peak (max_memory_reserved)")):
        s = summary[what]
        if s is None:
            why = ("dry run: no GPU memory was measured" if rows and rows[0]["dry_run"]
                   else "no job both completed and was estimated")
            lines.append(f"{label}: errors not computed ({why})")
            continue
        worst = ("none" if s["worst_under_estimate"] is None else
                 f"{_pct(s['worst_under_estimate'])} ({s['worst_under_estimate_job']})")
        lines.append(f"{label} over {s['jobs']} jobs: median |error| "
                     f"{s['median_abs_error'] * 100:.1f}%, p90 |error| "
                     f"{s['p90_abs_error'] * 100:.1f}%, worst under-estimate {worst}, "
                     f"{s['under_estimates']} under-estimate(s)")
    for o in summary["oom"]:
        agree = o["measured_oom"] == o["estimated_oom"]
        lines.append(f"OOM {o['job']}: measured {'OOM' if o['measured_oom'] else 'no OOM'}, "
                     f"estimate {'OOM' if o['estimated_oom'] else 'fits'}: "
                     f"{'agree' if agree else 'DISAGREE'}")
    req = summary.get("requests")
    if req and req["jobs"]:
        lines.append(f"requests under the default policy: {len(req['over_request'])} of "
                     f"{req['jobs']} jobs over their request"
                     + (f" ({', '.join(req['over_request'])})" if req["over_request"] else "")
                     + f"; median request over measured total "
                       f"{req['median_request_over_measured'] * 100:+.1f}%")
    rp = summary["replay"]
    lines.append(f"snapshot replay: {rp['matched']} of {rp['snapshots']} match, "
                 f"{rp['mismatched']} mismatch, {rp['not_replayed']} not replayed")
    if summary["measurement_failures"]:
        lines.append(f"{summary['measurement_failures']} measurement(s) failed: see "
                     f"measured_error")
    if summary["estimate_failures"]:
        lines.append(f"{summary['estimate_failures']} estimate(s) failed: see estimate_error")
    return "\n".join(lines)


# --- Command line --------------------------------------------------------------------------------


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="gpu_truth.py", description=__doc__.splitlines()[0],
        epilog="Default: the measuring half (CUDA machine). See bench/data/README.md.")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--estimate", action="store_true",
                      help="the estimating half: xmem estimate and xmem replay on measured jobs")
    mode.add_argument("--dry-run", action="store_true",
                      help="both halves on the CPU with tiny jobs (never under bench/data/)")
    mode.add_argument("--plan", action="store_true", help="print the matrix and its time plan")
    parser.add_argument("--out", type=Path,
                        help="measuring: output directory (default out/gpu-truth); dry run: "
                        "default a new temporary directory")
    parser.add_argument("--measurements", type=Path,
                        help=f"--estimate: the {MEASUREMENTS} written by the measuring half")
    parser.add_argument("--truth", type=Path,
                        help="--estimate: output file (default bench/data/<gpu-key>/truth.jsonl)")
    parser.add_argument("--gpu", help="--estimate: GPU to estimate for (default: the measured "
                        "one; H200 for a dry run)")
    parser.add_argument("--only", help="comma-separated job names to run or estimate")
    parser.add_argument("--matrix", choices=sorted(MATRICES), default="main",
                        help="measuring, dry run, --plan: the examples' matrix (main) or the "
                        "fine-tuning jobs (finetune)")
    parser.add_argument("--python", metavar="PATH",
                        help="--estimate: trace with this interpreter (xmem estimate --python), "
                        "e.g. one with the torch that ran on the GPU; a dry run: also run its "
                        "jobs with it")
    parser.add_argument("--workers", type=int, default=1,
                        help="estimating: jobs estimated at once (default 1; each needs up "
                        "to ~2 GiB of RAM)")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="measuring: start no job whose planned time exceeds what is left "
                        "of this many seconds, and stop a running one there (default 420)")
    args = parser.parse_args(argv)
    if args.estimate and args.measurements is None:
        parser.error("--estimate needs --measurements FILE")
    if args.budget_s <= 0:
        parser.error("--budget-s must be positive")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    return args


def _select(jobs: Sequence[Job], only: Optional[str]) -> List[Job]:
    if not only:
        return list(jobs)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(names) - {j.name for j in jobs})
    if unknown:
        raise HarnessError(f"--only: unknown job(s) {', '.join(unknown)}; --plan lists them")
    return [j for j in jobs if j.name in names]


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    jobs, dry_jobs = MATRICES[args.matrix]
    # the convolution shapes belong to the examples' matrix
    conv_budget_s = CONV_BUDGET_S if args.matrix == "main" else 0.0
    try:
        if args.python is not None and not (os.path.isfile(args.python)
                                            and os.access(args.python, os.X_OK)):
            raise HarnessError(f"--python {args.python}: not an executable file")
        if args.plan:
            print(plan_table(_select(jobs, args.only)))
            return 0
        if args.estimate:
            only = [n.strip() for n in args.only.split(",")] if args.only else None
            return estimate(args.measurements, truth=args.truth, gpu=args.gpu, only=only,
                            workers=args.workers, python=args.python)[1]
        if args.dry_run:
            out = args.out or Path(tempfile.mkdtemp(prefix="gpu-truth-dry-run-"))
            if _under(out, DATA):
                raise HarnessError(f"{out}: a dry run never writes under {DATA}; give --out "
                                   f"elsewhere")
            measure(_select(dry_jobs, args.only), out, dry_run=True, budget_s=args.budget_s,
                    conv_budget_s=conv_budget_s, python=args.python or sys.executable)
            return estimate(out / MEASUREMENTS, truth=out / "truth.jsonl",
                            gpu=args.gpu or "H200", workers=args.workers, python=args.python)[1]
        out = args.out or ROOT / "out" / "gpu-truth"
        if _under(out, DATA):
            raise HarnessError(f"{out}: raw measurements go to a scratch directory; --estimate "
                               f"writes bench/data/")
        rows = measure(_select(jobs, args.only), out, dry_run=False, budget_s=args.budget_s,
                       conv_budget_s=conv_budget_s)
        return 0 if rows and any(not r.get("error") for r in rows) else 1
    except HarnessError as exc:
        print(f"gpu_truth: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
