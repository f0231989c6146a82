"""The user's torch: the probe with every minor torch release of the supported range.

For each release (its newest patch on PyPI) and each of the oldest and newest Python it supports
(within 3.9-3.13), an environment standing for a user's image (``scripts/torch-venv.sh``: that
torch, numpy, the matching torchvision and the corpus's frameworks where they install), then
``xmem estimate --python ENV/bin/python`` (the estimation pod's path: the bundle on PYTHONPATH
of that interpreter) over the following, after the probe's own tests with that torch
(``scripts/test-torch.sh``):

- the fixed jobs: ``examples/train_gpt.py`` at GPT-2 small shape with AdamW in fp32 and in bf16
  autocast, ``examples/train_cnn.py`` ResNet-50 with SGD and fp16 AMP, the corpus's LSTM
  language model; the estimate of each for an A100-80GB, against the development pin's;
- the conformance corpus (``tests/conformance/scripts``) in fake mode: estimated or not, and why.

Plus one release below the range (2.1), which must be refused with the range.

    .venv/bin/python bench/coverage/compat.py [--only 2.6.0] [--python 3.11] [--keep-envs] [--table-only]

Results go to ``bench/coverage/compat/results.jsonl``, one line per (torch, Python); a rerun
skips the pairs already there (delete a line to redo it). The table is written into
bench/coverage/README.md between the ``compat-table`` markers. An environment is deleted once its
row is written (5 GB each), except the two that ``make test`` keeps (tests/support/torch_envs.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.support.torch_envs import NEWEST, OLDEST  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "coverage", "compat", "results.jsonl")
README = os.path.join(ROOT, "bench", "coverage", "README.md")
BEGIN, END = "<!-- compat-table -->", "<!-- /compat-table -->"
GPU = "A100-80GB"

# Each minor release's newest patch, with the oldest and newest Python of 3.9-3.13 it has wheels
# for on PyPI (`pip index versions torch --python-version 3.X --only-binary=:all:`, 2026-12-02:
# 3.9 up to 2.8, 3.13 from 2.5; 2.2-2.4 have 3.12 at most, 2.9 on start at 3.10, 2.15 at 3.11:
# `pip install --dry-run --only-binary=:all: --python-version 3.10 torch==2.15.0` finds none,
# 2026-12-03).
MATRIX: List[Tuple[str, Tuple[str, ...]]] = [
    ("2.2.2", ("3.9", "3.12")), ("2.3.1", ("3.9", "3.12")), ("2.4.1", ("3.9", "3.12")),
    ("2.5.1", ("3.9", "3.13")), ("2.6.0", ("3.9", "3.13")), ("2.7.1", ("3.9", "3.13")),
    ("2.8.0", ("3.9", "3.13")), ("2.9.1", ("3.10", "3.13")), ("2.10.0", ("3.10", "3.13")),
    ("2.11.0", ("3.10", "3.13")), ("2.12.1", ("3.10", "3.13")), ("2.13.0", ("3.10", "3.13")),
    ("2.14.1", ("3.10", "3.13")), ("2.15.0", ("3.11", "3.13")),
]
# Below the range: refused with it, never traced.
OUTSIDE = [("2.1.2", ("3.10",))]

GPT = ["examples/train_gpt.py", "--layers", "12", "--hidden", "768", "--heads", "12",
       "--vocab", "50257", "--seq-len", "1024", "--batch-size", "8", "--optimizer", "adamw"]
FIXED: List[Tuple[str, List[str]]] = [
    ("gpt2-adamw-fp32", GPT),
    ("gpt2-adamw-bf16", GPT + ["--amp", "bf16"]),
    ("resnet50-sgd-fp16", ["examples/train_cnn.py", "--model", "resnet50", "--batch-size", "32",
                           "--optimizer", "sgd", "--amp", "fp16"]),
    ("lstm-lm", ["tests/conformance/scripts/word_lm_train.py"]),
]
CORPUS = ["timm_train.py", "nanogpt_train.py", "accelerate_train.py", "lightning_train.py",
          "hf_trainer_train.py", "imagefolder_train.py", "word_lm_train.py",
          "checkpoint_resume.py"]


def estimate(python: str, argv: List[str], mode: str = "auto",
             timeout: float = 1800) -> Dict[str, Any]:
    """``xmem estimate --json`` with ``python`` tracing; the outcome as one dict."""
    command = [sys.executable, "-m", "xmem_admission.cli", "estimate", "--gpu", GPU, "--mode",
               mode, "--json", "--python", python, "--"] + ["python"] + argv
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    out: Dict[str, Any] = {"seconds": round(time.perf_counter() - started, 1)}
    if proc.returncode in (0, 3):
        body = json.loads(proc.stdout)
        gpu = body["gpus"][0]
        out.update(status="ok", mode=body["mode"], torch=body.get("torch"),
                   total_bytes=gpu["total_bytes"], peak_reserved_bytes=gpu["peak_reserved_bytes"])
    else:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        out.update(status="error", reason=lines[-1][:400] if lines else f"exit {proc.returncode}")
    return out


def corpus_run(python: str, env: str, name: str) -> Dict[str, Any]:
    from tests.conformance.test_corpus import FRAMEWORKS

    module = FRAMEWORKS.get(name)
    if module is not None:
        probe = subprocess.run([python, "-c", f"import importlib.util, sys; "
                                f"sys.exit(importlib.util.find_spec({module!r}) is None)"])
        if probe.returncode != 0:
            return {"status": "no_framework", "reason": f"{module} does not install here"}
    args: List[str] = []
    if name == "checkpoint_resume.py":
        path = os.path.join(tempfile.mkdtemp(prefix="xmem-compat-"), "checkpoint.pth.tar")
        made = subprocess.run([python, "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                               "import checkpoint_resume as m; "
                               "m.write_checkpoint(m.parse([]), sys.argv[2])",
                               os.path.join(ROOT, "tests", "conformance", "scripts"), path],
                              capture_output=True, text=True)
        if made.returncode != 0:  # torch.save itself fails with this torch and Python
            last = made.stderr.strip().splitlines()[-1:] or [f"exit {made.returncode}"]
            return {"status": "no_checkpoint",
                    "reason": f"torch.save fails here, without the probe: {last[0][:200]}"}
        args = ["--resume", path]
    return estimate(python, [f"tests/conformance/scripts/{name}"] + args, mode="fake")


def probe_tests(torch_version: str, python_minor: str) -> Dict[str, Any]:
    """The probe's own tests with this torch (scripts/test-torch.sh, as `make test` runs them
    for the range's two ends): the CUDA surface, fake and profile mode, autocast, activation
    checkpointing, the distributed launchers, DDP, FSDP1 and FSDP2, the corpus."""
    proc = subprocess.run(["bash", "scripts/test-torch.sh", torch_version, python_minor,
                           "-rf", "--timeout", "600"], cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)
    lines = proc.stdout.strip().splitlines()
    failed = [line.split(" ", 1)[1].split(" - ")[0] for line in lines
              if line.startswith("FAILED ")][:6]
    summary = lines[-1].strip("= ") if lines else f"exit {proc.returncode}"
    return {"status": "ok" if proc.returncode == 0 else "failed", "summary": summary,
            "failed": failed}


def run_pair(torch_version: str, python_minor: str, outside: bool) -> Dict[str, Any]:
    started = time.perf_counter()
    build = subprocess.run(["bash", "scripts/torch-venv.sh", torch_version, python_minor],
                           cwd=ROOT, capture_output=True, text=True)
    if build.returncode != 0:
        raise SystemExit(f"torch {torch_version} / Python {python_minor}: the environment did "
                         f"not build:\n{build.stderr[-2000:]}")
    env = build.stdout.strip().splitlines()[-1]
    python = os.path.join(env, "bin", "python")
    row: Dict[str, Any] = {"torch": torch_version, "python": python_minor,
                           "installed": open(os.path.join(env, "torch-version.txt")).read().strip(),
                           "setup_seconds": round(time.perf_counter() - started, 1)}
    if outside:
        row["fixed"] = {"gpt2-adamw-fp32": estimate(python, FIXED[0][1])}
    else:
        row["probe_tests"] = probe_tests(torch_version, python_minor)
        row["fixed"] = {name: estimate(python, argv) for name, argv in FIXED}
        row["corpus"] = {name: corpus_run(python, env, name) for name in CORPUS}
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def pin_row() -> Dict[str, Any]:
    """The development pin's estimates of the fixed jobs (this interpreter), the reference."""
    import torch

    python = sys.executable
    return {"torch": "pin", "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
            "installed": torch.__version__,
            "fixed": {name: estimate(python, argv) for name, argv in FIXED}}


def load_results() -> List[Dict[str, Any]]:
    if not os.path.exists(RESULTS):
        return []
    with open(RESULTS, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def append(row: Dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(row, sort_keys=True) + "\n")


def gib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def table(rows: List[Dict[str, Any]]) -> str:
    pins = [r for r in rows if r["torch"] == "pin"]
    pin = pins[-1]["fixed"] if pins else {}
    head = ["torch", "Python", "probe's tests", "corpus estimated", "not estimated (why)"] + \
        [f"{name} (GiB, vs pin)" for name, _ in FIXED] + ["seconds"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    order = {(t, p): i for i, (t, ps) in enumerate(OUTSIDE + MATRIX) for p in ps}
    for row in sorted((r for r in rows if r["torch"] != "pin"),
                      key=lambda r: order.get((r["torch"], r["python"]), 99)):
        corpus = row.get("corpus", {})
        done = [n for n, c in corpus.items() if c["status"] == "ok"]
        missing = [f"{n[:-3]}: {c.get('reason', c['status'])}" for n, c in corpus.items()
                   if c["status"] != "ok"]
        tests = row.get("probe_tests")
        cells = [row["installed"], row["python"],
                 "-" if tests is None else "; ".join([tests["summary"].split(" in ")[0]]
                                                     + tests["failed"]),
                 f"{len(done)} of {len(corpus)}" if corpus
                 else "-", "; ".join(missing) or "-"]
        for name, _ in FIXED:
            got = row["fixed"].get(name)
            if got is None:
                cells.append("-")
            elif got["status"] != "ok":
                cells.append(f"not estimated: {got.get('reason', '')}")
            else:
                ref = pin.get(name, {}).get("total_bytes")
                delta = (f" ({(got['total_bytes'] - ref) / ref * 100:+.1f}%)"
                         if ref else "")
                cells.append(gib(got["total_bytes"]) + delta)
        cells.append(str(row.get("seconds", "-")))
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    if pins:
        p = pins[-1]
        lines.append("")
        lines.append(f"The pin ({p['installed']}, Python {p['python']}): " + ", ".join(
            f"{name} {gib(p['fixed'][name].get('total_bytes'))} GiB" for name, _ in FIXED) +
            f" ({GPU}, total with the runtime overhead).")
    return "\n".join(lines)


def write_table(rows: List[Dict[str, Any]]) -> None:
    with open(README, encoding="utf-8") as fh:
        text = fh.read()
    block = f"{BEGIN}\n{table(rows)}\n{END}"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(README, "w", encoding="utf-8") as fh:
        fh.write(text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", default=[],
                        help="only this torch release (repeatable)")
    parser.add_argument("--python", action="append", default=[],
                        help="only this Python (repeatable)")
    parser.add_argument("--keep-envs", action="store_true",
                        help="keep every environment (5 GB each) instead of the two ends only")
    parser.add_argument("--table-only", action="store_true",
                        help="write the table from the results kept, run nothing")
    args = parser.parse_args()
    rows = load_results()
    if not args.table_only:
        if not any(r["torch"] == "pin" for r in rows):
            row = pin_row()
            append(row)
            rows.append(row)
        done = {(r["torch"], r["python"]) for r in rows}
        keep = {(OLDEST.torch, OLDEST.python), (NEWEST.torch, NEWEST.python)}
        pairs = [(t, p, True) for t, ps in OUTSIDE for p in ps] + \
            [(t, p, False) for t, ps in MATRIX for p in ps]
        for torch_version, python_minor, outside in pairs:
            if args.only and torch_version not in args.only:
                continue
            if args.python and python_minor not in args.python:
                continue
            if (torch_version, python_minor) in done:
                continue
            print(f"compat: torch {torch_version} on Python {python_minor}", flush=True)
            row = run_pair(torch_version, python_minor, outside)
            append(row)
            rows.append(row)
            write_table(rows)
            if not args.keep_envs and (torch_version, python_minor) not in keep:
                from tests.support.torch_envs import TorchEnv

                shutil.rmtree(TorchEnv(torch_version, python_minor).folder, ignore_errors=True)
    write_table(rows)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
