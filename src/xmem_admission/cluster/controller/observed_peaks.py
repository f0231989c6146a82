"""A sized workload that finished: what became of its OOM retries, and what its pods used.

When a workload of a kind the controller handles ends (a Job's
``Complete`` or ``Failed`` condition, a PyTorchJob's ``Succeeded`` or ``Failed``) and the
``GPUMemoryEstimate`` of its fingerprint is in its namespace, one pass here:

1. its ``status.oomRetries`` entry, if its pods ran out of GPU memory, gets ``outcome``
   (``Completed`` or ``Failed``); a workload retried bigger that completed is an OOM avoided on
   the second try: ``xmem_controller_oom_avoided_total{backend}`` and an Event
   (``OutOfGPUMemoryAvoided``);
2. where the policy names a Prometheus (``spec.rightSizing.prometheus``), the peak its pods
   used per GPU over their lifetimes is read (``cluster.observations``: HAMi's per-container
   series, else DCGM's for a device or MIG slice the pod had alone; ``max_over_time``, so a
   spike shorter than a scrape interval's worth of samples counts) and recorded as a run in
   ``status.runs``: the GPU model, the estimate the request was sized from (the pod's
   ``xmem.io/estimate-bytes``, the estimator's figure), the request, whether it completed, the
   peak; ``kubectl get gme`` shows the newest peak as a percent of the estimate. The webhook
   sizes the next job of the fingerprint in the namespace from those runs
   (``policy.right_sizing``). For the memory outside the allocator
   (``controller.learned_overhead``) the run also carries the simulated reserved peak of the
   estimate it was sized from (``peakReservedBytes``) and the NVIDIA driver version it ran
   under (``driverVersion``: the ``DCGM_FI_DRIVER_VERSION`` label of DCGM's series for the
   device, ``cluster.observations``); then the learned figures are recomputed. The node's GPU
   Feature Discovery label ``nvidia.com/cuda.driver-version.full`` (NVIDIA k8s-device-plugin
   ``internal/lm/nvml.go`` at b9fe486d8b7c581e1b144ea31f0d6f6173668601, ``newVersionLabeler``)
   says the same, but the controller reads no Node (least privilege: tests/helm
   ``test_least_privilege``), so a run without DCGM series counts as driver ``unknown``.

Prometheus down, slow or refusing changes nothing: the reader logs a warning and counts the
failure (``xmem_controller_observed_peak_failures_total{reason}``), no run is written and the
workload is not looked at again by this controller (``Context.looked``). A run whose pods had no
series is written without a peak, so right-sizing skips it. Only pods that carry the request
xmem gave them (``xmem.io/request-bytes``: the webhook writes it at Pod CREATE) count.

Trust: the series are selected by the pod's namespace and name, the run sizes only the same
fingerprint in the same namespace (``policy.store.choose`` drops runs from shared estimates),
and ``status.runs`` is writable by the controller alone (the chart's ValidatingAdmissionPolicy).
"""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple

from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import records
from xmem_admission.cluster.controller.context import Context
from xmem_admission.cluster.controller.oom_retries import (
    Programs,
    estimate_of,
    lookup,
    programs,
    with_entry,
)
from xmem_admission.cluster.controller.workloads import ESTIMATE_NAME
from xmem_admission.cluster.integrations import gpu_templates, held_owner
from xmem_admission.cluster.kube import quantity
from xmem_admission.cluster.kube.client import GME, Obj
from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.observations import ObservedPeak, PodLifetime
from xmem_admission.cluster.policy import sizing
from xmem_admission.contract.errors import InvalidObjectError, QuantityError

log = logging.getLogger(__name__)

COMPLETED, FAILED = "Completed", "Failed"
AVOIDED = "OutOfGPUMemoryAvoided"  # the Event's reason
MAX_LOOKED = 100_000  # uids remembered as looked at; past it the set starts over (a few
# workloads are then looked at once more: a read, never a write without a figure)


def _gme(ctx: Context, obj: Obj) -> Optional[Obj]:
    fp = ((obj.get("metadata") or {}).get("annotations") or {}).get(labels.FINGERPRINT)
    if not isinstance(fp, str) or not fp:
        return None
    return ctx.estimates.get(obj["metadata"].get("namespace", ""), records.name_for(fp))


def _prometheus(ctx: Context) -> Any:
    policy = ctx.policy.current()
    return policy.prometheus if policy is not None else None


def wants(ctx: Context, kind: str, obj: Obj) -> bool:
    """Whether a workload has ended with something to record (cheap: caches only). A sized
    workload without an estimate under its own fingerprint runs several programs (one estimate
    each): looked at once (``ctx.looked``)."""
    if ctx.workloads[kind].integration.finished(obj) is None:
        return False
    gme = _gme(ctx, obj)
    uid = obj["metadata"].get("uid", "")
    if gme is None:
        annotations = (obj.get("metadata") or {}).get("annotations") or {}
        if uid in ctx.looked or labels.FINGERPRINT not in annotations or \
                labels.HELD_REASON in annotations:
            return False
        if ESTIMATE_NAME in annotations:  # released by the controller
            return True
        integration = ctx.workloads[kind].integration  # or sized at CREATE by the webhook
        try:
            return not integration.resolves and len(gpu_templates(integration, obj)) > 1
        except InvalidObjectError:
            return False
    entry = records.retry_entry(gme, uid)
    if entry is not None and "outcome" not in entry:
        return True
    return _prometheus(ctx) is not None and uid not in ctx.looked and \
        records.run_entry(gme, uid) is None


def _look(ctx: Context, uid: str) -> None:
    if len(ctx.looked) >= MAX_LOOKED:
        ctx.looked.clear()
    ctx.looked.add(uid)


def _bytes(annotations: Dict[str, Any], key: str) -> Optional[int]:
    try:
        value = quantity.parse_digits(annotations.get(key))
    except QuantityError:
        return None
    return value if value > 0 else None


def _pods(ctx: Context, obj: Obj) -> List[Obj]:
    """The workload's pods that xmem sized: the workload controls them, or controls what
    does (a JobSet's Jobs, a TrainJob's JobSet: ``integrations.held_owner``), by uid."""
    if ctx.sized_pods is None:
        return []
    uid = obj["metadata"].get("uid")
    namespace = obj["metadata"].get("namespace", "")
    read = lookup(ctx)

    def ours(pod: Obj) -> bool:
        m = pod["metadata"]
        if m.get("namespace") != namespace or \
                _bytes(m.get("annotations") or {}, labels.REQUEST_BYTES) is None:
            return False
        if any(isinstance(r, dict) and r.get("controller") is True and r.get("uid") == uid
               for r in m.get("ownerReferences") or []):
            return True
        owner = held_owner(pod, read)
        return owner is not None and (owner.obj.get("metadata") or {}).get("uid") == uid
    return ctx.sized_pods.find(ours)


def lifetime(pod: Obj, ended: float) -> Optional[PodLifetime]:
    """When a pod ran: from its start (creation when it never started) to its containers' last
    finish (``ended``, the workload's end, when the kubelet has not reported one)."""
    m, status = pod["metadata"], pod.get("status") or {}
    began = records.parse_time(status.get("startTime")) or \
        records.parse_time(m.get("creationTimestamp"))
    if began is None:
        return None
    finishes = []
    for item in status.get("containerStatuses") or []:
        for field in ("state", "lastState"):
            terminated = ((item or {}).get(field) or {}).get("terminated") or {}
            when = records.parse_time(terminated.get("finishedAt"))
            if when is not None:
                finishes.append(when.timestamp())
    finished = max(finishes) if finishes and status.get("phase") in ("Succeeded", "Failed") \
        else ended
    return PodLifetime(m.get("namespace", ""), m["name"], began.timestamp(),
                       max(finished, began.timestamp()))


def _reserved(gme: Obj, gpu: Optional[str], estimate: Optional[int]) -> Optional[int]:
    """The simulated reserved peak of the recorded estimate a run was sized from (the row of
    its GPU whose total is the run's estimate), or None."""
    for row in (gme.get("status") or {}).get("estimates") or []:
        if isinstance(row, dict) and row.get("gpu") == gpu and row.get("totalBytes") == estimate \
                and isinstance(row.get("peakReservedBytes"), int) and row["peakReservedBytes"] > 0:
            return int(row["peakReservedBytes"])
    return None


def _sizing(gme: Obj, pods: List[Obj]) -> Tuple[Optional[str], Optional[int], Optional[int]]:
    """(GPU model, estimate it was sized from, largest request) of the workload's pods."""
    gpu: Optional[str] = None
    estimate: Optional[int] = None
    request: Optional[int] = None
    for pod in pods:
        annotations = pod["metadata"].get("annotations") or {}
        gpu = sizing.pinned_gpu(annotations) or gpu
        estimate = _bytes(annotations, labels.ESTIMATE_BYTES) or estimate
        asked = _bytes(annotations, labels.REQUEST_BYTES)
        request = max(request or 0, asked or 0) or request
    if estimate is None and gpu is not None:  # a pod without the estimate: the recorded one
        for row in (gme.get("status") or {}).get("estimates") or []:
            if row.get("gpu") == gpu and isinstance(row.get("totalBytes"), int):
                estimate = row["totalBytes"]
    return gpu, estimate, request


def run_entry(obj: Obj, kind: str, completed: bool, gpu: Optional[str],
              estimate: Optional[int], request: Optional[int], pods: int,
              peak: Optional[ObservedPeak], finished: str, reserved: Optional[int] = None,
              driver: Optional[str] = None) -> Dict[str, Any]:
    """A ``status.runs`` entry."""
    m = obj["metadata"]
    entry: Dict[str, Any] = {"workload": {"kind": kind, "name": m["name"], "uid": m["uid"]},
                             "completed": completed, "finished": finished, "pods": pods}
    for key, value in (("gpu", gpu), ("estimateBytes", estimate), ("requestBytes", request),
                       ("peakReservedBytes", reserved), ("driverVersion", driver)):
        if value is not None:
            entry[key] = value
    if peak is not None:
        entry.update(observedPeakBytes=peak.peak_bytes, source=peak.source.value,
                     series=peak.series)
    return entry


def reconcile(ctx: Context, kind: str, namespace: str, name: str) -> Optional[float]:
    """One pass over a workload that may have ended; the delay to look again, or None. A
    workload of several programs gets a run (and its retries' outcome) on each program's
    estimate, from the pods of that program's templates."""
    workload = ctx.workloads[kind]
    obj = workload.informer.get(namespace, name)
    if obj is None or not wants(ctx, kind, obj):
        return None
    uid = obj["metadata"]["uid"]
    known = programs(ctx, workload.integration, obj)
    if known is None:
        _look(ctx, uid)  # no estimate to record against (said in the log when unreadable)
        return None
    completed = workload.integration.finished(obj) is True
    pods: Optional[List[Obj]] = None
    for gme, unit_pods in _by_estimate(ctx, known, obj):
        pods = _record(ctx, kind, obj, gme, completed, unit_pods, pods)
    if known.whole is None:
        _look(ctx, uid)  # several programs: looked at once
    return None


def _by_estimate(ctx: Context, known: Programs, obj: Obj) -> List[Tuple[Obj, Any]]:
    """(estimate, which of the workload's pods ran its program) per program: every pod for a
    workload of one program, else the pods whose template is in the unit
    (``oom_retries.estimate_of``)."""
    if known.whole is not None:
        return [(known.whole, None)]
    namespace = obj["metadata"].get("namespace", "")
    out: List[Tuple[Obj, Any]] = []
    for unit in known.units:
        gme = ctx.estimates.get(namespace, records.name_for(unit.fingerprint))
        if gme is None:
            continue
        name = gme["metadata"]["name"]
        out.append((gme, lambda pod, name=name: (estimate_of(ctx, known, pod) or {})
                    .get("metadata", {}).get("name") == name))
    return out


def _record(ctx: Context, kind: str, obj: Obj, gme: Obj, completed: bool, mine: Any,
            pods: Optional[List[Obj]]) -> Optional[List[Obj]]:
    """Record on one estimate the outcome of the workload's retry and the run of its pods
    (``mine``: which of them ran this estimate's program, None for all); returns the
    workload's sized pods once read (read at most once per reconcile)."""
    namespace, name = obj["metadata"].get("namespace", ""), obj["metadata"]["name"]
    uid = obj["metadata"]["uid"]
    status = dict(gme.get("status") or {})
    avoided: Optional[Dict[str, Any]] = None
    entry = records.retry_entry(gme, uid)
    if entry is not None and "outcome" not in entry:
        status = with_entry(status, dict(entry, outcome=COMPLETED if completed else FAILED))
        if completed and not entry.get("gaveUp") and \
                int(entry.get("requestBytes") or 0) > int(entry.get("failedRequestBytes") or 0):
            avoided = entry
    prometheus = _prometheus(ctx)
    if prometheus is not None and uid not in ctx.looked and records.run_entry(gme, uid) is None:
        if pods is None:
            pods = _pods(ctx, obj)
        ran = [p for p in pods if mine is None or mine(p)]
        ended = ctx.now().timestamp()
        lifetimes = [t for t in (lifetime(p, ended) for p in ran) if t is not None]
        if not lifetimes:
            log.info("%s %s/%s ended with no pod sized by xmem left to observe (estimate %s)",
                     kind, namespace, name, gme["metadata"]["name"])
            if mine is None:
                _look(ctx, uid)
        else:
            peak, failure = ctx.peak_reader(prometheus).observe(lifetimes)
            if failure is not None:
                _look(ctx, uid)  # the reader warned and counted it; nothing else changes
            else:
                gpu, estimate, request = _sizing(gme, ran)
                driver = peak.driver_version if peak is not None else None
                status = records.with_run(status, run_entry(
                    obj, kind, completed, gpu, estimate, request, len(lifetimes), peak,
                    records.stamp(ctx.now()), _reserved(gme, gpu, estimate), driver))
                if peak is not None and completed:
                    ctx.queue.add(("overhead",), 1.0)  # after the write below lands
                if peak is not None:
                    percent = records.observed_percent(peak.peak_bytes, estimate or 0)
                    log.info("%s %s/%s used %s GiB per GPU at its peak (%s, %s%% of its "
                             "estimate %s)", kind, namespace, name, gib(peak.peak_bytes),
                             peak.source.value, "?" if percent is None else percent,
                             gme["metadata"]["name"])
    if status == (gme.get("status") or {}):
        return pods
    written = ctx.kube.replace_status(GME, records.with_status(gme, status, ctx.now()))
    ctx.estimates.put(written)
    if avoided is not None:
        ctx.metrics.oom_avoided.labels(str(avoided.get("backend", ""))).inc()
        ctx.emit(obj, "Normal", AVOIDED,
                 f"xmem: completed after {avoided.get('ooms')} CUDA out-of-memory failure(s), "
                 f"with the retry's request of {gib(int(avoided['requestBytes']))} GiB "
                 f"(the failed one: {gib(int(avoided['failedRequestBytes']))} GiB)")
    return pods
