"""A sized workload's pod that ran out of GPU memory: record it, and size the next pod bigger.

The mechanism, end to end:

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
3. ``reconcile`` finds the workload xmem holds that the pod belongs to, walking its
   controlling owner references through the integrations (``integrations.held_owner``): a
   Job's pod, a PyTorchJob's, a JobSet's (pod -> Job -> JobSet) and a TrainJob's (pod -> Job
   -> JobSet -> TrainJob), each owner matched by uid. It takes the ``GPUMemoryEstimate`` of
   the program the pod runs (``estimate_of``: the workload's fingerprint, or, where its GPU
   templates run several programs, the estimation unit of the pod's template, told by the
   pod's role label: ``integrations.unit_of``) in the same namespace and the request the pod
   ran with (its ``xmem.io/request-bytes``, which only the webhook writes on
   a pod that reaches it: see ``admission.trust``), and records on the GME
   (``status.oomRetries``, an entry per workload, by uid) what the message says (asked for,
   allocated, reserved, in use), how many OOMs in a row, and what the next pod asks for:
   ``policy.retry.grow`` (the report's evidence plus the margin, growing geometrically on
   repeated OOMs, never past the policy's ``oomRetry.maxRequest`` nor the GPU's capacity; MIG:
   the next profile up), or the terminal reason when no larger request can help. An Event on
   the workload says which, and the metrics count it.
4. The webhook sizes the workload's next pod at Pod CREATE from that entry
   (``admission.mutation.grow_after_oom``), found by the uid of the pod's controlling owner:
   the workload's own, or, for a JobSet's or TrainJob's pod, the Job's, which the entry lists
   in ``podOwners``. The Job controller's replacement under ``backoffLimit``, a PyTorchJob's
   restart. A pod with ``restartPolicy: OnFailure`` (JobSet v0.12.0's default for its Jobs'
   pods, pkg/webhooks/jobset_webhook.go ``Default``) would restart its container in place, at
   the same size, without a new admission: the controller deletes it (by uid,
   ``REPLACE_AFTER`` after recording) so that its Job makes a new one. Neither Trainer v2.3.0
   nor JobSet v0.12.0 lets a running workload's pod templates change (a TrainJob's runtime
   patches only while suspended, a JobSet's templates only while suspended), so the grown
   request travels by the grant, not by the workload. A Job that JobSet makes anew (its
   ``failurePolicy`` restarting the JobSet) has a new uid: its first pod runs at the old size,
   and if it runs out of memory too its Job is added to ``podOwners`` without counting
   another OOM, so that its next pod gets the grant.

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

import copy
import enum
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from xmem_admission.cluster import labels
from xmem_admission.cluster.backends import dra
from xmem_admission.cluster.controller import dra_claims, records, trials
from xmem_admission.cluster.controller.context import Context
from xmem_admission.cluster.integrations import (
    HeldOwner,
    Integration,
    Lookup,
    Unit,
    estimation_units,
    held_owner,
    unit_of,
)
from xmem_admission.cluster.kube import quantity
from xmem_admission.cluster.kube.client import GME, Obj
from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.policy import retry, sizing
from xmem_admission.cluster.policy.model import BackendName, Settings, Target
from xmem_admission.contract import oom
from xmem_admission.contract.errors import InvalidObjectError, KubeApiError, QuantityError

log = logging.getLogger(__name__)

ON_FAILURE = "OnFailure"
# Seconds between recording an OnFailure pod's OOM and deleting the pod: its controller creates
# the replacement at once, and the webhook's cache of estimates (a watch, as the controller's)
# must hold the record by then; a restartPolicy Never pod's replacement waits out the Job
# controller's backoff (10 s at least) anyway.
REPLACE_AFTER = 1.0
# The pod owners an entry lists (``podOwners``): the newest are kept.
MAX_POD_OWNERS = 32


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


def pod_owners(entry: Optional[Dict[str, Any]], parts: Sequence[str]) -> List[str]:
    """The entry's ``podOwners`` with the pod's controlling owner (``parts[0]``, when the pod
    belongs to a part of the workload, a JobSet's Job) added."""
    known = [u for u in (entry or {}).get("podOwners") or [] if isinstance(u, str) and u]
    if parts and parts[0] not in known:
        known.append(parts[0])
    return known[-MAX_POD_OWNERS:]


def decide(entry: Optional[Dict[str, Any]], workload: Obj, pod: Obj, request_bytes: int,
           found: Failure, target: Target, settings: Settings, now: str,
           parts: Sequence[str] = ()) -> Decision:
    """The workload's entry after ``pod`` (which ran with ``request_bytes``) ran out of memory;
    ``parts``: the uids between the pod and the workload (``integrations.HeldOwner.parts``)."""
    m = pod["metadata"]
    if entry is not None and entry.get("podUID") == m.get("uid"):
        return Decision(None, None, False)  # this pod is counted already
    granted = entry.get("requestBytes") if entry is not None else None
    granted = granted if isinstance(granted, int) and not isinstance(granted, bool) else None
    if entry is not None and (entry.get("gaveUp") or
                              (granted is not None and request_bytes < granted)):
        owners = pod_owners(entry, parts)
        if not entry.get("gaveUp") and owners != (entry.get("podOwners") or []):
            # A Job made anew (a JobSet's restart) ran at the old size: its next pod gets the
            # grant, and this OOM is not one more in a row.
            return Decision(dict(entry, podOwners=owners), None, False)
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
    owners = pod_owners(entry, parts)
    if owners:
        new["podOwners"] = owners
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


def lookup(ctx: Context) -> Lookup:
    """How ``integrations.held_owner`` reads owners: the controller's caches of the kinds it
    handles, else the API (a part such as a JobSet's Job may not be cached), each object read
    once per lookup; None for a kind the controller does not handle or an object gone."""
    read: Dict[Tuple[str, str, str], Optional[Obj]] = {}

    def get(kind: str, namespace: str, name: str) -> Optional[Obj]:
        workload = ctx.workloads.get(kind)
        if workload is None:
            return None
        found = workload.informer.get(namespace, name)
        if found is not None:
            return found
        key = (kind, namespace, name)
        if key not in read:
            try:
                read[key] = ctx.kube.get(workload.kind, namespace, name)
            except KubeApiError as exc:
                if not exc.not_found:
                    raise
                read[key] = None
        return read[key]
    return get


def _workload(ctx: Context, pod: Obj) -> Optional[HeldOwner]:
    """The held workload the pod belongs to, when it is of a kind the controller handles."""
    return held_owner(pod, lookup(ctx))


@dataclass(frozen=True)
class Programs:
    """A workload's programs as the controller estimated them: ``units`` is empty when the
    workload is one program, recorded under its own fingerprint (``whole``)."""

    integration: Integration
    obj: Obj  # resolved when there are units
    whole: Optional[Obj]  # the GME of the workload's fingerprint, when it has one
    units: Tuple[Unit, ...] = ()


def programs(ctx: Context, integration: Integration, obj: Obj) -> Optional[Programs]:
    """The workload's estimate, or its estimation units (a workload whose GPU templates run
    several programs: ``integrations.estimation_units``, read with the namespace's settings
    and ConfigMap versions); None when neither can be read."""
    namespace = obj["metadata"].get("namespace", "")
    fp = (obj["metadata"].get("annotations") or {}).get(labels.FINGERPRINT)
    gme = ctx.estimates.get(namespace, records.name_for(fp)) if isinstance(fp, str) and fp \
        else None
    if gme is not None:
        return Programs(integration, obj, gme)
    settings = ctx.settings(namespace)
    if settings is None or not isinstance(fp, str) or not fp:
        return None
    try:
        resolved = integration.resolve(copy.deepcopy(obj), ctx.kube)
        units = estimation_units(integration, resolved, settings.gpu_keys,
                                 ctx.versions(namespace))
    except InvalidObjectError as exc:  # NotResolved among them: the runtime is gone
        log.info("%s %s/%s: its programs cannot be read: %s", integration.kind, namespace,
                 obj["metadata"].get("name"), exc)
        return None
    return Programs(integration, resolved, None, tuple(units)) if len(units) > 1 else None


def estimate_of(ctx: Context, found: Programs, pod: Obj) -> Optional[Obj]:
    """The ``GPUMemoryEstimate`` of the program ``pod`` runs (one of the workload's pods)."""
    if found.whole is not None:
        return found.whole
    unit = unit_of(found.integration, found.obj, found.units, pod)
    if unit is None:
        return None
    return ctx.estimates.get(found.obj["metadata"].get("namespace", ""),
                             records.name_for(unit.fingerprint))


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
    if found is None or request is None:
        return None  # not an OOM, or not sized by xmem
    owner = _workload(ctx, pod)
    if owner is None or owner.integration.kind not in ctx.workloads:
        return None  # not a held workload's pod
    kind, workload = owner.integration.kind, dict(owner.obj)
    known = programs(ctx, owner.integration, workload)
    gme = estimate_of(ctx, known, pod) if known is not None else None
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
                      records.stamp(ctx.now()), owner.parts)
    if isinstance(decision.outcome, retry.Retry) and target.backend is BackendName.DRA:
        # The retry pod's claim names the workload's template of the grown request: made here,
        # before the record that makes the webhook point a pod at it.
        if ctx.devices is not None and not ctx.devices.ready():
            return 1.0
        grown = decision.outcome.request_bytes
        integration = ctx.workloads[kind].integration
        templates_of = known.obj if known is not None and known.units else \
            integration.resolve(copy.deepcopy(workload), ctx.kube)
        why = dra_claims.make_templates(ctx.kube, ctx.devices, workload, dra_claims.retry_plans(
            integration, templates_of, settings, target.gpu.key, grown))
        if why:
            decision = unplaceable(decision, request, why)
        elif decision.entry is not None and target.dra is not None:
            decision.entry["claim"] = dra.claim_form(target.dra, target.gpu, grown)
    if decision.entry is not None:
        status = with_entry(dict(gme.get("status") or {}), decision.entry)
        status = trials.after_oom(ctx, gme, workload, status)  # shared: not neutral after all
        written = ctx.kube.replace_status(GME, records.with_status(gme, status, ctx.now()))
        ctx.estimates.put(written)
        entry = decision.entry
        if decision.counted:
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
