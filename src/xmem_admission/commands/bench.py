"""``xmem bench paper``: the accuracy yardstick on the xMem paper's measured jobs.

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
        "with the estimators recorded in the file.")
    paper.add_argument("--runs", required=True, metavar="FILE.jsonl", help="the runs file")
    paper.add_argument("--out", required=True, metavar="OUT.jsonl",
                       help="where to write one JSON line per row")
    paper.add_argument("--mode", choices=("auto", "fake", "profile"), default="auto")
    paper.add_argument("--jobs", type=int, default=1, help="rows estimated in parallel")
    paper.add_argument("--only", metavar="SUBSTRING", default=None,
                       help="only rows whose id contains SUBSTRING")
    paper.add_argument("--explain", metavar="ID", default=None,
                       help="estimate one row and print its breakdown next to the measurement")
    paper.set_defaults(func=run_paper)


def _checkout() -> str:
    """The source checkout holding ``bench/``; BenchError when the package is not installed
    from one."""
    from xmem_admission.contract.errors import BenchError

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    if not os.path.isfile(os.path.join(root, "bench", "paper", "benchmark.py")):
        raise BenchError("xmem bench needs the source checkout's bench/ folder (the benchmark's "
                         f"model zoo), which is not beside this installation ({root}): install "
                         "the package from a clone with `pip install -e .` (make does)")
    return root


def run_paper(args: argparse.Namespace) -> int:
    root = _checkout()
    if root not in sys.path:
        sys.path.insert(0, root)
    from bench.paper import benchmark as paperbench
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
                                      progress=sys.stderr)
    with open(args.out, "w", encoding="utf-8") as fh:
        for result in results:
            fh.write(json.dumps({k: result[k] for k in ("id", "estimate_bytes", "predicted_oom",
                                                        "seconds", "mode", "peak_reserved_bytes",
                                                        "peak_allocated_bytes", "error")
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
