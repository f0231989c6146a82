"""The request a workload's next pod gets after a pod ran out of GPU memory.

A pure function of the previous request, what the out-of-memory report says
(``contract.oom.CudaOOM``), how many times in a row the workload has run out, its target GPU
and backend, and the policy's numbers (``RetryRule``). The controller records the OOM and the
webhook sizes the next pod with it at Pod CREATE; both call here, so they cannot disagree.

The rule, with N the number of OOMs in a row (1 for the first), P the previous request, m the
safety margin, g the growth factor and need the report's evidence (``CudaOOM.need_bytes``: the
largest of the process's memory in use + what it asked for, PyTorch's reserved memory + what it
asked for + the memory the GPU model's process holds outside the allocator, HAMi's usage + the
refused allocation)::

    next = max(need * (1 + m), P * step), step = 1 + m  for a first OOM whose report has figures
                                           step = g      for a repeated OOM, or one without figures
    next = at least P + granularity and the policy's minimum, rounded up to the granularity,
           then at most the ceiling: the policy's retry cap, never above the GPU's capacity

A repeated OOM means the evidence of the last one was not enough (the failing allocation is
rarely the step's peak), so the request grows geometrically from there: after k repeated OOMs
it is at least P * g**k. Overcommit never lowers a retry: it sized the request that failed.

MIG (``MIGMixed``, ``MIGSingle``): a slice's memory is what the pod gets, so the next request
is the memory of the smallest profile (``gpus.smallest_mig_profile``) that holds ``next`` and is
larger than the previous request's profile: the next profile up at least. The ceiling is the
largest profile within the cap.

MIG as a DRA claim (``DRA`` with driver ``NvidiaMIG``): the same next profile, but the request
is ``next``, at least one granule above the previous profile's memory and never above the chosen
profile's, which selects that profile: the claim's CEL selector asks for a device whose
published ``memory`` is at least the request and below the next slice size
(``backends.dra.mig_bounds``), and the driver publishes a profile's memory in whole MiB
(dra-driver-nvidia-gpu cmd/gpu-kubelet-plugin/deviceinfo.go, MigDeviceInfo.GetDevice:
``giProfileInfo.MemorySizeMB*1024*1024``), which may differ from the catalogue's figure
(``mig -lgip``, to 0.01 GiB) by a few MiB: the lower the request within the slice, the safer.

The workload gets a terminal reason instead of a retry when the previous request already was
the ceiling (it ran out at the largest size it may have), when the evidence alone (before the
margin) is more than the ceiling, or when no larger MIG profile exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Union

from xmem_admission.cluster.kube.quantity import ceil_div, gib
from xmem_admission.cluster.policy.model import BackendName, DraDriver, Settings, Target
from xmem_admission.contract import gpus
from xmem_admission.contract.oom import CudaOOM

MIG_BACKENDS = (BackendName.MIG_MIXED, BackendName.MIG_SINGLE)


def mig_claim(target: Target) -> bool:
    """Whether the target's request is a DRA claim for a MIG device (see the module)."""
    return target.backend is BackendName.DRA and target.dra is not None and \
        target.dra.driver is DraDriver.NVIDIA_MIG


@dataclass(frozen=True)
class RetryRule:
    """The policy's numbers for sizing a retry."""

    safety_margin_percent: float
    growth_percent: float  # g = 1 + growth_percent / 100 for repeated OOMs
    granularity_bytes: int
    minimum_request_bytes: int = 0
    cap_bytes: Optional[int] = None  # the most a retry may ask for; None: the GPU's capacity

    def __post_init__(self) -> None:
        if self.growth_percent <= 0:
            raise ValueError(f"growth_percent must be positive, got {self.growth_percent}")
        if self.granularity_bytes <= 0:
            raise ValueError(f"granularity_bytes must be positive, got {self.granularity_bytes}")


def rule_for(settings: Settings) -> RetryRule:
    """A namespace's rule: its margin, granularity and minimum, and ``oomRetry``'s cap and growth."""
    return RetryRule(
        safety_margin_percent=settings.safety_margin_percent,
        growth_percent=settings.oom_retry.growth_percent,
        granularity_bytes=settings.granularity_bytes,
        minimum_request_bytes=settings.minimum_request_bytes,
        cap_bytes=settings.oom_retry.max_request_bytes,
    )


@dataclass(frozen=True)
class Retry:
    """The next pod's request, and how it was reached (the words of the workload's Event)."""

    request_bytes: int
    need_bytes: Optional[int]
    mig_profile: Optional[str]
    reason: str


@dataclass(frozen=True)
class GiveUp:
    """No larger request can help: the workload ends with this reason."""

    reason: str


def _fraction(percent: float) -> Fraction:
    return Fraction(percent).limit_denominator(10_000) / 100


def _ceiling(target: Target, rule: RetryRule) -> int:
    ceiling = target.gpu.capacity_bytes
    if rule.cap_bytes is not None:
        ceiling = min(ceiling, rule.cap_bytes)
    return ceiling


def _mig_ceiling(gpu: gpus.GPU, ceiling: int) -> Optional[gpus.MigProfile]:
    within = [p for p in gpu.mig_profiles if p.memory_bytes <= ceiling]
    if not within:
        return None
    return max(within, key=lambda p: (p.memory_bytes, -p.compute_slices))


def grow(
    previous_request_bytes: int,
    report: Optional[CudaOOM],
    ooms_in_a_row: int,
    target: Target,
    rule: RetryRule,
) -> Union[Retry, GiveUp]:
    """The next request after ``ooms_in_a_row`` OOMs (the last one at ``previous_request_bytes``)."""
    if previous_request_bytes <= 0:
        raise ValueError(f"previous_request_bytes must be positive, got {previous_request_bytes}")
    if ooms_in_a_row < 1:
        raise ValueError(f"ooms_in_a_row must be >= 1, got {ooms_in_a_row}")
    gpu = target.gpu
    mig = target.backend in MIG_BACKENDS or mig_claim(target)
    ceiling = _ceiling(target, rule)
    top: Optional[gpus.MigProfile] = None
    if mig:
        top = _mig_ceiling(gpu, ceiling)
        if top is None:
            return GiveUp(f"no MIG slice of {gpu.key} is within the retry cap of "
                          f"{gib(ceiling)} GiB")
        ceiling = top.memory_bytes
    at_most = f"the most a retry may ask for on {gpu.key} ({gib(ceiling)} GiB)"
    if previous_request_bytes >= ceiling:
        return GiveUp(f"ran out of GPU memory at {gib(previous_request_bytes)} GiB, {at_most}: "
                      "it does not fit; cut its per-GPU memory (smaller batch, activation "
                      "checkpointing, more GPUs with sharded state)")
    need = report.need_bytes(overhead_bytes=gpu.overhead_bytes) if report is not None else None
    if need is not None and need > ceiling:
        return GiveUp(f"ran out of GPU memory needing at least {gib(need)} GiB (its report), "
                      f"more than {at_most}")
    margin = 1 + _fraction(rule.safety_margin_percent)
    repeated = ooms_in_a_row > 1 or need is None
    step = 1 + _fraction(rule.growth_percent) if repeated else margin
    wanted = Fraction(previous_request_bytes) * step
    if need is not None:
        wanted = max(wanted, Fraction(need) * margin)
    request = max(math.ceil(wanted), previous_request_bytes + rule.granularity_bytes,
                  rule.minimum_request_bytes)
    request = min(ceil_div(request, rule.granularity_bytes) * rule.granularity_bytes, ceiling)
    how = (f"evidence {gib(need)} GiB + {rule.safety_margin_percent:g}% margin"
           if need is not None else "no figures in the report")
    if repeated:
        how += f", at least {step.numerator / step.denominator:g} x the last request"
        how += f" (OOM {ooms_in_a_row} in a row)" if ooms_in_a_row > 1 else ""
    profile_name: Optional[str] = None
    if mig:
        before = gpus.smallest_mig_profile(gpu, previous_request_bytes)
        floor = before.memory_bytes if before is not None else previous_request_bytes
        larger = [p for p in gpu.mig_profiles
                  if p.memory_bytes >= request and p.memory_bytes > floor
                  and p.memory_bytes <= ceiling]
        if not larger:
            return GiveUp(f"ran out of GPU memory in MIG slice {before.name if before else '?'} "
                          f"and no larger slice of {gpu.key} is within {at_most}")
        profile = min(larger, key=lambda p: (p.memory_bytes, p.compute_slices))
        if mig_claim(target):
            above = ceil_div(floor + 1, rule.granularity_bytes) * rule.granularity_bytes
            request = min(max(request, above), profile.memory_bytes)
        else:
            request = profile.memory_bytes
        profile_name = profile.name
        how += f"; MIG {profile.name}"
    capped = " (capped)" if request == ceiling else ""
    return Retry(request, need, profile_name,
                 f"OOM at {gib(previous_request_bytes)} GiB: retry at {gib(request)} GiB"
                 f"{capped} ({how})")


__all__ = ["GiveUp", "MIG_BACKENDS", "Retry", "RetryRule", "grow", "mig_claim", "rule_for"]
