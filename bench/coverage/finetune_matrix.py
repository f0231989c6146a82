"""The fine-tuning matrix (``tests/finetune/test_matrix.py``'s jobs) at a ~0.83B Llama shape, as
a user estimates it: ``xmem estimate --python <torch env> --json --gpu H100-80GB,H200`` in the
default mode, batch 4 x 1024 tokens (``--python``: the torch 2.15 environment the probe's tests
build, or another with the same stack, e.g. torch 2.11's). Printed per job (markdown, for
``bench/coverage/README.md``): the mode the estimate ended in, the probe's seconds, the whole
``xmem estimate``'s seconds (the simulations included), the probe's peak RSS, trace events, the
H200 total, or the failure's first line.

    .venv/bin/python bench/coverage/finetune_matrix.py [--jobs matrix|options] [--only JOB[,JOB]]
        [--checkpoint DIR] [--timeout S] [--python ENV/bin/python]

``--jobs options``: instead of the matrix, the options users set most on the same stack, one
job each (``OPTIONS``: ``scripts/trainer_options.py``'s optimizers, precisions, adapters and
``Trainer`` flags; ``scripts/trl_trainers.py``'s reward, KTO, RLOO and IPO trainers).

The checkpoint (hidden 2048, 16 layers, 32 heads, 8 key/value heads, intermediate 5632, vocab
32000: ``tests/finetune/conftest.py``, ``SHAPES["bench"]``; 1.7 GB of bf16 safetensors) is made
once into ``--checkpoint`` (default ``~/.cache/xmem-admission/finetune-bench/llama-0.83b``) and
reused. One job at a time; ``--timeout`` bounds each estimate (a job that falls back to real
execution on the CPU at this size does not finish within it).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.finetune import conftest  # noqa: E402
from tests.finetune.test_matrix import JOBS, SCRIPTS, Job  # noqa: E402
from tests.support.torch_envs import NEWEST  # noqa: E402

CHECKPOINT = Path.home() / ".cache" / "xmem-admission" / "finetune-bench" / "llama-0.83b"
GIB = 2**30
FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)')
RETRACED = re.compile(r"^xmem: fake mode needs real values \((?P<reason>.*)\); tracing again in "
                      r"profile mode$", re.M)
# where a failure is said to happen: the deepest frame of the libraries the job uses, not of
# torch, Triton or the standard library under them
MACHINERY = ("site-packages/torch/", "site-packages/triton/", "/concurrent/", "/contextlib.py",
             "<frozen")


def _option(name: str, *args: str, script: str = "trainer_options.py") -> Job:
    return Job(name, script, args)


def _trl(name: str, *args: str) -> Job:
    return _option(name, *args, script="trl_trainers.py")


OPTIONS = [
    _option("accumulation_checkpointing", "--lora", "--accumulation", "4", "--checkpointing"),
    _option("fp16_lora", "--lora", "--fp16"),
    _option("fp32_full", "--fp32"),
    _option("dora", "--dora"),
    _option("rslora", "--rslora"),
    _option("lora_all_linear", "--lora", "--all-linear"),
    _option("neftune", "--lora", "--neftune", "5"),
    _option("eager_attention", "--lora", "--attention", "eager"),
    _option("torch_compile_flag", "--lora", "--torch-compile"),
    _option("adamw_torch", "--optim", "adamw_torch"),
    _option("adamw_bnb_8bit", "--optim", "adamw_bnb_8bit"),
    _option("paged_adamw_32bit", "--lora", "--optim", "paged_adamw_32bit"),
    _option("lion_8bit", "--optim", "lion_8bit"),
    _option("adafactor", "--optim", "adafactor"),
    _option("sgd", "--optim", "sgd"),
    _option("qlora_checkpointing", "--qlora", "--checkpointing"),
    _option("qlora_bf16_storage", "--qlora", "--storage-bf16", "--checkpointing"),
    _trl("reward_lora", "--trainer", "reward", "--peft"),
    _trl("reward_full", "--trainer", "reward"),
    _trl("kto_lora", "--trainer", "kto", "--peft"),
    _trl("rloo_lora", "--trainer", "rloo", "--peft"),
    _trl("dpo_ipo_lora", "--trainer", "dpo-ipo", "--peft"),
]
SETS = {"matrix": JOBS, "options": OPTIONS}


def failing_frame(stderr: str) -> str:
    frames = [m for m in FRAME.finditer(stderr)
              if not any(part in m["path"] for part in MACHINERY)]
    if not frames:
        return ""
    last = frames[-1]
    return f" ({last['path'].split('site-packages/')[-1]}:{last['line']}, {last['name']})"


def checkpoint(folder: Path) -> Path:
    if not (folder / "model.safetensors").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        conftest.make(folder, "bench", NEWEST.interpreter)
    return folder


def run(job: Job, model: Path, timeout: float, python: str) -> str:
    """One markdown row: job, mode, probe s, xmem estimate's wall s, probe RSS, events, H200
    total (or the failure)."""
    command = [sys.executable, "-m", "xmem_admission.cli", "estimate", "--python",
               python, "--json", "--gpu", "H100-80GB,H200", "--timeout", str(timeout),
               "--", "python", str(SCRIPTS / job.script), "--model", str(model),
               "--batch-size", "4", "--seq-len", "1024", *job.args]
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout + 600)
    wall = time.perf_counter() - started
    if proc.returncode not in (0, 3):
        lines = [line for line in proc.stderr.splitlines()
                 if line.startswith("xmem estimate: error:")]
        failure = lines[-1] if lines else proc.stderr.strip().splitlines()[-1]
        failure = failure.replace("xmem estimate: error: ", "").replace("|", "/")
        failure += failing_frame(proc.stderr)
        retraced = RETRACED.search(proc.stderr)
        if retraced:  # the default mode's fallback: what fake mode lacked, then what failed
            failure = f"fake: needs real values ({retraced['reason']}); profile: {failure}"
        failure = re.sub(r"/\S*/site-packages/", "", failure).replace(f"{ROOT}/", "")
        return (f"| {job.id} | failed (exit {proc.returncode}, {wall:.0f} s) | | | | | | "
                f"{failure[:700]} |")
    data = json.loads(proc.stdout)
    (h200,) = [g for g in data["gpus"] if g["gpu"] == "H200"]
    note = data.get("fallback_reason", "")[:300].replace("|", "/")
    if data.get("upper_bound"):  # e.g. torch.compile traced as eager code
        kinds = ", ".join(sorted({n["kind"] for n in data.get("notes", [])}))
        note = f"{note} upper bound ({kinds})".strip()
    return (f"| {job.id} | {data['mode']} | {data['probe_seconds']:.1f} | {wall:.1f} | "
            f"{data['probe_peak_rss_bytes'] / GIB:.2f} GiB | {data['trace_events']:,} | "
            f"{h200['total_bytes'] / GIB:.2f} GiB | {note} |")


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", choices=sorted(SETS), default="matrix",
                        help="the matrix's jobs, or the options users set most (default: matrix)")
    parser.add_argument("--only", default="", help="job ids, comma-separated (default: all)")
    parser.add_argument("--checkpoint", type=Path, default=CHECKPOINT)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds each estimate may trace for (xmem estimate --timeout)")
    parser.add_argument("--python", default=NEWEST.interpreter,
                        help="the torch environment's interpreter that traces the jobs (default: "
                             "the newest torch the probe's tests build)")
    options = parser.parse_args(argv)
    jobs = SETS[options.jobs]
    only = {name for name in options.only.split(",") if name}
    unknown = only - {job.id for job in jobs}
    if unknown:
        parser.error(f"unknown job(s): {', '.join(sorted(unknown))}")
    model = checkpoint(options.checkpoint)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, "
          f"{os.cpu_count()} cores, checkpoint {model}")
    print(f"traced with {options.python}")
    print("| job | mode | probe s | xmem estimate s | probe peak RSS | trace events | H200 total "
          "| fallback / failure |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for job in jobs:
        if not only or job.id in only:
            print(run(job, model, options.timeout, options.python), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
