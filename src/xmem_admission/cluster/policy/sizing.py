"""From a recorded estimate to the request a workload gets: one source of truth for the numbers.

The webhook (at Job CREATE and Pod CREATE) and the controller (when it releases a held workload)
both size requests here, so the number written into ``xmem.io/request-bytes``, the one the
backend turns into ``nvidia.com/gpumem`` or a MIG profile, and the one validation compares
against can never disagree.

The request for a GPU model, from the estimate E (``total_bytes``: what the process would show
on that GPU) and the high end H of its range (``high_bytes``, E where the record has none: what
the process may show when the GPU picks the largest convolution workspaces its cuDNN ranks):

    request = (E * (1 + safetyMarginPercent/100) + (H - E)) * (1 - overcommitPercent/100)
    request = max(request, minimumRequest), rounded up to a multiple of granularity,
              and never more than the GPU's capacity (a request above it could never schedule)

Overcommit is the admin's accepted risk: it lowers requests to pack more jobs, and it is also
the allowance for requests set by hand: validation accepts any request >= E * (1 - overcommit).
The target GPU is the first GPU of the policy (in its order) whose capacity holds E, unless the
workload pins one with ``xmem.io/gpu-model``.

A repeat job (the record carries runs: what earlier runs of the fingerprint in the workload's
own namespace used) is sized from E corrected by ``right_sizing.correct`` within the
policy's ``rightSizing``; E itself stays the plan's estimate (``xmem.io/estimate-bytes``), so
each run's observed peak is compared with the estimator's figure, never with a corrected one
(which would undo the correction on the run after). Validation's floor is taken from the lower
of E and the corrected estimate (``Plan.judged_bytes``).

The memory outside the allocator (``policy.overhead``): where the policy pins, or the
controller has learned from finished jobs, what a GPU model keeps outside PyTorch's caching
allocator, E's overhead term is replaced by that figure (a learned one moves E by at most
``learnedOverhead.maxCorrection``) before the margin, whichever path sizes the workload (the
webhook at CREATE, the controller at release, the MIG profile chosen from the request, an OOM
retry grown from it). A repeat job whose own earlier runs correct it is sized from those runs
alone: their observed peaks already hold everything outside the allocator. E stays the
estimator's figure (``xmem.io/estimate-bytes``), and the plan says what was applied
(``Plan.overhead``).

Where in their range a GPU model's jobs land (``policy.range_position``, learned by the
controller and read with the policy's status) narrows the high end the request covers, on every
path alike; ``Plan.narrowed`` says why.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Dict, List, Optional, Sequence

from xmem_admission.cluster import labels
from xmem_admission.cluster.kube.quantity import ceil_div, gib
from xmem_admission.cluster.policy import overhead, range_position, right_sizing
from xmem_admission.cluster.policy.model import Settings, Target
from xmem_admission.cluster.policy.store import EstimateRecord, GPUEstimate
from xmem_admission.contract import gpus
from xmem_admission.contract.errors import UnknownGPUError


@dataclass(frozen=True)
class Plan:
    """The decision for one workload: which GPU model, the estimate, the request per GPU."""

    target: Target
    estimate_bytes: int
    request_bytes: int
    # The request E alone would get, the corrected estimate the request was sized from, and
    # why, when earlier runs corrected it (right-sizing); None: the request is E's.
    uncorrected_request_bytes: Optional[int] = None
    correction: str = ""
    corrected_bytes: Optional[int] = None
    # What the estimate's memory-outside-the-allocator term became: None when the
    # workload's own runs sized it, or nothing was pinned or learned for the GPU.
    overhead: Optional[overhead.Applied] = None
    # The high end of the estimate's range when above the estimate (the request covers it):
    # None for an exact estimate, or one sized from the workload's own runs.
    high_bytes: Optional[int] = None
    # Where the GPU model's jobs with a range land in it narrowed what the request covers:
    # why ('' when it did not; ``policy.range_position``).
    narrowed: str = ""

    def range_text(self) -> str:
        """Why the request is above the estimate's margin, for the Event ('' when it is not)."""
        if self.high_bytes is None or self.high_bytes <= self.estimate_bytes:
            return ""
        return (f"the request covers the estimate's high end {gib(self.high_bytes)} GiB "
                f"(+{gib(self.high_bytes - self.estimate_bytes)} GiB: what the estimate cannot "
                f"know without the GPU, such as the cuDNN plans its convolutions run and what cuDNN "
                f"holds outside the allocator)"
                + (f"; {self.narrowed}" if self.narrowed else ""))

    @property
    def judged_bytes(self) -> int:
        """What validation's floor is taken from: the lower of the estimate and the corrected
        one, so a request right-sizing lowered (or sized before a later run raised the
        correction) is never refused for it."""
        return min(self.estimate_bytes, self.corrected_bytes or self.estimate_bytes)

    @property
    def given_back_bytes(self) -> int:
        """Bytes per GPU that right-sizing took off the request E alone would get (0 if none)."""
        if self.uncorrected_request_bytes is None:
            return 0
        return max(0, self.uncorrected_request_bytes - self.request_bytes)

    def annotations(self) -> Dict[str, str]:
        """The pod-template annotations that carry this plan to Pod CREATE."""
        return {
            labels.REQUEST_BYTES: str(self.request_bytes),
            labels.GPU_MODEL: self.target.gpu.key,
            labels.ESTIMATE_BYTES: str(self.estimate_bytes),
        }


@functools.lru_cache(maxsize=256)
def _percent(value: float) -> Fraction:
    """A policy percentage as an exact fraction (cached: policies have a handful of them)."""
    return Fraction(value).limit_denominator(10_000) / 100


def size_request(estimate_bytes: int, settings: Settings, capacity_bytes: int,
                 high_bytes: Optional[int] = None) -> int:
    """The request per GPU for an estimate, under the policy's margin, overcommit and rounding.

    ``high_bytes``: the high end of the estimate's range (``xmem estimate``'s ``high_bytes``:
    each convolution at the largest workspace cuDNN's heuristics rank for it). The margin is
    taken on the estimate and the high end's excess over it added whole: a job whose estimate
    is exact pays only the margin, one whose workspaces the GPU picks pays for their range."""
    exact = Fraction(estimate_bytes) * (1 + _percent(settings.safety_margin_percent))
    if high_bytes is not None and high_bytes > estimate_bytes:
        exact += high_bytes - estimate_bytes
    exact *= 1 - _percent(settings.overcommit_percent)
    request = max(math.ceil(exact), settings.minimum_request_bytes)
    granularity = settings.granularity_bytes
    request = ceil_div(request, granularity) * granularity
    return min(request, capacity_bytes)


def floor_bytes(estimate_bytes: int, settings: Settings) -> int:
    """The lowest request the policy accepts for an estimate: E * (1 - overcommit)."""
    return math.floor(Fraction(estimate_bytes) * (1 - _percent(settings.overcommit_percent)))


def fits(estimate_bytes: int, gpu: gpus.GPU) -> bool:
    return estimate_bytes <= gpu.capacity_bytes


def pinned_gpu(annotations: object) -> Optional[str]:
    """The catalogue key a template pins with ``xmem.io/gpu-model``, if any and if known."""
    if not isinstance(annotations, dict):
        return None
    name = annotations.get(labels.GPU_MODEL)
    if not isinstance(name, str) or not name:
        return None
    try:
        return gpus.lookup(name).key
    except UnknownGPUError:
        return None


def plan(record: EstimateRecord, settings: Settings, pinned: Optional[str] = None,
         positions: Optional[Sequence[range_position.RangePosition]] = None) -> Optional[Plan]:
    """The plan for a record under a policy, or None when the estimate fits no target GPU.
    ``positions``: where jobs with a range land in it per GPU model, learned from finished
    runs (``policy.range_position``; None: the policy's, read from its status): the high end
    the request covers is narrowed to it."""
    if positions is None:
        positions = range_position.positions(settings.learned_overhead)
    candidates: List[Target] = list(settings.targets)
    if pinned is not None and settings.target(pinned) is not None:
        candidates = [t for t in candidates if t.gpu.key == pinned]
    for target in candidates:
        estimate = record.for_gpu(target.gpu.key)
        if estimate is None:
            continue
        fixed = right_sizing.correct(estimate.total_bytes, target.gpu.key, record.runs,
                                     settings.right_sizing) if record.runs else None
        high = estimate.high_bytes if (estimate.high_bytes or 0) > estimate.total_bytes else None
        if fixed is None or fixed.runs == 0:  # no run of its own: the overhead term counts
            total, term = overhead.corrected_total(estimate, settings.learned_overhead)
            if not fits(total, target.gpu):
                continue
            # the range's excess is the convolutions', outside the overhead term: it moves along
            covered, narrowed = (None, "") if high is None else range_position.narrowed_high(
                estimate.total_bytes, high, total + high - estimate.total_bytes, total,
                range_position.find(positions, target.gpu.key),
                settings.learned_overhead.max_correction_bytes)
            if term.source == overhead.CATALOGUE:
                request = size_request(estimate.total_bytes, settings,
                                       target.gpu.capacity_bytes, covered)
                return Plan(target, estimate.total_bytes, request, high_bytes=high,
                            narrowed=narrowed)
            sized = size_request(total, settings, target.gpu.capacity_bytes, covered)
            return Plan(target, estimate.total_bytes, sized, corrected_bytes=total,
                        overhead=term, high_bytes=high, narrowed=narrowed)
        if not fits(estimate.total_bytes, target.gpu):
            continue
        request = size_request(estimate.total_bytes, settings, target.gpu.capacity_bytes, high)
        if fixed.estimate_bytes == estimate.total_bytes:
            return Plan(target, estimate.total_bytes, request, high_bytes=high)
        corrected = size_request(fixed.estimate_bytes, settings, target.gpu.capacity_bytes)
        return Plan(target, estimate.total_bytes, corrected, request, fixed.reason,
                    fixed.estimate_bytes)
    return None


def covered(record: EstimateRecord, settings: Settings) -> bool:
    """Whether the record has an estimate for at least one target GPU of the policy."""
    return any(record.for_gpu(key) is not None for key in settings.gpu_keys)


def _needed(record: EstimateRecord, estimate: GPUEstimate, settings: Settings) -> int:
    """What ``plan`` holds against a GPU's capacity: the estimate, with the memory outside the
    allocator pinned or learned unless the workload's own runs size it."""
    if settings.right_sizing.runs > 0 and any(r.gpu == estimate.gpu for r in record.runs):
        return estimate.total_bytes
    return overhead.corrected_total(estimate, settings.learned_overhead)[0]


def misfit(record: EstimateRecord, settings: Settings) -> str:
    """Why an estimate fits no GPU of the policy, by how much, and what would fit."""
    shortfalls = []
    need = None
    for target in settings.targets:
        estimate = record.for_gpu(target.gpu.key)
        if estimate is None:
            continue
        total = _needed(record, estimate, settings)
        need = total if need is None else min(need, total)
        short = total - target.gpu.capacity_bytes
        shortfalls.append(
            f"{target.gpu.key} ({gib(target.gpu.capacity_bytes)} GiB) short by {gib(short)} GiB"
        )
    if need is None:
        return "the recorded estimate covers no GPU model of the policy"
    largest = max(t.gpu.capacity_bytes for t in settings.targets)
    cut = math.ceil(100 * (need - largest) / need)
    bigger = [g.key for g in gpus.all_gpus() if g.capacity_bytes >= need]
    alternatives = f"GPUs that would hold it: {', '.join(bigger)}; " if bigger else ""
    return (
        f"estimated {gib(need)} GiB per GPU fits no GPU of the policy: {'; '.join(shortfalls)}. "
        f"{alternatives}or cut per-GPU memory by at least {cut}% (smaller batch, activation "
        f"checkpointing, or more GPUs with sharded parameters and optimizer state)"
    )


def short_misfit(record: EstimateRecord, settings: Settings) -> str:
    """A one-line (< 120 characters) version of ``misfit`` for kubectl warnings."""
    need = min(
        (_needed(record, e, settings) for e in record.gpus if settings.target(e.gpu) is not None),
        default=0,
    )
    largest = max(t.gpu.capacity_bytes for t in settings.targets)
    return (
        f"xmem: estimate {gib(need)} GiB fits no policy GPU (largest {gib(largest)} GiB); "
        f"see {labels.FINGERPRINT}"
    )


__all__ = [
    "Plan", "covered", "fits", "floor_bytes", "misfit", "pinned_gpu", "plan",
    "short_misfit", "size_request",
]
