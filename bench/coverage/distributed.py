"""Per-GPU memory of one GPT-style 1.3B model trained single-process, with DDP x8, and with
FSDP2 x8 and x64, with and without activation checkpointing: ``xmem estimate`` on
``examples/train_gpt.py`` under torchrun (rank 0 traced in one process), next to the model-state
arithmetic others use (the ZeRO paper's, which DeepSpeed's ``estimate_zero*_model_states_mem_needs``
helpers implement). Prints a markdown table and a breakdown per row.

    .venv/bin/python bench/coverage/distributed.py [--rows single,ddp8,fsdp8,fsdp64] [--checkpoint both|on|off]

``--speed`` instead times the shape-only trace of Llama-2-7B shapes (bf16) as one process and
as rank 0 of an 8-way and a 64-way FSDP2 job, with the probe's peak host memory.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "src"))

from xmem_admission.estimator.estimate import BREAKDOWN_KEYS, estimate  # noqa: E402

# GPT-style 1.3B (GPT-3 XL shapes: 24 layers, d_model 2048, 16 heads; GPT-2 vocabulary; SwiGLU
# MLP of the same width and an untied head, 1.44B parameters);
# fp32 AdamW; one sequence of 512 tokens per rank (the profile-mode rows must run on a CPU).
MODEL = ["--layers", "24", "--hidden", "2048", "--heads", "16",
         "--vocab", "50257", "--seq-len", "512", "--batch-size", "1", "--optimizer", "adamw"]
ROWS: Dict[str, Tuple[str, int]] = {"single": ("none", 1), "ddp8": ("ddp", 8),
                                    "fsdp8": ("fsdp2", 8), "fsdp64": ("fsdp2", 64)}
GPU = "H100-80GB"


def parameters() -> int:
    """Ψ, counted from the model's shapes (examples/train_gpt.py: embedding, blocks, norm, head)."""
    layers, hidden, inter, vocab = 24, 2048, 5632, 50257  # inter: llama_intermediate(2048)
    attention = 4 * hidden * hidden  # q, k, v, o without bias
    mlp = 3 * hidden * inter  # SwiGLU: gate, up, down
    norms = 2 * hidden
    return vocab * hidden * 2 + layers * (attention + mlp + norms) + hidden


def analytic(parallel: str, world: int, psi: int) -> int:
    """Model states per GPU by the ZeRO paper's arithmetic (Rajbhandari et al., SC'20, section
    3.1/5): fp32 Adam keeps 4 bytes of parameters, 4 of gradients and 8 of moments per parameter
    (16Ψ); DDP (stage 0) keeps all of them on every GPU, full sharding (stage 3, FSDP's
    FULL_SHARD) 16Ψ/N. DeepSpeed's estimators add the largest layer's gathered parameters for
    stage 3; activations, buffers and NCCL are outside this arithmetic."""
    states = 16 * psi
    return states if parallel in ("none", "ddp") else states // world


def run(row: str, checkpoint: bool) -> Dict[str, Any]:
    parallel, world = ROWS[row]
    script = [os.path.join(ROOT, "examples/train_gpt.py"), *MODEL, "--parallel", parallel]
    if checkpoint:
        script.append("--grad-ckpt")
    command = (["python", *script] if world == 1 else
               ["torchrun", "--nproc-per-node", str(world), *script])
    started = time.perf_counter()
    est, _ = estimate(command, [GPU], mode="auto", steps=2, timeout=3600.0)
    gpu = est.gpus[0]
    return {"row": row, "checkpoint": checkpoint, "mode": est.mode, "total": gpu.total_bytes,
            "breakdown": gpu.breakdown, "seconds": time.perf_counter() - started,
            "rss": est.probe_peak_rss_bytes,
            "analytic": analytic(parallel, world, parameters())}


# Llama-2-7B shapes in bf16 autocast, one sequence of 4096 tokens (examples/train_gpt.py's own
# example), for the speed check.
LLAMA_7B = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--intermediate", "11008",
            "--vocab", "32000", "--batch-size", "1", "--seq-len", "4096", "--amp", "bf16",
            "--optimizer", "adamw"]


def speed() -> None:
    """Shape-only tracing cost of the 7B job as one process and as rank 0 of 64 FSDP2 ranks."""
    script = [os.path.join(ROOT, "examples/train_gpt.py"), *LLAMA_7B]
    for name, command in (
            ("single", ["python", *script]),
            ("fsdp2 x8 rank 0", ["torchrun", "--nproc-per-node", "8", *script,
                                 "--parallel", "fsdp2"]),
            ("fsdp2 x64 rank 0", ["torchrun", "--nproc-per-node", "8", "--nnodes", "8", *script,
                                  "--parallel", "fsdp2"])):
        est, _ = estimate(command, [GPU], mode="fake", steps=2, timeout=3600.0)
        print(f"7B {name}: probe {est.probe_seconds:.1f} s, probe peak RSS "
              f"{est.probe_peak_rss_bytes / 2**30:.2f} GiB, estimate "
              f"{est.gpus[0].total_bytes / 2**30:.2f} GiB per GPU", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="single,ddp8,fsdp8,fsdp64")
    parser.add_argument("--checkpoint", choices=("both", "on", "off"), default="both")
    parser.add_argument("--speed", action="store_true")
    args = parser.parse_args()
    if args.speed:
        speed()
        return 0
    flags = {"both": (False, True), "on": (True,), "off": (False,)}[args.checkpoint]
    results: List[Dict[str, Any]] = []
    for row in args.rows.split(","):
        for flag in flags:
            result = run(row, flag)
            results.append(result)
            print(f"{row} checkpoint={flag}: {result['total'] / 2**30:.2f} GiB ({result['mode']}, "
                  f"{result['seconds']:.0f} s, probe RSS {int(result['rss']) / 2**30:.2f} GiB)",
                  flush=True)
    gib = 2**30
    print(f"\nΨ = {parameters():,} parameters; {GPU}; per-GPU GiB\n")
    print("| job | AC | mode | estimate | model states (16Ψ or 16Ψ/N) | "
          + " | ".join(BREAKDOWN_KEYS) + " |")
    print("|" + " --- |" * (5 + len(BREAKDOWN_KEYS)))
    for r in results:
        parts = r["breakdown"]
        assert isinstance(parts, dict)
        print(f"| {r['row']} | {'yes' if r['checkpoint'] else 'no'} | {r['mode']} | "
              f"{int(r['total']) / gib:.2f} | {int(r['analytic']) / gib:.2f} | "
              + " | ".join(f"{parts[k] / gib:.2f}" for k in BREAKDOWN_KEYS) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
