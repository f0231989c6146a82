"""Reconcile one held workload: see it estimated, then release it, whatever happens.

A workload is ours while it carries ``xmem.io/held-reason`` (the webhook's hold). Each pass:

1. gone, or unsuspended by someone else meanwhile: nothing to hold (the hold annotations are
   removed from a workload released behind our back, with an Event);
2. the steps the Kueue AdmissionCheck takes too (``gate``): the policy, the workload as its
   integration reads it, its fingerprint and its ``GPUMemoryEstimate``s (created or joined,
   owned by no workload: ``estimate_cache``; a stale one estimated again); a fingerprint that
   changed while held (an edit, or a policy whose target GPUs changed) is written back and
   estimation follows the new one;
3. succeeded: every GPU pod template gets the sizing annotations (``xmem.io/request-bytes`` and
   friends, allowed while a Job is suspended), the hold annotations go, the workload is
   unsuspended (unless its owner had suspended it), in one update with the resourceVersion read,
   and an Event says what was estimated and what will be requested;
4. failed (for this hold), or ``maxHoldSeconds`` passed: the policy's ``onEstimationFailure``:
   ``Release`` unchanged, ``Default`` request, or ``Hold`` (until ``maxHoldSeconds``, then
   released unchanged), with a Warning Event quoting why (and the script's last log lines).

A TrainJob's pod templates are resolved from its runtime at each pass (``gate``, through the
controller's API client); a runtime that cannot be read is waited for, up to ``maxHoldSeconds``
(then ``RuntimeNotResolved``, the policy's onEstimationFailure). Its sizing goes into the
controller's own runtime patch (``integrations.trainjob``), with the opt-in label, in the update
that releases it; every write goes through ``Integration.unresolved``.

An estimate that fits no GPU of the policy is a failure (``FitsNoGPU``) with the misfit message.
Every write carries the resourceVersion it was computed from: a 409 starts the pass over.
"""

from __future__ import annotations

import copy
import datetime
import logging
from typing import Any, Dict, List, Optional, Tuple

from xmem_admission.cluster import backends, labels
from xmem_admission.cluster.controller import dra_claims, estimate_cache, gate, records
from xmem_admission.cluster.controller.context import Context, Workload
from xmem_admission.cluster.controller.gate import Hold, annotations_of
from xmem_admission.cluster.integrations import TemplateRef, gpu_templates
from xmem_admission.cluster.kube.client import Obj
from xmem_admission.cluster.kube.jsonpatch import Draft
from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.policy import sizing
from xmem_admission.cluster.policy.model import DraFallback, FailureAction
from xmem_admission.cluster.policy.sizing import Plan
from xmem_admission.contract.errors import InvalidObjectError

log = logging.getLogger(__name__)

ESTIMATE_NAME = "xmem.io/estimate-name"  # on released workloads: which GME sized them
DEVICE_RECHECK = 10.0  # seconds between looks at a held workload's DRA class (fallback Hold)


def is_held(obj: Obj) -> bool:
    return labels.HELD_REASON in annotations_of(obj)


def held_since(obj: Obj) -> datetime.datetime:
    """When the hold began: the workload's creation (the webhook holds at CREATE), a time the
    API server stamps; the ``held-since`` annotation is the user's to write, so it only stands
    in when there is no creation time."""
    when = records.parse_time(obj["metadata"].get("creationTimestamp"))
    return when or records.parse_time(annotations_of(obj).get(labels.HELD_SINCE)) or \
        datetime.datetime.now(datetime.timezone.utc)


def _annotate(obj: Obj, path: Tuple[Any, ...], values: Dict[str, str],
              opt_in: bool = False) -> None:
    """Add annotations to the pod template at ``path`` (and the opt-in label, for a kind whose
    templates the webhook never wrote: a TrainJob's)."""
    node = obj
    for part in path:
        node = node[part]
    node.setdefault("metadata", {}).setdefault("annotations", {}).update(values)
    if opt_in:
        node["metadata"].setdefault("labels", {})[labels.OPT_IN] = labels.OPT_IN_VALUE


def _released(workload: Workload, obj: Obj) -> Obj:
    """A copy of the workload without our hold: annotations gone, unsuspended unless the owner
    had suspended it."""
    out = copy.deepcopy(obj)
    ann = out["metadata"].setdefault("annotations", {})
    user_suspended = ann.get(labels.USER_SUSPENDED) == "true"
    for key in labels.HELD_ANNOTATIONS:
        ann.pop(key, None)
    if user_suspended:
        return out
    draft = Draft(out)
    workload.integration.unsuspend(draft)
    return draft.root


def _write(ctx: Context, workload: Workload, obj: Obj) -> Obj:
    written = ctx.kube.replace(workload.kind, workload.integration.unresolved(obj))
    workload.informer.put(written)
    return written


def reconcile(ctx: Context, kind: str, namespace: str, name: str) -> Optional[float]:
    """One pass over a workload; returns the delay after which to look again, or None."""
    workload = ctx.workloads[kind]
    obj = workload.informer.get(namespace, name)
    if obj is None or "deletionTimestamp" in obj["metadata"] or not is_held(obj):
        return None
    if not workload.integration.is_suspended(obj):
        _write(ctx, workload, _released(workload, obj))
        ctx.emit(obj, "Normal", "ReleasedElsewhere", "xmem: the workload was unsuspended before "
                 "its GPU memory was estimated; it runs with the request it has")
        ctx.metrics.released.labels(kind, "external").inc()
        return None
    hold = Hold.of(ctx, namespace, held_since(obj))
    decision = gate.decide(ctx, workload, obj, hold, held=True)
    if isinstance(decision, gate.Wait):
        return decision.seconds
    if isinstance(decision, gate.Disabled):
        return _fail(ctx, workload, obj, hold, "PolicyDisabled", "the policy for this "
                     "namespace is disabled", timed_out=True)
    if isinstance(decision, gate.NoGpu):
        return _fail(ctx, workload, decision.obj, hold, "NoGPU", "the workload no longer "
                     "requests a GPU", timed_out=True)
    if isinstance(decision, gate.Changed):
        new = copy.deepcopy(decision.obj)
        new["metadata"].setdefault("annotations", {})[labels.FINGERPRINT] = decision.fingerprint
        _write(ctx, workload, new)
        if decision.old:
            ctx.emit(decision.obj, "Normal", "WorkloadChanged", f"xmem: the workload changed "
                     f"while held (fingerprint {decision.old[:12]} -> "
                     f"{decision.fingerprint[:12]}); estimating the new version")
        return 0.05
    if isinstance(decision, gate.Failed):
        return _fail(ctx, workload, decision.obj, hold, decision.reason, decision.message,
                     timed_out=decision.timed_out)
    if isinstance(decision, gate.Misfit):
        return _fail(ctx, workload, decision.obj, hold, "FitsNoGPU", decision.message)
    if isinstance(decision, gate.Estimated):
        return _release_estimated(ctx, workload, decision, hold)
    assert isinstance(decision, gate.Estimating), decision  # Exempt: only a queued job's
    obj = decision.obj
    if annotations_of(obj).get(labels.HELD_REASON) == labels.HeldReason.AWAITING_ESTIMATE.value:
        new = copy.deepcopy(obj)
        new["metadata"]["annotations"][labels.HELD_REASON] = labels.HeldReason.ESTIMATING.value
        _write(ctx, workload, new)
    return hold.left(ctx.now())


def _requests(draft_obj: Obj, workload: Workload, plans: List[Optional[Plan]]) -> List[str]:
    """What each backend will write at Pod CREATE, for the Event (computed on a draft of each
    template on its own: a TrainJob's are resolved, not where they are addressed)."""
    out: List[str] = []
    for (ref, containers), plan in zip(gpu_templates(workload.integration, draft_obj), plans):
        if plan is None:
            continue
        alone = TemplateRef(ref.role, (), ref.template)
        applied = backends.for_target(plan.target).apply(
            Draft(dict(ref.template)), alone, containers, plan.request_bytes, plan.target.gpu)
        out.extend(applied.written or [f"{labels.REQUEST_BYTES} {plan.request_bytes}"])
    return list(dict.fromkeys(out))


def _release_estimated(ctx: Context, workload: Workload, estimated: gate.Estimated,
                       hold: Hold) -> Optional[float]:
    obj, gmes, plans = estimated.obj, estimated.gmes, estimated.plans
    gme = gmes[0]
    new = _released(workload, obj)
    if ctx.devices is not None and not ctx.devices.ready() and ctx.now() < hold.deadline and \
            dra_claims.dra_plans(workload.integration, obj, plans):
        return 1.0  # the DRA devices are not listed yet: judge them once they are
    unsatisfiable = dra_claims.prepare(ctx.kube, ctx.devices, workload.integration, obj, plans)
    if unsatisfiable:
        return _no_device(ctx, workload, obj, hold, unsatisfiable)
    # Satisfiable, but a claim that takes a whole device shares it with no other: said, not held.
    whole = dra_claims.exclusive(ctx.devices, dra_claims.dra_plans(workload.integration, obj,
                                                                   plans))
    new["metadata"]["annotations"].pop(dra_claims.UNSATISFIABLE, None)  # a device appeared
    for (ref, _containers), plan in zip(gpu_templates(workload.integration, new), plans):
        if plan is not None:
            _annotate(new, ref.path, plan.annotations(), workload.integration.resolves)
    new["metadata"]["annotations"][ESTIMATE_NAME] = gme["metadata"]["name"]
    requesting = _requests(new, workload, plans)
    _write(ctx, workload, new)
    # Counted at the write, which is the release; the Event after it is best effort.
    ctx.metrics.released.labels(workload.kind.kind, "estimated").inc()
    estimate_cache.used(ctx, gmes)
    chosen = next((p for p in plans if p is not None), None)
    if chosen is not None:
        message = (f"estimated {gib(chosen.estimate_bytes)} GiB peak on {chosen.target.gpu.key}; "
                   f"requesting {', '.join(requesting)}")
        if chosen.overhead is not None:
            message += f"; {chosen.overhead.text()}"
        if chosen.range_text():
            message += f"; {chosen.range_text()}"
    else:
        message = "GPU memory estimated; the pod templates already carry a request"
    largest = ((gme.get("status") or {}).get("peak") or {}).get("largest")
    if largest:
        message += f"; largest at the peak: {largest}"
    if labels.USER_SUSPENDED in annotations_of(obj):
        message += " (left suspended, as its owner had it)"
    ctx.emit(obj, "Normal", "Estimated", f"xmem: {message}")
    for note in whole:
        ctx.emit(obj, "Warning", dra_claims.WHOLE_DEVICE, f"xmem: {note}; released with its "
                 f"claim, each pod's claim on a device of its own")
    return None


def _no_device(ctx: Context, workload: Workload, obj: Obj, hold: Hold,
               why: str) -> Optional[float]:
    """No device of the policy's DeviceClass could ever hold the claim (``dra_claims``): the
    workload is not released with it. ``spec.dra.fallback`` Hold keeps it held (until
    maxHoldSeconds), Release releases it as written (its GPU pod templates carry the annotation
    too, so the webhook leaves their pods' GPUs alone); the workload's
    ``xmem.io/dra-unsatisfiable`` annotation and a Warning Event say why."""
    assert hold.settings is not None  # estimated, so a policy was loaded
    dra = next((t.dra for t in hold.settings.targets if t.dra is not None), None)
    keep = dra is not None and dra.fallback is DraFallback.HOLD and ctx.now() < hold.deadline
    new = copy.deepcopy(obj) if keep else _released(workload, obj)
    new["metadata"].setdefault("annotations", {})[dra_claims.UNSATISFIABLE] = why[:500]
    if not keep:  # the pods' webhook pass would size them from the record: it must not
        for ref, _containers in gpu_templates(workload.integration, new):
            _annotate(new, ref.path, {dra_claims.UNSATISFIABLE: why[:500]})
    if keep and annotations_of(obj).get(dra_claims.UNSATISFIABLE) == why[:500]:
        return DEVICE_RECHECK  # said already; look again as devices come and go
    _write(ctx, workload, new)
    if keep:
        tail = f"kept held until {records.stamp(hold.deadline)} (policy spec.dra.fallback: Hold)"
    else:
        tail = "released as written, without a claim (policy spec.dra.fallback: Release)"
    ctx.emit(obj, "Warning", "NoShareableDevice", f"xmem: no claim written: {why}; {tail}")
    if keep:
        return DEVICE_RECHECK
    ctx.metrics.released.labels(workload.kind.kind, "unchanged").inc()
    return None


def _fail(ctx: Context, workload: Workload, obj: Obj, hold: Hold, reason: str, message: str,
          timed_out: bool = False) -> Optional[float]:
    """Apply the policy's onEstimationFailure (Hold turns into Release at the deadline)."""
    settings = hold.settings
    now = ctx.now()
    action = hold.action(now, timed_out)
    why = gate.failure_text(reason, message)
    if action is FailureAction.HOLD:
        if annotations_of(obj).get(labels.HELD_REASON) != labels.HeldReason.ESTIMATION_FAILED.value:
            new = copy.deepcopy(obj)
            new["metadata"]["annotations"][labels.HELD_REASON] = \
                labels.HeldReason.ESTIMATION_FAILED.value
            _write(ctx, workload, new)
            ctx.emit(obj, "Warning", "EstimationFailed", f"{why}; kept held until "
                     f"{records.stamp(hold.deadline)} (policy onEstimationFailure: Hold)")
        return max(0.5, (hold.deadline - now).total_seconds())
    new = _released(workload, obj)
    outcome = "unchanged"
    if action is FailureAction.DEFAULT and settings is not None and \
            settings.default_request_bytes is not None:
        try:
            templates = gpu_templates(workload.integration, new)
        except InvalidObjectError:  # unreadable, or a TrainJob whose runtime is not there
            templates = []
        for ref, _containers in templates:
            template_annotations = (ref.template.get("metadata") or {}).get("annotations") or {}
            if labels.REQUEST_BYTES in template_annotations:
                continue
            pinned = sizing.pinned_gpu(template_annotations)
            target = (settings.target(pinned) if pinned else None) or settings.targets[0]
            _annotate(new, ref.path, {labels.REQUEST_BYTES: str(settings.default_request_bytes),
                                      labels.GPU_MODEL: target.gpu.key},
                      workload.integration.resolves)
        outcome = "default"
        tail = f"; released with the policy's default request " \
               f"{gib(settings.default_request_bytes)} GiB"
    else:
        tail = "; released unchanged"
    _write(ctx, workload, new)
    ctx.emit(obj, "Warning", "EstimationFailed", why + tail)
    ctx.metrics.released.labels(workload.kind.kind, outcome).inc()
    return None
