"""Estimator speed and memory: the issue's three cases, measured end to end.

Runs ``xmem estimate`` (the real CLI, in a subprocess) and prints, per case, the wall time and
the peak RSS of the largest process involved (the probe subprocess: its ``ru_maxrss``, or the
CLI's own children figure), then for profile mode the ratio to running the same training steps
plainly on the CPU. Targets (issue 3): fake GPT 1.3B fp32 <= 20 s and 2 GiB; fake Llama-2-7B
shapes bf16 <= 40 s and 2 GiB; profile ResNet-50 batch 32 at 224 <= 3x plain CPU time.
Usage: ``.venv/bin/python bench/estimator_speed.py [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT = [sys.executable, os.path.join(ROOT, "examples", "train_gpt.py")]
CNN = [sys.executable, os.path.join(ROOT, "examples", "train_cnn.py")]

CASES = [
    ("fake GPT-1.3B fp32 b8x1024 AdamW", "fake",
     GPT + ["--layers", "24", "--hidden", "2048", "--heads", "16", "--vocab", "50257",
            "--batch-size", "8", "--seq-len", "1024", "--optimizer", "adamw"]),
    ("fake Llama-2-7B bf16 b1x4096 AdamW", "fake",
     GPT + ["--layers", "32", "--hidden", "4096", "--heads", "32", "--intermediate", "11008",
            "--vocab", "32000", "--batch-size", "1", "--seq-len", "4096", "--amp", "bf16",
            "--optimizer", "adamw"]),
]
RESNET = CNN + ["--model", "resnet50", "--batch-size", "32", "--image-size", "224",
                "--optimizer", "sgd"]


def estimate(mode: str, command: list) -> dict:
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "xmem_admission.cli", "estimate", "--gpu",
                           "H100-80GB", "--mode", mode, "--json", "--steps", "3", "--",
                           *command], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    if proc.returncode not in (0, 3):
        raise SystemExit(f"estimate failed:\n{proc.stderr[-3000:]}")
    data = json.loads(proc.stdout)
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    data["wall_s"] = wall
    data["peak_rss"] = max(data["probe_peak_rss_bytes"], children)
    return data


def plain(command: list, steps: int) -> float:
    started = time.perf_counter()
    subprocess.run([*command, "--steps", str(steps)], check=True, capture_output=True,
                   cwd=ROOT)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="only the profile-mode case")
    args = parser.parse_args()
    if not args.quick:
        for name, mode, command in CASES:
            data = estimate(mode, command)
            gpu = data["gpus"][0]
            print(f"{name}: wall {data['wall_s']:.1f} s, peak RSS "
                  f"{data['peak_rss'] / 2**30:.2f} GiB, estimate "
                  f"{gpu['total_bytes'] / 2**30:.1f} GiB on {gpu['gpu']}", flush=True)
    # Profile mode vs the same 3 training steps run plainly on the CPU (same script, same
    # interpreter start-up and model construction on both sides).
    data = estimate("profile", RESNET + ["--steps", "10"])
    base = plain(RESNET, 3)
    ratio = data["wall_s"] / base
    print(f"profile ResNet-50 b32 224 SGD: wall {data['wall_s']:.1f} s vs plain CPU "
          f"{base:.1f} s (ratio {ratio:.2f}), peak RSS {data['peak_rss'] / 2**30:.2f} GiB")
    print(f"profile_ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
