"""The xMem paper's rows with cuDNN's own convolution workspaces against the fitted rule.

    .venv/bin/python bench/convolution/conv_paper_rows.py RUNS.jsonl OUT.jsonl.traces [--misses 0.06]

``OUT.jsonl.traces`` is the folder of traces ``xmem bench paper --out OUT.jsonl`` keeps. Each row
with a kept trace is simulated on its GPU twice, as ``xmem bench paper --resume`` does (the
catalogue's runtime overhead added, the OOM decided on the card's capacity): with the workspaces
cuDNN's heuristics give (this environment's cuDNN, planning deviceless for the row's GPU: the
paper's runs used torch 2.6 with cuDNN 9.1.0, which cannot plan without a GPU, so this cuDNN
stands in), and with the fitted rule (``contract.cudnn.RULES``: none on the RTX 3060's and RTX
4060's architectures, so no workspace). Prints the benchmark's tables for
both and the convolution rows off by more than ``--misses``, each with both errors and what the
workspaces add to its simulated peak.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.yardsticks.paper import benchmark as paper  # noqa: E402
from xmem_admission.contract.gpus import lookup  # noqa: E402

MIB = 2**20


def answer(row: paper.Row, trace: Any, heuristics: bool) -> Dict[str, Any]:
    """The row's output line as ``xmem bench paper`` writes it, with cuDNN's heuristics or the
    fitted rule sizing the convolution workspaces (and which answered)."""
    from xmem_admission.estimator.allocator.simulate import simulate
    from xmem_admission.estimator.estimate import allocator_capacity
    from xmem_admission.estimator.orchestrate import ConvPlanner, for_gpu

    gpu = lookup(row.data["gpu_name"])
    stream = for_gpu(trace, gpu, {}, planner=ConvPlanner(gpu, {}, use_heuristics=heuristics))
    sim = simulate(stream, capacity_bytes=allocator_capacity(gpu))
    total = sim.peak_reserved_bytes + gpu.overhead_bytes
    info = stream.meta.get("conv_workspaces") or {}
    return {"id": row.id, "estimate_bytes": sim.peak_reserved_bytes + gpu.runtime_overhead_bytes,
            "predicted_oom": sim.oom is not None or total > gpu.capacity_bytes,
            "peak_reserved_bytes": sim.peak_reserved_bytes, "source": info.get("source"),
            "cudnn": info.get("cudnn")}


def misses(rows: List[paper.Row], cudnn: Dict[str, Dict[str, Any]],
           rule: Dict[str, Dict[str, Any]], threshold: float) -> str:
    lines = [f"convolution rows off by more than {threshold:.0%} (cuDNN's workspaces / the rule; "
             "what the workspaces add to the simulated peak reserved)"]
    for row in rows:
        ours, before = cudnn.get(row.id), rule.get(row.id)
        if ours is None or before is None or row.oom or ours["source"] is None:
            continue
        error = (ours["estimate_bytes"] - row.measured) / row.measured
        if abs(error) <= threshold:
            continue
        added = ours["peak_reserved_bytes"] - before["peak_reserved_bytes"]
        lines.append(f"  {row.id}: measured {row.measured / MIB:.0f} MiB, {error:+.1%} / "
                     f"{(before['estimate_bytes'] - row.measured) / row.measured:+.1%}; "
                     f"workspaces add {added / MIB:.0f} MiB")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs")
    parser.add_argument("traces")
    parser.add_argument("--misses", type=float, default=0.06, metavar="SHARE")
    args = parser.parse_args(argv)
    rows = [r for r in paper.load_runs(args.runs)
            if os.path.exists(os.path.join(args.traces, f"{r.id}.json"))]
    if not rows:
        print(f"no row of {args.runs} has a trace in {args.traces}", file=sys.stderr)
        return 2
    with_cudnn: Dict[str, Dict[str, Any]] = {}
    with_rule: Dict[str, Dict[str, Any]] = {}
    for row in rows:
        kept = paper.kept_trace(row.id, args.traces)
        assert kept is not None
        with_cudnn[row.id] = answer(row, kept[0], heuristics=True)
        with_rule[row.id] = answer(row, kept[0], heuristics=False)
    answered = sorted({(a["source"], a["cudnn"]) for a in with_cudnn.values() if a["source"]})
    print(f"{len(rows)} rows; convolution workspaces sized by {answered}")
    for name, results in (("cuDNN's heuristics", with_cudnn), ("the fitted rule", with_rule)):
        print(f"\n== {name}\n")
        print(paper.report(rows, list(results.values())))
    print()
    print(misses(rows, with_cudnn, with_rule, args.misses))
    return 0


if __name__ == "__main__":
    sys.exit(main())
