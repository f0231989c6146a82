"""The validation: what the policy refuses, as violations with field paths (Kueue's shape).

Run by ``/validate`` (after every mutating webhook, so it sees the object as it will be stored)
on CREATE and UPDATE. When the namespace's policy enforces, any violation denies the request;
otherwise each becomes a kubectl warning. The violations:

- the recorded estimate fits no GPU of the policy (the message says by how much, and what would
  fit);
- a GPU memory request set by hand (in the backend's form, or as ``xmem.io/request-bytes``)
  below the estimate less the overcommit allowance: E * (1 - overcommitPercent/100);
- a bare Pod with no estimate at all (it could never be held and resized later), and at CREATE a
  Job or PyTorchJob that is neither held nor sized (the mutation did not run, or no controller
  runs to release it);
- ``xmem.io/`` sizing annotations from anyone but the xmem controller that differ from what the
  record gives (see ``trust``);
- on UPDATE by anyone but the controller: a changed ``xmem.io/`` annotation, or the release
  (unsuspend) of a held workload (Kueue, on a workload it queues under ``integration: Kueue``,
  counts as the controller: it writes the AdmissionCheck's podSetUpdates and unsuspends).

A workload Kueue queues (``integration: Kueue`` and a queue-name label) is neither held nor
sized at CREATE by design: the xmem AdmissionCheck estimates it before Kueue admits it.

UPDATE judges only changes to what the policy governs (the pod templates, the suspend flag, the
``xmem.io/`` annotations): a metadata-only update (``kubectl label``, the garbage collector
removing a finalizer) and an object being deleted always pass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional

from xmem_admission.cluster import backends, labels
from xmem_admission.cluster.admission.mutation import (
    Context,
    annotated_plan,
    carried_plan,
    record_plan,
    sizing_annotations,
)
from xmem_admission.cluster.admission.trust import xmem_annotations
from xmem_admission.cluster.integrations.base import GpuTemplate, Integration, gpu_templates
from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.policy import sizing
from xmem_admission.cluster.policy.sizing import Plan


@dataclass(frozen=True)
class Violation:
    """One thing the policy refuses, with the field it is about."""

    field: str
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def _estimate_plan(template: GpuTemplate, ctx: Context) -> Optional[Plan]:
    """The estimate a template is judged against: the record, else its trusted annotations."""
    ref, _ = template
    recorded = record_plan(ref, ctx)
    if recorded is not None:
        return recorded
    carried = carried_plan(ref, ctx)
    if carried is not None and carried.estimate_bytes > 0:
        return carried
    return None


def _request_violations(template: GpuTemplate, plan: Plan, ctx: Context) -> List[Violation]:
    ref, containers = template
    floor = sizing.floor_bytes(plan.judged_bytes, ctx.settings)
    allowance = f"{ctx.settings.overcommit_percent:g}%"
    why = (
        f"below the {plan.target.gpu.key} estimate of {gib(plan.judged_bytes)} GiB less the "
        f"{allowance} overcommit allowance ({gib(floor)} GiB)"
    )
    found: List[Violation] = []
    carried = annotated_plan(ref, ctx.settings)
    if carried is not None and carried.request_bytes < floor:
        found.append(Violation(
            ref.field("metadata", "annotations", labels.REQUEST_BYTES),
            f"requests {gib(carried.request_bytes)} GiB, {why}",
        ))
    backend = backends.for_name(plan.target.backend)
    for slot, container, _count in containers:
        existing = backend.existing(ref.template, slot, container, plan.target.gpu)
        if existing is None or existing.bytes_per_gpu is None:
            continue
        if existing.bytes_per_gpu < floor:
            prefix = ".".join(p for p in (ref.field(), existing.field) if p)
            found.append(Violation(
                prefix,
                f"container {container.get('name')!r} asks {existing.what} "
                f"({gib(existing.bytes_per_gpu)} GiB per GPU), {why}",
            ))
    return found


def _untrusted_sizing(templates: List[GpuTemplate], ctx: Context) -> List[Violation]:
    """Sizing annotations written by someone other than the controller, where they differ from
    what xmem writes itself for the recorded estimate."""
    found: List[Violation] = []
    for ref, _ in templates:
        present = sizing_annotations(ref.template)
        if not present:
            continue
        plan = record_plan(ref, ctx)
        expected = plan.annotations() if plan is not None else {}
        for key, value in present.items():
            if expected.get(key) != value:
                found.append(Violation(
                    ref.field("metadata", "annotations", key),
                    "only the xmem controller sets this annotation",
                ))
                break
    return found


def _governed(integration: Integration, obj: Mapping[str, Any]) -> Any:
    """What the policy governs in a workload: its pod templates, the suspend flag, its
    ``xmem.io/`` annotations. Two versions that agree on these are the same to the policy."""
    templates = [ref.template for ref in integration.pod_templates(obj)]
    suspended = integration.is_suspended(obj) if integration.can_hold else None
    return templates, suspended, xmem_annotations(obj.get("metadata"))


def _changed_by_someone_else(
    integration: Integration, obj: Mapping[str, Any], old: Mapping[str, Any], ctx: Context
) -> List[Violation]:
    """What only the controller may change: ``xmem.io/`` annotations, a held workload's suspend."""
    found: List[Violation] = []
    before, after = xmem_annotations(old.get("metadata")), xmem_annotations(obj.get("metadata"))
    for key in sorted(set(before) | set(after)):
        if before.get(key) != after.get(key) and key != labels.FINGERPRINT:
            found.append(Violation(f"metadata.annotations[{key}]",
                                   "only the xmem controller changes this annotation"))
    old_refs = {ref.path: ref.template for ref in integration.pod_templates(old)}
    for ref in integration.pod_templates(obj):
        was = sizing_annotations(old_refs.get(ref.path) or {})
        now = sizing_annotations(ref.template)
        for key in sorted(set(was) | set(now)):
            if was.get(key) != now.get(key):
                found.append(Violation(ref.field("metadata", "annotations", key),
                                       "only the xmem controller changes this annotation"))
    held = labels.HELD_REASON in xmem_annotations(old.get("metadata"))
    if integration.can_hold and held and integration.is_suspended(old) \
            and not integration.is_suspended(obj):
        field = ".".join(integration.suspend_path)
        found.append(Violation(field, "the workload is held until its GPU memory is estimated; "
                               "only the xmem controller releases it"))
    return found


def validate(
    integration: Integration,
    obj: Mapping[str, Any],
    ctx: Context,
    templates: Optional[List[GpuTemplate]] = None,
    old: Optional[Mapping[str, Any]] = None,
    by_controller: bool = False,
) -> List[Violation]:
    """Every violation of the policy by this object (empty: nothing to refuse).

    ``old`` is the stored object on UPDATE; ``by_controller`` says the xmem controller asks.
    """
    if ctx.operation not in ("CREATE", "UPDATE"):
        return []
    if templates is None:
        templates = gpu_templates(integration, obj)
    found: List[Violation] = []
    if ctx.operation == "UPDATE" and old is not None:
        if _governed(integration, obj) == _governed(integration, old):
            return []
        if not by_controller:
            found.extend(_changed_by_someone_else(integration, obj, old, ctx))
    if not templates:
        return found
    if not ctx.trusted and ctx.operation == "CREATE":
        found.extend(_untrusted_sizing(templates, ctx))
    if ctx.record is not None and any(
        carried_plan(ref, ctx) is None and record_plan(ref, ctx) is None for ref, _ in templates
    ):
        found.append(Violation("spec", sizing.misfit(ctx.record, ctx.settings)))
    judged = False
    for template in templates:
        plan = _estimate_plan(template, ctx)
        if plan is None:
            continue
        judged = True
        found.extend(_request_violations(template, plan, ctx))
    unsized = not judged and ctx.record is None and all(
        carried_plan(ref, ctx) is None for ref, _ in templates)
    if unsized and ctx.operation == "CREATE" and not ctx.owned and not ctx.queued \
            and not _held(integration, obj):
        what = "bare Pod" if not integration.can_hold else integration.kind
        why = "" if not integration.can_hold else (
            " that is not held for estimation" if ctx.can_hold else
            " (no xmem controller runs to estimate it)")
        found.append(Violation(
            "metadata",
            f"no recorded GPU memory estimate for this {what}{why} (fingerprint "
            f"{ctx.fingerprint})",
        ))
    return found


def _held(integration: Integration, obj: Mapping[str, Any]) -> bool:
    return integration.can_hold and integration.is_suspended(obj) and \
        labels.HELD_REASON in xmem_annotations(obj.get("metadata"))
