"""``xmem bench paper`` and ``xmem bench gpumemnet``: the accuracy yardsticks (the xMem paper's
measured jobs, GPUMemNet's A100 jobs).

The benchmark's model zoo (torchvision and Hugging Face models) is not part of the product: it
lives in the repository's ``bench/`` folder, which this command imports from the source checkout
that the package was installed from (``pip install -e .``, as ``make`` does).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def register(sub: Any) -> None:
    parser = sub.add_parser("bench", help="benchmarks against published measurements",
                            description="Benchmarks against published measurements.")
    kinds = parser.add_subparsers(dest="bench", metavar="BENCHMARK")
    kinds.required = True
    paper = kinds.add_parser(
        "paper", help="estimate the xMem paper's measured jobs and compare all estimators",
        description="Rebuild each job of a runs file (the xMem paper artifact's format, e.g. "
        "the yardstick's runs.jsonl), estimate it with the same path as `xmem "
        "estimate` for the row's GPU, write one JSON line per row and print the comparison "
        "with the estimators recorded in the file. Each row's trace is kept in OUT.traces/.")
    paper.add_argument("--runs", required=True, metavar="FILE.jsonl", help="the runs file")
    paper.add_argument("--out", required=True, metavar="OUT.jsonl",
                       help="where to write one JSON line per row")
    paper.add_argument("--mode", choices=("auto", "fake", "profile"), default="auto")
    paper.add_argument("--jobs", type=int, default=1, help="rows estimated in parallel")
    paper.add_argument("--only", metavar="SUBSTRING", default=None,
                       help="only rows whose id contains SUBSTRING")
    paper.add_argument("--explain", metavar="ID", default=None,
                       help="estimate one row and print its breakdown next to the measurement")
    paper.add_argument("--resume", action="store_true",
                       help="simulate again from the traces an earlier run kept in OUT.traces/ "
                       "instead of running those rows' jobs")
    paper.set_defaults(func=run_paper)
    gmn = kinds.add_parser(
        "gpumemnet", help="run GPUMemNet's measured A100 jobs and score the estimates",
        description="Run each row's generator script unmodified (the commit and command line "
        "named in the row, checked out from REPO, a git clone of github.com/itu-rad/GPUMemNet "
        "with its history) through the same path as `xmem estimate`, fit the one device-wide "
        "floor on the rows' own data and print leave-one-out errors by family and "
        "architecture, OOM agreement on the A100-40GB and seconds per job.")
    gmn.add_argument("--runs", required=True, metavar="FILE.jsonl", help="the runs file")
    gmn.add_argument("--repo", required=True, metavar="DIR",
                     help="a git clone of GPUMemNet with its history (worktrees per commit "
                     "are made beside it, in DIR-worktrees)")
    gmn.add_argument("--out", required=True, metavar="OUT.jsonl",
                     help="where to write one JSON line per row")
    gmn.add_argument("--sample", type=int, default=None, metavar="N",
                     help="N rows spread evenly over subset, architecture and OOM")
    gmn.add_argument("--disjoint-from", type=int, default=None, metavar="M",
                     help="with --sample N: draw the N rows from those outside the M-row "
                     "sample (a second sample sharing no row with the first)")
    gmn.add_argument("--jobs", type=int, default=1, help="rows estimated in parallel")
    gmn.add_argument("--mode", choices=("auto", "fake", "profile"), default="auto")
    gmn.add_argument("--steps", type=int, default=3, help="optimizer steps traced per row")
    gmn.add_argument("--resume", action="store_true",
                     help="simulate again from the traces an earlier run kept in OUT.traces/ "
                     "instead of running those rows' scripts")
    gmn.add_argument("--explain", metavar="ID", default=None,
                     help="also print one row's breakdown next to its measurement")
    gmn.set_defaults(func=run_gpumemnet)


def _checkout() -> str:
    """The source checkout holding ``bench/``; BenchError when the package is not installed
    from one."""
    from xmem_admission.contract.errors import BenchError

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    if not os.path.isfile(os.path.join(root, "bench", "yardsticks", "paper", "benchmark.py")):
        raise BenchError("xmem bench needs the source checkout's bench/ folder (the benchmark's "
                         f"model zoo), which is not beside this installation ({root}): install "
                         "the package from a clone with `pip install -e .` (make does)")
    return root


def _bench_on_path() -> None:
    root = _checkout()
    if root not in sys.path:
        sys.path.insert(0, root)


def run_paper(args: argparse.Namespace) -> int:
    _bench_on_path()
    from bench.yardsticks.paper import benchmark as paperbench
    from xmem_admission.contract.errors import RunsFileError

    rows = paperbench.load_runs(args.runs)
    if args.explain:
        chosen = [r for r in rows if r.id == args.explain]
        if not chosen:
            raise RunsFileError(f"no row with id {args.explain!r} in {args.runs}")
        rows = chosen
    elif args.only:
        rows = [r for r in rows if args.only in r.id]
        if not rows:
            raise RunsFileError(f"no row id contains {args.only!r}")
    with open(os.devnull, "w") as devnull:
        results = paperbench.run_rows(rows, args.mode, args.jobs, log=devnull,
                                      progress=sys.stderr, traces=args.out + ".traces",
                                      resume=args.resume)
    with open(args.out, "w", encoding="utf-8") as fh:
        for result in results:
            fh.write(json.dumps({k: result[k] for k in ("id", "estimate_bytes", "low_bytes",
                                                        "high_bytes", "request_bytes",
                                                        "predicted_oom", "fit",
                                                        "seconds", "mode", "peak_reserved_bytes",
                                                        "peak_allocated_bytes",
                                                        "high_reserved_bytes", "convolutions",
                                                        "error")
                                 if k in result}) + "\n")
    if args.explain:
        result = results[0]
        if "error" in result:
            print(f"{result['id']}: {result['error']}")
            return 2
        print(paperbench.explain(rows[0], result))
        return 0
    print(paperbench.report(rows, results))
    return 0 if all("error" not in r for r in results) else 1


def run_gpumemnet(args: argparse.Namespace) -> int:
    _bench_on_path()
    from bench.yardsticks import gpumemnet as gmn
    from xmem_admission.contract.errors import RunsFileError
    from xmem_admission.contract.gpus import lookup

    if args.jobs < 1 or (args.sample is not None and args.sample < 1) or args.steps < 1:
        raise RunsFileError("--jobs, --sample and --steps must be at least 1")
    if args.disjoint_from is not None and (args.sample is None or args.disjoint_from < 1):
        raise RunsFileError("--disjoint-from needs --sample, and must be at least 1")
    every = gmn.load_runs(args.runs)
    if args.sample and args.disjoint_from:
        rows = gmn.disjoint_sample(every, args.sample, args.disjoint_from)
    else:
        rows = gmn.stratified_sample(every, args.sample) if args.sample else every
    if args.explain and args.explain not in {r.id for r in every}:
        raise RunsFileError(f"no row with id {args.explain!r} in {args.runs}")
    if args.explain and args.explain not in {r.id for r in rows}:
        rows.append(next(r for r in every if r.id == args.explain))
    checkouts = gmn.Checkouts(args.repo)
    with open(os.devnull, "w") as devnull:
        sims = gmn.run_rows(rows, checkouts, args.mode, args.steps, args.jobs, devnull,
                            traces=args.out + ".traces", resume=args.resume,
                            progress=sys.stderr)
    answers = gmn.leave_one_out(rows, sims, lookup(gmn.GPU_KEY).capacity_bytes)
    with open(args.out, "w", encoding="utf-8") as fh:
        for row in rows:
            sim = sims.get(row.id, {})
            fh.write(json.dumps({**sim, **answers.get(row.id, {})}) + "\n")
    print(gmn.report(rows, sims, answers, gmn.fit_floor(rows, sims)))
    if args.explain:
        row = next(r for r in rows if r.id == args.explain)
        if row.id not in answers:
            print(f"{row.id}: {sims[row.id].get('error')}")
            return 2
        print(gmn.explain(row, sims[row.id], answers[row.id]))
    return 0 if all(r.id in answers for r in rows) else 1
