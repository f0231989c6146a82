"""Fit the cuDNN convolution rule (``contract/cudnn.py``) of the xMem paper's consumer GPUs
jointly with their runtime overhead, and score both on rows they were not fitted on.

    .venv/bin/python bench/fits/fit_paper_conv_workspace.py RUNS.jsonl OUT.jsonl [--shared]

``OUT.jsonl`` is what ``xmem bench paper --out OUT.jsonl`` wrote, its traces kept in
``OUT.jsonl.traces`` (the rows' jobs do not run again). Every row of a GPU on which some kept
trace makes a convolution is fitted (the RTX 3060, compute capability 8.6, and the RTX 4060, 8.9);
each of those GPUs' convolution rows needs its trace, and rows without one (the transformers)
keep OUT.jsonl's simulated peak, which a convolution rule does not change. The rule has the
three parameters of ``bench/fits/fit_conv_workspace.py`` and the same grid and loss (CNN p90 plus the
share of OOM rows predicted to fit plus the share of under-estimates beyond 15%). Under each rule,
a GPU's runtime overhead is fitted as ``bench/fits/fit_overhead.py`` fits it (85th percentile of
measured minus simulated peak reserved over the GPU's rows that did not OOM, every family),
because the overhead absorbs whatever the rule adds or leaves out. Scores are leave-one-out:
each CNN row is answered with the rule chosen on the other CNN rows (of its GPU, or of every
fitted GPU with ``--shared``: one rule for both architectures) and the overhead fitted without
it; the other rows with the rule chosen on every CNN row and the overhead fitted without them.
Rows of other GPUs (the A100's transformers) keep OUT.jsonl's answer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Dict, List, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.fits.fit_conv_workspace import (  # noqa: E402
    UNDER_ALLOWED,
    Params,
    fraction_grid,
    simulate_grid,
)
from bench.fits.fit_conv_workspace import loss as rule_loss  # noqa: E402
from bench.fits.fit_overhead import fitted_overhead  # noqa: E402
from bench.yardsticks.paper import benchmark as paper  # noqa: E402
from xmem_admission.contract import cudnn  # noqa: E402
from xmem_admission.contract.gpus import GPU, lookup  # noqa: E402

MIB = 2**20
NONE: Params = (cudnn.ConvBasis.LARGEST, (0.0, 0.0), 0)
Answers = Dict[str, Dict[str, Any]]


def leave_one_out(rows: Sequence[paper.Row], gpu: GPU, sims: Dict[str, Tuple[int, bool]],
                  given_seconds: Dict[str, float]) -> Answers:
    """Each row of one GPU answered with the overhead fitted on the GPU's other rows."""
    residuals = {r.id: r.measured - sims[r.id][0] for r in rows if not r.oom}
    answers: Answers = {}
    for row in rows:
        others = [v for ident, v in residuals.items() if ident != row.id]
        overhead = fitted_overhead(others)
        reserved, simulated_oom = sims[row.id]
        answers[row.id] = {
            "estimate_bytes": reserved + overhead, "overhead_bytes": overhead,
            "seconds": given_seconds.get(row.id),
            "predicted_oom": simulated_oom
            or reserved + gpu.context_bytes + overhead > gpu.capacity_bytes}
    return answers


def table(rows: Sequence[paper.Row], answers: Answers) -> str:
    groups: List[Tuple[str, List[paper.Row]]] = [("all rows", list(rows))]
    for family in sorted({r.family for r in rows}):
        groups.append((f"family {family}", [r for r in rows if r.family == family]))
    for name in sorted({r.data["gpu_name"] for r in rows}):
        groups.append((f"gpu {name}", [r for r in rows if r.data["gpu_name"] == name]))
        groups.append((f"  cnn on {name}", [r for r in rows if r.data["gpu_name"] == name
                                            and r.family == "cnn"]))
    return paper.format_table("", [paper.stats(name, ((r.data, answers.get(r.id))
                                                      for r in group))
                                   for name, group in groups]).lstrip("\n")


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs")
    parser.add_argument("out")
    parser.add_argument("--shared", action="store_true",
                        help="one rule for every fitted GPU (each keeps its own overhead)")
    parser.add_argument("--fractions", default=None, metavar="F,F,...",
                        help="the fractions searched (default the grid of "
                        "fit_conv_workspace.py; 0 alone: resident bytes only)")
    parser.add_argument("--under-allowed", type=float, default=UNDER_ALLOWED, metavar="SHARE",
                        help="share of under-estimated rows the loss lets pass (1: the loss "
                        "is the p90 and the OOM rows predicted to fit)")
    args = parser.parse_args(argv)
    fractions = ([(f, f) for f in map(float, args.fractions.split(","))] if args.fractions
                 else fraction_grid(False))
    if (0.0, 0.0) not in fractions:
        fractions.insert(0, (0.0, 0.0))  # no rule: the "before" figures

    def loss(rows: Sequence[paper.Row], answers: Answers) -> float:
        return rule_loss(rows, answers, args.under_allowed)

    rows = paper.load_runs(args.runs)
    with open(args.out, encoding="utf-8") as fh:
        given = {o["id"]: o for o in map(json.loads, filter(str.strip, fh))}
    traces = args.out + ".traces"
    kept = {r.id: (k[0], lookup(r.data["gpu_name"])) for r in rows
            if (k := paper.kept_trace(r.id, traces)) is not None}
    fitted = sorted({gpu.key for trace, gpu in kept.values() if any(
        e.op == "mark" and e.label.startswith(cudnn.TRANSIENT_PREFIX) for e in trace.events)})
    by_gpu = {key: [r for r in rows if lookup(r.data["gpu_name"]).key == key] for key in fitted}
    missing = [r.id for key in fitted for r in by_gpu[key]
               if r.family == "cnn" and r.id not in kept]
    if missing or not fitted:
        print(f"need the kept trace of every CNN row of the fitted GPUs; missing: {missing}",
              file=sys.stderr)
        return 2
    grid = simulate_grid(kept, fractions)
    seconds = {ident: float(o.get("seconds") or 0.0) for ident, o in given.items()}
    answers: Dict[Params, Answers] = {}
    for params, sims in grid.items():
        answers[params] = {}
        for key in fitted:
            full = {r.id: sims.get(r.id, (given[r.id]["peak_reserved_bytes"],
                                          bool(given[r.id]["predicted_oom"])))
                    for r in by_gpu[key]}
            answers[params].update(leave_one_out(by_gpu[key], lookup(key), full, seconds))
    groups = [[r for key in fitted for r in by_gpu[key]]] if args.shared else \
        [by_gpu[key] for key in fitted]
    held_out: Answers = {r.id: given[r.id] for r in rows
                         if not any(r in group for group in groups)}
    for group in groups:
        cnn = [r for r in group if r.family == "cnn"]
        best = min(grid, key=lambda p: loss(cnn, answers[p]))
        names = sorted({r.data["gpu_name"] for r in group})
        overheads = {key: fitted_overhead([r.measured - grid[best].get(r.id, (
            given[r.id]["peak_reserved_bytes"], False))[0] for r in by_gpu[key] if not r.oom])
            for key in fitted if any(r in group for r in by_gpu[key])}
        print(f"{', '.join(names)}: rule fitted on all {len(cnn)} CNN rows: "
              f"{best[1][0]} x the {best[0].value} bytes of each call, resident {best[2]} MiB "
              f"(loss {loss(cnn, answers[best]):.4f}); runtime overhead "
              + ", ".join(f"{k} {v // MIB} MiB" for k, v in overheads.items()))
        chosen = set()
        for row in group:
            if row.family != "cnn":
                held_out[row.id] = answers[best][row.id]
                continue
            others = [r for r in cnn if r.id != row.id]
            params = min(grid, key=lambda p: loss(others, answers[p]))
            chosen.add((params[0].value, params[1][0], params[2]))
            held_out[row.id] = answers[params][row.id]
        print(f"  rules chosen when one CNN row is left out: {sorted(chosen)}")
    before_loo = {**{r.id: given[r.id] for r in rows}, **answers[NONE]}
    for name, result in (("as given (OUT.jsonl: the catalogue's overhead, fitted in-sample)",
                          given),
                         ("no rule, overhead leave-one-out", before_loo),
                         ("rule and overhead leave-one-out", held_out)):
        print(f"\n{name}\n{table(rows, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
