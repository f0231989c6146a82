"""Where in its range a kind of job lands on a GPU model, learned from finished runs.

An estimate with a range (``xmem estimate``'s ``low_bytes``/``high_bytes``: the cuDNN plans its
convolutions may run, the spread of the memory outside the allocator) gets a request that covers
its high end: the margin on the point E plus the high end's excess H - E. A cluster sees where
jobs really land: each completed run's observed peak P (``controller.observed_peaks``) against
the estimate and range it was sized from gives its position in the range,

    position = (P - E) / (H - E)      (0: the point, 1: the high end; < 0 below the point)

The kind of job is what the record says of it: its GPU model, and that its estimate has a range
above its point (today, the jobs that run convolutions). Jobs of that kind land at similar
positions (the same GPU picks the same kinds of plans), so their positions tell how much of the
range the request needs to cover.

The rule, under the policy's ``spec.learnedOverhead`` (the same window, minimum and bound as the
learned memory outside the allocator, ``policy.overhead``):

    window(gpu)   = the newest recentJobs completed runs with a range on that GPU model, at most
                    jobsPerNamespace of them from any one namespace
    position(gpu) = the largest position of the window once it holds at least minJobs runs,
                    kept within [0, 1]
    high'         = max(E + position * (H - E), the point the request is sized from)
                    and never more than maxCorrection below H

Narrowing only ever lowers requests, the direction that fails jobs, so it takes the window's
largest position, not the learned overhead's quantile: every job of the window fits under the
narrowed high end, and one run that lands high gives the whole range back. On the xMem paper's
RTX 3060 convolution rows, a quantile of 0.9 learned on half of them put 1 and 2 of the other
half over their narrowed request; the largest position none
(``tests/policy/test_range_position.py``).

A position is never above 1: runs that land past the high end do not widen a range here (the
request would then exceed what the estimator says); they are counted (``RangePosition.above``)
and said in the plan's text, and the learned memory outside the allocator and right-sizing are
what raise such requests. A forged sample moves other tenants' requests by at most the bound,
as in ``policy.overhead``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.policy.model import LearnedOverhead
from xmem_admission.cluster.policy.overhead import window


@dataclass(frozen=True)
class Landing:
    """One completed run of a job whose estimate had a range: where its observed peak fell."""

    gpu: str  # catalogue key
    namespace: str
    estimate_bytes: int  # E, the point the run was sized from
    high_bytes: int  # H, the range's high end (> E)
    observed_bytes: int  # P, the run's observed peak
    finished: float  # Unix seconds: the newest count

    @property
    def position(self) -> float:
        return (self.observed_bytes - self.estimate_bytes) / (self.high_bytes - self.estimate_bytes)


@dataclass(frozen=True)
class RangePosition:
    """Where in their range the window's jobs with a range land on one GPU model."""

    gpu: str
    position: float  # the window's largest position, within [0, 1]
    jobs: int
    above: int  # of them, runs that landed above their high end

    def text(self) -> str:
        out = (f"jobs with a range on {self.gpu} landed at most {self.position:.0%} of the way to "
               f"its high end ({self.jobs} job(s))")
        if self.above:
            out += f"; {self.above} landed above it"
        return out


def landing(gpu: str, namespace: str, estimate_bytes: int, high_bytes: Optional[int],
            observed_bytes: int, finished: float) -> Optional[Landing]:
    """A run's landing, or None where its estimate had no range above the point."""
    if high_bytes is None or high_bytes <= estimate_bytes or estimate_bytes <= 0 \
            or observed_bytes <= 0:
        return None
    return Landing(gpu, namespace, estimate_bytes, high_bytes, observed_bytes, finished)


def learn(landings: Iterable[Landing], settings: LearnedOverhead) -> Tuple[RangePosition, ...]:
    """The position per GPU model (none when learning is off or too few jobs ran)."""
    if not settings.enabled:
        return ()
    out: List[RangePosition] = []
    for gpu, kept in sorted(window(landings, settings).items()):
        if len(kept) < settings.min_jobs:
            continue
        positions = [s.position for s in kept]
        learned = min(1.0, max(0.0, max(positions)))
        out.append(RangePosition(gpu, learned, len(kept), sum(p > 1.0 for p in positions)))
    return tuple(out)


def narrowed_high(estimate_bytes: int, high_bytes: int, sized_bytes: int,
                  learned: Optional[RangePosition], bound_bytes: int) -> Tuple[int, str]:
    """The high end a request covers for an estimate E (``estimate_bytes``) with a range up to
    H (``high_bytes``, already moved by any learned overhead), sized from ``sized_bytes`` (E or
    E corrected): where the GPU model's jobs land, never above H, below the point sized from,
    or more than ``bound_bytes`` under H. Returns it and why ('' when unchanged)."""
    if learned is None or high_bytes <= sized_bytes:
        return high_bytes, ""
    wanted = estimate_bytes + round(learned.position * (high_bytes - estimate_bytes))
    high = min(high_bytes, max(wanted, sized_bytes, high_bytes - bound_bytes))
    if high == high_bytes:
        return high_bytes, ""
    cut = ", cut to the policy's bound" if high > max(wanted, sized_bytes) else ""
    return high, (f"{learned.text()}: the request covers {gib(high)} GiB of the range's "
                  f"{gib(high_bytes)} GiB{cut}")


# What the controller learned last (``controller.learned_overhead``'s pass publishes it): its own
# sizing narrows with it. A process that learns nothing (the webhook's) covers whole ranges.
_published: Tuple[RangePosition, ...] = ()


def publish(positions: Tuple[RangePosition, ...]) -> bool:
    """Make ``positions`` the ones sizing uses in this process; True when they changed."""
    global _published
    changed = positions != _published
    _published = positions
    return changed


def published() -> Tuple[RangePosition, ...]:
    return _published


def find(positions: Sequence[RangePosition], gpu: str) -> Optional[RangePosition]:
    return next((p for p in positions if p.gpu == gpu), None)


def summary(positions: Sequence[RangePosition]) -> Dict[str, str]:
    """Per GPU model, one line for logs."""
    return {p.gpu: p.text() for p in positions}


__all__ = ["Landing", "RangePosition", "find", "landing", "learn", "narrowed_high", "publish",
           "published", "summary"]
