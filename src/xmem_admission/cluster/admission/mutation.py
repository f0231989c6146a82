"""The mutation: a pure function from (object, context) to (new object, outcome).

It never touches the object it is given: writes go through a ``jsonpatch.Draft`` and the webhook
diffs before and after. Each step is small, named and idempotent (a second pass over its own
output writes nothing), which is what makes reinvocation give an empty patch:

- ``copy_opt_in_label``: GPU pod templates get ``xmem.io/estimate: "true"`` so their pods reach
  the webhook's objectSelector entry too;
- ``record_fingerprint``: the workload gets ``xmem.io/fingerprint`` (the controller's key);
- ``annotate_plan``: templates get the sizing annotations, unless they already carry a request;
- ``apply_backend``: the request is written in the backend's form where none exists;
- ``hold``: a workload without an estimate is suspended, with why and since when.

Flow for CREATE (UPDATE, DELETE and CONNECT pass unchanged):
1. templates that carry ``xmem.io/request-bytes`` already (the controller wrote it, or the
   user did): turn it into the backend's form;
2. else an estimate is recorded for the fingerprint: plan, annotate, apply, warn with the numbers;
   an estimate that fits no GPU of the policy is left to validation (denied when enforcing);
3. else a Job or PyTorchJob is held; a bare Pod is admitted with a warning, or denied when the
   policy enforces; a Pod with an owner is admitted unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from xmem_admission.cluster import backends, labels
from xmem_admission.cluster.admission.response import Decision
from xmem_admission.cluster.integrations.base import (
    GpuTemplate,
    Integration,
    TemplateRef,
    gpu_templates,
)
from xmem_admission.cluster.kube.jsonpatch import Draft
from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.policy import sizing
from xmem_admission.cluster.policy.model import Settings
from xmem_admission.cluster.policy.sizing import Plan
from xmem_admission.cluster.policy.store import EstimateRecord
from xmem_admission.contract.errors import InvalidObjectError


@dataclass(frozen=True)
class Context:
    """Everything the mutation depends on besides the object: it reads nothing else."""

    operation: str
    namespace: str
    settings: Settings
    fingerprint: str
    record: Optional[EstimateRecord]  # None when nothing is recorded (or it covers no target)
    now: str  # RFC 3339, UTC: the held-since stamp


@dataclass
class Outcome:
    """What the mutation decided, besides the new object."""

    decision: Decision = Decision.ALLOWED
    warnings: List[str] = field(default_factory=list)
    applied: List[Plan] = field(default_factory=list)  # plans made from a recorded estimate
    carried: List[Plan] = field(default_factory=list)  # plans read from request annotations
    held: bool = False
    message: str = ""  # the denial message when decision is DENIED


def _annotations(template: Mapping[str, Any]) -> Dict[str, Any]:
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    return annotations if isinstance(annotations, dict) else {}


def annotated_plan(ref: TemplateRef, settings: Settings) -> Optional[Plan]:
    """The plan a template already carries in its annotations, or None when it carries none."""
    annotations = _annotations(ref.template)
    raw = annotations.get(labels.REQUEST_BYTES)
    if raw is None:
        return None
    where = ref.field("metadata", "annotations", labels.REQUEST_BYTES)
    if not isinstance(raw, str) or not raw.isdigit() or int(raw) <= 0:
        raise InvalidObjectError(f"{where}: must be a positive whole number of bytes, got {raw!r}")
    key = sizing.pinned_gpu(annotations)
    target = settings.target(key) if key else None
    target = target or settings.targets[0]
    estimate = annotations.get(labels.ESTIMATE_BYTES)
    estimate_bytes = int(estimate) if isinstance(estimate, str) and estimate.isdigit() else 0
    return Plan(target, estimate_bytes, int(raw))


def record_plan(ref: TemplateRef, ctx: Context) -> Optional[Plan]:
    """The plan for a template from the recorded estimate (None: no record, or fits no GPU)."""
    if ctx.record is None:
        return None
    pinned = sizing.pinned_gpu(_annotations(ref.template))
    return sizing.plan(ctx.record, ctx.settings, pinned)


# --- steps ----------------------------------------------------------------------------------


def copy_opt_in_label(draft: Draft, refs: Sequence[TemplateRef]) -> None:
    for ref in refs:
        labels_path = ref.at("metadata", "labels")
        if not labels.is_opted_in(draft.get(labels_path)):
            draft.set(labels_path + (labels.OPT_IN,), labels.OPT_IN_VALUE)


def record_fingerprint(draft: Draft, fingerprint: str) -> None:
    path = ("metadata", "annotations", labels.FINGERPRINT)
    if draft.get(path) != fingerprint:
        draft.set(path, fingerprint)


def annotate_plan(draft: Draft, ref: TemplateRef, plan: Plan) -> None:
    if labels.REQUEST_BYTES in _annotations(ref.template):
        return
    for key, value in plan.annotations().items():
        draft.set(ref.at("metadata", "annotations", key), value)


def apply_backend(draft: Draft, template: GpuTemplate, plan: Plan) -> List[str]:
    """Write the plan's request in the target's backend form; returns warning lines."""
    ref, containers = template
    backend = backends.for_name(plan.target.backend)
    applied = backend.apply(draft, ref, containers, plan.request_bytes, plan.target.gpu)
    lines = list(applied.warnings)
    if applied.written:
        written = ", ".join(dict.fromkeys(applied.written))
        lines.append(f"xmem: {plan.target.gpu.key} request {gib(plan.request_bytes)} GiB: {written}")
    return lines


def hold(draft: Draft, integration: Integration, obj: Mapping[str, Any], ctx: Context) -> bool:
    """Suspend a workload awaiting its estimate; False when it was already held by us."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    if isinstance(annotations, dict) and labels.HELD_REASON in annotations:
        return False
    if integration.is_suspended(obj):
        draft.set(("metadata", "annotations", labels.USER_SUSPENDED), "true")
    draft.set(("metadata", "annotations", labels.HELD_REASON), labels.HeldReason.AWAITING_ESTIMATE.value)
    draft.set(("metadata", "annotations", labels.HELD_SINCE), ctx.now)
    integration.suspend(draft)
    return True


# --- the mutation ---------------------------------------------------------------------------


def mutate(
    integration: Integration,
    obj: Dict[str, Any],
    ctx: Context,
    templates: Optional[List[GpuTemplate]] = None,
) -> Tuple[Dict[str, Any], Outcome]:
    """The mutated object (``obj`` itself when nothing changes) and what was decided.

    ``templates`` is ``gpu_templates(integration, obj)`` when the caller has it already.
    """
    outcome = Outcome()
    if ctx.operation != "CREATE":
        return obj, outcome
    if templates is None:
        templates = gpu_templates(integration, obj)
    if not templates:
        return obj, outcome
    draft = Draft(obj)
    if integration.can_hold:
        copy_opt_in_label(draft, [ref for ref, _ in templates])
        record_fingerprint(draft, ctx.fingerprint)

    carried = [annotated_plan(ref, ctx.settings) for ref, _ in templates]
    if all(plan is not None for plan in carried):
        for template, plan in zip(templates, carried):
            assert plan is not None
            outcome.carried.append(plan)
            outcome.warnings.extend(apply_backend(draft, template, plan))
    elif ctx.record is not None:
        for template, plan in zip(templates, carried):
            if plan is None:
                plan = record_plan(template[0], ctx)
                if plan is None:
                    outcome.warnings.append(sizing.short_misfit(ctx.record, ctx.settings))
                    continue
                annotate_plan(draft, template[0], plan)
                outcome.applied.append(plan)
                outcome.warnings.append(
                    f"xmem: {plan.target.gpu.key} estimate {gib(plan.estimate_bytes)} GiB per GPU"
                    f" (fingerprint {ctx.fingerprint[:12]})"
                )
            outcome.warnings.extend(apply_backend(draft, template, plan))
    elif integration.can_hold:
        outcome.held = hold(draft, integration, obj, ctx)
        outcome.warnings.append(
            f"xmem: {integration.kind} held until its GPU memory is estimated"
            f" (fingerprint {ctx.fingerprint[:12]})"
        )
    elif integration.owner(obj) is None:
        text = "no recorded GPU memory estimate for this bare Pod"
        if ctx.settings.enforcing:
            outcome.decision = Decision.DENIED
            outcome.message = (
                f"{text} (fingerprint {ctx.fingerprint}); the policy enforces estimates: run it "
                f"as a Job so it can be held and estimated, or record an estimate first"
            )
            return obj, outcome
        outcome.warnings.append(f"xmem: {text}; admitted unchanged")
    else:
        outcome.warnings.append("xmem: no GPU memory estimate for this Pod; admitted unchanged")

    after = draft.root
    if outcome.held:
        outcome.decision = Decision.HELD
    return after, outcome
