"""DeepSpeed ZeRO jobs under the Hugging Face Trainer, started by the ``deepspeed`` launcher, are
traced in fake mode as rank 0 of their world: DeepSpeed's own partitioning runs under the fake
process group, and each rank holds what ZeRO's partitioning gives for the model's parameter count
P and the world size N (computed here from P and N, not read from DeepSpeed): ZeRO-1, 2 and 3,
with the optimizer (and under ZeRO-3 the parameters) offloaded to the CPU.

Real ``xmem estimate`` runs (the development environment's, ``.venv/bin/xmem``, so that these
tests run the same under ``scripts/test-torch.sh``) with the torch 2.15 environment (``NEWEST``:
DeepSpeed 0.19.8, transformers, accelerate; ``bash scripts/torch-venv.sh 2.15.0 3.13`` builds
it)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.distributed.conftest import live_at_last_step, script
from tests.support.torch_envs import NEWEST
from xmem_admission.estimator.trace import Trace

ROOT = Path(__file__).resolve().parents[2]
XMEM = ROOT / ".venv" / "bin" / "xmem"
WORLD = 4
# The Trainer script's model: a Llama whose model states (42M parameters) outweigh the
# activations of its batch (one sequence of 32 tokens), so each stage's saving shows in the peak.
LAYERS, WIDTH, VOCAB, SEQ = 8, 512, 8192, 32


def estimate(tmp_path: Path, config: str, *launcher: str) -> subprocess.CompletedProcess:
    trace = tmp_path / "trace.json"
    ds_config = ["--deepspeed", script(config)] if config else []
    command = [*(launcher or ("deepspeed", "--num_gpus", str(WORLD))),
               script("deepspeed_trainer.py"), *ds_config, "--bf16",
               "--layers", str(LAYERS), "--width", str(WIDTH), "--vocab", str(VOCAB),
               "--seq", str(SEQ), "--per_device_train_batch_size", "1", "--max_steps", "5", "--report_to", "none",
               "--save_strategy", "no", "--output_dir", str(tmp_path / "out"),
               "--report", str(tmp_path / "report.json")]
    assert XMEM.is_file(), f"no {XMEM}: build the development environment with `make venv`"
    return subprocess.run(
        [str(XMEM), "estimate", "--python", NEWEST.interpreter,
         "--json", "--gpu", "H100-80GB", "--trace", str(trace), "--", *command],
        cwd=ROOT, capture_output=True, text=True, timeout=600)


class Traced:
    """One rank's estimate, trace, and the script's report of its model."""

    def __init__(self, tmp_path: Path, config: str, *launcher: str) -> None:
        proc = estimate(tmp_path, config, *launcher)
        assert proc.returncode == 0, proc.stderr[-5000:]
        self.result = json.loads(proc.stdout)
        self.trace = Trace.load(str(tmp_path / "trace.json"))
        self.report = json.loads((tmp_path / "report.json").read_text())
        self.live = live_at_last_step(self.trace)

    def most(self, category: str) -> int:
        """The most bytes of ``category`` live at once over the trace."""
        sizes, live, top = {}, 0, 0
        for event in self.trace.events:
            if event.op == "alloc" and event.category == category:
                sizes[event.id] = event.size
                live += event.size
                top = max(top, live)
            elif event.op == "free" and event.id in sizes:
                live -= sizes.pop(event.id)
        return top

    @property
    def peak(self) -> int:
        return int(self.result["gpus"][0]["peak_allocated_bytes"])


def groups() -> tuple[int, int]:
    """The Trainer's two parameter groups (``get_decay_parameter_names``: weight decay for the
    matrices, none for the RMSNorm weights), each padded by ZeRO to a multiple of 2N elements
    (stage_1_and_2.py: ``flatten_dense_tensors_aligned`` with ``nccl_start_alignment_factor *
    dp_size``, the factor 2)."""
    decay = 2 * VOCAB * WIDTH + LAYERS * (4 * WIDTH * WIDTH + 3 * WIDTH * 4 * WIDTH)
    norms = (2 * LAYERS + 1) * WIDTH
    align = 2 * WORLD
    return -(-decay // align) * align, -(-norms // align) * align


@pytest.fixture(scope="module")
def zero(tmp_path_factory):
    done = {}

    def traced(stage: Any) -> Traced:
        if stage not in done:
            done[stage] = Traced(tmp_path_factory.mktemp(f"zero{stage}"),
                                 f"deepspeed_zero{stage}.json")
        return done[stage]

    return traced


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_zero_job_is_traced_in_fake_mode_as_rank_0_of_the_launchers_world(zero, stage):
    traced = zero(stage)
    assert traced.result["mode"] == "fake"
    assert traced.trace.meta["distributed"]["world_size"] == WORLD
    assert traced.report == {"parameters": sum(groups()), "stage": stage, "world_size": WORLD,
                             "buffer_bytes": traced.report["buffer_bytes"]}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_1_and_2_keep_every_bf16_parameter_and_a_quarter_of_the_fp32_state(zero, stage):
    traced = zero(stage)
    params = sum(groups())
    # the 16-bit model, whole, flattened (stage_1_and_2.py: bit16_groups_flat), and its buffers
    assert traced.live["parameter"] == 2 * params + traced.report["buffer_bytes"]
    # the fp32 master partition and Adam's two moments of it: 12 bytes per parameter / N
    # (single_partition_of_fp32_groups; torch AdamW's exp_avg and exp_avg_sq), plus the step's
    # few scalars (the gradient norm)
    state = traced.live["optimizer_state"]
    assert 12 * params // WORLD <= state <= 12 * params // WORLD + 64


def test_zero_1_holds_every_gradient_and_zero_2_a_partition_of_them(zero):
    decay, norms = groups()
    params = decay + norms
    # The bf16 gradients of this rank's partition (stage_1_and_2.py, grads_in_partition: each
    # parameter that overlaps the partition, whole; here one RMSNorm weight crosses its edge).
    partition, edge = 2 * params // WORLD, 2 * WIDTH * 2
    # ZeRO-1 (no overlap_comm) keeps every bf16 gradient until the step's boundary
    # (reduce_gradients), where it reduces them into the partition
    assert 2 * params + partition <= zero(1).most("gradient") <= 2 * params + partition + edge
    # ZeRO-2 reduces them in buckets as backward makes them (reduce_bucket_size: "auto", the
    # width squared), keeping the partition, and the step makes its fp32 copy one group at a
    # time (single_partition_of_fp32_groups[i].grad, the largest group's at most)
    fp32 = 4 * decay // WORLD
    assert partition + fp32 <= zero(2).most("gradient") <= partition + fp32 + edge
    assert 0 < zero(2).most("communication") < partition  # the reduce buckets


def test_a_rank_of_zero_2_needs_less_than_one_of_zero_1(zero):
    assert zero(2).peak < zero(1).peak


def zero3_partition() -> int:
    """Bytes of this rank's 16-bit partition under ZeRO-3: 1/N of each parameter (every one
    divides by N here; partition_parameters.py, ``_partition_param``: ceil(numel / N)), bf16."""
    return 2 * sum(groups()) // WORLD


def persistent() -> int:
    """Bytes of the parameters ZeRO-3 keeps whole on every rank: the RMSNorm weights, each at
    most stage3_param_persistence_threshold elements ("auto": 10 x hidden size, transformers'
    integrations/deepspeed.py, ``trainer_config_finalize``)."""
    return 2 * (2 * LAYERS + 1) * WIDTH


def test_zero_3_keeps_a_quarter_of_every_parameter_and_of_the_fp32_state(zero):
    traced = zero(3)
    params = sum(groups())
    # between steps: this rank's bf16 partition (stage3.py, lp_param_buffer), the persistent
    # parameters and the buffers; every other parameter is freed (an empty tensor on the GPU)
    assert traced.live["parameter"] == (zero3_partition() + persistent()
                                        + traced.report["buffer_bytes"])
    # the reduced bf16 gradient partition (grad_partitions_flat_buffer)
    assert traced.live["gradient"] == zero3_partition()
    # the fp32 master partition and Adam's two moments of it, and the step's few scalars
    state = traced.live["optimizer_state"]
    assert 12 * params // WORLD <= state <= 12 * params // WORLD + 64


def test_zero_3_gathers_as_many_parameters_at_once_as_deepspeed_keeps(zero):
    decay, _ = groups()
    buffers = zero(3).report["buffer_bytes"]
    resident = zero3_partition() + persistent() + buffers
    # The default stage3_max_reuse_distance (1e9 elements, runtime/zero/config.py) keeps a
    # parameter gathered when it is used again within that many elements
    # (partitioned_param_coordinator.py, __params_to_release): from the second step, forward's
    # gathered parameters stay until backward uses them again, the whole model at once.
    assert zero(3).most("parameter") == resident + 2 * decay
    # With stage3_max_reuse_distance 0 and no prefetch, each module's parameters are freed as
    # it ends: at most one module's are gathered, the largest (the embedding, or the LM head).
    lean = zero("3_lean")
    assert lean.most("parameter") == resident + 2 * VOCAB * WIDTH
    assert lean.peak < zero(3).peak


def test_offload_optimizer_leaves_no_optimizer_state_on_the_gpu(zero):
    # ZeRO-2 with offload_optimizer to the CPU: the fp32 partition, its gradient and Adam's
    # moments are host tensors, stepped by DeepSpeedCPUAdam; the GPU keeps the bf16 model
    traced = zero("2_offload")
    assert traced.result["mode"] == "fake"
    assert "optimizer_state" not in traced.live
    assert traced.live["parameter"] == 2 * sum(groups()) + traced.report["buffer_bytes"]
    assert traced.peak < zero(2).peak


def test_offload_param_leaves_no_parameter_partition_on_the_gpu(zero):
    # ZeRO-3 with offload_param and offload_optimizer to the CPU: between steps the GPU holds
    # only the persistent parameters and the buffers; a module's parameters are copied from
    # the host partitions and gathered while it runs
    traced = zero("3_offload")
    assert traced.result["mode"] == "fake"
    assert "optimizer_state" not in traced.live and "gradient" not in traced.live
    assert traced.live["parameter"] == persistent() + traced.report["buffer_bytes"]
    assert traced.most("parameter") >= 2 * VOCAB * WIDTH
    assert traced.peak < zero(3).peak


def test_accelerate_launch_use_deepspeed_hands_rank_0_its_zero_options(tmp_path):
    # accelerate launch --use_deepspeed --zero_stage 2: the Trainer takes Accelerate's
    # DeepSpeedPlugin (ACCELERATE_USE_DEEPSPEED and the stage reach rank 0 as the launcher
    # sets them), with no ds_config of the script's own
    traced = Traced(tmp_path, "", "accelerate", "launch", "--use_deepspeed", "--num_processes",
                    str(WORLD), "--zero_stage", "2", "--mixed_precision", "bf16")
    params = sum(groups())
    assert traced.result["mode"] == "fake"
    assert (traced.report["stage"], traced.report["world_size"]) == (2, WORLD)
    assert traced.live["parameter"] == 2 * params + traced.report["buffer_bytes"]
    assert 12 * params // WORLD <= traced.live["optimizer_state"] <= 12 * params // WORLD + 64


def test_deepspeed_is_there_to_trace_with():
    found = subprocess.run([NEWEST.interpreter, "-c", "import deepspeed, sys; "
                            "sys.stdout.write(deepspeed.__version__)"],
                           capture_output=True, text=True, timeout=300,
                           env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert found.returncode == 0 and found.stdout == "0.19.8", (
        f"DeepSpeed 0.19.8 is not importable with {NEWEST.interpreter}: run `bash "
        f"scripts/torch-venv.sh {NEWEST.torch} {NEWEST.python}`\n{found.stderr[-2000:]}")
