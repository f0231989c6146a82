"""The gate a held workload passes before it runs, for both ways it is held.

A job the webhook held (``workloads``: released by unsuspending it) and a Kueue-queued job
whose Workload waits on our AdmissionCheck (``admission_checks``: Ready with podSetUpdates)
take the same steps; ``decide`` takes them and says where the pass ended (a ``Decision``),
which each path turns into its own output. One pass, for a hold that began at ``Hold.since``
and ends at ``Hold.deadline`` (``maxHoldSeconds``):

1. no policy loaded: ``Wait``, until the deadline (then ``Failed``, not read: ``NoPolicy``); a
   disabled one: ``Disabled``;
2. the workload as its integration reads it (a TrainJob with its runtime's templates): a
   runtime that cannot be read is waited for until the deadline (then ``RuntimeNotResolved``);
   an unreadable workload is ``InvalidWorkload``;
3. its GPU pod templates (none: ``NoGpu``) and fingerprint. A job the webhook held carries
   the fingerprint it was held under (``xmem.io/fingerprint``): one that differs is computed
   again with the ConfigMaps' versions read from the API (the cache may lag an edit the
   webhook saw), and still differing is ``Changed`` (an edit while held, or a policy whose
   target GPUs changed: a different program to estimate). A queued job carries none; an
   admin's break-glass in every GPU template exempts it (``Exempt``: the webhook exempted a
   held one already);
4. the ``GPUMemoryEstimate`` of each estimation unit: one that failed in this hold is
   ``Failed`` (``failed_since``); all usable is ``Estimated`` with a plan per GPU template,
   or ``Misfit`` (fits no GPU of the policy), or ``Failed`` (``InvalidEstimate``); past the
   deadline, ``Failed`` (``HoldTimeout``); else each missing or unusable one is created,
   joined or tried again (``ensure_estimate``) and the pass is ``Estimating``.

A failure's outcome is the policy's ``onEstimationFailure`` (``action``): Hold gives way to
Release at the deadline and for failures that waiting cannot mend (``timed_out``).
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import estimate_cache, records, trials
from xmem_admission.cluster.controller.context import Context, Workload
from xmem_admission.cluster.integrations import (
    GpuTemplate,
    NotResolved,
    Unit,
    estimation_units,
    fingerprint_of,
    gpu_templates,
)
from xmem_admission.cluster.kube.client import GME, Obj
from xmem_admission.cluster.policy import sizing
from xmem_admission.cluster.policy.model import Estimation, FailureAction, Settings
from xmem_admission.cluster.policy.sizing import Plan
from xmem_admission.contract.errors import InvalidObjectError

log = logging.getLogger(__name__)

POLICY_WAIT = 5.0  # seconds between looks for a policy, or for a TrainJob's runtime


def annotations_of(obj: Obj) -> Dict[str, str]:
    """The object's annotations ({} when it has none)."""
    found: Dict[str, str] = (obj.get("metadata") or {}).get("annotations") or {}
    return found


@dataclass(frozen=True)
class Hold:
    """One hold: the namespace's policy settings (None while no policy is loaded), when the
    hold began (an estimate that failed before it failed for an earlier one) and its deadline."""

    settings: Optional[Settings]
    since: datetime.datetime
    deadline: datetime.datetime

    @classmethod
    def of(cls, ctx: Context, namespace: str, since: datetime.datetime,
           began: Optional[datetime.datetime] = None) -> Hold:
        """The hold that began at ``since``; its deadline counts from ``began`` (default
        ``since``), ``maxHoldSeconds`` later."""
        settings = ctx.settings(namespace)
        estimation = settings.estimation if settings is not None else Estimation()
        deadline = (began or since) + datetime.timedelta(seconds=estimation.max_hold_seconds)
        return cls(settings, since, deadline)

    def action(self, now: datetime.datetime, timed_out: bool = False) -> FailureAction:
        """The policy's onEstimationFailure (Release without a policy); Hold turns into
        Release at the deadline, or at once for a failure waiting cannot mend."""
        action = self.settings.on_failure if self.settings is not None else FailureAction.RELEASE
        if action is FailureAction.HOLD and (timed_out or now >= self.deadline):
            return FailureAction.RELEASE
        return action

    def left(self, now: datetime.datetime) -> float:
        """Seconds until the next look while estimating: the deadline, at most a minute."""
        return min(60.0, max(0.5, (self.deadline - now).total_seconds()))


def failure_text(reason: str, message: str) -> str:
    """The first part of every failure's Event or check message."""
    return f"xmem: GPU memory estimation failed ({reason}): {message}".rstrip(": ")


# --- decisions ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Wait:
    """Nothing decided yet: look again in ``seconds``."""

    seconds: float


@dataclass(frozen=True)
class Disabled:
    """The namespace's policy is disabled."""


@dataclass(frozen=True)
class NoGpu:
    """The workload (as read) requests no GPU."""

    obj: Obj


@dataclass(frozen=True)
class Exempt:
    """A queued job an admin exempted: break-glass in every GPU pod template."""


@dataclass(frozen=True)
class Changed:
    """A held workload's fingerprint is not the one it carries (``old``, None for none)."""

    obj: Obj
    fingerprint: str
    old: Optional[str]


@dataclass(frozen=True)
class Failed:
    """The estimation failed in this hold, or none came by the deadline (``timed_out``); or,
    not ``read``, the workload cannot be estimated as it is (no policy by the deadline, a
    runtime that cannot be read, an invalid workload: timed out, as waiting cannot mend it).
    ``obj``: the workload as far as it was read (its integration's reading, when that
    succeeded)."""

    reason: str
    message: str
    obj: Obj
    timed_out: bool = False
    read: bool = True


@dataclass(frozen=True)
class Misfit:
    """The estimate fits no GPU of the policy: ``message`` says why."""

    obj: Obj
    message: str


@dataclass(frozen=True)
class Estimated:
    """Every unit is estimated: a plan per GPU pod template (None where the template carries a
    request already), from ``gmes`` (in unit order)."""

    obj: Obj
    gmes: List[Obj]
    plans: List[Optional[Plan]]


@dataclass(frozen=True)
class Estimating:
    """Estimation is under way (its estimates created, joined or tried again)."""

    obj: Obj
    fingerprint: str


Decision = Union[Wait, Disabled, NoGpu, Exempt, Changed, Failed, Misfit, Estimated, Estimating]


def decide(ctx: Context, workload: Workload, obj: Obj, hold: Hold, *, held: bool) -> Decision:
    """One pass of the gate over a workload (see the module docstring). ``held``: the webhook
    held it (it carries its fingerprint, and break-glass was honoured at admission), rather
    than Kueue queueing it."""
    meta = obj["metadata"]
    namespace = meta["namespace"]
    settings = hold.settings
    now = ctx.now()
    if settings is None:
        if now >= hold.deadline:
            return _unreadable("NoPolicy", "no GPU admission policy could be loaded", obj)
        return Wait(POLICY_WAIT)
    if not settings.enabled:
        return Disabled()
    try:
        obj = workload.integration.resolve(obj, ctx.kube)  # a TrainJob: its runtime's templates
    except NotResolved as exc:
        if now >= hold.deadline:
            return _unreadable("RuntimeNotResolved", str(exc), obj)
        log.info("%s %s/%s: %s; looking again", obj.get("kind"), namespace, meta["name"], exc)
        return Wait(POLICY_WAIT)
    except InvalidObjectError as exc:
        return _unreadable("InvalidWorkload", str(exc), obj)
    recorded = annotations_of(obj).get(labels.FINGERPRINT)
    try:
        templates = gpu_templates(workload.integration, obj)
        versions = ctx.versions(namespace)
        fp = fingerprint_of(workload.integration, obj, settings.gpu_keys, versions=versions)
        if held and fp != recorded and versions is not None:
            # The cache of ConfigMaps may lag an edit the webhook saw: ask the API.
            versions = ctx.fresh_versions(namespace)
            fp = fingerprint_of(workload.integration, obj, settings.gpu_keys, versions=versions)
    except InvalidObjectError as exc:
        return _unreadable("InvalidWorkload", str(exc), obj)
    if not templates:
        return NoGpu(obj)
    if held and recorded != fp:
        return Changed(obj, fp, recorded)
    if not held and all(labels.BREAK_GLASS in ((ref.template.get("metadata") or {})
                                               .get("annotations") or {})
                        for ref, _ in templates):  # only the webhook writes it there
        return Exempt()
    units = estimation_units(workload.integration, obj, settings.gpu_keys, versions)
    gmes = [ctx.estimates.get(namespace, records.name_for(u.fingerprint)) for u in units]
    failed = failed_since(gmes, hold.since)
    if failed is not None:
        status = failed.get("status") or {}
        return Failed(status.get("reason") or "Error", status.get("message") or "", obj)
    done = [g for g in gmes if g is not None and records.usable(g)]
    if len(done) == len(units):
        return _sized(workload, obj, settings, done, units)
    if now >= hold.deadline:
        return Failed("HoldTimeout", f"no estimate within maxHoldSeconds="
                      f"{settings.estimation.max_hold_seconds}", obj, timed_out=True)
    for unit, gme in zip(units, gmes):
        if gme is None or not records.usable(gme):
            ensure_estimate(ctx, obj, unit.fingerprint, settings,
                            [templates[i] for i in unit.templates], gme)
    return Estimating(obj, fp)


def _unreadable(reason: str, message: str, obj: Obj) -> Failed:
    return Failed(reason, message, obj, timed_out=True, read=False)


def _sized(workload: Workload, obj: Obj, settings: Settings, gmes: List[Obj],
           units: List[Unit]) -> Decision:
    per_template, unusable = unit_records(gmes, units)
    if unusable:
        return Failed("InvalidEstimate", f"GPUMemoryEstimate {unusable} holds no usable "
                      "estimate", obj)
    plans, misfit = plans_for(workload.integration, obj, per_template, settings)
    if misfit:
        return Misfit(obj, misfit)
    return Estimated(obj, gmes, plans)


# --- the steps ------------------------------------------------------------------------------


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
