"""The validation: what the policy refuses, as violations with field paths (Kueue's shape).

Run by ``/validate`` (after every mutating webhook, so it sees the object as it will be stored)
on CREATE and UPDATE. When the namespace's policy enforces, any violation denies the request;
otherwise each becomes a kubectl warning. The violations:

- the recorded estimate fits no GPU of the policy (the message says by how much, and what would
  fit);
- a GPU memory request set by hand (in the backend's form, or as ``xmem.io/request-bytes``)
  below the estimate less the overcommit allowance: E * (1 - overcommitPercent/100);
- a bare Pod with no estimate at all (it could never be held and resized later).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional

from xmem_admission.cluster import backends, labels
from xmem_admission.cluster.admission.mutation import Context, annotated_plan, record_plan
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
    """The estimate a template is judged against: its own annotations, else the record."""
    ref, _ = template
    recorded = record_plan(ref, ctx)
    if recorded is not None:
        return recorded
    carried = annotated_plan(ref, ctx.settings)
    if carried is not None and carried.estimate_bytes > 0:
        return carried
    return None


def _request_violations(template: GpuTemplate, plan: Plan, ctx: Context) -> List[Violation]:
    ref, containers = template
    floor = sizing.floor_bytes(plan.estimate_bytes, ctx.settings)
    allowance = f"{ctx.settings.overcommit_percent:g}%"
    why = (
        f"below the {plan.target.gpu.key} estimate of {gib(plan.estimate_bytes)} GiB less the "
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
    for index, container, _count in containers:
        existing = backend.existing(ref.template, index, container, plan.target.gpu)
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


def validate(
    integration: Integration,
    obj: Mapping[str, Any],
    ctx: Context,
    templates: Optional[List[GpuTemplate]] = None,
) -> List[Violation]:
    """Every violation of the policy by this object (empty: nothing to refuse)."""
    if ctx.operation not in ("CREATE", "UPDATE"):
        return []
    if templates is None:
        templates = gpu_templates(integration, obj)
    if not templates:
        return []
    found: List[Violation] = []
    if ctx.record is not None and any(
        annotated_plan(ref, ctx.settings) is None and record_plan(ref, ctx) is None
        for ref, _ in templates
    ):
        found.append(Violation("spec", sizing.misfit(ctx.record, ctx.settings)))
    judged = False
    for template in templates:
        plan = _estimate_plan(template, ctx)
        if plan is None:
            continue
        judged = True
        found.extend(_request_violations(template, plan, ctx))
    if (
        not judged
        and ctx.record is None
        and all(annotated_plan(ref, ctx.settings) is None for ref, _ in templates)
        and not integration.can_hold
        and integration.owner(obj) is None
    ):
        found.append(Violation(
            "metadata",
            f"no recorded GPU memory estimate for this bare Pod (fingerprint {ctx.fingerprint})",
        ))
    return found
