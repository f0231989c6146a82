"""The memory outside PyTorch's caching allocator, learned from finished jobs.

An estimate's total for a GPU is the simulated reserved peak of the caching allocator plus what
the process holds outside it: the CUDA context, the kernels of cuBLAS, cuDNN and NCCL loaded
lazily, what the driver maps per process. The catalogue gives the second term per GPU model
(``contract.gpus``); what it really is depends on the driver and the libraries a job's torch
brings, and the H200 measured 751-771 MiB in every job where the catalogue said 290 MiB
(``bench/data/H200/measurements.jsonl``, NVML's peak minus ``max_memory_reserved``). A cluster
measures it on every job: the controller records each finished run's observed peak per GPU
(``controller.observed_peaks``) next to the simulated reserved peak of the estimate
that sized it. This module is the rule that turns those runs into one figure per GPU model and
driver, and applies it to new estimates.

What is learned: ``outside = observed peak - simulated reserved peak`` per completed run, not
``observed - estimate total``. The first is a fact of the GPU, driver and libraries, the same
whatever catalogue figure the estimate was made with; the second is a correction of one
catalogue release and goes stale the day the catalogue changes (runs sized under the old figure
would correct the new one by the old error). Applied to a new estimate, the correction is
``outside - (total - peak reserved)``: the learned figure minus the estimate's own overhead
term, so a catalogue that becomes right makes the correction zero by itself.

The rule (``spec.learnedOverhead``, cluster-wide):

    window(gpu)  = the newest recentJobs completed runs on that GPU model, across namespaces,
                   with at most jobsPerNamespace of them from any one namespace
    figure(gpu, driver) = percentile_lower(outside of the window's runs on that driver, percentile)
                   once they are at least minJobs; no figure below that
    applied(gpu) = a pinned figure (spec.learnedOverhead.pinned, the admin's) if any, else the
                   largest figure of the GPU model's drivers (a new job may land on any of
                   them), else nothing (the catalogue's term stands)
    correction   = applied - (total - peak reserved), within +/- maxCorrection when learned
                   (a pinned figure is the admin's own and is applied as given)

``percentile_lower`` is numpy's "lower" percentile: the value at index floor(p * (n - 1) / 100)
of the sorted values, so with p < 100 and n >= 2 it is never the single largest value: one wild
observation (a job that leaks, a sidecar on the same GPU) is never the figure (it shifts it by
at most one rank among the others), and any number of them moves an estimate by at most
maxCorrection.

Trust (``DESIGN.md``): a run's observed peak is measured by DCGM or HAMi, but the simulated
reserved peak it is compared with came out of the tenant's own estimation pod, so one tenant can
forge either side of its own samples. What keeps that from sizing other tenants: every sample
is bounded in effect by maxCorrection (a forged sample moves any other tenant's estimate by at
most that, up or down); one namespace holds at most jobsPerNamespace of a window of
recentJobs, so once other namespaces have run jobs one tenant cannot fill it; and the figure is
a high quantile: raising it needs only the top tenth of a window (it costs memory, never an
out-of-memory failure), lowering it, the direction that can fail other tenants' jobs, needs
nine in ten of the window's jobs to be low.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Protocol, Sequence, Tuple, TypeVar

from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.policy.model import LearnedOverhead, OverheadFigure
from xmem_admission.cluster.policy.store import GPUEstimate

UNKNOWN_DRIVER = "unknown"  # a run no source gave a driver version for


@dataclass(frozen=True)
class Sample:
    """One completed run's memory outside the allocator on one GPU model."""

    gpu: str  # catalogue key
    driver: str  # driver version ("unknown" when neither DCGM nor the node said)
    namespace: str
    outside_bytes: int  # observed peak - the simulated reserved peak of its estimate (may be < 0)
    finished: float  # Unix seconds: the newest count


# status.overhead.source of a GME
LEARNED, PINNED, CATALOGUE = "Learned", "Pinned", "Catalogue"


@dataclass(frozen=True)
class Applied:
    """What the memory-outside-the-allocator term of one estimate became, and why."""

    gpu: str
    source: str  # LEARNED, PINNED or CATALOGUE
    outside_bytes: int  # the figure applied (the estimate's own term when CATALOGUE)
    catalogue_bytes: int  # the estimate's own term: total - simulated reserved peak
    correction_bytes: int  # added to the estimate's total (0: unchanged)
    jobs: int = 0  # the jobs the figure was learned from (learned only)
    driver: str = ""  # the driver version(s) it was learned on (learned only)
    bounded: bool = False  # the learned figure was further than maxCorrection: cut to it

    def text(self) -> str:
        """One line for a warning, an Event or a log."""
        if self.source == CATALOGUE:
            return f"catalogue's {_mib(self.catalogue_bytes)} MiB outside the allocator"
        where = f"learned from {self.jobs} job(s), driver {self.driver}" \
            if self.source == LEARNED else "pinned by the policy"
        cut = ", cut to the policy's bound" if self.bounded else ""
        return (f"{_mib(self.outside_bytes)} MiB outside the allocator on {self.gpu} ({where}) "
                f"against the estimate's {_mib(self.catalogue_bytes)} MiB: "
                f"{_signed_mib(self.correction_bytes)} MiB{cut}")

    def status(self) -> Dict[str, object]:
        """The GME's ``status.overhead``."""
        out: Dict[str, object] = {
            "gpu": self.gpu, "source": self.source, "outsideAllocatorBytes": self.outside_bytes,
            "catalogueBytes": self.catalogue_bytes, "correctionBytes": self.correction_bytes,
            "applied": self.column()}
        if self.source == LEARNED:
            out.update(jobs=self.jobs, driverVersion=self.driver, bounded=self.bounded)
        return out

    def column(self) -> str:
        """The ``kubectl get gme`` column: ``+481Mi learned/7``, ``+0Mi catalogue``."""
        what = f"learned/{self.jobs}" if self.source == LEARNED else self.source.lower()
        return f"{_signed_mib(self.correction_bytes)}Mi {what}"


def _mib(size: int) -> str:
    return f"{size / (1 << 20):.0f}"


def _signed_mib(size: int) -> str:
    return f"{size / (1 << 20):+.0f}"


_Number = TypeVar("_Number", int, float)


def percentile_lower(values: Sequence[_Number], p: int) -> _Number:
    """numpy.percentile(values, p, method="lower"): the sorted value at floor(p * (n - 1) / 100),
    in integers (a float quantile p / 100 is not exact in binary: 0.57 * 100 < 57)."""
    if not values:
        raise ValueError("no values")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    ordered = sorted(values)
    return ordered[p * (len(ordered) - 1) // 100]


class _Finished(Protocol):
    @property
    def gpu(self) -> str: ...
    @property
    def namespace(self) -> str: ...
    @property
    def finished(self) -> float: ...


_Run = TypeVar("_Run", bound=_Finished)


def window(samples: Iterable[_Run], settings: LearnedOverhead) -> Dict[str, List[_Run]]:
    """Per GPU model, the samples that count (a ``Sample`` or any finished run on a GPU model
    in a namespace): newest first, at most ``jobs_per_namespace`` from one namespace, at most
    ``recent_jobs`` in all."""
    by_gpu: Dict[str, List[_Run]] = {}
    for sample in sorted(samples, key=lambda s: s.finished, reverse=True):
        kept = by_gpu.setdefault(sample.gpu, [])
        if len(kept) >= settings.recent_jobs:
            continue
        if sum(1 for s in kept if s.namespace == sample.namespace) >= \
                settings.jobs_per_namespace:
            continue
        kept.append(sample)
    return by_gpu


def learn(samples: Iterable[Sample], settings: LearnedOverhead) -> Tuple[OverheadFigure, ...]:
    """The figures per GPU model and driver (none when learning is off), sorted by both."""
    if not settings.enabled:
        return ()
    out: List[OverheadFigure] = []
    for gpu, kept in sorted(window(samples, settings).items()):
        drivers: Dict[str, List[Sample]] = {}
        for sample in kept:
            drivers.setdefault(sample.driver, []).append(sample)
        for driver, group in sorted(drivers.items()):
            if len(group) < settings.min_jobs:
                continue
            value = percentile_lower([s.outside_bytes for s in group], settings.percentile)
            if value <= 0:  # no process holds nothing outside the allocator: not a figure
                continue
            out.append(OverheadFigure(gpu, driver, value, len(group),
                                      len({s.namespace for s in group})))
    return tuple(out)


def applied(estimate: GPUEstimate, settings: LearnedOverhead) -> Applied:
    """The overhead term of ``estimate`` under the policy: pinned, learned or the catalogue's."""
    own = max(0, estimate.total_bytes - estimate.peak_reserved_bytes)
    pin = settings.pin(estimate.gpu)
    if pin is not None:
        return Applied(estimate.gpu, PINNED, pin, own, pin - own)
    found = [f for f in settings.figures if f.gpu == estimate.gpu] if settings.enabled else []
    if not found:
        return Applied(estimate.gpu, CATALOGUE, own, own, 0)
    top = max(found, key=lambda f: (f.outside_bytes, f.jobs))
    wanted = top.outside_bytes - own
    bound = settings.max_correction_bytes
    correction = max(-bound, min(bound, wanted))
    return Applied(estimate.gpu, LEARNED, top.outside_bytes, own, correction, top.jobs,
                   top.driver, bounded=correction != wanted)


def corrected_total(estimate: GPUEstimate, settings: LearnedOverhead) -> Tuple[int, Applied]:
    """The estimate's total with its overhead term as ``applied`` says (at least 1 byte)."""
    term = applied(estimate, settings)
    return max(1, estimate.total_bytes + term.correction_bytes), term


def describe(figure: OverheadFigure) -> str:
    return (f"{figure.gpu} driver {figure.driver}: {gib(figure.outside_bytes)} GiB outside the "
            f"allocator from {figure.jobs} job(s) in {figure.namespaces} namespace(s)")


__all__ = ["Applied", "Sample", "UNKNOWN_DRIVER", "applied", "corrected_total", "describe",
           "learn", "percentile_lower", "window"]
