"""Fit what a process holds from its first cuDNN convolution on, with cuDNN's own workspaces, on
GPUMemNet rows, and score it on rows it was not fitted on.

    .venv/bin/python bench/fits/fit_conv_resident.py RUNS.jsonl OUT.jsonl.traces [--apply MIB]

``OUT.jsonl.traces`` is the folder of traces ``xmem bench gpumemnet --out OUT.jsonl`` keeps. With
cuDNN's heuristics sizing each convolution's workspaces (``orchestrate.ConvPlanner``: the plans
PyTorch tries on the A100-40GB, in its order), one figure is left that no document gives: the
bytes the cuDNN handle and the kernels CUDA loads lazily hold outside the caching allocator from
the first convolution on (``contract.cudnn.HEURISTICS_RESIDENT``). Every row is simulated once
without it; each candidate (0 to 2,048 MiB by 32) is added to the simulated peak of the rows that
convolve (one block held for the whole run, its own segment: it adds its size to the reserved
peak; only a job within that many bytes of the capacity would place things otherwise), and
scored with ``fit_conv_workspace.loss`` (CNN p90, OOM rows predicted to fit, under-estimates
beyond 15%). Printed: the figure fitted on all rows, the figures chosen with each row left out,
and the leave-one-out table (each CNN row answered with the figure fitted on the others, the
floor fitted on the other MLP rows as in the benchmark). ``--apply MIB`` scores a given figure
instead of fitting (a sample the figure was not fitted on).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from bench.fits.fit_conv_workspace import fit_and_hold_out, loss, rows_with_traces  # noqa: E402
from bench.yardsticks import gpumemnet as gmn  # noqa: E402
from bench.yardsticks.paper.benchmark import kept_trace  # noqa: E402
from xmem_admission.contract import cudnn  # noqa: E402
from xmem_admission.contract.gpus import lookup  # noqa: E402

MIB = 2**20
RESIDENT_MIB = tuple(range(0, 2049, 32))


def simulate_rows(rows: List[gmn.Row], traces: str) -> Dict[str, Dict[str, Any]]:
    """Every row with a kept trace simulated on the A100-40GB with cuDNN's workspaces and no
    resident bytes, as ``gmn.leave_one_out`` reads it (``convolves``: the trace has a cudnn:
    mark)."""
    from xmem_admission.estimator.allocator.simulate import simulate
    from xmem_admission.estimator.estimate import allocator_capacity
    from xmem_admission.estimator.orchestrate import ConvPlanner, for_gpu

    gpu = lookup(gmn.GPU_KEY)
    out: Dict[str, Dict[str, Any]] = {}
    for row in rows:
        kept = kept_trace(row.id, traces)
        if kept is None:
            continue
        trace, seconds, mode = kept
        stream = for_gpu(trace, gpu, {}, planner=ConvPlanner(gpu, {}, resident_bytes=0))
        sim = simulate(stream, capacity_bytes=allocator_capacity(gpu))
        info = stream.meta.get("conv_workspaces") or {}
        # the same trace with no workspace at all: what the workspaces add to the peak
        bare = simulate(for_gpu(trace, gpu, {}, conv_rule=_NO_WORKSPACE),
                        capacity_bytes=allocator_capacity(gpu))
        workspaces = [e.size for e in stream.events if e.op == "alloc"
                      and e.phase.startswith(cudnn.TRANSIENT_PREFIX)]
        out[row.id] = {"id": row.id, "peak_reserved_bytes": sim.peak_reserved_bytes,
                       "simulated_oom": sim.oom is not None, "seconds": seconds, "mode": mode,
                       "convolves": bool(info), "source": info.get("source", "none"),
                       "bare_reserved_bytes": bare.peak_reserved_bytes,
                       "largest_workspace_bytes": max(workspaces, default=0)}
    return out


_NO_WORKSPACE = cudnn.ConvWorkspaceRule({call: 0.0 for call in cudnn.ConvCall}, 0,
                                        "no workspace (for comparison)")


def misses(rows: List[gmn.Row], sims: Dict[str, Dict[str, Any]],
           answers: Dict[str, Dict[str, Any]], resident_mib: Dict[str, int],
           threshold: float) -> str:
    """The CNN rows that ran whose answer is off by more than ``threshold``, each with what the
    simulation without resident bytes (``sims``) says of it: the error with cuDNN's workspaces and with none at all (the
    resident bytes and the floor in both), and the largest workspace asked."""
    lines = [f"CNN rows off by more than {threshold:.0%}: error with cuDNN's workspaces / with "
             "no workspace (same resident bytes and floor), what the workspaces add to the "
             "simulated peak, the largest one"]
    for row in rows:
        answer, sim = answers.get(row.id), sims.get(row.id)
        if row.family != "cnn" or row.oom or answer is None or sim is None:
            continue
        error = (answer["estimate_bytes"] - row.measured) / row.measured
        if abs(error) <= threshold:
            continue
        resident = resident_mib.get(row.id, 0) * MIB
        bare = sim["bare_reserved_bytes"] + resident + answer["floor_bytes"]
        added = sim["peak_reserved_bytes"] - sim["bare_reserved_bytes"]
        lines.append(f"  {row.id} ({row.architecture}, batch {row.data['batch_size']}): "
                     f"measured {row.measured / MIB:.0f} MiB, {error:+.1%} / "
                     f"{(bare - row.measured) / row.measured:+.1%}; workspaces add "
                     f"{added / MIB:.0f} MiB, largest {sim['largest_workspace_bytes'] / MIB:.0f}"
                     " MiB")
    return "\n".join(lines)


def with_resident(sims: Dict[str, Dict[str, Any]], mib: int) -> Dict[str, Dict[str, Any]]:
    return {ident: dict(sim, peak_reserved_bytes=sim["peak_reserved_bytes"]
                        + (mib * MIB if sim["convolves"] else 0))
            for ident, sim in sims.items()}


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs")
    parser.add_argument("traces")
    parser.add_argument("--apply", type=int, default=None, metavar="MIB",
                        help="score this figure (MiB) instead of fitting one")
    parser.add_argument("--misses", type=float, default=0.10, metavar="SHARE",
                        help="list the CNN rows off by more than this share (default 0.10)")
    args = parser.parse_args(argv)
    capacity = lookup(gmn.GPU_KEY).capacity_bytes
    found = rows_with_traces(args.runs, args.traces)
    if found is None:
        return 2
    rows, cnn = found
    started = time.perf_counter()
    base = simulate_rows(rows, args.traces)
    sources = sorted({s["source"] for s in base.values() if s["convolves"]})
    print(f"rows with traces: {len(rows)} ({len(cnn)} CNN, {len(rows) - len(cnn)} MLP); "
          f"simulated in {time.perf_counter() - started:.0f} s; workspaces sized by {sources}")
    floor = gmn.fit_floor(rows, base)
    if args.apply is not None:
        sims = with_resident(base, args.apply)
        given = gmn.leave_one_out(rows, sims, capacity)
        print(f"\nresident {args.apply} MiB (given, not fitted on these rows)")
        print(gmn.report(rows, sims, given, floor))
        print(misses(rows, base, given, {r.id: args.apply for r in cnn}, args.misses))
        return 0
    grid = {mib: with_resident(base, mib) for mib in RESIDENT_MIB}
    answers = {mib: gmn.leave_one_out(rows, sims, capacity) for mib, sims in grid.items()}
    best, held_out, chosen = fit_and_hold_out(rows, cnn, answers)
    print(f"resident bytes fitted on all rows: {best} MiB (loss {loss(cnn, answers[best]):.4f})")
    print(f"figures chosen when one row is left out: {sorted(set(chosen.values()))} MiB")
    for name, sims, result in (("no resident bytes", grid[0], answers[0]),
                               (f"fitted on all rows ({best} MiB, in-sample)", grid[best],
                                answers[best]),
                               ("leave-one-out", grid[best], held_out)):
        print(f"\n{name}")
        print(gmn.report(rows, sims, result, floor))
    print(misses(rows, base, held_out, chosen, args.misses))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
