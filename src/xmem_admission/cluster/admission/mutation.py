"""The mutation: a pure function from (object, context) to (new object, outcome).

It never touches the object it is given: writes go through a ``jsonpatch.Draft`` and the webhook
diffs before and after. Each step is small, named and idempotent (a second pass over its own
output writes nothing), which is what makes reinvocation give an empty patch:

- ``strip_untrusted``: sizing annotations (``xmem.io/request-bytes``, ``gpu-model``,
  ``estimate-bytes``) that someone other than the xmem controller wrote are removed (see
  ``trust``); what the record says is written back below, so on a reinvocation the patch is
  still empty;
- ``copy_opt_in_label``: GPU pod templates get ``xmem.io/estimate: "true"`` so their pods reach
  the webhook's objectSelector entry too;
- ``record_fingerprint``: the workload gets ``xmem.io/fingerprint`` (the controller's key);
- ``annotate_plan``: templates get the sizing annotations, unless they already carry a request;
- ``apply_backend``: the request is written in the backend's form where none exists;
- ``grow_after_oom``: a Pod its workload's controller creates after that workload's pod ran out
  of GPU memory gets the request the xmem controller recorded for the retry (``ctx.retry``, from
  the workload's ``GPUMemoryEstimate``, by the workload's uid, in its own namespace) in place of
  the template's, where that is larger; its ``xmem.io/request-bytes`` says so. The
  backend's form xmem wrote into a repeat job's template at its CREATE is rewritten; a form
  with any other value was set by hand and is never grown;
- ``fallback_to_logs``: the GPU containers of a sized Pod get ``terminationMessagePolicy:
  FallbackToLogsOnError``, so the kubelet puts the tail of a failed container's log (the last
  80 lines, at most 2048 bytes) in its termination message, where the controller reads a CUDA
  out-of-memory error without reading any log. The API server defaults the field to ``File``
  before admission, so ``File`` is what every pod that chose nothing carries: it is replaced,
  and any other value is the user's and kept. The two differ only for a container that failed
  without writing a termination message, so nothing a container wrote is ever lost;
- ``hold``: a workload without an estimate is suspended, with why and since when (one that
  already says it is held is suspended too: the annotation alone holds nothing).

A kind whose pod templates are resolved from elsewhere (``Integration.resolves``: a TrainJob's
come from its runtime) gets none of the template steps: the places they would write do not
exist in the object. It is held (fingerprint and hold annotations, suspended), estimate known
or not, and the controller sizes it through its own runtime patch before releasing it
(``integrations.trainjob``); queued by Kueue it gets nothing at all, an empty patch: Kueue's
TrainJob webhook appends its runtime patch and is not idempotent when webhooks are invoked
again (kueue issue 15210), so xmem changes nothing that would make the API server reinvoke it.
Sizing annotations in its resolved templates from anyone but the controller cannot be stripped
(they may be the runtime's) and are refused.

Flow for CREATE (UPDATE, DELETE and CONNECT pass unchanged):
1. templates that carry ``xmem.io/request-bytes`` from a trusted writer (the controller wrote it
   into the template of a Job whose pod the Job controller creates): turn it into the backend's
   form;
2. else an estimate is recorded for the fingerprint: plan, annotate, apply, warn with the numbers;
   an estimate that fits no GPU of the policy is left to validation (denied when enforcing);
3. else a Job or PyTorchJob that names a Kueue queue, where the policy's integration is
   ``Kueue``, is left to Kueue (its suspend flag is never touched: the xmem AdmissionCheck
   estimates it before Kueue admits it); any other Job or PyTorchJob is held (when a
   controller runs to release it); a bare Pod (or a
   Job nothing would release) is admitted with a warning, or denied when the policy enforces;
   a Pod a workload controller created for its owner is admitted unchanged.
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
from xmem_admission.cluster.kube import quantity
from xmem_admission.cluster.kube.jsonpatch import Draft
from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.policy import sizing
from xmem_admission.cluster.policy.model import Settings, UntrustedAnnotations
from xmem_admission.cluster.policy.sizing import Plan
from xmem_admission.cluster.policy.store import EstimateRecord, RetryGrant
from xmem_admission.contract.errors import InvalidObjectError, QuantityError

# The annotations that size a pod template: only the xmem controller writes them (the GPU
# model pin, xmem.io/gpu-model, is the user's to choose among the policy's targets); with them
# the exemption only the webhook writes there, for an admin's honoured break-glass.
SIZING = (labels.REQUEST_BYTES, labels.ESTIMATE_BYTES, labels.BREAK_GLASS)


@dataclass(frozen=True)
class Context:
    """Everything the mutation depends on besides the object: it reads nothing else."""

    operation: str
    namespace: str
    settings: Settings
    fingerprint: str
    record: Optional[EstimateRecord]  # None when nothing is recorded (or it covers no target)
    now: str  # RFC 3339, UTC: the held-since stamp
    trusted: bool = True  # the sizing annotations come from the controller (``trust``)
    owned: bool = False  # a workload controller created this Pod for its owner
    can_hold: bool = True  # a controller runs that releases held workloads
    queued: bool = False  # Kueue holds it (policy integration Kueue, a queue-name label)
    retry: Optional[RetryGrant] = None  # the owning workload's grant after a GPU OOM
    # Where a workload's GPU templates run different programs, each template's own record, by
    # template path (``integrations.estimation_units``); ``record`` is then set only when every
    # template has one.
    template_records: Optional[Mapping[Tuple[Any, ...], EstimateRecord]] = None


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
    try:
        request = quantity.parse_digits(raw)
    except QuantityError as exc:
        raise InvalidObjectError(f"{where}: must be a positive whole number of bytes: {exc}") \
            from None
    if request <= 0:
        raise InvalidObjectError(f"{where}: must be a positive whole number of bytes, got {raw!r}")
    key = sizing.pinned_gpu(annotations)
    target = settings.target(key) if key else None
    target = target or settings.targets[0]
    try:
        estimate_bytes = quantity.parse_digits(annotations.get(labels.ESTIMATE_BYTES))
    except QuantityError:
        estimate_bytes = 0  # informational: absent or unreadable means "not known"
    return Plan(target, estimate_bytes, request)


def carried_plan(ref: TemplateRef, ctx: Context) -> Optional[Plan]:
    """The plan a template carries, when its annotations may be believed (``ctx.trusted``)."""
    return annotated_plan(ref, ctx.settings) if ctx.trusted else None


def sizing_annotations(template: Mapping[str, Any]) -> Dict[str, Any]:
    """The ``xmem.io/`` sizing annotations a pod template carries."""
    annotations = _annotations(template)
    return {k: annotations[k] for k in SIZING if k in annotations}


def record_plan(ref: TemplateRef, ctx: Context) -> Optional[Plan]:
    """The plan for a template from the recorded estimate (None: no record, or fits no GPU)."""
    record = ctx.record
    if ctx.template_records:
        record = ctx.template_records.get(tuple(ref.path), record)
    if record is None:
        return None
    pinned = sizing.pinned_gpu(_annotations(ref.template))
    return sizing.plan(record, ctx.settings, pinned)


def right_sized_line(plan: Plan) -> str:
    """The warning line of a request that earlier runs' observed peaks corrected."""
    before = plan.uncorrected_request_bytes or plan.request_bytes
    return (f"xmem: right-sized by earlier runs: request {gib(before)} -> "
            f"{gib(plan.request_bytes)} GiB ({plan.correction})")[:500]


# --- steps ----------------------------------------------------------------------------------


def strip_untrusted(draft: Draft, refs: Sequence[TemplateRef]) -> None:
    for ref in refs:
        for key in sizing_annotations(ref.template):
            draft.delete(ref.at("metadata", "annotations", key))


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
    if draft.get(ref.at("metadata", "annotations", labels.REQUEST_BYTES)) is not None:
        return
    for key, value in plan.annotations().items():
        draft.set(ref.at("metadata", "annotations", key), value)


def apply_backend(draft: Draft, template: GpuTemplate, plan: Plan) -> List[str]:
    """Write the plan's request in the target's backend form; returns warning lines."""
    ref, containers = template
    backend = backends.for_target(plan.target)
    applied = backend.apply(draft, ref, containers, plan.request_bytes, plan.target.gpu)
    lines = list(applied.warnings)
    if applied.written:
        written = ", ".join(dict.fromkeys(applied.written))
        lines.append(f"xmem: {plan.target.gpu.key} request {gib(plan.request_bytes)} GiB: {written}")
    return lines


FALLBACK_TO_LOGS = "FallbackToLogsOnError"
DEFAULT_MESSAGE_POLICY = "File"  # what the API server's defaulting writes before admission


def fallback_to_logs(draft: Draft, templates: Sequence[GpuTemplate]) -> None:
    for ref, containers in templates:
        for slot, _container, _count in containers:
            path = ref.at("spec", *slot, "terminationMessagePolicy")
            if draft.get(path) in (None, DEFAULT_MESSAGE_POLICY):
                draft.set(path, FALLBACK_TO_LOGS)


def grow_after_oom(draft: Draft, template: GpuTemplate, plan: Plan,
                   grant: Optional[RetryGrant]) -> Tuple[Plan, List[str]]:
    """The plan with the retry's request when the grant is larger (and the warning lines).

    Containers without the backend's form get it from ``apply_backend`` with the grown plan.
    A container that carries the form xmem wrote for the template's request (a repeat job
    sized at its CREATE) has it rewritten; one that carries any other value set it by hand:
    then nothing grows, and validation judges the request as it does at every CREATE.
    """
    if grant is None or grant.request_bytes <= plan.request_bytes or \
            grant.gpu != plan.target.gpu.key:
        return plan, []
    ref, containers = template
    gpu = plan.target.gpu
    backend = backends.for_target(plan.target)
    pending = {slot for slot, _, _ in backend.pending(ref, containers, gpu)}
    carrying = [c for c in containers if c[0] not in pending]
    lines: List[str] = []
    if carrying:
        expected = backend.written_bytes(plan.request_bytes, gpu)
        found = [backend.existing(ref.template, slot, c, gpu) for slot, c, _ in carrying]
        if expected is None or any(f is None or f.bytes_per_gpu != expected for f in found):
            return plan, []
        applied = backend.rewrite(draft, ref, carrying, grant.request_bytes, gpu)
        if not applied.written:
            return plan, applied.warnings
        lines += applied.warnings + [f"xmem: {gpu.key} request {gib(grant.request_bytes)} GiB: "
                                     + ", ".join(dict.fromkeys(applied.written))]
    draft.set(ref.at("metadata", "annotations", labels.REQUEST_BYTES), str(grant.request_bytes))
    draft.set(ref.at("metadata", "annotations", labels.OOM_RETRY), str(grant.ooms))
    after = f" (gave up: {grant.gave_up})" if grant.gave_up else ""
    return Plan(plan.target, plan.estimate_bytes, grant.request_bytes), [
        f"xmem: retry after {grant.ooms} CUDA out-of-memory failure(s): request "
        f"{gib(plan.request_bytes)} -> {gib(grant.request_bytes)} GiB{after}"] + lines


def hold(draft: Draft, integration: Integration, obj: Mapping[str, Any], ctx: Context) -> bool:
    """Suspend a workload awaiting its estimate; False when it was already held by us.

    A workload that already says it is held (our own earlier pass, on a reinvocation, or an
    annotation its owner wrote) is suspended all the same: the annotation holds nothing.
    """
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    if isinstance(annotations, dict) and labels.HELD_REASON in annotations:
        if integration.is_suspended(obj):
            return False
        integration.suspend(draft)
        return True
    if integration.is_suspended(obj):
        draft.set(("metadata", "annotations", labels.USER_SUSPENDED), "true")
    draft.set(("metadata", "annotations", labels.HELD_REASON), labels.HeldReason.AWAITING_ESTIMATE.value)
    draft.set(("metadata", "annotations", labels.HELD_SINCE), ctx.now)
    integration.suspend(draft)
    return True


def rewritten_sizing(templates: Sequence[GpuTemplate], draft: Draft) -> str:
    """The field of the first sizing annotation the object came with that the mutation did not
    leave as it was ('' when none): a value equal to what xmem writes itself is harmless."""
    for ref, _ in templates:
        for key, value in sizing_annotations(ref.template).items():
            if draft.get(ref.at("metadata", "annotations", key)) != value:
                return ref.field("metadata", "annotations", key)
    return ""


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
    if integration.resolves:
        return _mutate_resolved(integration, obj, draft, ctx, templates, outcome)
    if not ctx.trusted:
        strip_untrusted(draft, [ref for ref, _ in templates])
    if integration.can_hold:
        copy_opt_in_label(draft, [ref for ref, _ in templates])
        record_fingerprint(draft, ctx.fingerprint)

    carried = [carried_plan(ref, ctx) for ref, _ in templates]
    if all(plan is not None for plan in carried):
        for template, plan in zip(templates, carried):
            assert plan is not None
            plan, grown = grow_after_oom(draft, template, plan, ctx.retry)
            outcome.warnings.extend(grown)
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
                if plan.correction:
                    outcome.warnings.append(right_sized_line(plan))
                if plan.overhead is not None and plan.overhead.correction_bytes:
                    outcome.warnings.append(f"xmem: {plan.overhead.text()}"[:500])
                if plan.narrowed:
                    outcome.warnings.append(f"xmem: {plan.narrowed}"[:500])
            outcome.warnings.extend(apply_backend(draft, template, plan))
    elif integration.can_hold and ctx.queued:
        # Kueue owns the suspend flag: the xmem AdmissionCheck keeps the Workload Pending until
        # the estimate exists and hands the sizing to Kueue as podSetUpdates.
        outcome.warnings.append(
            f"xmem: {integration.kind} is estimated by the xmem AdmissionCheck before Kueue "
            f"admits it (fingerprint {ctx.fingerprint[:12]})"
        )
    elif integration.can_hold and ctx.can_hold:
        outcome.held = hold(draft, integration, obj, ctx)
        outcome.warnings.append(
            f"xmem: {integration.kind} held until its GPU memory is estimated"
            f" (fingerprint {ctx.fingerprint[:12]})"
        )
    elif not ctx.owned:
        what = "bare Pod" if not integration.can_hold else integration.kind
        text = f"no recorded GPU memory estimate for this {what}"
        if ctx.settings.enforcing:
            outcome.decision = Decision.DENIED
            outcome.message = (
                f"{text} (fingerprint {ctx.fingerprint}); the policy enforces estimates: "
                + ("run it as a Job so it can be held and estimated, or record an estimate first"
                   if not integration.can_hold else
                   "no xmem controller runs to estimate it; record an estimate first")
            )
            return obj, outcome
        outcome.warnings.append(f"xmem: {text}; admitted unchanged")
    else:
        outcome.warnings.append("xmem: no GPU memory estimate for this Pod; admitted unchanged")

    if not ctx.trusted and ctx.settings.untrusted_annotations is UntrustedAnnotations.DENY:
        rewritten = rewritten_sizing(templates, draft)
        if rewritten:
            outcome.decision = Decision.DENIED
            outcome.message = (
                f"{rewritten}: only the xmem controller writes the xmem.io/ sizing annotations "
                f"(policy untrustedAnnotations: Deny); remove them and xmem sizes the workload"
            )
            return obj, outcome

    if not integration.can_hold and (outcome.carried or outcome.applied):
        fallback_to_logs(draft, templates)
    after = draft.root
    if outcome.held:
        outcome.decision = Decision.HELD
    return after, outcome


def _mutate_resolved(integration: Integration, obj: Dict[str, Any], draft: Draft, ctx: Context,
                     templates: List[GpuTemplate],
                     outcome: Outcome) -> Tuple[Dict[str, Any], Outcome]:
    """``mutate`` for a kind whose templates are resolved (see the module docstring)."""
    if not ctx.trusted:
        for ref, _ in templates:
            for key in sizing_annotations(ref.template):
                outcome.decision = Decision.DENIED
                outcome.message = (
                    f"{integration.kind} pod template {ref.role!r} carries {key} (from its "
                    f"runtime or spec.runtimePatches): only the xmem controller writes the "
                    f"xmem.io/ sizing annotations; remove it and xmem sizes the workload")
                return obj, outcome
    if ctx.queued:
        outcome.warnings.append(
            f"xmem: {integration.kind} is estimated by the xmem AdmissionCheck before Kueue "
            f"admits it (fingerprint {ctx.fingerprint[:12]})")
        return obj, outcome
    if not ctx.can_hold:
        text = f"no xmem controller runs to size this {integration.kind}"
        if ctx.settings.enforcing:
            outcome.decision = Decision.DENIED
            outcome.message = f"{text} (fingerprint {ctx.fingerprint}); the policy enforces " \
                              "estimates"
            return obj, outcome
        outcome.warnings.append(f"xmem: {text}; admitted unchanged")
        return obj, outcome
    record_fingerprint(draft, ctx.fingerprint)
    outcome.held = hold(draft, integration, obj, ctx)
    known = " (estimate known: sized and released by the xmem controller)" \
        if ctx.record is not None else ""
    outcome.warnings.append(f"xmem: {integration.kind} held until its GPU memory is estimated"
                            f"{known} (fingerprint {ctx.fingerprint[:12]})")
    outcome.decision = Decision.HELD if outcome.held else Decision.ALLOWED
    return draft.root, outcome
