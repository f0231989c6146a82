"""The conformance corpus as a user runs it: ``xmem estimate`` on each script of
``tests/conformance/scripts``, with the mode it ended in, its seconds, and the check of the
parameter, gradient and optimizer-state bytes live at the second step's end against the count
made from the model itself (``tests/conformance/counts.py``). Then two cost figures: a host data
pipeline in fake mode against the same script's plain CPU run, and profile mode against the
plain CPU run of a torchvision ResNet-50 (the issue's ImageNet case, batch ``--resnet-batch``).

    .venv/bin/python bench/coverage/conformance.py [--only NAME] [--skip-costs] [--resnet-batch 16]

Prints one table row per script and one line per cost figure (markdown, for bench/coverage/README.md).
Minutes on a 2-core machine; every run is a subprocess, one at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.conformance.counts import expected, load, script  # noqa: E402
from tests.conformance.test_corpus import CORPUS  # noqa: E402
from tests.estimator.trace_counts import live_by_category_at  # noqa: E402
from xmem_admission.estimator.trace import Trace  # noqa: E402

PYTHON = sys.executable
GPU = "H100-80GB"


def estimate(argv: List[str], mode: str = "auto", trace: str = "") -> Tuple[Dict, float]:
    command = [PYTHON, "-m", "xmem_admission.cli", "estimate", "--gpu", GPU, "--mode", mode,
               "--json"] + (["--trace", trace] if trace else []) + ["--", "python"] + argv
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - started
    if proc.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(argv)}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout), seconds


def plain(argv: List[str]) -> Tuple[float, int]:
    """Seconds and peak RSS of the script's own run on the CPU (no probe)."""
    started = time.perf_counter()
    proc = subprocess.Popen([PYTHON] + argv, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    if status != 0:
        raise SystemExit(f"plain run of {' '.join(argv)} failed: {proc.stderr.read()[-2000:]}")
    return seconds, usage.ru_maxrss * 1024


def corpus_rows(only: str) -> List[str]:
    rows = ["| script | mode | seconds (probe) | parameters / gradients / optimizer state "
            "(MiB, traced = counted) | check |", "| --- | --- | --- | --- | --- |"]
    with tempfile.TemporaryDirectory(prefix="xmem-conformance-") as tmp:
        for name, extra, kind, step_on_gpu in CORPUS:
            if only and only not in name:
                continue
            module = load(name)
            checkpoint = os.path.join(tmp, "checkpoint.pth.tar")
            if name == "checkpoint_resume.py":
                module.write_checkpoint(module.parse([]), checkpoint)
            trace_path = os.path.join(tmp, name + ".trace.json")
            args = [script(name)] + [a.format(checkpoint=checkpoint) for a in extra]
            result, seconds = estimate(args, trace=trace_path)
            live = live_by_category_at(Trace.load(trace_path), "step 2")
            want = expected(module.build_model(module.parse([])), kind, step_on_gpu)
            got = {k: live.get(k, 0) for k in want}
            mib = " / ".join(f"{want[k] / 2**20:.2f}" for k in want)
            rows.append(f"| {name} | {result['mode']} | {seconds:.1f} "
                        f"({result['probe_seconds']:.1f}) | {mib} | "
                        f"{'equal' if got == want else f'DIFFERS: traced {got}'} |")
            print(rows[-1], flush=True)
    return rows


def cost_lines(resnet_batch: int) -> List[str]:
    lines = []
    pipeline = os.path.join(ROOT, "tests", "estimator", "scripts", "data_pipeline.py")
    for kind, extra in (("shuffle", ["--samples", "1000000"]), ("mnist", ["--samples", "60000"]),
                        ("tokens", [])):
        argv = [pipeline, "--kind", kind, "--steps", "3", "--workers", "0"] + extra
        seconds, rss = plain(argv + ["--device", "cpu"])
        result, wall = estimate(argv, mode="fake")
        lines.append(f"- data pipeline `{kind}` ({' '.join(extra) or 'defaults'}), 3 steps: plain "
                     f"CPU run {seconds:.1f} s, {rss / 2**20:.0f} MiB; fake mode "
                     f"{result['probe_seconds']:.1f} s in the probe ({wall:.1f} s in all), "
                     f"{result['probe_peak_rss_bytes'] / 2**20:.0f} MiB, mode {result['mode']}")
        print(lines[-1], flush=True)
    argv = [script("imagefolder_train.py"), "--arch", "resnet50", "--batch-size",
            str(resnet_batch), "--steps", "3", "--indices", "1000", "--workers", "0"]
    seconds, rss = plain(argv + ["--device", "cpu"])
    result, wall = estimate(argv, mode="profile")
    lines.append(f"- ResNet-50 batch {resnet_batch} (imagefolder_train.py), 3 steps: plain CPU "
                 f"run {seconds:.1f} s, {rss / 2**20:.0f} MiB; profile mode "
                 f"{result['probe_seconds']:.1f} s in the probe ({wall:.1f} s in all), "
                 f"{result['probe_peak_rss_bytes'] / 2**20:.0f} MiB "
                 f"({result['probe_seconds'] / seconds:.2f}x the plain run's time)")
    print(lines[-1], flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="only corpus scripts whose name has this")
    parser.add_argument("--skip-costs", action="store_true")
    parser.add_argument("--resnet-batch", type=int, default=16)
    args = parser.parse_args()
    rows = corpus_rows(args.only)
    lines = [] if args.skip_costs else cost_lines(args.resnet_batch)
    print("\n" + "\n".join(rows + [""] + lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
