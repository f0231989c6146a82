"""``xmem bench gpumemnet``: GPUMemNet's measured A100 jobs as a second accuracy yardstick.

Each row of the runs file (``../shared/data/gpumemnet/runs.jsonl``, format in its README) is a
training job GPUMemNet's authors ran on an A100-SXM4-40GB and measured with ``nvidia-smi``
(device-wide, so the CUDA context and the driver's reservation are in the figure). The row names
the generator script and commit of their public repository that produced it, and the exact
command line their launcher ran from the script's folder. This benchmark checks out each commit
once (a ``git worktree`` of the clone the user points it at, cached beside the clone) and runs the
command unmodified through the same path as ``xmem estimate`` (``estimate.estimate``).

What is compared: the row's ``measured_peak_bytes`` against our simulated peak reserved plus one
device-wide floor (context + driver of their unrecorded PyTorch/CUDA versions). The floor is the
only figure fitted, on the rows' own data: the median of measured minus simulated over the MLP
rows that did not run out of memory (tiny jobs whose figure is the floor and little else; every
row if there is no MLP row), and every row is scored with the floor fitted on the other rows
(leave-one-out). The A100-40GB capacity from the catalogue decides the predicted OOM.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any, Dict, Iterable, List, Optional, Sequence, Tuple

from bench.yardsticks.paper.benchmark import (
    MeasuredRow,
    json_objects,
    keep_trace,
    kept_trace,
    quantile,
)
from xmem_admission.contract.errors import BenchError, EstimateError, RunsFileError

GPU_KEY = "A100-40GB"  # the runs' GPU (the data's README: inferred from UUID, logs and OOM level)
# Their runs train for 60-75 s (thousands of steps); the probe records this many.
DEFAULT_STEPS = 3
_MIB = 2**20


class Row(MeasuredRow):
    @property
    def architecture(self) -> str:
        return str((self.data.get("arch") or {}).get("architecture") or "?")

    @property
    def oom(self) -> bool:
        return self.data.get("oom") is True or self.data["status"] == "oom"

    @property
    def commit(self) -> str:
        return str(self.data["rebuild"]["script"]["commit"])

    @property
    def script_dir(self) -> str:
        """The folder of the generator script inside the repository ('' for the top)."""
        return os.path.dirname(str(self.data["rebuild"]["script"]["path"]))

    def argv(self) -> List[str]:
        """The launcher's command line, with this interpreter for ``python``."""
        argv = shlex.split(self.data["rebuild"]["train_cli"])
        if argv and os.path.basename(argv[0]).startswith("python"):
            argv[0] = sys.executable
        return argv


def _field(data: Dict[str, Any], dotted: str) -> Any:
    value: Any = data
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


_REQUIRED = (("id", str), ("family", str), ("batch_size", int), ("measured_peak_bytes", int),
             ("status", str), ("rebuild.script.commit", str), ("rebuild.script.path", str),
             ("rebuild.train_cli", str))


def load_runs(path: str) -> List[Row]:
    """Parse a runs file; raise ``RunsFileError`` naming the line and what is wrong."""
    rows: List[Row] = []
    seen = set()
    for number, data in json_objects(path):
        where = f"{path}:{number}"
        for key, kind in _REQUIRED:
            value = _field(data, key)
            if value is None:
                raise RunsFileError(f"{where}: missing field {key!r}")
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise RunsFileError(f"{where}: field {key!r} must be {kind.__name__}, got "
                                    f"{value!r}")
        if data["measured_peak_bytes"] < 0:
            raise RunsFileError(f"{where}: measured_peak_bytes must be non-negative")
        if not shlex.split(data["rebuild"]["train_cli"]):
            raise RunsFileError(f"{where}: rebuild.train_cli is empty")
        if data["id"] in seen:
            raise RunsFileError(f"{where}: duplicate id {data['id']!r}")
        seen.add(data["id"])
        rows.append(Row(data))
    if not rows:
        raise RunsFileError(f"{path}: no rows")
    return rows


def _stratum(row: Row) -> Tuple[str, str, bool]:
    """CNN rows by architecture and OOM; MLP rows (tracked to a few MiB) by generator only."""
    subset = str(row.data.get("subset") or row.family)
    if row.family == "mlp":
        return (subset, "", row.oom)
    return (subset, row.architecture, row.oom)


def stratified_sample(rows: Sequence[Row], n: int) -> List[Row]:
    """``n`` rows spread evenly over strata (``_stratum``), each stratum in a fixed
    pseudo-random order (a hash of the id), so the same file and ``n`` give the same sample."""
    if n >= len(rows):
        return list(rows)
    strata: Dict[Tuple[str, str, bool], List[Row]] = {}
    for row in sorted(rows, key=lambda r: hashlib.sha256(r.id.encode()).hexdigest()):
        strata.setdefault(_stratum(row), []).append(row)
    queues = [strata[key] for key in sorted(strata)]
    chosen: List[Row] = []
    depth = 0
    while len(chosen) < n:
        for queue in queues:
            if depth < len(queue) and len(chosen) < n:
                chosen.append(queue[depth])
        depth += 1
    return chosen


def disjoint_sample(rows: Sequence[Row], n: int, first: int) -> List[Row]:
    """``n`` rows drawn as ``stratified_sample`` draws them, from the rows outside the
    ``first``-row sample: a second sample that shares no row with the first."""
    taken = {r.id for r in stratified_sample(rows, first)}
    return stratified_sample([r for r in rows if r.id not in taken], n)


# -- checkouts ----------------------------------------------------------------------------
class Checkouts:
    """One ``git worktree`` per commit of the user's clone, made once and reused."""

    def __init__(self, repo: str, cache: Optional[str] = None) -> None:
        if not os.path.isdir(repo):
            raise BenchError(f"--repo {repo}: not a folder (a git clone of "
                             f"github.com/itu-rad/GPUMemNet with its history)")
        probe = subprocess.run(["git", "-C", repo, "rev-parse", "--git-dir"],
                               capture_output=True, text=True, check=False)
        if probe.returncode != 0:
            raise BenchError(f"--repo {repo}: not a git clone ({probe.stderr.strip()})")
        self.repo = os.path.abspath(repo)
        self.cache = os.path.abspath(cache or (self.repo.rstrip("/") + "-worktrees"))
        self._lock = threading.Lock()

    def folder(self, commit: str) -> str:
        path = os.path.join(self.cache, commit)
        with self._lock:
            if not os.path.isdir(path):
                os.makedirs(self.cache, exist_ok=True)
                made = subprocess.run(["git", "-C", self.repo, "worktree", "add", "--force",
                                       "--detach", path, commit],
                                      capture_output=True, text=True, check=False)
                if made.returncode != 0:
                    raise BenchError(f"cannot check out commit {commit} of {self.repo}: "
                                     f"{made.stderr.strip().splitlines()[-1:]}")
        return path


# -- estimating ---------------------------------------------------------------------------
def growth_in_last_step(trace: Any) -> int:
    """Bytes by which the simulated reserved peak (no capacity limit) rose during the last
    traced step: zero when the pool had stopped growing, so more steps would not raise it."""
    from xmem_admission.contract.gpus import lookup
    from xmem_admission.estimator.allocator.simulate import simulate
    from xmem_admission.estimator.orchestrate import for_gpu

    stream = for_gpu(trace, lookup(GPU_KEY))
    steps = [i for i, e in enumerate(stream.events)
             if e.op == "mark" and e.label.startswith("step ")]
    if len(steps) < 2:
        return 0
    timeline = simulate(stream, timeline=True).timeline or []
    before = max((r for i, _, r in timeline if i < steps[-2]), default=0)
    return max(0, max((r for _, _, r in timeline), default=0) - before)


def _simulated(row_id: str, trace: Any, seconds: float, mode: str) -> Dict[str, Any]:
    """Simulate a row's trace on the A100-40GB (the orchestration of today's code)."""
    from xmem_admission.contract.gpus import lookup
    from xmem_admission.estimator.estimate import estimate_trace

    result = estimate_trace(trace, [lookup(GPU_KEY)], margin=0.0)[0]
    # the ends of the range as peaks reserved (the floor is added to all three alike)
    return {"id": row_id, "seconds": seconds, "mode": mode,
            "peak_allocated_bytes": result.peak_allocated_bytes,
            "peak_reserved_bytes": result.peak_reserved_bytes,
            "low_reserved_bytes": result.peak_reserved_bytes + result.low_bytes
            - result.total_bytes,
            "high_reserved_bytes": result.peak_reserved_bytes + result.high_bytes
            - result.total_bytes,
            "low_oom": result.low_oom, "high_oom": result.high_oom,
            "simulated_oom": result.oom is not None, "breakdown": result.breakdown,
            "growth_in_last_step_bytes": growth_in_last_step(trace)}


def estimate_row(row: Row, checkouts: Checkouts, mode: str, steps: int,
                 log: Optional[IO[str]], traces: Optional[str] = None) -> Dict[str, Any]:
    """Run one row's command through ``xmem estimate``'s path; the simulated figures. The
    trace is kept in ``traces`` (a folder) when given, for ``--resume`` to simulate again."""
    from xmem_admission.estimator.estimate import estimate

    folder = os.path.join(checkouts.folder(row.commit), row.script_dir)
    started = time.perf_counter()
    est, trace = estimate(row.argv(), [GPU_KEY], mode=mode, steps=steps, margin=0.0,
                          stream=log, progress=None, cwd=folder)
    seconds = round(time.perf_counter() - started, 3)
    if traces is not None:
        keep_trace(traces, row.id, trace, seconds, est.mode)
    return _simulated(row.id, trace, seconds, est.mode)


def resimulate(row_id: str, traces: str) -> Optional[Dict[str, Any]]:
    """A row's figures from the trace an earlier run kept (None when there is none)."""
    kept = kept_trace(row_id, traces)
    return None if kept is None else _simulated(row_id, *kept)


def run_rows(rows: Sequence[Row], checkouts: Checkouts, mode: str, steps: int, jobs: int,
             log: IO[str], traces: Optional[str] = None, resume: bool = False,
             progress: Optional[IO[str]] = None) -> Dict[str, Dict[str, Any]]:
    """Estimate every row (with ``resume``, simulate again the rows whose trace is kept)."""
    lock = threading.Lock()
    done: Dict[str, Dict[str, Any]] = {}

    def one(row: Row) -> None:
        out = resimulate(row.id, traces) if resume and traces is not None else None
        if out is None:
            try:
                out = estimate_row(row, checkouts, mode, steps, log, traces)
            except EstimateError as exc:
                out = {"id": row.id, "error": str(exc).splitlines()[0]}
        with lock:
            done[row.id] = out
            if progress is not None:
                shown = (f"simulated {out['peak_reserved_bytes'] / _MIB:9.0f} MiB reserved, "
                         f"measured {row.measured / _MIB:7.0f} MiB device-wide"
                         if "error" not in out else f"error: {out['error']}")
                print(f"xmem bench: {row.id}: {shown}", file=progress, flush=True)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        list(pool.map(one, rows))
    return done


# -- the floor and the scores -------------------------------------------------------------
def _fitting_rows(rows: Iterable[Row], sims: Dict[str, Dict[str, Any]]) -> List[Row]:
    usable = [r for r in rows if not r.oom and not r.data.get("measured_is_lower_bound")
              and "peak_reserved_bytes" in sims.get(r.id, {})]
    mlp = [r for r in usable if r.family == "mlp"]
    return mlp or usable


def fit_floor(rows: Iterable[Row], sims: Dict[str, Dict[str, Any]]) -> int:
    """The device-wide floor: median of measured minus simulated peak reserved over the fitting
    rows (the MLP rows that did not OOM, else every row that did not OOM)."""
    fitting = _fitting_rows(rows, sims)
    if not fitting:
        raise BenchError("no row to fit the floor on: every row ran out of memory, failed or "
                         "has only a lower bound")
    return int(statistics.median(r.measured - sims[r.id]["peak_reserved_bytes"]
                                 for r in fitting))


def leave_one_out(rows: Sequence[Row], sims: Dict[str, Dict[str, Any]],
                  capacity_bytes: int) -> Dict[str, Dict[str, Any]]:
    """Each estimated row's answer with the floor fitted on every other row."""
    fitting = _fitting_rows(rows, sims)
    residuals = {r.id: r.measured - sims[r.id]["peak_reserved_bytes"] for r in fitting}
    ordered = sorted(residuals.values())
    whole = int(statistics.median(ordered)) if ordered else None
    answers: Dict[str, Dict[str, Any]] = {}
    for row in rows:
        sim = sims.get(row.id, {})
        if "peak_reserved_bytes" not in sim:
            continue
        if row.id in residuals:
            others = list(ordered)
            others.remove(residuals[row.id])
            floor = int(statistics.median(others)) if others else None
        else:
            floor = whole
        if floor is None:
            raise BenchError("the floor needs at least two rows that did not run out of memory")
        answers[row.id] = _answer(row.id, sim, floor, capacity_bytes)
    return answers


def _answer(row_id: str, sim: Dict[str, Any], floor: int, capacity_bytes: int) -> Dict[str, Any]:
    """A row's answer under a floor: the point, the ends of its range, its request under the
    default policy and the OOM call ("does not fit" only where the low end does not; traces
    simulated before the range existed have the point for both ends)."""
    from bench.yardsticks.paper.request_sizes import request_bytes

    estimate_bytes = sim["peak_reserved_bytes"] + floor
    low_bytes = sim.get("low_reserved_bytes", sim["peak_reserved_bytes"]) + floor
    high_bytes = sim.get("high_reserved_bytes", sim["peak_reserved_bytes"]) + floor
    point_oom = bool(sim.get("simulated_oom")) or estimate_bytes > capacity_bytes
    low_oom = bool(sim.get("low_oom", sim.get("simulated_oom"))) or low_bytes > capacity_bytes
    high_oom = bool(sim.get("high_oom", sim.get("simulated_oom"))) or high_bytes > capacity_bytes
    fit = "does not fit" if low_oom else "may not fit" if point_oom or high_oom else "fits"
    return {"id": row_id, "estimate_bytes": estimate_bytes, "low_bytes": low_bytes,
            "high_bytes": high_bytes,
            "request_bytes": request_bytes(estimate_bytes, high_bytes, GPU_KEY),
            "predicted_oom": low_oom, "fit": fit, "seconds": sim["seconds"],
            "floor_bytes": floor}


@dataclass
class Score:
    name: str
    n: int
    median: float
    p90: float
    under: float
    oom_rows: int
    oom_predicted_to_fit: int
    fit_predicted_oom: int
    seconds: float


def score(name: str, rows: Iterable[Row], answers: Dict[str, Dict[str, Any]]) -> Score:
    """Errors on rows that did not OOM; OOM agreement on every answered row."""
    errors: List[float] = []
    under = ooms = missed = false_alarms = 0
    times: List[float] = []
    for row in rows:
        answer = answers.get(row.id)
        if answer is None:
            continue
        times.append(float(answer["seconds"]))
        if row.oom:
            ooms += 1
            missed += not answer["predicted_oom"]
            continue
        false_alarms += bool(answer["predicted_oom"])
        if row.measured > 0:
            errors.append(abs(answer["estimate_bytes"] - row.measured) / row.measured)
            under += answer["estimate_bytes"] < row.measured
    nan = float("nan")
    return Score(name, len(errors), statistics.median(errors) if errors else nan,
                 quantile(errors, 0.9), under / len(errors) if errors else nan, ooms, missed,
                 false_alarms, statistics.median(times) if times else nan)


def report(rows: Sequence[Row], sims: Dict[str, Dict[str, Any]],
           answers: Dict[str, Dict[str, Any]], floor: int) -> str:
    groups: List[Tuple[str, List[Row]]] = [("all rows", list(rows))]
    for family in sorted({r.family for r in rows}):
        in_family = [r for r in rows if r.family == family]
        groups.append((f"family {family}", in_family))
        for arch in sorted({r.architecture for r in in_family}):
            groups.append((f"  {family} {arch}", [r for r in in_family
                                                  if r.architecture == arch]))
    lines = [f"device-wide floor (fitted on every row, MLP rows that did not OOM): "
             f"{floor / _MIB:.0f} MiB; each row scored with the floor fitted on the others",
             f"{'rows':26} {'n':>4} {'median':>8} {'p90':>8} {'under':>7} {'OOM rows':>8} "
             f"{'OOM said fit':>12} {'fit said OOM':>12} {'s/job':>6}"]
    for name, group in groups:
        s = score(name, group, answers)
        lines.append(f"{s.name:26} {s.n:4d} {s.median:8.2%} {s.p90:8.2%} {s.under:7.1%} "
                     f"{s.oom_rows:8d} {s.oom_predicted_to_fit:12d} {s.fit_predicted_oom:12d} "
                     f"{s.seconds:6.1f}")
    growing = [r.id for r in rows if sims.get(r.id, {}).get("growth_in_last_step_bytes")]
    if any("growth_in_last_step_bytes" in sim for sim in sims.values()):
        lines.append(f"rows whose simulated pool still grew in the last traced step: "
                     f"{len(growing)} of "
                     f"{sum('peak_reserved_bytes' in sims.get(r.id, {}) for r in rows)}"
                     + (f" ({', '.join(growing[:10])})" if growing else ""))
    from bench.yardsticks.paper.request_sizes import table, tally

    lines.append(table("requests under the default policy (each row with the floor fitted on "
                       "the others)", tally(rows, answers)))
    failed = [sims[r.id] for r in rows if "error" in sims.get(r.id, {})]
    if failed:
        lines.append(f"{len(failed)} row(s) failed: " + "; ".join(
            f"{f['id']}: {f['error']}" for f in failed))
    return "\n".join(lines)


def explain(row: Row, sim: Dict[str, Any], answer: Dict[str, Any]) -> str:
    """One row: the simulated breakdown, the floor, next to the measurement."""
    est, measured = answer["estimate_bytes"], row.measured
    lines = [f"{row.id} ({row.family} {row.architecture}, batch {row.data['batch_size']}): "
             f"measured {measured / _MIB:.0f} MiB device-wide (oom={row.oom}), estimated "
             f"{est / _MIB:.0f} MiB ({(est - measured) / max(measured, 1):+.2%}), "
             f"predicted OOM {answer['predicted_oom']}",
             f"  command (from {row.data['rebuild']['script']['path']} at "
             f"{row.commit[:10]}): {row.data['rebuild']['train_cli']}",
             f"  simulated peak allocated {sim['peak_allocated_bytes'] / _MIB:.0f} MiB, peak "
             f"reserved {sim['peak_reserved_bytes'] / _MIB:.0f} MiB, floor "
             f"{answer['floor_bytes'] / _MIB:.0f} MiB ({sim['mode']} mode, "
             f"{sim['seconds']:.1f} s)",
             "  breakdown at the simulated peak (overhead = the catalogue's, not used here):"]
    for key, value in sim["breakdown"].items():
        lines.append(f"    {key:16} {value / _MIB:10.1f} MiB")
    return "\n".join(lines)
