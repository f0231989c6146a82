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
    percent(gpu)  = the largest position of the window in whole percent, rounded up, once it
                    holds at least minJobs runs, kept within [0, 100]
    high'         = max(E, S) + percent/100 * (H - E), where S is the point the request is sized
                    from (E with the learned or pinned memory outside the allocator), never above
                    the high end the request covers without narrowing (H moved as E was: H + S - E)
                    nor more than maxCorrection below it; 100 narrows nothing

The share sits on the higher of E and S: positions are measured from E, so a negative learned
correction never also takes the share down, and a positive one is never undone. The request is
then the margin on S plus high' - S (``sizing.size_request``): never below S plus its margin.

The controller learns the positions and writes them on the policy's ``status.rangePositions``
(``controller.learned_overhead``); every reader of the policy, the webhook at CREATE and the
controller at release, reads them back with it (``policy.model.range_positions``), so both size a
workload alike. A status without them learned none: requests cover whole ranges.

Narrowing only ever lowers requests, the direction that fails jobs, so it takes the window's
largest position, not the learned overhead's quantile: every job of the window fits under the
narrowed high end, and one run that lands high gives the whole range back. On the xMem paper's
RTX 3060 convolution rows, a quantile of 0.9 learned on half of them put 1 and 2 of the other
half over their narrowed request; the largest position none
(``tests/policy/test_range_position.py``).

A position is never above 1: runs that land past the high end do not widen a range here (the
request would then exceed what the estimator says); they are counted (``RangePosition.above``)
and said in the plan's text, and the learned memory outside the allocator and right-sizing are
what raise such requests.

Trust, as in ``policy.overhead``: a tenant can forge its own runs, so whatever they say a
position moves any other tenant's request by at most maxCorrection, one namespace holds at most
jobsPerNamespace of a window, and lowering a position takes every run of the window (the
largest counts), raising it one. The status says how many namespaces a position came from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

from xmem_admission.cluster.kube.quantity import ceil_div, gib
from xmem_admission.cluster.policy.model import LearnedOverhead, RangePosition
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

    @property
    def percent(self) -> int:
        """The position in whole percent, rounded up (exact: integers)."""
        return ceil_div(100 * (self.observed_bytes - self.estimate_bytes),
                        self.high_bytes - self.estimate_bytes)


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
        percent = min(100, max(0, max(s.percent for s in kept)))
        out.append(RangePosition(gpu, percent, len(kept), len({s.namespace for s in kept}),
                                 sum(s.observed_bytes > s.high_bytes for s in kept)))
    return tuple(out)


def narrowed_high(estimate_bytes: int, high_bytes: int, covered_bytes: int, sized_bytes: int,
                  learned: Optional[RangePosition], bound_bytes: int) -> Tuple[int, str]:
    """The high end a request covers for an estimate E (``estimate_bytes``) with a range up to
    H (``high_bytes``), sized from ``sized_bytes`` (E, or E with the learned or pinned memory
    outside the allocator) and covering ``covered_bytes`` (H moved as E was) without narrowing:
    the learned share of the range on top of the higher of E and the point sized from, never
    above ``covered_bytes`` nor more than ``bound_bytes`` under it. Returns it and why ('' when
    unchanged)."""
    if learned is None or learned.percent >= 100 or covered_bytes <= sized_bytes:
        return covered_bytes, ""
    share = ceil_div(learned.percent * (high_bytes - estimate_bytes), 100)
    wanted = max(estimate_bytes, sized_bytes) + share
    high = min(covered_bytes, max(wanted, covered_bytes - bound_bytes))
    if high == covered_bytes:
        return covered_bytes, ""
    cut = ", cut to the policy's bound" if high > wanted else ""
    return high, (f"{learned.text()}: the request covers {gib(high)} GiB of the range's "
                  f"{gib(covered_bytes)} GiB{cut}")


def positions(settings: LearnedOverhead) -> Tuple[RangePosition, ...]:
    """The positions sizing narrows with: those learned, from the policy's status, unless
    learning is off."""
    return settings.positions if settings.enabled else ()


def find(positions: Sequence[RangePosition], gpu: str) -> Optional[RangePosition]:
    return next((p for p in positions if p.gpu == gpu), None)


def summary(positions: Sequence[RangePosition]) -> Dict[str, str]:
    """Per GPU model, one line for logs."""
    return {p.gpu: p.text() for p in positions}


__all__ = ["Landing", "RangePosition", "find", "landing", "learn", "narrowed_high", "positions",
           "summary"]
