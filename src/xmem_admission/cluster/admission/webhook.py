"""The webhook's core: review bytes in, review bytes out, with no web framework in sight.

``Webhook.review`` is all the ASGI app calls, so tests, the benchmark and a real cluster drive
the same code. It reads the envelope, finds the integration, checks the opt-in and the policy,
looks the estimate up once, runs the pure mutation or validation, diffs, and builds the answer
with ``response.build``; whatever goes wrong becomes a ranked AdmissionResponse, never an
exception out of here.

Opt-in and the two webhook entries: an AdmissionReview does not carry the namespace's labels,
so the webhook configuration selects and the path says which entry sent the review:

- ``/mutate/namespace``, ``/validate/namespace``: the entry with a namespaceSelector on
  ``xmem.io/estimate=true``; everything it sends is opted in;
- ``/mutate/object``, ``/validate/object`` (and plain ``/mutate``, ``/validate``): the entry with
  an objectSelector on the same label; the webhook still checks the object's own label, so an
  entry without a selector can never opt everything in by mistake.

An object in an opted-in namespace that also carries the label is reviewed twice; the mutation
is idempotent, so the second pass patches nothing (the chart may exclude opted-in namespaces
from the object entry to save the call).

dryRun: the answer (patch, warnings, denial) is the same, but nothing is counted as held or
applied and the ``on_hold`` hook (the controller's queue when run in one process) is not called.
"""

from __future__ import annotations

import enum
import logging
import time
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Optional

from xmem_admission.cluster import integrations, labels
from xmem_admission.cluster.admission import request, response
from xmem_admission.cluster.admission.metrics import AdmissionMetrics
from xmem_admission.cluster.admission.mutation import Context, mutate
from xmem_admission.cluster.admission.request import Request
from xmem_admission.cluster.admission.response import Decision, Verdict
from xmem_admission.cluster.admission.validation import validate
from xmem_admission.cluster.integrations.base import GpuTemplate, Integration
from xmem_admission.cluster.kube.jsonpatch import diff
from xmem_admission.cluster.kube.resources import gpu_containers
from xmem_admission.cluster.policy import fingerprint
from xmem_admission.cluster.policy.model import Settings
from xmem_admission.cluster.policy.sizing import covered
from xmem_admission.cluster.policy.sources import PolicySource
from xmem_admission.cluster.policy.store import EstimateRecord, EstimateStore, WorkloadRef
from xmem_admission.contract.errors import InvalidObjectError, UnsupportedKindError

log = logging.getLogger(__name__)


class Endpoint(str, enum.Enum):
    MUTATE = "mutate"
    VALIDATE = "validate"


class Scope(str, enum.Enum):
    """Which webhook entry sent the review (see the module docstring)."""

    OBJECT = "object"
    NAMESPACE = "namespace"


# Called once per workload newly held (never for dryRun): (workload, fingerprint).
HoldHook = Callable[[WorkloadRef, str], None]


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class Webhook:
    """Answers AdmissionReviews for the configured policy and estimate store."""

    def __init__(
        self,
        policy: PolicySource,
        store: EstimateStore,
        metrics: Optional[AdmissionMetrics] = None,
        clock: Callable[[], str] = utc_now,
        on_hold: Optional[HoldHook] = None,
    ):
        self.policy = policy
        self.store = store
        self.metrics = metrics if metrics is not None else AdmissionMetrics()
        self.clock = clock
        self.on_hold = on_hold

    def review(self, body: bytes, endpoint: Endpoint, scope: Scope = Scope.OBJECT) -> bytes:
        """Answer one AdmissionReview (the HTTP body); always returns a review to send back."""
        started = time.perf_counter()
        envelope = request.Envelope()
        kind = operation = "unknown"
        try:
            document = request.decode(body)
            envelope = request.envelope(document)
            req = request.parse(document)
            operation = req.operation
            integration = integrations.for_kind(req.group, req.version, req.kind)
            if integration is None:
                kind = "other"
                raise UnsupportedKindError(
                    f"xmem does not handle {req.group or 'core'}/{req.version} {req.kind}: the "
                    f"webhook rules should send only {', '.join(i.kind for i in integrations.ALL)}"
                )
            kind = integration.kind
            verdict = self._decide(req, integration, endpoint, scope)
        except Exception as exc:  # ranked: input errors refused, bugs fail open
            verdict = response.verdict_for_error(exc)
            if verdict.decision is Decision.FAILED_OPEN:
                log.exception("internal error answering an admission review")
                self.metrics.policy_errors.labels("internal").inc()
        try:
            out = response.build(envelope.uid, verdict, envelope.api_version)
        except Exception:  # an unserialisable patch value: still answer, unchanged
            log.exception("cannot serialise the admission response")
            self.metrics.policy_errors.labels("internal").inc()
            verdict = response.verdict_for_error(RuntimeError("response serialisation"))
            out = response.build(envelope.uid, verdict, envelope.api_version)
        self.metrics.requests.labels(endpoint.value, kind, operation, verdict.decision.value).inc()
        self.metrics.latency.labels(endpoint.value).observe(time.perf_counter() - started)
        return out

    # --- decisions -------------------------------------------------------------------------

    def _decide(
        self, req: Request, integration: Integration, endpoint: Endpoint, scope: Scope
    ) -> Verdict:
        obj = req.obj
        if req.operation not in ("CREATE", "UPDATE") or req.sub_resource or obj is None:
            return Verdict(Decision.ALLOWED)
        metadata = obj.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise InvalidObjectError("metadata: expected an object")
        if scope is Scope.OBJECT and not labels.is_opted_in(metadata.get("labels")):
            return Verdict(Decision.ALLOWED)
        policy = self.policy.current()
        if policy is None:
            return Verdict(Decision.ALLOWED, warnings=["xmem: no policy loaded; admitted unchanged"])
        settings = policy.for_namespace(req.namespace)
        if not settings.enabled:
            return Verdict(Decision.ALLOWED)
        refs = integration.pod_templates(obj)
        groups = [list(gpu_containers(ref.template)) for ref in refs]
        templates = [(ref, group) for ref, group in zip(refs, groups) if group]
        if not templates:
            return Verdict(Decision.ALLOWED)
        fp = fingerprint.of_containers(groups, settings.gpu_keys)
        record = self._lookup(fp, settings, templates, endpoint)
        ctx = Context(req.operation, req.namespace, settings, fp, record, self.clock())
        if endpoint is Endpoint.MUTATE:
            return self._mutate(req, integration, obj, ctx, templates)
        violations = validate(integration, obj, ctx, templates)
        if not violations:
            return Verdict(Decision.ALLOWED)
        if settings.enforcing:
            return Verdict.deny("xmem: " + "; ".join(str(v) for v in violations))
        return Verdict(Decision.ALLOWED, warnings=[f"xmem: {v}" for v in violations])

    def _lookup(
        self, fp: str, settings: Settings, templates: List[GpuTemplate], endpoint: Endpoint
    ) -> Optional[EstimateRecord]:
        sized = all(
            all(k in ((ref.template.get("metadata") or {}).get("annotations") or {})
                for k in (labels.REQUEST_BYTES, labels.ESTIMATE_BYTES))
            for ref, _ in templates
        )
        if sized and endpoint is Endpoint.MUTATE:
            # Every GPU template carries its sizing (the Pod CREATE of a released workload): the
            # mutation needs no lookup. Validation always looks, so a hand-written estimate
            # annotation cannot stand in for the recorded one.
            return None
        record = self.store.get(fp)
        self.metrics.cache.labels("hit" if record is not None else "miss").inc()
        if record is not None and not covered(record, settings):
            return None
        return record

    def _mutate(
        self,
        req: Request,
        integration: Integration,
        obj: Dict[str, Any],
        ctx: Context,
        templates: List[GpuTemplate],
    ) -> Verdict:
        after, outcome = mutate(integration, obj, ctx, templates)
        if outcome.decision is Decision.DENIED:
            return Verdict.deny(outcome.message, outcome.warnings)
        ops = diff(obj, after)
        if outcome.held:
            decision = Decision.HELD
        else:
            decision = Decision.MUTATED if ops else Decision.ALLOWED
        if not req.dry_run:
            workload = integration.workload_ref(obj, req.namespace)
            if outcome.held:
                self.metrics.held.labels(integration.kind).inc()
                if self.on_hold is not None:
                    self.on_hold(workload, ctx.fingerprint)
            for plan in outcome.applied:
                gpu = plan.target.gpu.key
                self.metrics.applied.labels(integration.kind, gpu, plan.target.backend.value).inc()
                self.metrics.record_request(
                    req.namespace, workload.name, integration.kind, gpu, plan.request_bytes
                )
            owner = integration.owner(obj) if outcome.carried else None
            for plan in outcome.carried:
                # A released workload's pods carry the request in an annotation: record it under
                # the owning workload (the Job), which is what dashboards join actual usage on.
                kind, name = ((str(owner.get("kind") or ""), str(owner.get("name") or ""))
                              if owner else (integration.kind, workload.name))
                self.metrics.record_request(
                    req.namespace, name, kind, plan.target.gpu.key, plan.request_bytes
                )
        return Verdict(decision, patch=ops, warnings=outcome.warnings)
