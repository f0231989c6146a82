"""``xmem estimate``: trace a training command on the CPU and predict its GPU memory."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Tuple

EXIT_FITS_NONE = 3


def register(sub: Any) -> None:
    parser = sub.add_parser(
        "estimate",
        help="estimate a training script's GPU memory per GPU model, on the CPU",
        description="Run an unmodified training script on the CPU under a virtual GPU, record "
        "its allocations for a few optimizer steps, replay them through a simulation of "
        "PyTorch's CUDA caching allocator for each GPU model, and print the peak memory the "
        "job needs there. Exit status 0 when the job fits at least one GPU model, "
        f"{EXIT_FITS_NONE} when it fits none, 2 on errors. The script is traced with the "
        "interpreter the command names and that interpreter's torch, the probe bundle first on "
        "its PYTHONPATH as in an estimation pod: a path (-- /venv/bin/python train.py) or "
        "--python PATH is that interpreter; a bare `python` (or python3) is the interpreter "
        "xmem runs under; a launcher (torchrun, accelerate launch) is not started: the chosen "
        "interpreter traces its rank 0, and a launcher given by its path (-- "
        "/venv/bin/torchrun ...) picks the interpreter of its #! line.",
        epilog="examples: xmem estimate --gpu A100-80GB,H100-80GB -- python "
        "examples/train_gpt.py --layers 12 --hidden 768 --heads 12; "
        "xmem estimate -- /path/to/venv/bin/python train.py; "
        "xmem estimate --python /path/to/venv/bin/python -- torchrun --nproc-per-node 8 "
        "train.py",
    )
    parser.add_argument("--gpu", default=None,
                        help="GPU models, comma-separated (short names like A100-80GB or CUDA "
                        "names; see `xmem gpus`); default A100-40GB,A100-80GB,H100-80GB,L40S")
    parser.add_argument("--mode", choices=("auto", "fake", "profile"), default="auto",
                        help="fake: shape-only, no arithmetic; profile: real execution on the "
                        "CPU; auto (default): fake, falling back to profile when the script "
                        "needs real values")
    parser.add_argument("--steps", type=int, default=3,
                        help="optimizer steps to record before stopping the script (default 3)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout (the script's stdout goes to "
                        "stderr); its torch, python and interpreter keys say what traced it, each GPU's "
                        "conv_workspaces what sized its convolution workspaces (cuDNN's "
                        "heuristics and which cuDNN, or the fitted rule and why)")
    parser.add_argument("--trace", metavar="OUT.json",
                        help="also write the recorded allocation trace (xmem-trace v2)")
    parser.add_argument("--plot", metavar="OUT.png",
                        help="also plot allocated and reserved memory over the trace, one "
                        "panel per GPU with its capacity and request, steps and phases "
                        "shaded (needs matplotlib)")
    parser.add_argument("--report", metavar="OUT.html",
                        help="also write one self-contained HTML page explaining the peak: "
                        "the timeline stacked by category with steps and phases, each GPU's "
                        "capacity and request, what holds the memory at the peak, and what "
                        "would change it")
    parser.add_argument("--alternatives", choices=("targets", "catalogue"), default=None,
                        help="what would change the estimate, simulated again: on the target "
                        "GPUs (expandable segments, margin and MIG rounding) or on every "
                        "catalogue GPU too (one simulation each: slow for CNNs, whose cuDNN "
                        "workspaces are planned per GPU); default targets, catalogue with "
                        "--report")
    parser.add_argument("--alloc-conf", default=None,
                        help="PYTORCH_CUDA_ALLOC_CONF to simulate (default: the environment's)")
    parser.add_argument("--margin", type=float, default=5.0,
                        help="safety margin in percent added to the request (default 5)")
    parser.add_argument("--python", metavar="PATH", default=None,
                        help="the interpreter that traces the script, with its torch (a bare "
                        "name is looked up on PATH); default: the one named by path after --, "
                        "else the one xmem runs under")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds the script may take to make its steps (default 900)")
    # Not dest "command": that is the subcommand's name, which the CLI's error line starts with.
    parser.add_argument("training_command", metavar="command", nargs=argparse.REMAINDER,
                        help="-- python SCRIPT.py [ARGS...], -- python -m MODULE [ARGS...], "
                        "-- /path/to/venv/bin/python SCRIPT.py [ARGS...] or -- torchrun "
                        "[OPTIONS] SCRIPT.py [ARGS...]")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from xmem_admission import bundle
    from xmem_admission.contract.errors import EstimateError
    from xmem_admission.estimator import peak
    from xmem_admission.estimator.estimate import DEFAULT_GPUS, estimate
    from xmem_admission.estimator.replays import Replays

    command: List[str] = list(args.training_command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise EstimateError("no training command given: use `xmem estimate -- python train.py`")
    if args.margin < 0:
        raise EstimateError("--margin must not be negative")
    names = [n for n in args.gpu.split(",") if n.strip()] if args.gpu else list(DEFAULT_GPUS)
    # The script's own stdout must never mix with ours: it goes to stderr. Every run, with
    # whichever interpreter, imports the probe from the bundle an estimation pod gets.
    # the estimate's GPU streams and simulations, which the peak's explanation reuses
    replays = Replays(workers=_cores(), variants=(peak.with_expandable_segments,))
    est, trace = estimate(command, names, mode=args.mode, steps=args.steps,
                          alloc_conf=args.alloc_conf, margin=args.margin / 100.0,
                          timeout=args.timeout, stream=sys.stderr, progress=sys.stderr,
                          python=args.python, bundle=bundle.cached(), replays=replays)
    if args.trace:
        trace.dump(args.trace)
    explained = _explain(trace, est, args, replays)
    if args.plot:
        _plot(trace, est, explained, args, args.plot)
    if args.report:
        from xmem_admission.estimator import report

        report.write(args.report, trace, est, explained, _allocator_config(args, trace),
                     command=reproduce_command(command, args))
    if args.json:
        print(json.dumps(explained.into(est.to_dict())))
    else:
        print(_table(est) + "\n" + "\n".join(explained.lines()))
    return 0 if any(g.fits for g in est.gpus) else EXIT_FITS_NONE


def _cores() -> int:
    """The cores this process may run on: the simulations after the probe use as many."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _table(est: Any) -> str:
    from xmem_admission.estimator.estimate import BREAKDOWN_KEYS

    lines = [f"mode {est.mode}, {est.steps} steps, {est.seconds:.1f} s"
             + (f" (fell back from fake: {est.fallback_reason})" if est.fallback_reason else ""),
             f"traced with torch {est.torch} on Python {est.python} ({est.interpreter})", ""]
    head = ("GPU", "capacity", "peak alloc", "peak reserved", "overhead", "total", "request",
            "fits", "MIG profile")
    rows: List[Tuple[str, ...]] = [head]
    for g in est.gpus:
        rows.append((g.gpu, _gib(g.capacity_bytes), _gib(g.peak_allocated_bytes),
                     _gib(g.peak_reserved_bytes), _gib(g.overhead_bytes), _gib(g.total_bytes),
                     _gib(g.recommended_request_bytes),
                     "yes" if g.fit == "fits" else g.fit if g.fits else "NO",
                     g.mig_profile or "-"))
    lines += _columns(rows)
    lines += ["", "breakdown of the peak:"]
    rows = [("",) + tuple(g.gpu for g in est.gpus)]
    for key in BREAKDOWN_KEYS:
        rows.append((key,) + tuple(_gib(g.breakdown[key]) for g in est.gpus))
    lines += _columns(rows)
    for g in est.gpus:
        if g.conv_workspaces:
            lines.append(f"{g.gpu}: convolution workspaces: {conv_source_line(g.conv_workspaces)}")
    lines += note_lines(est.notes)
    from xmem_admission.estimator.estimate import range_lines
    lines += [""] + range_lines(est.gpus) if any(g.uncertain for g in est.gpus) else []
    for g in est.gpus:
        if not g.fits:
            short = g.total_bytes - g.capacity_bytes
            why = (f"simulated out of memory: {g.oom['message']}" if g.oom else
                   f"needs {_gib(g.total_bytes)}, {_gib(max(short, 0))} more than the card has")
            lines.append(f"{g.gpu}: does not fit: {why}")
    return "\n".join(lines)


def note_lines(notes: List[Dict[str, Any]]) -> List[str]:
    """The trace's notes under their kinds' headings (nothing when there are none)."""
    from xmem_admission.estimator.trace import note_groups

    lines: List[str] = []
    for heading, items in note_groups(notes):
        lines += ["", f"{heading}:"] + [f"  {item}" for item in items]
    return lines


def conv_source_line(info: Dict[str, Any]) -> str:
    """One line saying what sized a GPU's convolution workspaces (``GPUEstimate.
    conv_workspaces``): cuDNN's heuristics and which cuDNN, or the fitted rule and why."""
    planned, by_rule = info.get("planned_calls", 0), info.get("rule_calls", 0)
    text = {"cudnn-heuristics": f"cuDNN {info.get('cudnn')}'s own heuristics, planned on this "
                                f"host for the GPU ({planned} calls)",
            "fitted-rule": f"the fitted rule ({by_rule} calls; {info.get('rule')})",
            "none": "none modelled"}.get(str(info.get("source")), str(info.get("source")))
    if info.get("source") == "cudnn-heuristics" and by_rule:
        text += f", the fitted rule for {by_rule} calls cuDNN could not plan"
    if info.get("source") != "cudnn-heuristics" and info.get("heuristics_unavailable"):
        text += f"; cuDNN's heuristics unavailable: {info['heuristics_unavailable']}"
    if info.get("resident_bytes"):
        text += (f"; {info['resident_bytes'] / 2**20:.0f} MiB held from the first convolution "
                 f"on ({info.get('resident_source')})")
    return text


def _columns(rows: List[Tuple[str, ...]]) -> List[str]:
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def _allocator_config(args: argparse.Namespace, trace: Any) -> Any:
    from xmem_admission.estimator.estimate import allocator_config

    return allocator_config(args.alloc_conf, trace.meta.get("torch"), trace.meta)


def _explain(trace: Any, est: Any, args: argparse.Namespace, replays: Any) -> Any:
    from xmem_admission.estimator import peak
    from xmem_admission.estimator.estimate import resolve_gpus

    config = _allocator_config(args, trace)
    peaks = peak.explain(trace, resolve_gpus([g.gpu for g in est.gpus]), config,
                         replays=replays)
    everywhere = (args.alternatives or ("catalogue" if args.report else "targets")) == "catalogue"
    return peak.Explained(peaks, peak.alternatives(trace, est.gpus, config,
                                                   args.margin / 100.0, peaks,
                                                   everywhere=everywhere, replays=replays))


def reproduce_command(command: List[str], args: argparse.Namespace) -> str:
    """The ``xmem estimate`` command line that reproduces this estimate."""
    import shlex

    words = ["xmem", "estimate"]
    if args.gpu:
        words += ["--gpu", args.gpu]
    if args.mode != "auto":
        words += ["--mode", args.mode]
    words += ["--steps", str(args.steps)]
    if args.alloc_conf is not None:
        words += ["--alloc-conf", args.alloc_conf]
    if args.margin != 5.0:
        words += ["--margin", f"{args.margin:g}"]
    return shlex.join(words + ["--", *command])


def _plot(trace: Any, est: Any, explained: Any, args: argparse.Namespace, path: str) -> None:
    from xmem_admission.contract.errors import EstimateError
    from xmem_admission.estimator import report

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise EstimateError("--plot needs matplotlib (pip install matplotlib)") from None
    report.plot(plt, path, trace, est, _allocator_config(args, trace), explained)
