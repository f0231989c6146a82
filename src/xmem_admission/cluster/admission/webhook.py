"""The webhook's core: review bytes in, review bytes out, with no web framework in sight.

``Webhook.review`` is all the ASGI app calls, so tests, the benchmark and a real cluster drive
the same code. It reads the envelope, finds the integration, checks the opt-in and the policy,
looks the estimate up once, runs the pure mutation or validation, diffs, and builds the answer
with ``response.build``; whatever goes wrong becomes a ranked AdmissionResponse, never an
exception out of here.

Opt-in and the two webhook entries: an AdmissionReview does not carry the namespace's labels,
so the webhook configuration selects and the path says which entry sent the review:

- ``/mutate/namespace``, ``/validate/namespace``: the entry with a namespaceSelector on
  ``xmem.io/estimate=true``; everything it sends is opted in, except a workload that opts
  itself out with its own label ``xmem.io/estimate: "false"``: admitted unchanged where the
  namespace's policy warns, judged as any other (with a warning saying so) where it enforces,
  so a tenant cannot step around an admin's Enforce;
- ``/mutate/object``, ``/validate/object`` (and plain ``/mutate``, ``/validate``): the entry with
  an objectSelector on the same label; the webhook still checks the object's own label, so an
  entry without a selector can never opt everything in by mistake.

An object in an opted-in namespace that also carries the label is reviewed twice; the mutation
is idempotent, so the second pass patches nothing (the chart may exclude opted-in namespaces
from the object entry to save the call).

Workload kinds whose pod templates live elsewhere (a Kubeflow ``TrainJob``: its runtime's) are
resolved first through ``reader`` (``Integration.resolve``: the runtime is read from the API
server, once per review); a runtime that is missing or cannot be read is an object that cannot
be read (refused where the policy enforces, admitted with a warning where it warns, saying
which runtime and why), never an error of the webhook. A part of a held workload (a JobSet a
TrainJob made, a Job a JobSet made: ``integrations.part_of_held_workload``), created by a
workload controller, passes unchanged: its owner is the workload that is held and sized.

dryRun: the answer (patch, warnings, denial) is the same, but nothing is counted as held or
applied and the ``on_hold`` hook (the controller's queue when run in one process) is not called.

Trust (``trust``): the requester (``userInfo``) decides whether ``xmem.io/`` annotations are
believed, whether a Pod counts as owned, and who may release a held workload; an admin's
``xmem.io/break-glass`` annotation admits a workload unchanged (``break_glass``). Estimates are
looked up in the workload's own namespace and those the policy shares with it, never elsewhere.

An opted-in object that cannot be read (a field of the wrong shape, a quantity out of range, a
bug of ours) fails closed where the namespace's policy enforces (refused, and the answer says
so) and open where it only warns (admitted unchanged, with a warning that says so).
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

from xmem_admission.cluster import integrations, labels
from xmem_admission.cluster.admission import break_glass, request, response
from xmem_admission.cluster.admission.metrics import AdmissionMetrics
from xmem_admission.cluster.admission.mutation import Context, mutate
from xmem_admission.cluster.admission.request import Request
from xmem_admission.cluster.admission.response import Decision, Verdict
from xmem_admission.cluster.admission.trust import Trust
from xmem_admission.cluster.admission.validation import validate
from xmem_admission.cluster.integrations.base import (
    GpuTemplate,
    Integration,
    Reader,
    estimation_units,
    fingerprint_of,
    part_of_held_workload,
)
from xmem_admission.cluster.kube.jsonpatch import diff
from xmem_admission.cluster.kube.resources import gpu_containers
from xmem_admission.cluster.policy.fingerprint import Versions
from xmem_admission.cluster.policy.model import Policy, Settings
from xmem_admission.cluster.policy.sizing import covered
from xmem_admission.cluster.policy.sources import PolicySource
from xmem_admission.cluster.policy.store import (
    EstimateRecord,
    EstimateStore,
    RetryGrant,
    WorkloadRef,
)
from xmem_admission.contract.errors import (
    InvalidObjectError,
    MalformedReviewError,
    UnsupportedKindError,
)

log = logging.getLogger(__name__)


# The value of labels.OPT_IN by which a workload in a labelled namespace opts itself out.
OPT_OUT_VALUE = "false"


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
        trust: Optional[Trust] = None,
        hold: bool = True,
        reader: Optional[Reader] = None,
        versions: Optional[Callable[[str], Versions]] = None,
    ):
        self.policy = policy
        self.store = store
        self.metrics = metrics if metrics is not None else AdmissionMetrics()
        self.clock = clock
        self.on_hold = on_hold
        self.trust = trust if trust is not None else Trust()
        self.hold = hold  # False: no controller runs, so nothing would release a held workload
        self.reader = reader  # the API, for kinds whose templates are resolved (a TrainJob's)
        # namespace -> the lookup of ConfigMap versions the fingerprint reads: a metadata-only
        # cache (``Informer.versions``), never a request per review; None: names only.
        self.versions = versions

    def review(self, body: bytes, endpoint: Endpoint, scope: Scope = Scope.OBJECT) -> bytes:
        """Answer one AdmissionReview (the HTTP body); always returns a review to send back."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        envelope = request.Envelope()
        kind = operation = "unknown"
        settings: Optional[Settings] = None
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
            policy = self.policy.current()
            settings = policy.for_namespace(req.namespace) if policy is not None else None
            verdict = self._decide(req, integration, endpoint, scope, policy, settings)
        except Exception as exc:  # ranked: input errors refused, unreadable objects by mode
            verdict = self._failed(exc, kind, settings)
        try:
            out = response.build(envelope.uid, verdict, envelope.api_version)
        except Exception:  # an unserialisable patch value: still answer, unchanged
            log.exception("cannot serialise the admission response")
            self.metrics.policy_errors.labels("internal").inc()
            verdict = self._failed(RuntimeError("response serialisation"), kind, settings)
            out = response.build(envelope.uid, verdict, envelope.api_version)
        self.metrics.requests.labels(endpoint.value, kind, operation, verdict.decision.value).inc()
        self.metrics.latency.labels(endpoint.value).observe(time.perf_counter() - started)
        self.metrics.cpu.labels(endpoint.value).observe(time.thread_time() - cpu_started)
        return out

    def _failed(self, exc: BaseException, kind: str, settings: Optional[Settings]) -> Verdict:
        """The answer when something went wrong: a malformed review or an unknown kind is
        refused (400); an opted-in object that cannot be read fails closed or open by the
        namespace's enforcement; an error of ours is logged and counted."""
        if not isinstance(exc, (MalformedReviewError, UnsupportedKindError, InvalidObjectError)):
            log.exception("internal error answering an admission review", exc_info=exc)
            self.metrics.policy_errors.labels("internal").inc()
        if settings is None or not settings.enabled or isinstance(
                exc, (MalformedReviewError, UnsupportedKindError)):
            return response.verdict_for_error(exc)
        return response.unreadable(exc, kind, settings.enforcing)

    # --- decisions -------------------------------------------------------------------------

    def _decide(
        self, req: Request, integration: Integration, endpoint: Endpoint, scope: Scope,
        policy: Optional[Policy], settings: Optional[Settings],
    ) -> Verdict:
        obj = req.obj
        if req.operation not in ("CREATE", "UPDATE") or req.sub_resource or obj is None:
            return Verdict(Decision.ALLOWED)
        metadata = obj.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise InvalidObjectError("metadata: expected an object")
        if scope is Scope.OBJECT and not (
                labels.is_opted_in(metadata.get("labels")) or _opted_in(req.old_obj)):
            return Verdict(Decision.ALLOWED)
        if policy is None or settings is None:
            return Verdict(Decision.ALLOWED, warnings=["xmem: no policy loaded; admitted unchanged"])
        if not settings.enabled:
            return Verdict(Decision.ALLOWED)
        if req.operation == "UPDATE" and metadata.get("deletionTimestamp"):
            return Verdict(Decision.ALLOWED)  # being deleted: finalizers must be able to go
        glass = break_glass.assess(req, integration, self.trust,
                                   lambda: self._provenance(req, integration, obj)[1])
        if glass.honoured:
            return break_glass.admit(glass, req, integration, obj,
                                     endpoint is Endpoint.MUTATE, self.metrics)
        return glass.noted(self._decide_usual(req, integration, endpoint, scope, policy, settings,
                                              obj, metadata))

    def _decide_usual(
        self, req: Request, integration: Integration, endpoint: Endpoint, scope: Scope,
        policy: Policy, settings: Settings, obj: Dict[str, Any], metadata: Dict[str, Any],
    ) -> Verdict:
        """``_decide`` for an object the policy applies to and no break-glass exempts."""
        if self._part_of_held_workload(req, integration, obj):
            return Verdict(Decision.ALLOWED)  # its owner is the workload held and sized
        if scope is Scope.NAMESPACE and _opted_out(metadata):
            if not settings.enforcing:
                return Verdict(Decision.ALLOWED)  # the workload's own opt-out, under Warn
            verdict = self._judge(req, integration, endpoint, policy, settings, obj, metadata)
            verdict.warnings.insert(0, (
                f"xmem: {labels.OPT_IN}={OPT_OUT_VALUE} is not honoured: the policy enforces in "
                f"namespace {req.namespace}, so only an admin can exempt a workload there"))
            return verdict
        return self._judge(req, integration, endpoint, policy, settings, obj, metadata)

    def _judge(
        self, req: Request, integration: Integration, endpoint: Endpoint, policy: Policy,
        settings: Settings, obj: Dict[str, Any], metadata: Dict[str, Any],
    ) -> Verdict:
        """``_decide`` for an object the policy applies to."""
        if integration.resolves:
            reader = CachingReader(self.reader) if self.reader is not None else None
            obj = integration.resolve(obj, reader)
            if req.old_obj is not None:
                req = replace(req, old_obj=integration.resolve(req.old_obj, reader))
        refs = integration.pod_templates(obj)
        groups = [list(gpu_containers(ref.template)) for ref in refs]
        templates = [(ref, group) for ref, group in zip(refs, groups) if group]
        if not templates and req.operation == "CREATE":
            return Verdict(Decision.ALLOWED)
        versions = self.versions(req.namespace) if self.versions is not None else None
        fp = fingerprint_of(integration, obj, settings.gpu_keys, groups, versions)
        shared = policy.shares_with(req.namespace)
        owned, trusted = self._provenance(req, integration, obj)
        units = estimation_units(integration, obj, settings.gpu_keys, versions) \
            if len(templates) > 1 else []
        by_path: Dict[Tuple[Any, ...], EstimateRecord] = {}
        if len(units) > 1:  # GPU templates that run different programs: each its own estimate
            found = [self._lookup(u.fingerprint, req.namespace, shared, settings,
                                  [templates[i] for i in u.templates], endpoint, trusted)
                     for u in units]
            by_path = {templates[i][0].path: rec for u, rec in zip(units, found)
                       if rec is not None for i in u.templates}
            record = found[0] if all(rec is not None for rec in found) else None
        else:
            record = self._lookup(fp, req.namespace, shared, settings, templates, endpoint,
                                  trusted) if templates else None
        queued = settings.kueue and integration.can_hold and bool(
            labels.kueue_queue(metadata.get("labels")))
        retry = self._retry(req, integration, obj) if owned and trusted and templates else None
        ctx = Context(req.operation, req.namespace, settings, fp, record, self.clock(),
                      trusted=trusted, owned=owned, can_hold=self.hold, queued=queued,
                      retry=retry, template_records=by_path)
        if endpoint is Endpoint.MUTATE:
            return self._mutate(req, integration, obj, ctx, templates)
        by_controller = self.trust.is_controller(req.user) or (
            queued and self.trust.is_kueue(req.user))
        violations = validate(integration, obj, ctx, templates, old=req.old_obj,
                              by_controller=by_controller)
        if not violations:
            return Verdict(Decision.ALLOWED)
        if settings.enforcing:
            return Verdict.deny("xmem: " + "; ".join(str(v) for v in violations))
        return Verdict(Decision.ALLOWED, warnings=[f"xmem: {v}" for v in violations])

    def _part_of_held_workload(self, req: Request, integration: Integration,
                               obj: Dict[str, Any]) -> bool:
        """A workload another held workload's controller made for it: at CREATE from a workload
        controller (or the xmem controller), at UPDATE one that was such a part already."""
        if not integration.can_hold or part_of_held_workload(obj) is None:
            return False
        if req.operation == "UPDATE":
            return req.old_obj is not None and part_of_held_workload(req.old_obj) is not None
        return self.trust.is_workload_controller(req.user) or self.trust.is_controller(req.user)

    def _provenance(self, req: Request, integration: Integration,
                    obj: Dict[str, Any]) -> Tuple[bool, bool]:
        """(owned, trusted): whether a workload controller created this Pod for an owner, and
        whether its ``xmem.io/`` sizing annotations may be believed (see ``trust``)."""
        if self.trust.is_controller(req.user):
            return integration.owner(obj) is not None, True
        if integration.can_hold or not self.trust.is_workload_controller(req.user):
            return False, False
        owner = integration.owner(obj)
        if owner is None:
            return False, False
        holds = any(i.can_hold and i.kind == owner.get("kind") for i in integrations.ALL)
        return True, holds

    def _retry(self, req: Request, integration: Integration,
               obj: Dict[str, Any]) -> Optional[RetryGrant]:
        """The OOM retry grant of the workload that owns this Pod (its controller created the
        Pod, so the owner reference is its own): by the owner's uid, in the Pod's namespace
        only, never one shared with it (the message the grant grew from is the tenant's)."""
        if integration.can_hold or req.operation != "CREATE":
            return None
        owner = integration.owner(obj)
        uid = owner.get("uid") if owner is not None else None
        if not isinstance(uid, str) or not uid:
            return None
        return self.store.retry(req.namespace, uid)

    def _lookup(
        self, fp: str, namespace: str, shared: FrozenSet[str], settings: Settings,
        templates: List[GpuTemplate], endpoint: Endpoint, trusted: bool,
    ) -> Optional[EstimateRecord]:
        sized = all(
            all(k in ((ref.template.get("metadata") or {}).get("annotations") or {})
                for k in (labels.REQUEST_BYTES, labels.ESTIMATE_BYTES))
            for ref, _ in templates
        )
        if sized and trusted and endpoint is Endpoint.MUTATE:
            # Every GPU template carries its sizing from the controller (the Pod CREATE of a
            # released workload): the mutation needs no lookup. Validation always looks, so a
            # hand-written estimate annotation cannot stand in for the recorded one.
            return None
        return self._find(fp, namespace, shared, settings)

    def _find(self, fp: str, namespace: str, shared: FrozenSet[str],
              settings: Settings) -> Optional[EstimateRecord]:
        record = self.store.get(fp, namespace, shared)
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
                self.metrics.right_sizing(plan)
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


class CachingReader:
    """A ``Reader`` that reads each object once (one review reads a runtime for the object and
    again for its stored version)."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self.seen: Dict[Tuple[Any, ...], Dict[str, Any]] = {}

    def get(self, kind: Any, namespace: str, name: str) -> Dict[str, Any]:
        key = (kind, namespace, name)
        if key not in self.seen:
            self.seen[key] = self.reader.get(kind, namespace, name)
        return self.seen[key]

    def get_cluster(self, kind: Any, name: str) -> Dict[str, Any]:
        key = (kind, "", name)
        if key not in self.seen:
            self.seen[key] = self.reader.get_cluster(kind, name)
        return self.seen[key]


def _opted_out(metadata: Dict[str, Any]) -> bool:
    """Whether a workload in an opted-in namespace opts itself out (``xmem.io/estimate:
    "false"``); honoured where the namespace's policy warns, not where it enforces."""
    found = metadata.get("labels")
    return isinstance(found, dict) and found.get(labels.OPT_IN) == OPT_OUT_VALUE


def _opted_in(old: Optional[Dict[str, Any]]) -> bool:
    """Whether the stored version of an updated object was opted in (taking the label off is
    itself an update the webhook judges)."""
    meta = (old or {}).get("metadata")
    return isinstance(meta, dict) and labels.is_opted_in(meta.get("labels"))
