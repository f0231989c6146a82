"""``xmem bench paper``: estimate the xMem paper's measured jobs and compare every estimator.

Each row of a runs file (the ``runs.jsonl`` format of the xMem paper's artifact) is one training job
measured on a real GPU. The job is rebuilt by ``paperjobs`` and estimated through exactly the
path ``xmem estimate`` takes (``estimate.estimate``), for the row's GPU. The quantity compared
is the row's ``measured_peak_bytes``: NVML device memory at its peak minus the first sample,
taken after CUDA was initialised, so the CUDA context is excluded while the allocator's
segments and what training loads outside the allocator are included. Ours is therefore the
simulated peak reserved plus the GPU's ``runtime_overhead_bytes`` (catalogue), context left out.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

from xmem_admission.contract.errors import EstimateError, RunsFileError

# Each row runs as a training script, unmodified, the way a user would run it.
JOBS_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs.py")
OTHER_ESTIMATORS = ("xmem", "dnnmem", "schedtune", "llmem")
_REQUIRED = {"id": str, "family": str, "model": str, "optimizer": str, "batch_size": int,
             "gpu_name": str, "measured_peak_bytes": int, "measured_oom": bool}


@dataclass
class MeasuredRow:
    """A measured job of a yardstick's runs file (both yardsticks' rows)."""

    data: Dict[str, Any]

    @property
    def id(self) -> str:
        return str(self.data["id"])

    @property
    def family(self) -> str:
        return str(self.data["family"])

    @property
    def measured(self) -> int:
        return int(self.data["measured_peak_bytes"])


class Row(MeasuredRow):
    @property
    def oom(self) -> bool:
        return bool(self.data["measured_oom"])

    def command(self) -> List[str]:
        argv = [sys.executable, JOBS_SCRIPT, "--model", self.data["model"],
                "--optimizer", self.data["optimizer"], "--batch-size",
                str(self.data["batch_size"]), "--zero-grad-mode",
                str(self.data.get("zero_grad_mode") or 0), "--steps",
                str(self.data.get("optimizer_steps") or 4)]
        if self.data.get("max_seq_len"):
            # Batches were padded to the longest of randomly drawn sequences, at most 128
            # tokens, with no seed: the safe side is the maximum.
            argv += ["--seq-len", str(self.data["max_seq_len"])]
        return argv


def json_objects(path: str) -> Iterator[Tuple[int, Dict[str, Any]]]:
    """(line number, object) for each non-blank line of a JSON-lines runs file; raise
    ``RunsFileError`` naming the line when one is not a JSON object."""
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise RunsFileError(f"{path}: cannot read: {exc.strerror}") from None
    with fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as exc:
                raise RunsFileError(f"{path}:{number}: not valid JSON: {exc.msg}") from None
            if not isinstance(data, dict):
                raise RunsFileError(f"{path}:{number}: expected a JSON object")
            yield number, data


def load_runs(path: str) -> List[Row]:
    """Parse a runs file; raise ``RunsFileError`` naming the line and what is wrong."""
    rows: List[Row] = []
    seen = set()
    for number, data in json_objects(path):
        for key, kind in _REQUIRED.items():
            value = data.get(key)
            if value is None:
                raise RunsFileError(f"{path}:{number}: missing field {key!r}")
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise RunsFileError(f"{path}:{number}: field {key!r} must be "
                                    f"{kind.__name__}, got {value!r}")
        if data["batch_size"] < 1 or data["measured_peak_bytes"] < 0:
            raise RunsFileError(f"{path}:{number}: batch_size must be positive and "
                                f"measured_peak_bytes non-negative")
        if data["id"] in seen:
            raise RunsFileError(f"{path}:{number}: duplicate id {data['id']!r}")
        seen.add(data["id"])
        for name in OTHER_ESTIMATORS:
            other = data.get(name)
            if other is not None and not (isinstance(other, dict) and isinstance(
                    other.get("estimate_bytes"), (int, float))):
                raise RunsFileError(f"{path}:{number}: {name!r} must be null or an object "
                                    f"with estimate_bytes")
        rows.append(Row(data))
    if not rows:
        raise RunsFileError(f"{path}: no rows")
    return rows


def keep_trace(traces: str, row_id: str, trace: Any, seconds: float, mode: str) -> None:
    """Keep a row's trace in the folder ``traces`` (``OUT.jsonl.traces``), for ``--resume`` and
    the fitting scripts to simulate again without running the row's script."""
    os.makedirs(traces, exist_ok=True)
    with open(os.path.join(traces, f"{row_id}.json"), "w", encoding="utf-8") as fh:
        json.dump({"mode": mode, "seconds": seconds, "trace": trace.to_dict()}, fh)


def kept_trace(row_id: str, traces: str) -> Optional[Tuple[Any, float, str]]:
    """(trace, seconds, mode) of the trace an earlier run kept for a row; None when none was."""
    from xmem_admission.estimator.trace import Trace

    path = os.path.join(traces, f"{row_id}.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as fh:
        kept = json.load(fh)
    return Trace.from_dict(kept["trace"]), float(kept["seconds"]), str(kept["mode"])


# The paper's runs used torch 2.6 with CUDA 12.4 (data/xmem-paper/README.md, "Software"): their
# figures outside the allocator are those of CUDA 12, whatever torch traces them here.
PAPER_CUDA_MAJOR = 12
# ... and its cuDNN: torch 2.6's wheels require nvidia-cudnn-cu12 9.1.0 (CUDNN_VERSION 90100),
# which cannot plan without a GPU (cudnn_heuristics.DEVICELESS_MIN_VERSION): an estimation pod
# beside the runs' torch sizes convolution workspaces by the fitted rule, whatever cuDNN traces
# them here, so the rows are simulated with the trace's cuDNN set to the runs'.
PAPER_CUDNN = 90100


# The runs' CUDA, as ``torch.version.cuda`` names it for torch 2.6+cu124.
PAPER_CUDA = "12.4"


def as_paper_runs(trace: Any) -> Any:
    """``trace`` as if recorded beside the runs' torch: its cuDNN (``PAPER_CUDNN``) and its CUDA
    (``PAPER_CUDA``: what lives outside the allocator, and so what the allocator is left with,
    is CUDA 12's, not that of the torch tracing here)."""
    trace.meta["cudnn"] = PAPER_CUDNN
    trace.meta["cuda"] = PAPER_CUDA
    trace.meta.pop("cudnn_library", None)
    return trace


def paper_runtime_overhead(gpu: str, result: Any) -> int:
    """What the paper's measurement counts outside the allocator: the runtime figures (the
    context is excluded: NVML was first sampled after CUDA init) for CUDA 12, with cuDNN's when
    the job has convolutions (``contract.overhead``)."""
    from xmem_admission.contract import overhead

    assert overhead.cuda_major_of(PAPER_CUDA) == PAPER_CUDA_MAJOR
    return overhead.for_gpu(gpu, PAPER_CUDA_MAJOR, uses_cudnn=bool(result.conv_workspaces)
                            ).runtime_bytes


def _answer(row: Row, result: Any, runtime_overhead_bytes: int, seconds: float,
            mode: str) -> Dict[str, Any]:
    from bench.yardsticks.paper.request_sizes import request_bytes

    # measured_peak_bytes excludes the CUDA context (sampled after CUDA init): so do we, and so
    # do the ends of the range (the same figures outside the allocator as the point's).
    estimate_bytes = result.peak_reserved_bytes + runtime_overhead_bytes
    shift = estimate_bytes - result.total_bytes
    high_bytes = result.high_bytes + shift
    # the convolutions' high end alone, as a reserved peak (what the spread of the memory
    # outside the allocator is fitted beyond: bench/fits/fit_overhead.py)
    conv = next((w for w in result.uncertain if w["what"] == "convolution workspaces"), None)
    high_reserved = result.peak_reserved_bytes if conv is None else max(
        result.peak_reserved_bytes,
        conv["high_bytes"] - (result.total_bytes - result.peak_reserved_bytes))
    return {"id": row.id, "estimate_bytes": estimate_bytes,
            "low_bytes": result.low_bytes + shift, "high_bytes": high_bytes,
            "high_reserved_bytes": high_reserved, "convolutions": bool(result.conv_workspaces),
            "request_bytes": request_bytes(estimate_bytes, high_bytes, row.data["gpu_name"]),
            "predicted_oom": not result.fits, "fit": result.fit,
            "seconds": seconds, "mode": mode,
            "peak_allocated_bytes": result.peak_allocated_bytes,
            "peak_reserved_bytes": result.peak_reserved_bytes,
            "breakdown": result.breakdown, "oom": result.oom}


def held_out(rows: Sequence[Row], results: Sequence[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Each answer with the runtime overhead fitted on the other rows of its GPU that ran
    (``bench/fits/fit_overhead.py``'s fit: the 85th percentile of measured minus simulated peak
    reserved), so that no row is scored with a figure fitted on itself: the point, its range
    and the request move by the difference; the OOM calls stay the simulation's. A job with
    convolutions has its high end refitted too: its convolutions' high end plus the most the
    GPU's other convolution rows needed beyond theirs (``fit_overhead.spread_over_runtime``)."""
    from bench.fits.fit_overhead import fitted_overhead, spread_over_runtime
    from bench.yardsticks.paper.request_sizes import request_bytes

    by_id = {r["id"]: r for r in results if "estimate_bytes" in r}
    residuals: Dict[str, Dict[str, int]] = {}
    beyond_high: Dict[str, Dict[str, int]] = {}
    for row in rows:
        answer = by_id.get(row.id)
        if answer is not None and not row.oom and row.measured > 0:
            residuals.setdefault(row.data["gpu_name"], {})[row.id] = (
                row.measured - answer["peak_reserved_bytes"])
            if answer.get("convolutions") and answer.get("high_reserved_bytes") is not None:
                beyond_high.setdefault(row.data["gpu_name"], {})[row.id] = (
                    row.measured - answer["high_reserved_bytes"])
    out: Dict[str, Dict[str, Any]] = {}
    for row in rows:
        answer = by_id.get(row.id)
        if answer is None:
            continue
        others = [v for k, v in residuals.get(row.data["gpu_name"], {}).items() if k != row.id]
        if not others:
            out[row.id] = answer
            continue
        runtime = fitted_overhead(others)
        estimate_bytes = answer["peak_reserved_bytes"] + runtime
        shift = estimate_bytes - answer["estimate_bytes"]
        high_bytes = answer.get("high_bytes", answer["estimate_bytes"]) + shift
        convs = [v for k, v in beyond_high.get(row.data["gpu_name"], {}).items() if k != row.id]
        if answer.get("convolutions") and answer.get("high_reserved_bytes") is not None and convs:
            high_bytes = max(estimate_bytes, answer["high_reserved_bytes"] + runtime
                             + spread_over_runtime(convs, runtime))
        out[row.id] = dict(answer, estimate_bytes=estimate_bytes, high_bytes=high_bytes,
                           low_bytes=answer.get("low_bytes", answer["estimate_bytes"]) + shift,
                           request_bytes=request_bytes(estimate_bytes, high_bytes,
                                                       row.data["gpu_name"]))
    return out


def estimate_row(row: Row, mode: str, log: Optional[IO[str]],
                 traces: Optional[str] = None) -> Dict[str, Any]:
    """Run one row through ``xmem estimate``'s path; returns the output line's object. The
    trace is kept in ``traces`` (a folder) when given."""
    from xmem_admission.contract.gpus import lookup
    from xmem_admission.estimator.estimate import estimate, estimate_trace

    gpu = lookup(row.data["gpu_name"])
    started = time.perf_counter()
    est, trace = estimate(row.command(), [gpu.key], mode=mode,
                          steps=int(row.data.get("optimizer_steps") or 4), margin=0.0,
                          stream=log, progress=None)
    seconds = round(time.perf_counter() - started, 3)
    if traces is not None:
        keep_trace(traces, row.id, trace, seconds, est.mode)
    result = estimate_trace(as_paper_runs(trace), [gpu], margin=0.0)[0]
    return _answer(row, result, paper_runtime_overhead(gpu.key, result), seconds, est.mode)


def resimulate(row: Row, traces: str) -> Optional[Dict[str, Any]]:
    """A row's output line from the trace an earlier run kept (None when there is none):
    simulated again with today's orchestration, cuDNN rules and catalogue."""
    from xmem_admission.contract.gpus import lookup
    from xmem_admission.estimator.estimate import estimate_trace

    kept = kept_trace(row.id, traces)
    if kept is None:
        return None
    trace, seconds, mode = kept
    gpu = lookup(row.data["gpu_name"])
    result = estimate_trace(as_paper_runs(trace), [gpu], margin=0.0)[0]
    return _answer(row, result, paper_runtime_overhead(gpu.key, result), seconds, mode)


def run_rows(rows: Sequence[Row], mode: str, jobs: int, log: IO[str],
             progress: Optional[IO[str]] = None, traces: Optional[str] = None,
             resume: bool = False) -> List[Dict[str, Any]]:
    """Estimate every row, keeping its trace in ``traces`` when given (with ``resume``, the
    rows whose trace is kept are simulated again instead of run)."""
    def one(row: Row) -> Dict[str, Any]:
        out = resimulate(row, traces) if resume and traces is not None else None
        if out is None:
            try:
                out = estimate_row(row, mode, log, traces)
            except EstimateError as exc:
                out = {"id": row.id, "error": str(exc).splitlines()[0]}
        if progress is not None:
            shown = (f"{out['estimate_bytes'] / 2**30:7.2f} GiB vs measured "
                     f"{row.data['measured_peak_bytes'] / 2**30:7.2f} GiB"
                     if "estimate_bytes" in out else f"error: {out['error']}")
            print(f"xmem bench: {row.id}: {shown}", file=progress, flush=True)
        return out

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return list(pool.map(one, rows))


# -- statistics ---------------------------------------------------------------------------
def quantile(values: List[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


@dataclass
class Stats:
    name: str
    n: int
    median: float
    p90: float
    under: float
    missed_oom: int
    oom_right: float
    seconds: float


def stats(name: str, pairs: Iterable[Tuple[Dict[str, Any], Optional[Dict[str, Any]]]]) -> Stats:
    """Errors on rows that did not OOM; OOM agreement on every row with an answer."""
    errors, under, oom_total, oom_right, missed, times = [], 0, 0, 0, 0, []
    for row, answer in pairs:
        if answer is None or answer.get("estimate_bytes") is None:
            continue
        est = float(answer["estimate_bytes"])
        predicted = bool(answer.get("predicted_oom"))
        oom_total += 1
        oom_right += predicted == row["measured_oom"]
        missed += row["measured_oom"] and not predicted
        if answer.get("runtime_s") is not None or answer.get("seconds") is not None:
            times.append(float(answer.get("seconds", answer.get("runtime_s")) or 0.0))
        if not row["measured_oom"] and row["measured_peak_bytes"] > 0 and est > 0:
            measured = row["measured_peak_bytes"]
            errors.append(abs(est - measured) / measured)
            under += est < measured
    return Stats(name, len(errors), statistics.median(errors) if errors else math.nan,
                 quantile(errors, 0.9), under / len(errors) if errors else math.nan, missed,
                 oom_right / oom_total if oom_total else math.nan,
                 statistics.median(times) if times else math.nan)


def comparison(rows: Sequence[Row], ours: Dict[str, Dict[str, Any]]) -> List[Stats]:
    """Ours on all rows, then each estimator next to ours on the rows that estimator answered."""
    data = [r.data for r in rows]
    table = [stats("xmem-admission (ours)", ((r, ours.get(r["id"])) for r in data))]
    for name in OTHER_ESTIMATORS:
        answered = [r for r in data if r.get(name) and r[name].get("estimate_bytes", -1) > 0]
        if not answered:
            continue
        table.append(stats(name, ((r, r[name]) for r in answered)))
        table.append(stats(f"  ours on {name}'s rows",
                           ((r, ours.get(r["id"])) for r in answered)))
    return table


def format_table(title: str, table: List[Stats]) -> str:
    lines = [title, f"{'estimator':28} {'n':>4} {'median':>8} {'p90':>8} {'under':>7} "
             f"{'missed OOM':>10} {'OOM right':>9} {'time s':>8}"]
    for s in table:
        lines.append(f"{s.name:28} {s.n:4d} {s.median:8.2%} {s.p90:8.2%} {s.under:7.1%} "
                     f"{s.missed_oom:10d} {s.oom_right:9.1%} {s.seconds:8.2f}")
    return "\n".join(lines)


def report(rows: Sequence[Row], results: Sequence[Dict[str, Any]]) -> str:
    ours = {r["id"]: r for r in results if "estimate_bytes" in r}
    parts = [format_table("all rows (error on rows that did not OOM; median time per job)",
                          comparison(rows, ours))]
    for key in ("family", "gpu_name"):
        for value in sorted({r.data[key] for r in rows}):
            subset = [r for r in rows if r.data[key] == value]
            table = [s for s in comparison(subset, ours)
                     if s.name.startswith(("xmem", "  ours on xmem"))]
            parts.append(format_table(f"{key} = {value}", table))
    from bench.yardsticks.paper.request_sizes import table as requests_table
    from bench.yardsticks.paper.request_sizes import tally

    data = [r.data for r in rows]
    parts.append(requests_table("requests under the default policy (the catalogue's runtime overhead, "
                       "fitted on these rows)", tally(rows, ours)))
    loo = held_out(rows, results)
    parts.append(format_table("held out: each row with the runtime overhead fitted on the other "
                              "rows of its GPU", [stats("xmem-admission (ours)",
                                                        ((r, loo.get(r["id"])) for r in data))]))
    parts.append(requests_table("requests, held out", tally(rows, loo)))
    failed = [r for r in results if "error" in r]
    if failed:
        parts.append(f"{len(failed)} row(s) failed: " + "; ".join(
            f"{r['id']}: {r['error']}" for r in failed))
    return "\n\n".join(parts)


def explain(row: Row, result: Dict[str, Any]) -> str:
    """One row: the simulated breakdown next to the measured peak."""
    measured = row.data["measured_peak_bytes"]
    est = result["estimate_bytes"]
    lines = [f"{row.id}: measured {measured / 2**30:.3f} GiB (oom={row.data['measured_oom']}), "
             f"estimated {est / 2**30:.3f} GiB ({(est - measured) / max(measured, 1):+.2%})",
             f"  peak allocated {result['peak_allocated_bytes'] / 2**30:.3f} GiB, "
             f"peak reserved {result['peak_reserved_bytes'] / 2**30:.3f} GiB",
             "  breakdown (overhead here = catalogue overhead incl. context; the estimate "
             "leaves the context out):"]
    for key, value in result["breakdown"].items():
        lines.append(f"    {key:16} {value / 2**30:8.3f} GiB")
    if row.data.get("xmem"):
        lines.append(f"  xMem estimated {row.data['xmem']['estimate_bytes'] / 2**30:.3f} GiB")
    return "\n".join(lines)
