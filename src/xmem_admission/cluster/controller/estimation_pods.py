"""Reconcile one ``GPUMemoryEstimate``: run its estimation pod and record how it ended.

Steps, each idempotent and each ending in one write (so a crash between two leaves a state the
next reconcile continues from):

1. a terminal estimate (``Succeeded``/``Failed``) only has leftovers cleaned: a pod that is
   still pending or running after a failure (stuck pulling an image) is deleted, and a
   succeeded one whose delete after the result was lost;
2. no pod for the current attempt: create it once the line grants it a slot
   (``estimation_line``: first come, first served in a namespace, round-robin across
   namespaces, under the policy's ``maxConcurrentPerNamespace`` and ``maxConcurrent``), named
   after its workload (``podspec.pod_name``), then record ``Running``, ``podName`` and
   ``startTime``; a pod the API server refuses (a ResourceQuota's 403 ``exceeded quota``, a
   LimitRange) is a Warning Event on the waiting workloads (``EstimationQuotaExceeded``,
   ``EstimationPodRefused``, once per run of refusals) and is tried again with back-off; the
   pods of earlier attempts, kept after their failure, are deleted; a pod that vanished while
   running (evicted, deleted by hand) is replaced by a new attempt, up to ``max_attempts``;
   a pod is ours only when its controlling owner reference carries this GME's uid: one that
   merely has the name (a 409 AlreadyExists included) is someone else's, and the estimation
   fails (``PodNameTaken``) instead of reading a result its author wrote;
3. a pod that finished, or is stuck (image pull failure, bad config), or outlived
   ``activeDeadlineSeconds`` plus a slack (an unschedulable pod never starts its own clock):
   classify it (``pod_outcome``; a pod that carries several estimates, ``batches``) and record
   ``Succeeded`` with the estimates, then delete the pod (the estimate holds everything it
   said), or ``Failed`` with a reason and a message that quotes the script's last log lines
   (one that carries several: traces not run go back to the line, which is woken), keeping a finished pod for ``kubectl logs`` (it goes with the next
   attempt or with its estimate);
4. ``actualBytes`` set by whoever measures the job on a GPU: the ``actual`` and
   ``relativeErrorPercent`` columns are filled in.

Every status write brings the conditions along (``records.with_status``); an estimate whose
conditions lag its status (an older release wrote it) is written once more, and one queued
for its pod is written ``Pending`` with ``Estimating=True`` (``Queued``).

Failure reasons: those of a pod that ended (``pod_outcome``), and ``DeadlineExceeded``,
``PodDeleted``, ``PodNameTaken``.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any, Dict, Optional, Tuple

from xmem_admission.cluster.backends import dra
from xmem_admission.cluster.controller import (
    batches,
    estimate_cache,
    estimation_line,
    podspec,
    records,
)
from xmem_admission.cluster.controller.context import Context, Workload
from xmem_admission.cluster.controller.pod_outcome import Outcome, classify, statuses
from xmem_admission.cluster.integrations import NotResolved, gpu_templates
from xmem_admission.cluster.kube.client import GME, POD, Obj
from xmem_admission.cluster.policy import sizing
from xmem_admission.cluster.policy.model import BackendName
from xmem_admission.contract import probe_env
from xmem_admission.contract.errors import InvalidObjectError, KubeApiError

log = logging.getLogger(__name__)


def owner(ctx: Context, gme: Obj) -> Optional[Tuple[Workload, Obj]]:
    """The live workload the pod is built from: one waiting on the GME (``estimate_cache``)."""
    return estimate_cache.waiter(ctx, gme)


def owns(gme: Obj, pod: Obj, controller: bool = False) -> bool:
    """Whether the controller made this pod for this GME: an owner reference names the GME's
    uid (a name and labels anyone can copy; a uid, only the API server assigns), its controlling
    one, or one of the estimates it carries (``batches``) unless ``controller``."""
    uid = gme["metadata"].get("uid")
    return bool(uid) and any(
        isinstance(ref, dict) and (ref.get("controller") is True or (
            not controller and podspec.CARRIED in (pod["metadata"].get("annotations") or {})))
        and ref.get("kind") == GME.kind
        and ref.get("uid") == uid for ref in pod["metadata"].get("ownerReferences") or [])


running = estimation_line.running


def current_pod_name(gme: Obj) -> str:
    """The pod of the estimate's current attempt: the one recorded once started (an older
    release's name included), else the one it will be created as."""
    status = gme.get("status") or {}
    if records.phase(gme) != records.PENDING and status.get("podName"):
        return str(status["podName"])
    return podspec.pod_name(gme)


def at_capacity(ctx: Context, namespace: str, settings: Any) -> Optional[str]:
    """Why no estimation pod may start now (the policy's caps), or None."""
    live = [p for p in ctx.pods.items() if running(p) and estimation_line.is_estimation_pod(p)]
    policy = ctx.policy.current()
    cluster_cap = policy.max_concurrent if policy is not None else settings.estimation.max_concurrent
    if len(live) >= cluster_cap:
        return f"{len(live)} estimation pods run in the cluster (maxConcurrent {cluster_cap})"
    here = sum(1 for p in live if p["metadata"].get("namespace") == namespace)
    cap = settings.estimation.max_concurrent_per_namespace
    if here >= cap:
        return f"{here} estimation pods run in {namespace} (maxConcurrentPerNamespace {cap})"
    return None


def _summary(ctx: Context, gme: Obj, status: Dict[str, Any]) -> None:
    """The kubectl columns: the GPU the policy would pick, estimate and request there."""
    settings = ctx.settings(gme["metadata"]["namespace"])
    record = records.record(dict(gme, status=status))
    if record is None or settings is None:
        return
    plan = sizing.plan(record, settings)
    if plan is None:
        smallest = min(record.gpus, key=lambda g: g.total_bytes)
        status.update(gpu="none fits", estimateBytes=smallest.total_bytes,
                      estimate=records.human(smallest.total_bytes))
        return
    status.update(gpu=plan.target.gpu.key, estimateBytes=plan.estimate_bytes,
                  estimate=records.human(plan.estimate_bytes), requestBytes=plan.request_bytes,
                  request=records.human(plan.request_bytes),
                  range=records.range_text(status.get("estimates") or [], plan.target.gpu.key))
    if plan.target.backend is BackendName.DRA and plan.target.dra is not None:  # DRA: the claim's form
        status.update(claim=dra.claim_form(plan.target.dra, plan.target.gpu, plan.request_bytes))
    if plan.overhead is not None:  # what the memory outside the allocator became
        status.update(overhead=plan.overhead.status(), overheadApplied=plan.overhead.column())


def needs_summary(gme: Obj) -> bool:
    """A succeeded estimate without the kubectl columns (GPU, estimate, request)."""
    return records.phase(gme) == records.SUCCEEDED and "gpu" not in (gme.get("status") or {})


def _write_status(ctx: Context, gme: Obj, status: Dict[str, Any]) -> Obj:
    written = ctx.kube.replace_status(GME, records.with_status(gme, status, ctx.now()))
    ctx.estimates.put(written)
    return written


def _enqueue_workloads(ctx: Context, gme: Obj) -> None:
    """Wake the held workloads waiting on this estimate."""
    estimate_cache.wake(ctx, gme)


def reconcile(ctx: Context, namespace: str, name: str) -> Optional[float]:
    """One pass over a GME; returns the delay after which to look again, or None."""
    gme = ctx.estimates.get(namespace, name)
    if gme is None or "deletionTimestamp" in gme["metadata"]:
        return None
    status = dict(gme.get("status") or {})
    phase = records.phase(gme)
    pod = ctx.pods.get(namespace, current_pod_name(gme))
    if pod is not None and not owns(gme, pod):
        if phase in records.TERMINAL:
            return None  # never delete someone else's pod
        _finish(ctx, gme, status, None, _name_taken(pod))
        return None
    if phase in records.TERMINAL:
        if phase == records.SUCCEEDED and needs_summary(gme):
            _summary(ctx, gme, status)  # recorded by someone else (KubeStore.put, an older run)
            if "gpu" in status:
                gme = _write_status(ctx, gme, status)
        if not _fill_error(ctx, gme, status) and records.conditions_lag(gme):
            _write_status(ctx, gme, status)  # written by an older release, or the spec changed
        if pod is not None and "deletionTimestamp" not in pod["metadata"] and (
                (phase == records.SUCCEEDED and batches.may_delete(ctx, pod)) or (pod.get("status") or {}).get("phase") in
                (None, "Pending", "Running")):
            ctx.kube.delete_pod(namespace, pod["metadata"]["name"], pod["metadata"]["uid"])
        return None
    found = owner(ctx, gme)
    if found is None:
        return None  # no workload waits: the next one to join queues it again
    workload, obj = found
    settings = ctx.settings(namespace)
    if settings is None:
        return 5.0  # no policy yet: limits and deadline unknown
    if pod is None or "deletionTimestamp" in pod["metadata"]:
        if phase == records.RUNNING and status.get("podName"):
            return _pod_lost(ctx, gme, status)
        if pod is not None:
            return 1.0  # the old pod is still terminating
        return _start(ctx, gme, status, workload, obj, settings)
    outcome = batches.outcome(ctx, pod, gme) if podspec.carried(pod) else classify(ctx, pod)
    if outcome is not None and outcome.reason == batches.REQUEUE:
        batches.requeue(ctx, gme, status, outcome.message == "solo", _write_status)
        estimation_line.wake(ctx)
        return None
    if outcome is None:
        started = records.parse_time(status.get("startTime")) or ctx.now()
        limit = float(pod["spec"].get("activeDeadlineSeconds") or
                      settings.estimation.active_deadline_seconds)
        overdue = started + datetime.timedelta(seconds=limit + ctx.deadline_slack)
        if ctx.now() < overdue:
            return min(30.0, max(1.0, (overdue - ctx.now()).total_seconds()))
        waiting = [((s.get("state") or {}).get("waiting") or {}).get("reason", "")
                   for s in statuses(pod, "containerStatuses")]
        outcome = Outcome(reason="DeadlineExceeded", message=f"the estimation pod did not finish "
                          f"within activeDeadlineSeconds={int(limit)} (phase "
                          f"{(pod.get('status') or {}).get('phase', 'Pending')}"
                          f"{', ' + ', '.join(w for w in waiting if w) if any(waiting) else ''})")
    _finish(ctx, gme, status, pod, outcome)
    return None


def _start(ctx: Context, gme: Obj, status: Dict[str, Any], workload: Workload, obj: Obj,
           settings: Any) -> Optional[float]:
    namespace = gme["metadata"]["namespace"]
    key = (namespace, gme["metadata"]["name"])
    if not ctx.line.granted(key):
        if records.conditions_lag(gme):  # kubectl shows it queued, not a blank row
            _write_status(ctx, gme, dict(status, phase=records.PENDING))
        estimation_line.wake(ctx)  # the dispatch queues it when its turn comes
        return None
    why = "the workload has no GPU container to estimate"
    try:
        obj = workload.integration.resolve(obj, ctx.kube)  # a TrainJob: its runtime's templates
        templates = gpu_templates(workload.integration, obj)
    except NotResolved as exc:
        templates, why = [], str(exc)
    except InvalidObjectError:
        templates = []
    if not templates:
        ctx.line.release(key)
        status.update(phase=records.FAILED, reason="Error", completionTime=records.stamp(ctx.now()),
                      message=why)
        _write_status(ctx, gme, status)
        _enqueue_workloads(ctx, gme)
        return None
    ref, containers, world = podspec.unit_template(workload, obj, templates, gme, settings,
                                            ctx.versions(gme["metadata"]["namespace"]))
    body, riders = batches.fill(ctx, gme, podspec.build(
        gme, obj, ref.template, containers[0][1], settings, ctx.probe_image, world), settings)
    _delete_earlier_attempts(ctx, gme, body["metadata"]["name"])
    try:
        # The caps are checked against the pod cache and the new pod is put there right after
        # its create, under the line's lock: a dispatch never counts a slot twice or not at all.
        with ctx.line.lock:
            full = at_capacity(ctx, namespace, settings)
            if full is not None:  # the policy's caps went down since the grant
                ctx.line.release(key)
                log.info("estimation %s waits: %s", gme["metadata"]["name"], full)
                estimation_line.wake(ctx)
                return None
            created = ctx.kube.create(POD, namespace, body)
            ctx.pods.put(created)
            ctx.line.started(key)
        ctx.metrics.started.inc()
    except KubeApiError as exc:
        if exc.status == 403:
            return _refused(ctx, gme, key, exc, settings)
        if not exc.already_exists:
            raise
        existing = ctx.kube.get(POD, namespace, body["metadata"]["name"])
        if not owns(gme, existing):  # a 409 is ours only when the pod that holds the name is
            ctx.line.release(key)
            _finish(ctx, gme, status, None, _name_taken(existing))
            return None
        ctx.pods.put(existing)
        ctx.line.started(key)
    status.update(phase=records.RUNNING, attempt=records.attempt(gme),
                  podName=body["metadata"]["name"])
    status.setdefault("startTime", records.stamp(ctx.now()))
    estimate_cache.record_inputs(ctx, gme, ref.template, status)
    _write_status(ctx, gme, status)
    batches.started(ctx, gme, body, riders, _write_status)
    return float(body["spec"]["activeDeadlineSeconds"]) + ctx.deadline_slack


def _refused(ctx: Context, gme: Obj, key: Tuple[str, str], exc: KubeApiError,
             settings: Any) -> float:
    """The API server refused the pod (403): a ResourceQuota without room, a LimitRange, a
    missing service account. Said once per run of refusals, as a Warning Event on the workloads
    waiting, and tried again with back-off (the workloads stay held, up to maxHoldSeconds)."""
    quota = "quota" in exc.message.lower()
    delay, first = ctx.line.refused(key, ctx.now(), quota)
    reason = estimation_line.QUOTA_REFUSED if quota else estimation_line.POD_REFUSED
    ctx.metrics.refused.labels(reason).inc()
    log.info("estimation pod of %s/%s refused (%s): %s; again in %.0f s", key[0], key[1], reason,
             exc.message, delay)
    if first:
        estimation = settings.estimation
        need = (f"; an estimation pod asks for {estimation.cpu} CPU and {estimation.memory} "
                "(spec.estimation.resources), and a ResourceQuota with room for it lets it "
                "start" if quota else "")
        for workload in estimation_line.workloads_waiting(ctx, gme):
            ctx.emit(workload, "Warning", reason, f"xmem: the estimation pod was refused: "
                     f"{exc.message}; tried again with back-off, the workload stays held until "
                     f"it starts or maxHoldSeconds ({estimation.max_hold_seconds}) end{need}")
    estimation_line.wake(ctx)  # its slot goes to whoever is next
    return delay


def _delete_earlier_attempts(ctx: Context, gme: Obj, current: str) -> None:
    """The pods of the estimate's earlier attempts (kept after they failed, for their logs):
    a new attempt replaces them."""
    namespace = gme["metadata"]["namespace"]
    for pod in ctx.pods.items():
        m = pod["metadata"]
        if m.get("namespace") == namespace and m["name"] != current and owns(gme, pod, True) and \
                "deletionTimestamp" not in m:
            ctx.kube.delete_pod(namespace, m["name"], m.get("uid"))


def _name_taken(pod: Obj) -> Outcome:
    return Outcome(reason="PodNameTaken", message=f"a pod named {pod['metadata']['name']!r} that "
                   "xmem did not create holds the estimation pod's name; its result is not read")


def _pod_lost(ctx: Context, gme: Obj, status: Dict[str, Any]) -> Optional[float]:
    attempt = records.attempt(gme)
    if attempt >= ctx.max_attempts:
        _finish(ctx, gme, status, None, Outcome(
            reason="PodDeleted", message=f"the estimation pod was deleted before it finished, "
            f"{attempt} times"))
        return None
    log.info("estimation pod %s vanished; starting attempt %d", status.get("podName"), attempt + 1)
    status.update(phase=records.PENDING, attempt=attempt + 1)
    for key in ("podName", "startTime"):
        status.pop(key, None)
    _write_status(ctx, gme, status)
    return 0.1


def _finish(ctx: Context, gme: Obj, status: Dict[str, Any], pod: Optional[Obj],
            outcome: Outcome) -> None:
    now = ctx.now()
    status["completionTime"] = records.stamp(now)
    for key in ("reason", "message", "estimates", "peak", "reproduce", "allocationDigest"):
        status.pop(key, None)
    if outcome.result is not None:
        result = outcome.result
        status.update(phase=records.SUCCEEDED, mode=records.mode_name(result.mode),
                      steps=result.steps, seconds=result.seconds,
                      estimates=records.estimates_from(result.gpus))
        if result.fallback:
            status["fallbackReason"] = result.fallback[:1000]
        if result.digest:
            status["allocationDigest"] = result.digest  # what trials of a family compare
        peak = records.peak_from(result)
        if peak is not None:
            status["peak"] = peak
        if pod is not None:
            status["reproduce"] = records.reproduce(gme, batches.trace_view(pod, gme), result.steps,
                                                    _probe_mode(pod))
            status["imageID"] = estimate_cache.ran_image(pod)
        _summary(ctx, gme, status)
    else:
        status.update(phase=records.FAILED, reason=outcome.reason,
                      message=outcome.message[-4000:])
    _write_status(ctx, gme, status)
    started = records.parse_time(status.get("startTime"))
    if started is not None:
        ctx.line.finished((now - started).total_seconds())
    if outcome.result is not None:
        ctx.metrics.succeeded.inc()
        if started is not None:
            ctx.metrics.duration.observe(max(0.0, (now - started).total_seconds()))
    else:
        ctx.metrics.failed.labels(outcome.reason).inc()
        log.info("estimation %s failed: %s", gme["metadata"]["name"], outcome.reason)
    # Its result is recorded: a succeeded pod goes (its slot, and a pod per estimate, no
    # more); a failed one that ended stays for `kubectl logs`; one still pending or running
    # (stuck, past its deadline) is stopped.
    if pod is not None and (pod.get("status") or {}).get("phase") in (None, "Pending", "Running"):
        for other in batches.siblings(ctx, pod, gme):  # stopped: each trace it carries ends so
            _finish(ctx, other, dict(other.get("status") or {}), None, outcome)
    if pod is not None and ((outcome.result is not None and batches.may_delete(ctx, pod)) or
                            (pod.get("status") or {}).get("phase") in (None, "Pending", "Running")):
        ctx.kube.delete_pod(pod["metadata"]["namespace"], pod["metadata"]["name"],
                            pod["metadata"]["uid"])
    estimation_line.wake(ctx)
    _enqueue_workloads(ctx, gme)


def _probe_mode(pod: Obj) -> str:
    """The probe mode an estimation pod was given (auto, fake or profile)."""
    container = ((pod.get("spec") or {}).get("containers") or [{}])[0]
    for env in container.get("env") or []:
        if env.get("name") == probe_env.MODE:
            return str(env.get("value") or "")
    return ""


def _fill_error(ctx: Context, gme: Obj, status: Dict[str, Any]) -> bool:
    """Fill the ``actual`` and ``relativeErrorPercent`` columns once someone recorded
    ``actualBytes``; whether it wrote."""
    actual = status.get("actualBytes")
    estimate = status.get("estimateBytes")
    if not isinstance(actual, int) or not isinstance(estimate, int) or actual <= 0:
        return False
    percent = records.relative_error_percent(estimate, actual)
    if status.get("relativeErrorPercent") == percent and \
            status.get("actual") == records.human(actual):
        return False
    status.update(actual=records.human(actual), relativeErrorPercent=percent)
    _write_status(ctx, gme, status)
    return True
