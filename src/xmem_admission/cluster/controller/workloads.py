"""Reconcile one held workload: see it estimated, then release it, whatever happens.

A workload is ours while it carries ``xmem.io/held-reason`` (the webhook's hold). Each pass:

1. gone, or unsuspended by someone else meanwhile: nothing to hold (the hold annotations are
   removed from a workload released behind our back, with an Event);
2. no policy loaded: wait, but never past the default ``maxHoldSeconds``;
3. the fingerprint is recomputed from the workload as it is now (an edit while held, or a
   policy whose target GPUs changed, means a different program to estimate): a changed one is
   written back and estimation follows the new one;
4. a ``GPUMemoryEstimate`` for the fingerprint is created or joined (owned by no workload:
   ``estimate_cache``); a stale one is estimated again;
5. succeeded: every GPU pod template gets the sizing annotations (``xmem.io/request-bytes`` and
   friends, allowed while a Job is suspended), the hold annotations go, the workload is
   unsuspended (unless its owner had suspended it), in one update with the resourceVersion read,
   and an Event says what was estimated and what will be requested;
6. failed (for this hold), or ``maxHoldSeconds`` passed: the policy's ``onEstimationFailure``:
   ``Release`` unchanged, ``Default`` request, or ``Hold`` (until ``maxHoldSeconds``, then
   released unchanged), with a Warning Event quoting why (and the script's last log lines).

A TrainJob's pod templates are resolved from its runtime at each pass (``resolved``, through the
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
from xmem_admission.cluster.controller import dra_claims, estimate_cache, records, trials
from xmem_admission.cluster.controller.context import Context, Workload
from xmem_admission.cluster.integrations import (
    GpuTemplate,
    NotResolved,
    TemplateRef,
    Unit,
    estimation_units,
    fingerprint_of,
    gpu_templates,
)
from xmem_admission.cluster.kube.client import GME, Obj
from xmem_admission.cluster.kube.jsonpatch import Draft
from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.policy import sizing
from xmem_admission.cluster.policy.model import (
    DraFallback,
    Estimation,
    FailureAction,
    Settings,
)
from xmem_admission.cluster.policy.sizing import Plan
from xmem_admission.contract.errors import InvalidObjectError

log = logging.getLogger(__name__)

ESTIMATE_NAME = "xmem.io/estimate-name"  # on released workloads: which GME sized them
DEVICE_RECHECK = 10.0  # seconds between looks at a held workload's DRA class (fallback Hold)


def annotations_of(obj: Obj) -> Dict[str, str]:
    """The object's annotations ({} when it has none)."""
    found: Dict[str, str] = (obj.get("metadata") or {}).get("annotations") or {}
    return found


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


def resolved(ctx: Context, workload: Workload, obj: Obj) -> Obj:
    """The workload as its integration reads it (a TrainJob with its runtime's templates)."""
    return workload.integration.resolve(obj, ctx.kube)


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
    now = ctx.now()
    since = held_since(obj)
    settings = ctx.settings(namespace)
    estimation = settings.estimation if settings is not None else Estimation()
    deadline = since + datetime.timedelta(seconds=estimation.max_hold_seconds)
    if settings is None:
        if now >= deadline:
            return _fail(ctx, workload, obj, None, "NoPolicy", "no GPU admission policy could be "
                         "loaded", deadline, timed_out=True)
        return 5.0
    if not settings.enabled:
        return _fail(ctx, workload, obj, settings, "PolicyDisabled", "the policy for this "
                     "namespace is disabled", deadline, timed_out=True)
    try:
        obj = resolved(ctx, workload, obj)
    except NotResolved as exc:
        if now >= deadline:
            return _fail(ctx, workload, obj, settings, "RuntimeNotResolved", str(exc), deadline,
                         timed_out=True)
        log.info("%s %s/%s: %s; looking again", kind, namespace, name, exc)
        return 5.0
    except InvalidObjectError as exc:
        return _fail(ctx, workload, obj, settings, "InvalidWorkload", str(exc), deadline,
                     timed_out=True)
    try:
        templates = gpu_templates(workload.integration, obj)
        versions = ctx.versions(namespace)
        fp = fingerprint_of(workload.integration, obj, settings.gpu_keys, versions=versions)
        if fp != annotations_of(obj).get(labels.FINGERPRINT) and versions is not None:
            # The cache of ConfigMaps may lag an edit the webhook saw: ask the API.
            versions = ctx.fresh_versions(namespace)
            fp = fingerprint_of(workload.integration, obj, settings.gpu_keys, versions=versions)
    except InvalidObjectError as exc:
        return _fail(ctx, workload, obj, settings, "InvalidWorkload", str(exc), deadline,
                     timed_out=True)
    if not templates:
        return _fail(ctx, workload, obj, settings, "NoGPU", "the workload no longer requests a "
                     "GPU", deadline, timed_out=True)
    old_fp = annotations_of(obj).get(labels.FINGERPRINT)
    if old_fp != fp:
        new = copy.deepcopy(obj)
        new["metadata"].setdefault("annotations", {})[labels.FINGERPRINT] = fp
        _write(ctx, workload, new)
        if old_fp:
            ctx.emit(obj, "Normal", "WorkloadChanged", f"xmem: the workload changed while held "
                     f"(fingerprint {old_fp[:12]} -> {fp[:12]}); estimating the new version")
        return 0.05
    units = estimation_units(workload.integration, obj, settings.gpu_keys, versions)
    gmes = [ctx.estimates.get(namespace, records.name_for(u.fingerprint)) for u in units]
    failed = failed_since(gmes, since)
    if failed is not None:
        status = failed.get("status") or {}
        return _fail(ctx, workload, obj, settings, status.get("reason") or "Error",
                     status.get("message") or "", deadline)
    done = [g for g in gmes if g is not None and records.usable(g)]
    if len(done) == len(units):
        return _release_estimated(ctx, workload, obj, settings, done, units, deadline)
    if now >= deadline:
        return _fail(ctx, workload, obj, settings, "HoldTimeout", f"no estimate within "
                     f"maxHoldSeconds={estimation.max_hold_seconds}", deadline, timed_out=True)
    for unit, gme in zip(units, gmes):
        if gme is None or not records.usable(gme):
            ensure_estimate(ctx, obj, unit.fingerprint, settings,
                            [templates[i] for i in unit.templates], gme)
    if annotations_of(obj).get(labels.HELD_REASON) == labels.HeldReason.AWAITING_ESTIMATE.value:
        new = copy.deepcopy(obj)
        new["metadata"]["annotations"][labels.HELD_REASON] = labels.HeldReason.ESTIMATING.value
        _write(ctx, workload, new)
    return min(60.0, max(0.5, (deadline - now).total_seconds()))


def failed_since(gmes: List[Optional[Obj]], since: datetime.datetime) -> Optional[Obj]:
    """The first estimate that failed in this hold (or AdmissionCheck round), if any: one that
    failed before it gets a new attempt instead (``ensure_estimate``)."""
    for gme in gmes:
        if gme is None or records.phase(gme) != records.FAILED:
            continue
        failed_at = records.parse_time((gme.get("status") or {}).get("completionTime"))
        if failed_at is None or failed_at >= since:
            return gme
    return None


def unit_records(gmes: List[Obj], units: List[Unit]) -> Tuple[List[Any], str]:
    """The record each GPU template is sized from (its unit's), and the name of an estimate
    that holds no usable one ('' when all do)."""
    per_template: Dict[int, Any] = {}
    for gme, unit in zip(gmes, units):
        record = records.record(gme)
        if record is None:
            return [], gme["metadata"]["name"]
        per_template.update({index: record for index in unit.templates})
    return [per_template[i] for i in sorted(per_template)], ""


def ensure_estimate(ctx: Context, obj: Obj, fp: str, settings: Settings,
                    templates: List[GpuTemplate], gme: Optional[Obj]) -> None:
    """See the workload estimated: create the ``GPUMemoryEstimate`` for its fingerprint, or
    join the existing one (``estimate_cache.join``: no owner reference, no write but its last
    use); one that failed before this hold (or this AdmissionCheck round), or a stale one, gets
    a new attempt."""
    namespace = obj["metadata"]["namespace"]
    shared = trials.share(ctx, obj, fp, list(settings.gpu_keys), gme) \
        if trials.shareable(ctx, gme) else None
    if shared is not None:  # sized from an estimate of its family: no estimation pod
        estimate_cache.wait_on(ctx, shared, obj)
        estimate_cache.wake(ctx, shared)
        return
    if gme is None:
        image = templates[0][1][0][1].get("image", "")
        gme = ctx.kube.create(GME, namespace, trials.mark(
            records.new(obj, fp, list(settings.gpu_keys), image),
            trials.trial_of(ctx, obj, fp, list(settings.gpu_keys))))
        ctx.estimates.put(gme)
        estimate_cache.wait_on(ctx, gme, obj)
        ctx.queue.add(("estimate", namespace, gme["metadata"]["name"]))
        return
    gme = estimate_cache.join(ctx, gme, obj)
    if records.phase(gme) == records.FAILED or records.is_stale(gme):  # a new attempt
        status = estimate_cache.new_attempt(gme)
        gme = ctx.kube.replace_status(GME, dict(gme, status=status))
        ctx.estimates.put(gme)
        ctx.queue.add(("estimate", namespace, gme["metadata"]["name"]))


def plans_for(integration: Any, obj: Obj, record: Any,
              settings: Settings) -> Tuple[List[Optional[Plan]], str]:
    """A plan per GPU pod template from a recorded estimate (None where the template already
    carries a request: sized by hand or before), and the misfit message ('' when every template
    fits a GPU of the policy). ``record`` is one record for every template, or a list of one
    per GPU template (``unit_records``)."""
    plans: List[Optional[Plan]] = []
    for index, (ref, _containers) in enumerate(gpu_templates(integration, obj)):
        template_annotations = (ref.template.get("metadata") or {}).get("annotations") or {}
        if labels.REQUEST_BYTES in template_annotations:
            plans.append(None)  # sized by hand or already: validation checks it
            continue
        record_here = record[index] if isinstance(record, list) else record
        plan = sizing.plan(record_here, settings, sizing.pinned_gpu(template_annotations))
        if plan is None:
            return plans, sizing.misfit(record_here, settings)
        plans.append(plan)
    return plans, ""


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


def _release_estimated(ctx: Context, workload: Workload, obj: Obj, settings: Settings,
                       gmes: List[Obj], units: List[Unit],
                       deadline: datetime.datetime) -> Optional[float]:
    per_template, unusable = unit_records(gmes, units)
    if unusable:
        return _fail(ctx, workload, obj, settings, "InvalidEstimate", f"GPUMemoryEstimate "
                     f"{unusable} holds no usable estimate", deadline)
    gme = gmes[0]
    new = _released(workload, obj)
    plans, misfit = plans_for(workload.integration, new, per_template, settings)
    if misfit:
        return _fail(ctx, workload, obj, settings, "FitsNoGPU", misfit, deadline)
    if ctx.devices is not None and not ctx.devices.ready() and ctx.now() < deadline and \
            dra_claims.dra_plans(workload.integration, obj, plans):
        return 1.0  # the DRA devices are not listed yet: judge them once they are
    unsatisfiable = dra_claims.prepare(ctx.kube, ctx.devices, workload.integration, obj, plans)
    if unsatisfiable:
        return _no_device(ctx, workload, obj, settings, unsatisfiable, deadline)
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


def _no_device(ctx: Context, workload: Workload, obj: Obj, settings: Settings, why: str,
               deadline: datetime.datetime) -> Optional[float]:
    """No device of the policy's DeviceClass could ever hold the claim (``dra_claims``): the
    workload is not released with it. ``spec.dra.fallback`` Hold keeps it held (until
    maxHoldSeconds), Release releases it as written (its GPU pod templates carry the annotation
    too, so the webhook leaves their pods' GPUs alone); the workload's
    ``xmem.io/dra-unsatisfiable`` annotation and a Warning Event say why."""
    dra = next((t.dra for t in settings.targets if t.dra is not None), None)
    hold = dra is not None and dra.fallback is DraFallback.HOLD and ctx.now() < deadline
    new = copy.deepcopy(obj) if hold else _released(workload, obj)
    new["metadata"].setdefault("annotations", {})[dra_claims.UNSATISFIABLE] = why[:500]
    if not hold:  # the pods' webhook pass would size them from the record: it must not
        for ref, _containers in gpu_templates(workload.integration, new):
            _annotate(new, ref.path, {dra_claims.UNSATISFIABLE: why[:500]})
    if hold and annotations_of(obj).get(dra_claims.UNSATISFIABLE) == why[:500]:
        return DEVICE_RECHECK  # said already; look again as devices come and go
    _write(ctx, workload, new)
    tail = f"kept held until {records.stamp(deadline)} (policy spec.dra.fallback: Hold)" if hold \
        else "released as written, without a claim (policy spec.dra.fallback: Release)"
    ctx.emit(obj, "Warning", "NoShareableDevice", f"xmem: no claim written: {why}; {tail}")
    if hold:
        return DEVICE_RECHECK
    ctx.metrics.released.labels(workload.kind.kind, "unchanged").inc()
    return None


def _fail(ctx: Context, workload: Workload, obj: Obj, settings: Optional[Settings], reason: str,
          message: str, deadline: datetime.datetime, timed_out: bool = False) -> Optional[float]:
    """Apply the policy's onEstimationFailure (Hold turns into Release at the deadline)."""
    action = settings.on_failure if settings is not None else FailureAction.RELEASE
    now = ctx.now()
    if action is FailureAction.HOLD and (timed_out or now >= deadline):
        action = FailureAction.RELEASE
    why = f"xmem: GPU memory estimation failed ({reason}): {message}".rstrip(": ")
    if action is FailureAction.HOLD:
        if annotations_of(obj).get(labels.HELD_REASON) != labels.HeldReason.ESTIMATION_FAILED.value:
            new = copy.deepcopy(obj)
            new["metadata"]["annotations"][labels.HELD_REASON] = \
                labels.HeldReason.ESTIMATION_FAILED.value
            _write(ctx, workload, new)
            ctx.emit(obj, "Warning", "EstimationFailed", f"{why}; kept held until "
                     f"{records.stamp(deadline)} (policy onEstimationFailure: Hold)")
        return max(0.5, (deadline - now).total_seconds())
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
