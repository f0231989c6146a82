"""Estimator speed and memory: three cases, measured end to end.

Runs ``xmem estimate`` (the real CLI, in a subprocess) and prints, per case, the wall time and
the peak RSS of the largest process involved (the probe subprocess: its ``ru_maxrss``, or the
CLI's own children figure), then for profile mode the ratio to running the same training steps
plainly on the CPU. Targets: fake GPT 1.3B fp32 <= 20 s and 2 GiB; fake Llama-2-7B
shapes bf16 <= 40 s and 2 GiB; profile ResNet-50 batch 32 at 224 <= 3x plain CPU time.
Each line also gives the probe's own time and the size of the trace it wrote (``--trace``), the
figures the attribution of trace format v2 (module and op per allocation) must keep
within 5%. ``--compare-ref REF`` measures that: it checks out git revision REF in a temporary
worktree and runs every case with REF's ``src`` and with this checkout's (first on
``PYTHONPATH``, the same models and interpreter), alternating, ``--repeat`` times, then prints
each side's median and range and the ratios.
Usage: ``.venv/bin/python bench/speed/estimator_speed.py [--quick] [--compare-ref REF [--repeat N]]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def estimate(mode: str, command: list, src: str | None = None) -> dict:
    """One ``xmem estimate`` run; ``src``: the package tree put first on ``PYTHONPATH``."""
    env = None
    if src is not None:
        rest = os.environ.get("PYTHONPATH", "")
        env = dict(os.environ, PYTHONPATH=src + (os.pathsep + rest if rest else ""))
    with tempfile.TemporaryDirectory() as tmp:
        trace = os.path.join(tmp, "trace.json")
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "xmem_admission.cli", "estimate", "--gpu",
                               "H100-80GB", "--mode", mode, "--json", "--steps", "3",
                               "--trace", trace, "--", *command],
                              capture_output=True, text=True, cwd=ROOT, env=env)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        trace_bytes = os.path.getsize(trace) if os.path.exists(trace) else 0
        version = None
        if trace_bytes:
            with open(trace, encoding="utf-8") as fh:
                found = re.search(r'"version":\s*(\d+)', fh.read(200))
            version = int(found.group(1)) if found else None
    if proc.returncode not in (0, 3):
        raise SystemExit(f"estimate failed:\n{proc.stderr[-3000:]}")
    data = json.loads(proc.stdout)
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    data["wall_s"] = wall
    # CPU seconds of the CLI and its children (the probe): less sensitive to other load
    data["cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    data["trace_bytes"] = trace_bytes
    data["trace_version"] = version
    data["peak_rss"] = max(data["probe_peak_rss_bytes"], children)
    return data


def plain(command: list, steps: int) -> float:
    started = time.perf_counter()
    subprocess.run([*command, "--steps", str(steps)], check=True, capture_output=True,
                   cwd=ROOT)
    return time.perf_counter() - started


def _spread(values: list) -> str:
    return (f"{statistics.median(values):.2f} s [{min(values):.2f}-{max(values):.2f}]")


def compare(ref: str, repeat: int, quick: bool) -> None:
    """Every case with REF's probe and this checkout's, alternating, ``repeat`` times each."""
    cases = [] if quick else list(CASES)
    cases.append(("profile ResNet-50 b32 224 SGD", "profile", RESNET + ["--steps", "10"]))
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=True).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="estimator-speed-")
    tree = os.path.join(tmp, "ref")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", tree, ref],
                   check=True)
    sides = [(ref, os.path.join(tree, "src")), (f"this checkout ({head})",
                                                  os.path.join(ROOT, "src"))]
    try:
        for name, mode, command in cases:
            runs: dict = {label: [] for label, _ in sides}
            for _ in range(repeat):
                for label, src in sides:
                    runs[label].append(estimate(mode, command, src))
            print(f"{name}:")
            for label, _ in sides:
                got = runs[label]
                sizes = sorted({d["trace_bytes"] for d in got})
                print(f"  {label}: trace v{got[0]['trace_version']}, "
                      f"{', '.join(f'{b:,}' for b in sizes)} bytes "
                      f"({got[0]['trace_events']:,} events); probe "
                      f"{_spread([d['probe_seconds'] for d in got])}, wall "
                      f"{_spread([d['wall_s'] for d in got])}, CPU "
                      f"{_spread([d['cpu_s'] for d in got])} (median [min-max] of {repeat})")
            old, new = (runs[label] for label, _ in sides)
            ratio = {key: statistics.median(d[key] for d in new)
                     / statistics.median(d[key] for d in old)
                     for key in ("probe_seconds", "wall_s", "cpu_s", "trace_bytes")}
            print(f"  this / {ref}: probe time {ratio['probe_seconds']:.3f}, wall "
                  f"{ratio['wall_s']:.3f}, CPU {ratio['cpu_s']:.3f}, trace bytes "
                  f"{ratio['trace_bytes']:.3f}", flush=True)
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", tree], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="only the profile-mode case")
    parser.add_argument("--compare-ref", metavar="REF",
                        help="compare the probe of git revision REF with this checkout's")
    parser.add_argument("--repeat", type=int, default=5,
                        help="runs per side and case with --compare-ref (default 5)")
    args = parser.parse_args()
    if args.compare_ref:
        compare(args.compare_ref, args.repeat, args.quick)
        return
    if not args.quick:
        for name, mode, command in CASES:
            data = estimate(mode, command)
            gpu = data["gpus"][0]
            print(f"{name}: wall {data['wall_s']:.1f} s, peak RSS "
                  f"{data['peak_rss'] / 2**30:.2f} GiB, estimate "
                  f"{gpu['total_bytes'] / 2**30:.1f} GiB on {gpu['gpu']}; probe "
                  f"{data['probe_seconds']:.1f} s, trace {data['trace_bytes']:,} bytes "
                  f"({data['trace_events']:,} events)", flush=True)
    # Profile mode vs the same 3 training steps run plainly on the CPU (same script, same
    # interpreter start-up and model construction on both sides).
    data = estimate("profile", RESNET + ["--steps", "10"])
    base = plain(RESNET, 3)
    ratio = data["wall_s"] / base
    print(f"profile ResNet-50 b32 224 SGD: wall {data['wall_s']:.1f} s vs plain CPU "
          f"{base:.1f} s (ratio {ratio:.2f}), peak RSS {data['peak_rss'] / 2**30:.2f} GiB; probe "
          f"{data['probe_seconds']:.1f} s, trace {data['trace_bytes']:,} bytes "
          f"({data['trace_events']:,} events)")
    print(f"profile_ratio: {ratio:.2f}")


if __name__ == "__main__":
    main()
