"""The break-glass path: an admin gets one workload admitted unchanged where the policy enforces.

In an emergency (the estimator or the controller is broken, a job must run now) an admin
annotates the workload ``xmem.io/break-glass: "<reason>"``. The annotation is honoured only when
the requester (the AdmissionReview's ``userInfo.groups``) is in one of the webhook's
break-glass groups (``Trust.break_glass_groups``, ``xmem serve --break-glass-group``); nobody is
unless the webhook names a group. Honoured, the workload is:

- admitted unchanged: never held, never sized, not judged by the validation (a misfit, a
  request below the estimate, a release by hand: none is refused). The mutation writes one
  thing: the annotation, copied into the workload's GPU pod templates, so that the pods its
  controller creates from them are exempt too (``xmem.io/break-glass`` is one of the template
  annotations only xmem writes: it is stripped from anyone else's templates at CREATE, and a
  change to it is refused where the policy enforces, like the sizing annotations);
- released, when it was held: the admin's UPDATE that adds the annotation to a workload the
  webhook holds must release it in the same update (unsuspend it, and put the annotation in
  its GPU pod templates, which a suspended Job that never ran may still change), else it is
  refused with a message naming what is missing, so that a break-glass workload is never left
  for the controller to size (the controller sees it unsuspended, removes its hold annotations
  and emits ``ReleasedElsewhere``: nothing is sized). The mutating entries see CREATE only, so
  the update itself must carry the release;
- recorded: a kubectl warning that says so, and (once, by the validating endpoint, which sees
  the request last) the counter
  ``xmem_admission_break_glass_total{namespace,kind}``, a log line of the webhook naming who
  and why, and two audit annotations in the answer (``break-glass-by``,
  ``break-glass-reason``), which the API server writes into its audit log under the webhook's
  name. The annotation itself stays on the object (where the policy enforces, only an admin
  may change it): ``kubectl get`` shows the reason.

A kind whose pod templates are resolved from elsewhere (a TrainJob's, from its runtime) gets
no copy and is not asked for one: it is admitted without its runtime being read.

A Pod a workload controller (the Job controller, a training operator) creates for a workload
xmem holds copies its template, which the webhook reviewed, so a template's break-glass
annotation is believed there (``trusted``, see ``trust``). Anyone else's annotation is ignored:
the answer warns why, and the policy applies as usual (under Enforce: held, sized, or refused as
any other workload).

The webhook writes nothing to the API (its RBAC is read-only, and at a mutating CREATE the
object has no uid yet and may still be refused by a later admission step or be a dry run), so
it emits no Event: the audit annotations are the Kubernetes record of who and why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional

from xmem_admission.cluster import labels
from xmem_admission.cluster.admission.metrics import AdmissionMetrics, label_value
from xmem_admission.cluster.admission.request import Request
from xmem_admission.cluster.admission.response import Decision, Verdict, short
from xmem_admission.cluster.admission.trust import Trust
from xmem_admission.cluster.integrations.base import GpuTemplate, Integration, gpu_templates
from xmem_admission.cluster.kube.jsonpatch import Draft, diff

log = logging.getLogger(__name__)

# The reason as the warning, the log and the audit log carry it: one line of printable
# characters, at most this long (an annotation value may be 256 KiB; a reason is a sentence).
REASON_CHARS = 200
# Audit annotation keys (the API server prefixes them with the webhook's name).
AUDIT_BY = "break-glass-by"
AUDIT_REASON = "break-glass-reason"


@dataclass(frozen=True)
class BreakGlass:
    """What one review's ``xmem.io/break-glass`` annotation amounts to."""

    reason: str = ""  # the annotation's value, one bounded line ('' when absent)
    honoured: bool = False
    by: str = ""  # the admin who asked; '' when a Pod is exempt by its workload's template
    note: str = ""  # why a present annotation is not honoured (a warning), '' otherwise
    new: bool = False  # CREATE, or an UPDATE that adds or changes the annotation

    def noted(self, verdict: Verdict) -> Verdict:
        """The usual verdict, with the warning that says why the annotation was ignored."""
        if self.note:
            verdict.warnings.insert(0, self.note)
        return verdict


def _value(obj: Optional[Mapping[str, Any]]) -> Optional[str]:
    meta = (obj or {}).get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, dict) else None
    value = annotations.get(labels.BREAK_GLASS) if isinstance(annotations, dict) else None
    return value if isinstance(value, str) else None


def assess(req: Request, integration: Integration, trust: Trust,
           trusted: Callable[[], bool]) -> BreakGlass:
    """Whether the object's break-glass annotation is honoured for this requester.

    ``trusted`` says whether the object's ``xmem.io/`` template annotations may be believed
    (a Pod its workload's controller created); it is only called for a Pod that carries one.
    """
    raw = _value(req.obj)
    if raw is None:
        return BreakGlass()
    reason = short("".join(c if c.isprintable() else " " for c in raw), REASON_CHARS)
    new = req.operation == "CREATE" or _value(req.old_obj) != raw
    if trust.may_break_glass(req.groups):
        if not reason:
            return BreakGlass(reason, new=new, note=(
                f"xmem: {labels.BREAK_GLASS} is not honoured: it needs a reason (the annotation's "
                f"value, kept in the audit log); the policy applies as usual"))
        return BreakGlass(reason, honoured=True, by=req.user, new=new)
    if not integration.can_hold and reason and trusted():
        return BreakGlass(reason, honoured=True, new=new)
    if not new:
        return BreakGlass(reason)  # standing on the object; someone else's unrelated update
    why = (f"{req.user or 'the requester'} is in none of the webhook's break-glass groups"
           if trust.break_glass_groups else
           "the webhook names no break-glass group (xmem serve --break-glass-group)")
    return BreakGlass(reason, new=new, note=(
        f"xmem: {labels.BREAK_GLASS} is not honoured: {why}; the policy applies as usual"))


def admit(glass: BreakGlass, req: Request, integration: Integration, obj: Dict[str, Any],
          mutating: bool, metrics: AdmissionMetrics) -> Verdict:
    """The answer for an honoured break-glass: unchanged but for the annotation's copy in the
    GPU pod templates at CREATE, with its warning and audit; counted and logged once, by the
    validating endpoint (the last word on the request, after every mutation)."""
    if not glass.by:  # a Pod exempt by its workload's template: the workload was recorded
        return Verdict(Decision.ALLOWED)
    where = f"{integration.kind} {req.namespace}/{req.name or _name(obj)}"
    # A kind whose templates are resolved from elsewhere (a TrainJob's runtime) has none here
    # to copy the annotation into, nor to read before its runtime is read: none is asked for.
    templates = [] if integration.resolves else gpu_templates(integration, obj)
    missing = _unreleased(integration, obj, req.old_obj, templates)
    if missing:
        return Verdict.deny(
            f"xmem: {where} is held by xmem until its GPU memory is estimated: a break-glass "
            f"releases it in the same update: set {' and '.join(missing)} (docs/operations.md, "
            f"Break-glass)")
    draft = Draft(obj)
    if mutating and req.operation == "CREATE":
        value = _value(obj)  # the annotation as written (the reason is its one-line cut)
        for ref, _ in templates:
            path = ref.at("metadata", "annotations", labels.BREAK_GLASS)
            if draft.get(path) != value:
                draft.set(path, value)
    ops = diff(obj, draft.root)
    did = "released from its hold" if missing is not None else "admitted unchanged"
    if not mutating and glass.new:
        if not req.dry_run:
            metrics.break_glass.labels(label_value(req.namespace), integration.kind).inc()
        log.warning("break-glass%s: %s %s by %s (groups %s): %s", " (dry run)" if req.dry_run
                    else "", where, did, glass.by, ", ".join(req.groups), glass.reason)
    return Verdict(
        Decision.MUTATED if ops else Decision.ALLOWED, patch=ops,
        warnings=[f"xmem: break-glass by {glass.by}: {did}, not held or sized by xmem "
                  f"({glass.reason})"],
        audit={AUDIT_BY: glass.by, AUDIT_REASON: glass.reason},
    )


def _unreleased(integration: Integration, obj: Mapping[str, Any],
                old: Optional[Mapping[str, Any]],
                templates: List[GpuTemplate]) -> Optional[List[str]]:
    """For an UPDATE of a workload the webhook held: what the update leaves undone of its
    release (unsuspended, and the annotation in every GPU pod template, so that neither the
    controller nor the Pod webhook sizes it later); None when the workload was not held."""
    if old is None or not integration.can_hold or not integration.is_suspended(old):
        return None
    before = (old.get("metadata") or {}).get("annotations") or {}
    if not isinstance(before, dict) or labels.HELD_REASON not in before:
        return None
    missing = [f"{'.'.join(integration.suspend_path)}: false"] if \
        integration.is_suspended(obj) else []
    for ref, _ in templates:
        annotations = (ref.template.get("metadata") or {}).get("annotations") or {}
        if not isinstance(annotations, dict) or not annotations.get(labels.BREAK_GLASS):
            missing.append(ref.field("metadata", "annotations", labels.BREAK_GLASS))
    return missing


def _name(obj: Mapping[str, Any]) -> str:
    meta = obj.get("metadata")
    name = meta.get("name") or meta.get("generateName") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else ""
