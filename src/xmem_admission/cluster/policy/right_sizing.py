"""A repeat job's estimate, corrected by what its earlier runs used.

A repeat job is one with the same fingerprint in the same namespace (estimates never cross
namespaces here, whatever ``estimateSharing`` says: the peaks were produced by that namespace's
own code). When one of its runs finishes, the controller records the peak its pods used per GPU
(``cluster.observations``: HAMi's per-container series, or DCGM's for a GPU the pod had alone)
next to the estimate that sized it. The next run's estimate E for a GPU model is then corrected
by the runs on that model, the policy's ``spec.rightSizing`` setting the bounds:

    counted  = the latest ``runs`` runs on the same GPU model with a peak (runs: 0 turns it off)
    ratio    = max over counted of peak / the estimate that run was sized from
    corrected = E * ratio   when ratio > 1 (a run used more than estimated: always raised)
              = E * ratio   when ratio < 1, lowerRequests is true and every counted run
                            completed (a run cut short may have stopped before its peak)
              = E           otherwise

A ratio rather than the peak itself, so a new estimator release or catalogue (a different E for
the same job) keeps the correction proportional; the maximum rather than a mean, because a
request below any run's peak is an OOM waiting to happen under enforcement. The corrected
estimate goes through ``sizing.size_request`` like any other (margin, granularity, minimum,
never above the GPU's capacity).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.policy.model import RightSizing
from xmem_admission.cluster.policy.store import Run  # one earlier run, as the record carries it


@dataclass(frozen=True)
class Correction:
    """The estimate a repeat job is sized from, and how it was reached."""

    estimate_bytes: int
    ratio: Fraction  # corrected / original (1: unchanged)
    runs: int  # runs counted
    reason: str


def correct(estimate_bytes: int, gpu: str, runs: Sequence[Run],
            settings: RightSizing) -> Correction:
    """``estimate_bytes`` (for GPU model ``gpu``) corrected by the latest earlier runs."""
    if estimate_bytes <= 0:
        raise ValueError(f"estimate_bytes must be positive, got {estimate_bytes}")
    if settings.runs == 0:
        return Correction(estimate_bytes, Fraction(1), 0, "right-sizing is off (runs: 0)")
    usable = [r for r in runs if r.gpu == gpu and r.peak_bytes > 0 and r.estimate_bytes > 0]
    counted = sorted(usable, key=lambda r: r.finished, reverse=True)[:settings.runs]
    if not counted:
        return Correction(estimate_bytes, Fraction(1), 0, f"no earlier run on {gpu} with an "
                          "observed peak")
    ratio = max(Fraction(r.peak_bytes, r.estimate_bytes) for r in counted)
    used = f"{len(counted)} earlier run(s) on {gpu} used up to {float(ratio):.2f} x their estimate"
    if ratio < 1 and not settings.lower_requests:
        return Correction(estimate_bytes, Fraction(1), len(counted),
                          f"{used}; lowerRequests is false: kept")
    if ratio < 1 and not all(r.completed for r in counted):
        return Correction(estimate_bytes, Fraction(1), len(counted),
                          f"{used}; not every one completed: kept")
    corrected = math.ceil(estimate_bytes * ratio)
    if corrected == estimate_bytes:
        return Correction(estimate_bytes, Fraction(1), len(counted), f"{used}: kept")
    verb = "raised" if corrected > estimate_bytes else "lowered"
    return Correction(corrected, ratio, len(counted),
                      f"{used}: {verb} from {gib(estimate_bytes)} to {gib(corrected)} GiB")


__all__ = ["Correction", "Run", "correct"]
