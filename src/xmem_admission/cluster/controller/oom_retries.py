"""A sized workload's pod that ran out of GPU memory: record it, and size the next pod bigger.

Issue 31. The mechanism, end to end:

1. At Pod CREATE the webhook gives a sized pod's GPU containers ``terminationMessagePolicy:
   FallbackToLogsOnError`` (``admission.mutation.fallback_to_logs``). PyTorch writes no
   termination message and HAMi-core prints its refusal on stderr, so when the container fails
   the kubelet puts the tail of its log (the last 80 lines, at most 2048 bytes) in
   ``state.terminated.message`` (``lastState`` once a restarted container runs again). The
   controller reads that from the pod's status: it never reads a log.
2. The controller watches the pods that carry the opt-in label (the webhook copies it into every
   sized workload's pod templates) and queues one whose container ended with a CUDA
   out-of-memory message (``contract.oom.read``: PyTorch's across releases, HAMi-core's, ``CUDA
   error: out of memory``; never an exit code, never a container the kubelet reports
   ``OOMKilled``, which is host memory).
3. ``reconcile`` finds the workload that controls the pod (a kind the controller handles, the
   same uid), the ``GPUMemoryEstimate`` of the workload's fingerprint in the same namespace and
   the request the pod ran with (its ``xmem.io/request-bytes``, which only the webhook writes on
   a pod that reaches it: see ``admission.trust``), and records on the GME
   (``status.oomRetries``, an entry per workload, by uid) what the message says (asked for,
   allocated, reserved, in use), how many OOMs in a row, and what the next pod asks for:
   ``policy.retry.grow`` (the report's evidence plus the margin, growing geometrically on
   repeated OOMs, never past the policy's ``oomRetry.maxRequest`` nor the GPU's capacity; MIG:
   the next profile up), or the terminal reason when no larger request can help. An Event on
   the workload says which, and the metrics count it.
4. The webhook sizes the workload's next pod at Pod CREATE from that entry
   (``admission.mutation.grow_after_oom``): the Job controller's replacement under
   ``backoffLimit``, a PyTorchJob's restart. A pod with ``restartPolicy: OnFailure`` would
   restart its container in place, at the same size, without a new admission: the controller
   deletes it (by uid, ``REPLACE_AFTER`` after recording) so that its controller makes a new
   one.

Which OOMs count: one pod once (the entry names the last pod counted); a pod whose request is
below the one already granted failed at an older size (pods running side by side, or created
before the retry was recorded) and adds no OOM in a row; after the terminal reason nothing is
counted and no pod is deleted, so the workload ends by its own ``backoffLimit``.

Trust: the message is written by the tenant's code, so it only ever sizes that workload, in its
own namespace (the grant is keyed by the workload's uid; ``estimateSharing`` never carries it to
another namespace), and only up to the policy's cap. ``status.oomRetries`` is writable by the
controller alone (the chart's ValidatingAdmissionPolicy on GPUMemoryEstimates).

Kueue (``docs/kueue.md``): Kueue admits a workload for the resources of its pod templates
(``nvidia.com/gpu``, cpu, memory); GPU memory is written into each pod at Pod CREATE by the
backend and is never part of a Kueue quota, so a retry's larger request changes nothing Kueue
reserved: the workload stays admitted, its pod asks for more memory of the same GPUs, and the
scheduler (with the device plugin's per-node resources) decides where it fits.
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from xmem_admission.cluster import labels
from xmem_admission.cluster.backends import dra
from xmem_admission.cluster.controller import dra_claims, records, trials
from xmem_admission.cluster.controller.context import Context
from xmem_admission.cluster.kube import quantity
from xmem_admission.cluster.kube.client import GME, Obj
from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.policy import retry, sizing
from xmem_admission.cluster.policy.model import BackendName, Settings, Target
from xmem_admission.contract import oom
from xmem_admission.contract.errors import QuantityError

log = logging.getLogger(__name__)

ON_FAILURE = "OnFailure"
# Seconds between recording an OnFailure pod's OOM and deleting the pod: its controller creates
# the replacement at once, and the webhook's cache of estimates (a watch, as the controller's)
# must hold the record by then; a restartPolicy Never pod's replacement waits out the Job
# controller's backoff (10 s at least) anyway.
REPLACE_AFTER = 1.0


class EventReason(str, enum.Enum):
    """The reasons of the Events the controller writes on the workload."""

    RETRY = "OutOfGPUMemory"  # a retry with a larger request follows
    GAVE_UP = "OutOfGPUMemoryGaveUp"  # no larger request can help: the terminal reason
    NOT_RETRIED = "OutOfGPUMemoryNotRetried"  # the policy's oomRetry is off for the namespace


@dataclass(frozen=True)
class Failure:
    """A container of a pod that ended with a CUDA out-of-memory report."""

    container: str
    report: oom.CudaOOM
    finished_at: str


def _terminations(status: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    for field in ("state", "lastState"):
        terminated = (status.get(field) or {}).get("terminated")
        if isinstance(terminated, dict):
            out.append(terminated)
    return out


def failure(pod: Obj) -> Optional[Failure]:
    """The first container of the pod whose termination message reports a CUDA OOM, or None."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    for status in statuses:
        if not isinstance(status, dict):
            continue
        for terminated in _terminations(status):
            message = terminated.get("message")
            report = oom.read(message if isinstance(message, str) else None,
                              terminated.get("reason"))
            if report is not None:
                return Failure(str(status.get("name", "")), report,
                               str(terminated.get("finishedAt") or ""))
    return None


def describe(report: oom.CudaOOM) -> str:
    """What the message says, in a few words, for Events."""
    parts = []
    for label, value in (("asked for", report.asked_bytes),
                         ("allocated by PyTorch", report.allocated_bytes),
                         ("reserved by PyTorch", report.reserved_bytes),
                         ("in use by the process", report.in_use_bytes),
                         ("HAMi usage + allocation", report.hami_requested_bytes)):
        if value is not None:
            parts.append(f"{gib(value)} GiB {label}")
    what = report.exception or report.source
    return f"{what}: {', '.join(parts)}" if parts else what


def _evidence(report: oom.CudaOOM, need: Optional[int]) -> Dict[str, Any]:
    out: Dict[str, Any] = {"source": report.source}
    if report.exception:
        out["exception"] = report.exception
    for key, value in (("askedBytes", report.asked_bytes),
                       ("allocatedBytes", report.allocated_bytes),
                       ("reservedBytes", report.reserved_bytes),
                       ("inUseBytes", report.in_use_bytes), ("needBytes", need)):
        if value is not None:
            out[key] = value
    return out


@dataclass(frozen=True)
class Decision:
    """What one OOM changes: the workload's new entry (None: nothing to record) and why."""

    entry: Optional[Dict[str, Any]]
    outcome: Union[retry.Retry, retry.GiveUp, None]  # None: recorded without a retry
    counted: bool  # a new OOM in a row (False: an older pod's, or already counted)


def decide(entry: Optional[Dict[str, Any]], workload: Obj, pod: Obj, request_bytes: int,
           found: Failure, target: Target, settings: Settings, now: str) -> Decision:
    """The workload's entry after ``pod`` (which ran with ``request_bytes``) ran out of memory."""
    m = pod["metadata"]
    if entry is not None and entry.get("podUID") == m.get("uid"):
        return Decision(None, None, False)  # this pod is counted already
    granted = entry.get("requestBytes") if entry is not None else None
    granted = granted if isinstance(granted, int) and not isinstance(granted, bool) else None
    if entry is not None and (entry.get("gaveUp") or
                              (granted is not None and request_bytes < granted)):
        return Decision(None, None, False)  # terminal, or a pod of an older size
    same = entry is not None and granted == request_bytes and entry.get("gpu") == target.gpu.key
    ooms = int(entry.get("ooms") or 0) + 1 if same and entry is not None else 1
    rule = retry.rule_for(settings)
    need = found.report.need_bytes(overhead_bytes=target.gpu.overhead_bytes)
    wm = workload["metadata"]
    new: Dict[str, Any] = {
        "workload": {"kind": workload.get("kind"), "name": wm["name"], "uid": wm["uid"]},
        "ooms": ooms, "pod": m["name"], "podUID": m.get("uid"), "container": found.container,
        "time": now, "gpu": target.gpu.key, "backend": target.backend.value,
        "failedRequestBytes": request_bytes, **_evidence(found.report, need),
    }
    outcome: Union[retry.Retry, retry.GiveUp, None]
    if not settings.oom_retry.enabled:
        outcome = None
        new["requestBytes"] = request_bytes
        new["message"] = (f"OOM at {gib(request_bytes)} GiB; not retried: oomRetry is off for "
                          f"this namespace")
    else:
        outcome = retry.grow(request_bytes, found.report, ooms, target, rule)
        if isinstance(outcome, retry.Retry):
            new["requestBytes"] = outcome.request_bytes
            if outcome.mig_profile:
                new["migProfile"] = outcome.mig_profile
        else:
            new["requestBytes"] = request_bytes
            new["gaveUp"] = outcome.reason
        new["message"] = outcome.reason
    return Decision(new, outcome, True)


def unplaceable(decision: Decision, request_bytes: int, why: str) -> Decision:
    """The decision when a retry's DRA claim could never be allocated: no device of the policy's
    DeviceClass holds the grown request (``dra_claims.DeviceView``). The workload ends with that
    reason, as at the retry cap, rather than with a retry pod whose claim waits forever; its
    next pod keeps the request that failed (``request_bytes``), whose template exists."""
    assert decision.entry is not None and isinstance(decision.outcome, retry.Retry)
    reason = (f"retry at {gib(decision.outcome.request_bytes)} GiB: no device of the policy's "
              f"DeviceClass holds it ({why})")
    entry = {k: v for k, v in decision.entry.items() if k not in ("migProfile", "claim")}
    entry.update(requestBytes=request_bytes, gaveUp=reason, message=reason)
    return Decision(entry, retry.GiveUp(reason), decision.counted)


def with_entry(status: Dict[str, Any], entry: Dict[str, Any]) -> Dict[str, Any]:
    """The status with the workload's entry replaced (the newest ``MAX_RETRY_ENTRIES`` kept)."""
    uid = entry["workload"]["uid"]
    kept = [e for e in records.retry_entries({"status": status})
            if e["workload"].get("uid") != uid]
    kept = (kept + [entry])[-records.MAX_RETRY_ENTRIES:]
    return dict(status, **{records.OOM_RETRIES: kept})


def _workload(ctx: Context, pod: Obj) -> Optional[Tuple[str, Obj]]:
    """The workload that controls the pod, when it is of a kind the controller handles."""
    namespace = pod["metadata"].get("namespace", "")
    for ref in pod["metadata"].get("ownerReferences") or []:
        if not isinstance(ref, dict) or ref.get("controller") is not True:
            continue
        kind = ref.get("kind")
        if kind not in ctx.workloads:
            return None
        obj = ctx.workloads[kind].informer.get(namespace, str(ref.get("name", "")))
        if obj is None or obj["metadata"].get("uid") != ref.get("uid"):
            return None
        return kind, obj
    return None


def _request(pod: Obj) -> Optional[int]:
    raw = ((pod["metadata"].get("annotations") or {}).get(labels.REQUEST_BYTES))
    try:
        value = quantity.parse_digits(raw)
    except QuantityError:
        return None
    return value if value > 0 else None


def _target(pod: Obj, settings: Settings) -> Target:
    pinned = sizing.pinned_gpu(pod["metadata"].get("annotations") or {})
    return (settings.target(pinned) if pinned else None) or settings.targets[0]


def reconcile(ctx: Context, namespace: str, name: str) -> Optional[float]:
    """One pass over a pod that may have run out of GPU memory; the delay to look again, or None."""
    if ctx.sized_pods is None:
        return None
    pod = ctx.sized_pods.get(namespace, name)
    if pod is None:
        return None
    found = failure(pod)
    request = _request(pod)
    owner = _workload(ctx, pod)
    if found is None or request is None or owner is None:
        return None  # not an OOM, not sized by xmem, or not a workload's pod
    kind, workload = owner
    fp = (workload["metadata"].get("annotations") or {}).get(labels.FINGERPRINT)
    gme = ctx.estimates.get(namespace, records.name_for(fp)) if isinstance(fp, str) else None
    if gme is None:
        log.info("pod %s/%s ran out of GPU memory, but no GPUMemoryEstimate sized it", namespace,
                 name)
        return None
    settings = ctx.settings(namespace)
    if settings is None:
        return 5.0
    target = _target(pod, settings)
    entry = records.retry_entry(gme, workload["metadata"]["uid"])
    decision = decide(entry, workload, pod, request, found, target, settings,
                      records.stamp(ctx.now()))
    if isinstance(decision.outcome, retry.Retry) and target.backend is BackendName.DRA:
        # The retry pod's claim names the workload's template of the grown request: made here,
        # before the record that makes the webhook point a pod at it (issue 40).
        if ctx.devices is not None and not ctx.devices.ready():
            return 1.0
        grown = decision.outcome.request_bytes
        why = dra_claims.make_templates(ctx.kube, ctx.devices, workload, dra_claims.retry_plans(
            ctx.workloads[kind].integration, workload, settings, target.gpu.key, grown))
        if why:
            decision = unplaceable(decision, request, why)
        elif decision.entry is not None and target.dra is not None:
            decision.entry["claim"] = dra.claim_form(target.dra, target.gpu, grown)
    if decision.entry is not None:
        status = with_entry(dict(gme.get("status") or {}), decision.entry)
        status = trials.after_oom(ctx, gme, workload, status)  # shared: not neutral after all
        written = ctx.kube.replace_status(GME, dict(gme, status=status))
        ctx.estimates.put(written)
        entry = decision.entry
        _report(ctx, workload, pod, found, decision)
    restarts_in_place = entry is not None and not entry.get("gaveUp") and \
        settings.oom_retry.enabled and pod["spec"].get("restartPolicy") == ON_FAILURE and \
        request < int(entry.get("requestBytes") or 0) and "deletionTimestamp" not in pod["metadata"]
    if not restarts_in_place:
        return None
    if decision.entry is not None:
        return REPLACE_AFTER  # the record reaches the webhook's cache before the new pod does
    # The kubelet would restart the container in this pod at the same size: a new pod is a new
    # admission, at the larger request.
    ctx.kube.delete_pod(namespace, name, pod["metadata"].get("uid"))
    log.info("deleted pod %s/%s (restartPolicy OnFailure) so that its retry is sized anew",
             namespace, name)
    return None


def _report(ctx: Context, workload: Obj, pod: Obj, found: Failure, decision: Decision) -> None:
    """The Event on the workload and the metrics, for an OOM just recorded."""
    target_backend = str((decision.entry or {}).get("backend", ""))
    source = found.report.source
    ctx.metrics.oom_caught.labels(source).inc()
    what = (f"xmem: pod {pod['metadata']['name']} ran out of GPU memory "
            f"({describe(found.report)})")
    outcome = decision.outcome
    if isinstance(outcome, retry.Retry):
        ctx.metrics.oom_retries.labels(target_backend).inc()
        ctx.emit(workload, "Warning", EventReason.RETRY.value,
                 f"{what}; its next pod is sized bigger: {outcome.reason}")
    elif isinstance(outcome, retry.GiveUp):
        ctx.metrics.oom_gave_up.labels(target_backend).inc()
        ctx.emit(workload, "Warning", EventReason.GAVE_UP.value,
                 f"{what}; no retry can help: {outcome.reason}")
    else:
        ctx.emit(workload, "Warning", EventReason.NOT_RETRIED.value,
                 f"{what}; its next pod keeps its request: the policy's oomRetry is off for "
                 f"namespace {pod['metadata'].get('namespace', '')}")
