"""Fit the cuDNN convolution rule of one GPU architecture (``contract/cudnn.py``) on GPUMemNet
rows, and score it on rows it was not fitted on.

    .venv/bin/python bench/fit_conv_workspace.py RUNS.jsonl OUT.jsonl.traces [--arch 8.0]

``OUT.jsonl.traces`` is the folder of traces ``xmem bench gpumemnet --out OUT.jsonl`` keeps, so
the rows' scripts do not run again. The rule has two parameters: the workspace as a fraction of
the largest tensor a convolution call touches (one fraction for the forward and both backward
calls) and the bytes a process holds from its first convolution on. Every pair of a grid is
simulated on every row; a pair's loss on a set of rows is the 90th percentile of the relative
error on rows that did not run out of memory, plus the share of OOM rows predicted to fit. The
rule printed is the pair with the lowest loss on all rows; the scores printed are
leave-one-out: each row answered with the pair fitted on the other rows (and, as in the
benchmark, the device-wide floor fitted on the other MLP rows).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench import gpumemnet as gmn  # noqa: E402
from bench.paper.benchmark import quantile  # noqa: E402
from xmem_admission.contract import cudnn  # noqa: E402
from xmem_admission.contract.gpus import lookup  # noqa: E402

MIB = 2**20
FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)
RESIDENT_MIB = tuple(range(0, 1025, 64))
Params = Tuple[float, int]


def rule(params: Params) -> cudnn.ConvWorkspaceRule:
    fraction, resident_mib = params
    return cudnn.ConvWorkspaceRule({call: fraction for call in cudnn.ConvCall},
                                   resident_mib * MIB, "fit candidate")


def simulate_all(rows: List[gmn.Row], traces: str) -> Dict[Params, Dict[str, Dict[str, Any]]]:
    """Every row simulated under every pair of the grid."""
    from xmem_admission.estimator.allocator.simulate import simulate
    from xmem_admission.estimator.estimate import allocator_capacity
    from xmem_admission.estimator.orchestrate import for_gpu

    gpu = lookup(gmn.GPU_KEY)
    kept = {r.id: gmn.kept_trace(r.id, traces) for r in rows}
    out: Dict[Params, Dict[str, Dict[str, Any]]] = {}
    for fraction in FRACTIONS:
        for resident in RESIDENT_MIB:
            params = (fraction, resident)
            sims = out[params] = {}
            for row in rows:
                trace, seconds, mode = kept[row.id]
                sim = simulate(for_gpu(trace, gpu, {}, conv_rule=rule(params)),
                               capacity_bytes=allocator_capacity(gpu))
                sims[row.id] = {"id": row.id, "peak_reserved_bytes": sim.peak_reserved_bytes,
                                "simulated_oom": sim.oom is not None, "seconds": seconds,
                                "mode": mode}
    return out


def loss(rows: List[gmn.Row], answers: Dict[str, Dict[str, Any]]) -> float:
    errors = [abs(answers[r.id]["estimate_bytes"] - r.measured) / r.measured
              for r in rows if not r.oom]
    ooms = [r for r in rows if r.oom]
    missed = sum(not answers[r.id]["predicted_oom"] for r in ooms)
    return quantile(errors, 0.9) + (missed / len(ooms) if ooms else 0.0)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs")
    parser.add_argument("traces")
    args = parser.parse_args(argv)
    capacity = lookup(gmn.GPU_KEY).capacity_bytes
    rows = [r for r in gmn.load_runs(args.runs)
            if os.path.exists(os.path.join(args.traces, f"{r.id}.json"))]
    cnn = [r for r in rows if r.family == "cnn"]
    if len(cnn) < 3 or not any(r.family == "mlp" for r in rows):
        print("need at least 3 CNN rows and MLP rows (for the floor) with kept traces",
              file=sys.stderr)
        return 2
    grid = simulate_all(rows, args.traces)
    answers = {p: gmn.leave_one_out(rows, sims, capacity) for p, sims in grid.items()}
    best = min(grid, key=lambda p: loss(cnn, answers[p]))
    held_out: Dict[str, Dict[str, Any]] = {r.id: answers[best][r.id] for r in rows
                                           if r.family == "mlp"}
    chosen: Dict[str, Params] = {}
    for row in cnn:
        others = [r for r in cnn if r.id != row.id]
        params = min(grid, key=lambda p: loss(others, answers[p]))
        chosen[row.id] = params
        held_out[row.id] = answers[params][row.id]
    before = answers[(0.0, 0)]
    print(f"rows with traces: {len(rows)} ({len(cnn)} CNN, {len(rows) - len(cnn)} MLP)")
    print(f"rule fitted on all rows: workspace {best[0]} x the largest tensor of each "
          f"convolution call, resident {best[1]} MiB (loss {loss(cnn, answers[best]):.4f})")
    print(f"pairs chosen when one row is left out: {sorted(set(chosen.values()))}")
    for name, result in (("before (no cuDNN model)", before),
                         ("after, leave-one-out", held_out)):
        print(f"\n{name}")
        print(gmn.report(rows, grid[(0.0, 0)], result, gmn.fit_floor(rows, grid[(0.0, 0)])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
