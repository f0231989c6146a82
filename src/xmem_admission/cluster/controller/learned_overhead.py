"""The memory outside the allocator, learned from every namespace's finished runs.

One pass (queue key ``("overhead",)``: after a completed run with an observed peak is recorded,
and at every resync) reads the runs of every ``GPUMemoryEstimate`` in the controller's cache,
turns each completed run that carries its observed peak, the simulated reserved peak of its
estimate and its GPU model into a sample (``policy.overhead.Sample``: observed minus reserved,
per driver version), learns the figures under the policy's ``spec.learnedOverhead``
(``policy.overhead.learn``), publishes them as ``xmem_controller_learned_overhead_bytes`` and
``..._jobs`` per GPU model and driver, and, when they changed, writes them on the policy's
``status.learnedOverhead`` (the status subresource: only the controller writes it). The webhook
and this controller read them back with the policy (``policy.model.overhead_figures``) and
``sizing.plan`` applies them to new estimates. The same pass learns where in their range the
jobs with one land per GPU model (``policy.range_position``) and writes it, with the figures, on
the policy's ``status.rangePositions``: every reader narrows with it from there
(``policy.model.range_positions``).

Samples cross namespaces on purpose: what a GPU model and driver keep outside the allocator is a
fact of the hardware and driver, not of a tenant. How that stays safe when a tenant forges its
own samples is ``policy.overhead``'s docstring (bounded effect, a per-namespace share of the
window, a high quantile).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional, Tuple

from xmem_admission.cluster.controller import records
from xmem_admission.cluster.controller.context import Context
from xmem_admission.cluster.kube.client import POLICY
from xmem_admission.cluster.policy import range_position
from xmem_admission.cluster.policy.model import OverheadFigure, RangePosition
from xmem_admission.cluster.policy.overhead import UNKNOWN_DRIVER, Sample, describe, learn
from xmem_admission.contract.errors import KubeApiError

log = logging.getLogger(__name__)
# per policy name: said once, not per pass
_unwritten: Dict[str, Tuple[Tuple[OverheadFigure, ...], Tuple[RangePosition, ...]]] = {}


def _count(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def samples(ctx: Context) -> List[Sample]:
    """Every recorded completed run that says what it used outside the allocator."""
    out: List[Sample] = []
    for gme in ctx.estimates.items():
        namespace = gme["metadata"].get("namespace", "")
        for entry in records.run_entries(gme):
            gpu = entry.get("gpu")
            peak = _count(entry.get("observedPeakBytes"))
            reserved = _count(entry.get("peakReservedBytes"))
            finished = records.parse_time(entry.get("finished"))
            if entry.get("completed") is not True or not isinstance(gpu, str) or \
                    peak is None or reserved is None or finished is None:
                continue
            driver = entry.get("driverVersion")
            out.append(Sample(gpu, driver if isinstance(driver, str) and driver
                              else UNKNOWN_DRIVER, namespace, peak - reserved,
                              finished.timestamp()))
    return out


def landings(gmes: Iterable[Dict[str, Any]]) -> List[range_position.Landing]:
    """Every recorded completed run (of the ``GPUMemoryEstimate`` objects ``gmes``) whose
    estimate had a range above its point on the run's GPU (the GME's ``estimates`` entry for
    it, the same point the run was sized from)."""
    out: List[range_position.Landing] = []
    for gme in gmes:
        namespace = gme["metadata"].get("namespace", "")
        ranges = {e.get("gpu"): e for e in (gme.get("status") or {}).get("estimates") or []
                  if isinstance(e, dict)}
        for entry in records.run_entries(gme):
            estimate = ranges.get(entry.get("gpu"))
            peak, point = _count(entry.get("observedPeakBytes")), _count(entry.get("estimateBytes"))
            finished = records.parse_time(entry.get("finished"))
            if entry.get("completed") is not True or estimate is None or peak is None or \
                    point is None or finished is None or estimate.get("totalBytes") != point:
                continue
            found = range_position.landing(entry["gpu"], namespace, point,
                                           _count(estimate.get("highBytes")), peak,
                                           finished.timestamp())
            if found is not None:
                out.append(found)
    return out


def status_entries(figures: Tuple[OverheadFigure, ...]) -> List[Dict[str, Any]]:
    """The policy's ``status.learnedOverhead``."""
    return [{"gpu": f.gpu, "driverVersion": f.driver, "outsideAllocatorBytes": f.outside_bytes,
             "outsideAllocator": records.human(f.outside_bytes), "jobs": f.jobs,
             "namespaces": f.namespaces} for f in figures]


def position_entries(positions: Tuple[RangePosition, ...]) -> List[Dict[str, Any]]:
    """The policy's ``status.rangePositions`` (``api.RangePositionStatus``)."""
    return [{"gpu": p.gpu, "positionPercent": p.percent, "jobs": p.jobs,
             "namespaces": p.namespaces, "above": p.above} for p in positions]


def summary(figures: Tuple[OverheadFigure, ...], positions: Tuple[RangePosition, ...] = ()) -> str:
    """The ``kubectl get gap`` column: ``H200/580.159.04 770Mi (7 jobs); H200 range 30% (5
    jobs)``."""
    text = "; ".join([f"{f.gpu}/{f.driver} {round(f.outside_bytes / (1 << 20))}Mi "
                      f"({f.jobs} jobs)" for f in figures]
                     + [f"{p.gpu} range {p.percent}% ({p.jobs} jobs)" for p in positions])
    return text[:500] or "none yet"


def reconcile(ctx: Context) -> Optional[float]:
    """Learn, publish, and write the figures and positions on the policy when they changed."""
    policy = ctx.policy.current()
    if policy is None:
        return None
    settings = policy.learned_overhead
    positions = range_position.learn(landings(ctx.estimates.items()), settings)
    figures = learn(samples(ctx), settings)
    ctx.metrics.set_overhead((f.gpu, f.driver, f.outside_bytes, f.jobs) for f in figures)
    if figures == settings.figures and positions == settings.positions:
        return None
    try:
        obj = ctx.kube.get_cluster(POLICY, policy.name)
    except KubeApiError as exc:
        if exc.not_found:  # a policy from a file (``--policy``): nothing to write it on
            if _unwritten.get(policy.name) != (figures, positions):
                log.info("learned overhead not written: no GPUAdmissionPolicy %r (%s)",
                         policy.name, "; ".join([describe(f) for f in figures]
                                                + [p.text() for p in positions]) or "none")
                _unwritten[policy.name] = (figures, positions)
            return None
        raise
    status = dict(obj.get("status") or {}, learnedOverhead=status_entries(figures),
                  rangePositions=position_entries(positions), learned=summary(figures, positions),
                  learnedAt=records.stamp(ctx.now()))
    ctx.kube.replace_cluster_status(POLICY, dict(obj, status=status))
    for figure in figures:
        log.info("learned: %s", describe(figure))
    for gpu, text in range_position.summary(positions).items():
        log.info("learned for %s: %s", gpu, text)
    ctx.policy.refresh()  # the controller's own sizing uses them from now on
    return None
