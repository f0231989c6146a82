"""The OOM retry loop replayed on the two yardsticks' measured jobs.

    .venv/bin/python bench/yardsticks/oom_replay.py \\
        --paper-runs ../shared/data/xmem-paper/runs.jsonl --paper-out PAPER.jsonl \\
        --gpumemnet-runs ../shared/data/gpumemnet/runs.jsonl --gpumemnet-out GMN.jsonl \\
        --sample 110

``PAPER.jsonl`` and ``GMN.jsonl`` are the ``--out`` files of earlier ``xmem bench paper`` and
``xmem bench gpumemnet --sample 110`` runs: their kept traces (``OUT.jsonl.traces/``) are
simulated again (the benchmarks' own ``resimulate``), so no job runs again. Either yardstick may
be left out.

Each measured job is one submission under HAMi-style enforcement with the default policy
(``policy.model.DEFAULTS``: 5% margin, 256 MiB granularity, 1 GiB minimum) and HAMi as the
backend. Its request is what the webhook would write (``policy.sizing.size_request`` of the
benchmark's estimate); a job whose estimate fits no GPU is refused at admission, as
``sizing.plan`` refuses it. The job then runs: it fails when its measured peak exceeds its
request (HAMi-core refuses the allocation that would pass the limit and PyTorch raises
``torch.OutOfMemoryError``, ``contract/oom.py``), or when it ran out of memory on the whole GPU
in the measurement. A failed attempt leaves a log tail (HAMi-core's ``oom_check`` line and
PyTorch's message), which ``contract.oom.read`` reads as the controller would, and the next
attempt's request is ``policy.retry.grow`` of it; at most ``backoffLimit`` retries (6, the Job
controller's default: Kubernetes documentation, "Pod backoff failure policy").

The log tail is what the simulator reports at capacity = request. The traced job never needs
more than its estimate, which is below its request, so the trace as traced cannot run out there
(``--literal`` counts it: no failed job does). A job fails because it really needs more than the
trace shows, by the ratio of its measured peak to its estimate, so the evidence comes from the
trace with every allocation scaled by that ratio (the allocator's share of the measured peak over
the simulated peak reserved), replayed with the allocator's capacity set to the request minus
the memory held outside the allocator: the allocated, reserved and requested figures of that
simulated OOM make PyTorch's message. Where the scaled trace still fits (a peak just above the
request), the job's tail holds only ``CUDA error: out of memory`` (no figures).

Both yardsticks are compared in their measurement's basis, so a request is compared with what
was measured: the paper's peaks exclude the CUDA context (its README), so there the GPU's budget
is its capacity less the catalogue's context and the memory outside the allocator is the
catalogue's runtime overhead; GPUMemNet's are device-wide, so there the budget is the whole
capacity and the memory outside the allocator is the benchmark's fitted floor (leave-one-out).

Memory requested: every admitted job's requests summed over its attempts (a failed attempt held
its request until it failed), against the whole-GPU baseline in which every job gets the whole
GPU once; without the loop a failed job is not retried.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from xmem_admission.cluster.policy import retry  # noqa: E402
from xmem_admission.cluster.policy.model import BackendName, Policy, Settings, Target  # noqa: E402
from xmem_admission.cluster.policy.sizing import size_request  # noqa: E402
from xmem_admission.contract import gpus, oom  # noqa: E402
from xmem_admission.contract.errors import XmemError  # noqa: E402
from xmem_admission.estimator.allocator.simulate import OutOfMemoryInfo, simulate  # noqa: E402
from xmem_admission.estimator.trace import ALLOC, Trace  # noqa: E402

GIB = 2**30
# The Job controller's default backoffLimit (Kubernetes documentation, Job: "Pod backoff failure
# policy": "The back-off limit is set by default to 6").
BACKOFF_LIMIT = 6
# The kubelet keeps the last 80 lines, at most 2048 bytes, of a container's log as its message
# under FallbackToLogsOnError (pkg/kubelet/container/runtime.go, as contract/oom.py cites).
TAIL_LINES, TAIL_BYTES = 80, 2048
NO_LOOP = "no retry loop"


# -- the job's log tail -------------------------------------------------------------------
def format_size(size: int) -> str:
    """c10's ``format_size``: bytes up to 1024, else two decimals of KiB up to 1 MiB, MiB up to
    1 GiB, GiB beyond (c10/util, as contract/oom.py describes it)."""
    if size <= 1024:
        return f"{size} bytes"
    for unit, scale in (("KiB", 1 << 10), ("MiB", 1 << 20)):
        if size <= scale << 10:
            return f"{size / scale:.2f} {unit}"
    return f"{size / GIB:.2f} GiB"


def log_tail(report: Optional[OutOfMemoryInfo], limit_bytes: int, outside_bytes: int,
             pid: int = 4242) -> str:
    """The kubelet's copy of a job's last output after HAMi refused an allocation.

    ``report``: the simulated OOM at capacity = ``limit_bytes`` - ``outside_bytes``. HAMi-core's
    line (``[HAMI-core ERROR ...]: Device 0 OOM <usage + new> / <limit>``, contract/oom.py) counts
    the memory outside the allocator too; PyTorch's message is torch 2.4's form, with the
    limit as the total capacity (HAMi-core answers ``cuMemGetInfo`` with it) and the job's own
    process listed by pid. None: the tail of a CUDA call that failed without figures.
    """
    frames = ['Traceback (most recent call last):',
              '  File "/workspace/train.py", line 88, in <module>',
              '    loss.backward()']
    if report is None:
        lines = frames + ["RuntimeError: CUDA error: out of memory"]
    else:
        used = report.reserved_bytes + outside_bytes
        asked = report.allocation_bytes
        hami = (f"[HAMI-core ERROR (pid:{pid} thread={pid + 7} allocator.c:52)]: "
                f"Device 0 OOM {used + asked} / {limit_bytes}")
        message = (
            f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {format_size(asked)}. "
            f"GPU 0 has a total capacity of {format_size(limit_bytes)} of which "
            f"{format_size(max(0, limit_bytes - used))} is free. Process {pid} has "
            f"{format_size(used)} memory in use. Of the allocated memory "
            f"{format_size(report.allocated_bytes)} is allocated by PyTorch, and "
            f"{format_size(report.reserved_bytes - report.allocated_bytes)} is reserved by "
            "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
            "documentation for Memory Management  "
            "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
        lines = [hami] + frames + [message]
    text = "\n".join(lines[-TAIL_LINES:]) + "\n"
    data = text.encode()
    return data[-TAIL_BYTES:].decode(errors="ignore")


# -- one job ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """A measured job, in its measurement's basis.

    ``stream``: its allocator events for its GPU (``orchestrate.for_gpu`` already applied);
    ``peak_reserved_bytes``: their simulated peak reserved; ``outside_bytes``: what the process
    holds outside the allocator in this basis, so the estimate is the sum of the two; ``gpu``:
    the GPU with this basis's capacity and outside memory (the retry rule's ceiling and overhead).
    """

    id: str
    stream: Trace
    peak_reserved_bytes: int
    outside_bytes: int
    gpu: gpus.GPU
    measured_bytes: int
    measured_oom: bool = False  # ran out of memory on the whole GPU when measured
    predicted_oom: bool = False  # the estimator said it does not fit the GPU
    # the scaled trace, and what it reports at each request: simulated once
    reports: Dict[int, Optional[OutOfMemoryInfo]] = field(default_factory=dict, compare=False,
                                                          repr=False)
    scaled_stream: List[Trace] = field(default_factory=list, compare=False, repr=False)

    @property
    def estimate_bytes(self) -> int:
        return self.peak_reserved_bytes + self.outside_bytes


@dataclass(frozen=True)
class BasisGPU(gpus.GPU):
    """A catalogue GPU whose memory outside the allocator is a measurement basis's, not
    ``contract.overhead``'s (the catalogue's figures are read through properties)."""

    outside_bytes: int = 0

    @property
    def context_bytes(self) -> int:
        return self.outside_bytes

    @property
    def runtime_overhead_bytes(self) -> int:
        return 0


def basis_gpu(gpu: gpus.GPU, capacity_bytes: int, outside_bytes: int) -> gpus.GPU:
    """``gpu`` with a measurement basis's capacity and memory outside the allocator."""
    fields = {f.name: getattr(gpu, f.name) for f in dataclasses.fields(gpus.GPU)}
    return BasisGPU(**dict(fields, capacity_bytes=capacity_bytes), outside_bytes=outside_bytes)


def scaled(stream: Trace, factor: float) -> Trace:
    """The stream with every allocation ``factor`` times its traced size."""
    return Trace([e._replace(size=round(e.size * factor)) if e.op == ALLOC else e
                  for e in stream.events], dict(stream.meta))


@dataclass(frozen=True)
class Attempt:
    request_bytes: int
    failed: bool
    evidence: Optional[oom.CudaOOM] = None  # what the controller read from the log tail
    next_step: str = ""  # the retry rule's words (the Event), or its reason to give up


@dataclass
class Outcome:
    id: str
    admitted: bool
    attempts: List[Attempt] = field(default_factory=list)
    end_reason: str = ""  # the retry rule's reason to give up, or the back-off limit

    @property
    def succeeded(self) -> bool:
        return bool(self.attempts) and not self.attempts[-1].failed


class Criterion(str, enum.Enum):
    """When a job fails at a request."""

    MEASURED = "measured"  # its measured peak is above the request (the rule)
    ALLOCATOR = "allocator"  # its scaled trace runs out there even after the allocator freed
    # its cache and retried (c10 DeviceCachingAllocator::malloc does before raising)


def fails(job: Job, request_bytes: int, criterion: Criterion = Criterion.MEASURED) -> bool:
    """HAMi-style enforcement: the job fails when it needs more than its request."""
    if job.measured_oom:
        return True
    if criterion is Criterion.ALLOCATOR:
        return scaled_report(job, request_bytes) is not None
    return job.measured_bytes > request_bytes


def true_factor(job: Job) -> float:
    """How much more the job allocates than its trace: the allocator's share of the measured
    peak over the simulated peak reserved (for a job that ran out on the whole GPU, at least
    the whole GPU)."""
    need = job.measured_bytes
    if job.measured_oom:
        need = max(need, job.gpu.capacity_bytes)
    return max(need - job.outside_bytes, 1) / max(job.peak_reserved_bytes, 1)


def simulated_oom(stream: Trace, request_bytes: int, outside_bytes: int) -> Optional[OutOfMemoryInfo]:
    """What the simulator reports for ``stream`` with the capacity set to the request."""
    return simulate(stream, capacity_bytes=max(0, request_bytes - outside_bytes)).oom


def scaled_report(job: Job, request_bytes: int) -> Optional[OutOfMemoryInfo]:
    """What the simulator reports for the job as it ran (its trace scaled to the measured peak)
    with the capacity set to ``request_bytes``."""
    if request_bytes not in job.reports:
        if not job.scaled_stream:
            job.scaled_stream.append(scaled(job.stream, true_factor(job)))
        job.reports[request_bytes] = simulated_oom(job.scaled_stream[0], request_bytes,
                                                   job.outside_bytes)
    return job.reports[request_bytes]


def evidence(job: Job, request_bytes: int) -> Optional[oom.CudaOOM]:
    """What the controller reads after the job failed at ``request_bytes``."""
    report = scaled_report(job, request_bytes)
    return oom.read(log_tail(report, request_bytes, job.outside_bytes))


def replay(job: Job, settings: Settings, loop: bool = True,
           backoff_limit: int = BACKOFF_LIMIT,
           criterion: Criterion = Criterion.MEASURED) -> Outcome:
    """Submit ``job`` under ``settings`` and run it until it succeeds, gives up, or (with the
    loop) the back-off limit is spent."""
    outcome = Outcome(job.id, admitted=not job.predicted_oom
                      and job.estimate_bytes <= job.gpu.capacity_bytes)
    if not outcome.admitted:
        outcome.end_reason = "refused at admission: the estimate fits no GPU"
        return outcome
    target = Target(job.gpu, BackendName.HAMI)
    rule = retry.rule_for(settings)
    request = size_request(job.estimate_bytes, settings, job.gpu.capacity_bytes)
    ooms = 0
    while True:
        if not fails(job, request, criterion):
            outcome.attempts.append(Attempt(request, failed=False))
            return outcome
        if not loop:
            outcome.attempts.append(Attempt(request, failed=True))
            outcome.end_reason = NO_LOOP
            return outcome
        report = evidence(job, request)
        ooms += 1
        step: Union[retry.Retry, retry.GiveUp] = retry.grow(request, report, ooms, target, rule)
        outcome.attempts.append(Attempt(request, True, report, step.reason))
        if isinstance(step, retry.GiveUp):
            outcome.end_reason = step.reason
            return outcome
        if ooms > backoff_limit:
            outcome.end_reason = f"backoffLimit {backoff_limit} spent"
            return outcome
        request = step.request_bytes


def default_settings(gpu_key: str) -> Settings:
    """The default policy's settings (HAMi on one GPU model)."""
    return Policy.from_spec({"targets": [{"gpu": gpu_key, "backend": BackendName.HAMI.value}]}
                            ).defaults


# -- the figures --------------------------------------------------------------------------
@dataclass
class Summary:
    jobs: int = 0
    refused: int = 0
    failed_first: int = 0
    failed_after_retry: int = 0  # failed at the first attempt and at the second
    succeeded: int = 0
    gave_up: int = 0
    attempts: int = 0
    with_figures: int = 0  # failed attempts whose log tail had the allocator's figures
    requested_bytes: int = 0  # every attempt's request
    whole_gpu_bytes: int = 0  # each job given its whole GPU once
    whole_gpu_failed: int = 0  # jobs that ran out of memory even with the whole GPU
    admitted_whole_gpu_bytes: int = 0  # the whole GPUs of the jobs xmem admitted
    final_request_bytes: int = 0  # the succeeding attempt's request, over the jobs that succeeded
    reasons: Dict[str, int] = field(default_factory=dict)


def reason_kind(reason: str) -> str:
    """A give-up reason's kind (``retry.grow``'s sentences, the back-off limit)."""
    if "it does not fit" in reason:
        return "ran out at the largest request"
    if "more than the most a retry may ask for" in reason:
        return "its report needs more than the largest request"
    return reason.split(":")[0]


def summarise(jobs: Sequence[Job], outcomes: Sequence[Outcome]) -> Summary:
    s = Summary()
    for job, out in zip(jobs, outcomes):
        s.jobs += 1
        s.whole_gpu_bytes += job.gpu.capacity_bytes
        s.whole_gpu_failed += job.measured_oom
        if not out.admitted:
            s.refused += 1
            continue
        s.admitted_whole_gpu_bytes += job.gpu.capacity_bytes
        s.attempts += len(out.attempts)
        s.requested_bytes += sum(a.request_bytes for a in out.attempts)
        s.with_figures += sum(a.evidence is not None and a.evidence.need_bytes() is not None
                              for a in out.attempts if a.failed)
        s.failed_first += out.attempts[0].failed
        s.failed_after_retry += len(out.attempts) > 1 and out.attempts[1].failed
        if out.succeeded:
            s.succeeded += 1
            s.final_request_bytes += out.attempts[-1].request_bytes
        elif out.end_reason != NO_LOOP:
            s.gave_up += 1
            key = reason_kind(out.end_reason)
            s.reasons[key] = s.reasons.get(key, 0) + 1
    return s


def table(rows: Iterable[Tuple[str, Summary]]) -> str:
    """Markdown: each stream under the whole-GPU baseline, then xmem's sizing without and with
    the loop."""
    lines = ["| stream | jobs | refused at admission | failed at the first attempt | failed after "
             "the retry | completed | ended with a reason | attempts | GiB requested, all "
             "attempts | of the admitted jobs' whole GPUs |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    done = set()
    for name, s in rows:
        stream = name.split(",")[0]
        if stream not in done:
            done.add(stream)
            lines.append(f"| {stream}, whole GPU each | {s.jobs} | 0 | {s.whole_gpu_failed} | - | "
                         f"{s.jobs - s.whole_gpu_failed} | - | {s.jobs} | "
                         f"{s.whole_gpu_bytes / GIB:,.1f} | - |")
        share = s.requested_bytes / s.admitted_whole_gpu_bytes if s.admitted_whole_gpu_bytes \
            else 0.0
        lines.append(
            f"| {name} | {s.jobs} | {s.refused} | {s.failed_first} | "
            f"{s.failed_after_retry if 'without' not in name else '-'} | {s.succeeded} | "
            f"{s.gave_up} | {s.attempts} | {s.requested_bytes / GIB:,.1f} | {share:.1%} |")
    return "\n".join(lines)


def details(jobs: Sequence[Job], outcomes: Sequence[Outcome]) -> str:
    """One line per job that failed at least once, with the loop."""
    out = []
    for job, o in zip(jobs, outcomes):
        if not o.attempts or not o.attempts[0].failed:
            continue
        steps = " -> ".join(f"{a.request_bytes / GIB:.2f}" for a in o.attempts)
        figures = sum(a.evidence is not None and a.evidence.need_bytes() is not None
                      for a in o.attempts if a.failed)
        end = "ok" if o.succeeded else o.end_reason
        out.append(f"  {job.id}: estimate {job.estimate_bytes / GIB:.2f}, measured "
                   f"{job.measured_bytes / GIB:.2f}{' (OOM on the whole GPU)' if job.measured_oom else ''}"
                   f" GiB; requests {steps} GiB; {figures} tail(s) with figures; {end}")
    return "\n".join(out)


# -- the yardsticks -----------------------------------------------------------------------
def paper_jobs(runs: str, out: str) -> List[Job]:
    """The xMem paper's rows from an ``xmem bench paper --out OUT`` run's kept traces."""
    from bench.yardsticks.paper import benchmark as paperbench
    from xmem_admission.estimator.orchestrate import for_gpu

    traces = out + ".traces"
    jobs = []
    missing = []
    for row in paperbench.load_runs(runs):
        answer = paperbench.resimulate(row, traces)
        kept = paperbench.kept_trace(row.id, traces)
        if answer is None or kept is None:
            missing.append(row.id)
            continue
        gpu = gpus.lookup(row.data["gpu_name"])
        outside = gpu.runtime_overhead_bytes  # the paper's peaks leave the context out
        jobs.append(Job(row.id, for_gpu(kept[0], gpu), answer["peak_reserved_bytes"], outside,
                        basis_gpu(gpu, gpu.capacity_bytes - gpu.context_bytes, outside),
                        row.measured, row.oom, bool(answer["predicted_oom"])))
    _warn_missing("paper", missing, traces)
    return jobs


def gpumemnet_jobs(runs: str, out: str, sample: Optional[int]) -> List[Job]:
    """GPUMemNet's rows (the benchmark's sample) from an ``xmem bench gpumemnet --out OUT`` run's
    kept traces, each with the floor fitted on the other rows."""
    from bench.yardsticks import gpumemnet as gmn
    from bench.yardsticks.paper.benchmark import kept_trace
    from xmem_admission.estimator.orchestrate import for_gpu

    traces = out + ".traces"
    every = gmn.load_runs(runs)
    rows = gmn.stratified_sample(every, sample) if sample else every
    sims = {}
    missing = []
    for row in rows:
        sim = gmn.resimulate(row.id, traces)
        if sim is None:
            missing.append(row.id)
        else:
            sims[row.id] = sim
    _warn_missing("gpumemnet", missing, traces)
    gpu = gpus.lookup(gmn.GPU_KEY)
    answers = gmn.leave_one_out(rows, sims, gpu.capacity_bytes)
    jobs = []
    for row in rows:
        answer = answers.get(row.id)
        kept = kept_trace(row.id, traces)
        if answer is None or kept is None:
            continue
        floor = int(answer["floor_bytes"])  # device-wide measurements: context and driver in it
        jobs.append(Job(row.id, for_gpu(kept[0], gpu), sims[row.id]["peak_reserved_bytes"], floor,
                        basis_gpu(gpu, gpu.capacity_bytes, floor), row.measured, row.oom,
                        bool(answer["predicted_oom"])))
    return jobs


def _warn_missing(name: str, missing: List[str], traces: str) -> None:
    if missing:
        print(f"oom_replay: {name}: {len(missing)} row(s) without a kept trace in {traces} "
              f"left out ({', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''})",
              file=sys.stderr)


def literal_ooms(jobs: Sequence[Job], settings_for: Dict[str, Settings]) -> Tuple[int, int]:
    """(first attempts that fail, of them the traces as traced that run out at the request)."""
    failed = hit = 0
    for job in jobs:
        if job.predicted_oom or job.estimate_bytes > job.gpu.capacity_bytes:
            continue
        request = size_request(job.estimate_bytes, settings_for[job.id], job.gpu.capacity_bytes)
        if fails(job, request):
            failed += 1
            hit += simulated_oom(job.stream, request, job.outside_bytes) is not None
    return failed, hit


def run(name: str, jobs: List[Job], verbose: bool, literal: bool) -> List[Tuple[str, Summary]]:
    """The stream under both failure criteria, without and with the loop."""
    settings_for = {j.id: default_settings(j.gpu.key) for j in jobs}
    rows = []
    for criterion in Criterion:
        label = "" if criterion is Criterion.MEASURED else " (failing only where the allocator " \
            "runs out)"
        without = [replay(j, settings_for[j.id], False, criterion=criterion) for j in jobs]
        with_loop = [replay(j, settings_for[j.id], criterion=criterion) for j in jobs]
        s_with = summarise(jobs, with_loop)
        rows += [(f"{name}, xmem without the loop{label}", summarise(jobs, without)),
                 (f"{name}, xmem with the loop{label}", s_with)]
        print(f"{name}{label}: {len(jobs)} jobs; failed attempts whose tail had the allocator's "
              f"figures: {s_with.with_figures} of {s_with.attempts - s_with.succeeded}; reasons "
              f"given: {s_with.reasons or 'none'}")
        if verbose:
            print(details(jobs, with_loop))
    if literal:
        failed, hit = literal_ooms(jobs, settings_for)
        print(f"{name}: traces as traced, capacity = request: {hit} of the {failed} failing "
              f"first attempts run out in the simulator")
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--paper-runs", metavar="RUNS.jsonl")
    parser.add_argument("--paper-out", metavar="OUT.jsonl",
                        help="an `xmem bench paper --out` file whose OUT.jsonl.traces/ is kept")
    parser.add_argument("--gpumemnet-runs", metavar="RUNS.jsonl")
    parser.add_argument("--gpumemnet-out", metavar="OUT.jsonl",
                        help="an `xmem bench gpumemnet --out` file whose traces are kept")
    parser.add_argument("--sample", type=int, default=None, metavar="N",
                        help="the GPUMemNet rows of `xmem bench gpumemnet --sample N`")
    parser.add_argument("--verbose", action="store_true",
                        help="one line per job that failed at least once")
    parser.add_argument("--literal", action="store_true",
                        help="also count the failing jobs whose trace, as traced, runs out at "
                        "capacity = request")
    args = parser.parse_args(argv)
    streams: List[Tuple[str, Summary]] = []
    if bool(args.paper_runs) != bool(args.paper_out) or \
            bool(args.gpumemnet_runs) != bool(args.gpumemnet_out):
        parser.error("--paper-runs goes with --paper-out, --gpumemnet-runs with --gpumemnet-out")
    if args.paper_runs:
        streams += run("xMem paper", paper_jobs(args.paper_runs, args.paper_out),
                       args.verbose, args.literal)
    if args.gpumemnet_runs:
        name = f"GPUMemNet{f' sample {args.sample}' if args.sample else ''}"
        streams += run(name, gpumemnet_jobs(args.gpumemnet_runs, args.gpumemnet_out, args.sample),
                       args.verbose, args.literal)
    if not streams:
        parser.error("nothing to replay: give --paper-runs/--paper-out or "
                     "--gpumemnet-runs/--gpumemnet-out")
    print(table(streams))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except XmemError as exc:
        print(f"oom_replay: {exc}", file=sys.stderr)
        sys.exit(2)
