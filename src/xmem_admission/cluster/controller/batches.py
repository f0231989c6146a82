"""Several estimates of one program traced in one estimation pod.

A sweep's trials that the line chooses to trace (``trials``) run one image and program with
other option values. Started one pod each, every trace pays the pod's start, the interpreter's
and ``import torch`` (seconds in a real training image) and is charged the pod's CPU and memory
in the namespace's quota. Instead, the family's estimates chosen for a trace in one dispatch
that get no slot of their own ride in the pods of those that do (``form``), in line order,
dealt in turn, up to ``TRACES`` a pod and as many as one termination message has room for
(``termination.batch_capacity``, by the number of target GPU models). A trace that has a free
slot keeps it, so the traces run in parallel as far as the caps allow and none waits longer
than it would have for a slot of its own.

The pod (``fill``): a rider joins when its own estimation pod would be the same pod but for its
command line (``podspec.batchable``: one program, other option values; the same environment,
volumes and world), else it waits for a pod of its own. The probe starts once and forks a trace
per estimate, one after the other (``estimator.probe.sitehook``): CPU and memory stay one
trace's (the forks share the first process's pages: tens of MiB more),
``activeDeadlineSeconds`` is the policy's times the traces, each trace is stopped past the
policy's. The caps count pods: a pod that carries eight traces is one pod's CPU and memory
and one slot, for longer. Every rider is recorded ``Running`` with the pod's name
(``started``).

Results (``outcome``): the pod's termination message holds one entry per trace; each estimate
reads its own, so a trace that fails, runs out of memory or past its deadline ends its own
estimate only. When the pod itself fails mid-way, the trace under way when it died takes the
pod's failure (an ``OOMKilled`` container, ``DeadlineExceeded``), and the traces not run yet go
back to the line (``REQUEUE``), as does every rider of a pod whose probe could not run the batch
(its own command line only: those are then traced alone). A pod that ended before its probe
began (an image that cannot be pulled, no torch) fails every estimate it carries, as it would
each of their own pods. The pod is deleted once every estimate it carries has its result, kept
while any of them failed (``kubectl logs``), as a pod of one estimate is.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from xmem_admission.cluster.controller import estimate_cache, podspec, records
from xmem_admission.cluster.controller.pod_outcome import (
    STATUS_REASONS,
    Outcome,
    classify,
    main_status,
)
from xmem_admission.cluster.controller.trials import FAMILY_LABEL
from xmem_admission.cluster.kube.client import Obj
from xmem_admission.contract import termination
from xmem_admission.contract.errors import InvalidObjectError, TerminationMessageError

if TYPE_CHECKING:  # the context holds the line, which calls ``form``
    from xmem_admission.cluster.controller.context import Context

log = logging.getLogger(__name__)

TRACES = 8  # traces one pod carries at most (fewer where the termination message has less room)
REQUEUE = "Requeued"  # an Outcome's reason: the trace was not run; back to the line

Key = Tuple[str, str]


def _family(gme: Optional[Obj]) -> str:
    if gme is None:
        return ""
    return str((gme["metadata"].get("labels") or {}).get(FAMILY_LABEL) or "")


def capacity(gme: Obj) -> int:
    """The traces a pod for this estimate may carry, itself included."""
    gpus = [str(g) for g in (gme.get("spec") or {}).get("gpus") or []]
    return max(1, min(TRACES, termination.batch_capacity(gpus)))


def form(ctx: Context, new: Sequence[Key], lines: Mapping[str, Sequence[Key]],
         solo: Set[Key]) -> Dict[Key, List[Key]]:
    """The riders each estimate the dispatch grants a slot carries (``new``, in grant order):
    the estimates of its namespace and trial family chosen for a trace (``lines``, in line
    order) that got no slot of their own, none of ``solo``, dealt in turn to the family's
    granted estimates up to each one's ``capacity``. A trace that has a free slot keeps it (the
    traces run in parallel, as before); only those that would wait for a slot ride."""
    granted = set(new)
    leaders: Dict[Tuple[str, str], List[Key]] = {}
    for key in new:
        gme = ctx.estimates.get(*key)
        family = _family(gme)
        if gme is not None and family and key not in solo:
            leaders.setdefault((key[0], family), []).append(key)
    riders: Dict[Key, List[Key]] = {}
    if not leaders:
        return riders
    turn: Dict[Tuple[str, str], int] = {}
    for namespace, keys in lines.items():
        for other in keys:
            if other in granted or other in solo:
                continue
            group = (namespace, _family(ctx.estimates.get(*other)))
            heads = leaders.get(group)
            if not heads:
                continue
            for step in range(len(heads)):
                head = heads[(turn.get(group, 0) + step) % len(heads)]
                gme = ctx.estimates.get(*head)
                if gme is not None and len(riders.get(head, ())) + 1 < capacity(gme):
                    riders.setdefault(head, []).append(other)
                    turn[group] = (turn.get(group, 0) + step + 1) % len(heads)
                    break
    return riders


def fill(ctx: Context, gme: Obj, body: Obj, settings: Any) -> Tuple[Obj, List[Obj]]:
    """The leader's pod with the riders the line gave it that can ride (see the module
    docstring), and those riders' estimates; the others go back to the line."""
    from xmem_admission.cluster.integrations import NotResolved, gpu_templates

    namespace = gme["metadata"]["namespace"]
    keys = ctx.line.riders_of((namespace, gme["metadata"]["name"]))
    traces: List[Tuple[Obj, List[str]]] = [(gme, podspec.words(body["spec"]["containers"][0]))]
    for key in keys:
        other = ctx.estimates.get(*key)
        if other is None or records.phase(other) != records.PENDING or \
                ctx.pods.get(namespace, podspec.pod_name(other)) is not None:
            continue
        found = estimate_cache.waiter(ctx, other)
        if found is None:
            continue
        workload, obj = found
        try:
            obj = workload.integration.resolve(obj, ctx.kube)
            templates = gpu_templates(workload.integration, obj)
        except (NotResolved, InvalidObjectError):
            continue
        if not templates:
            continue
        ref, containers, world = podspec.unit_template(
            workload, obj, templates, other, settings, ctx.versions(namespace))
        own = podspec.build(other, obj, ref.template, containers[0][1], settings,
                            ctx.probe_image, world)
        words = podspec.batchable(body, own)
        if words is None:
            log.info("estimate %s/%s does not ride in %s's pod: its pod differs in more than "
                     "its command line", namespace, key[1], gme["metadata"]["name"])
            continue
        traces.append((other, words))
    return podspec.carry(body, traces, settings), [g for g, _ in traces[1:]]


def started(ctx: Context, gme: Obj, pod: Obj, riders: List[Obj], write: Any) -> None:
    """Record each rider ``Running`` in the pod (``write``: the status writer), then give the
    line back those that did not ride; a rider whose write fails is traced but its result
    unread (it waits for a pod of its own)."""
    name = pod["metadata"]["name"]
    try:
        _record_riders(ctx, name, riders, write)
    finally:
        ctx.line.drop_riders((gme["metadata"]["namespace"], gme["metadata"]["name"]))


def _record_riders(ctx: Context, name: str, riders: List[Obj], write: Any) -> None:
    from xmem_admission.contract.errors import KubeApiError

    for gme in riders:
        status = dict(gme.get("status") or {})
        status.update(phase=records.RUNNING, attempt=records.attempt(gme), podName=name)
        status.setdefault("startTime", records.stamp(ctx.now()))
        try:
            write(ctx, gme, status)
        except KubeApiError as exc:
            log.info("estimate %s rides in %s but its status was not written: %s",
                     gme["metadata"]["name"], name, exc.message)


def outcome(ctx: Context, pod: Obj, gme: Obj) -> Optional[Outcome]:
    """How ``gme``'s trace in a pod that carries several ended, or None while it runs."""
    phase = (pod.get("status") or {}).get("phase")
    whole = classify(ctx, pod)
    if phase not in ("Succeeded", "Failed"):
        return whole  # running (None), or stuck before the probe began: the same for all
    traces = [t["estimate"] for t in podspec.carried(pod)]
    name = gme["metadata"]["name"]
    if name not in traces:
        return Outcome(reason=REQUEUE, message="not among the pod's traces")
    index = traces.index(name)
    terminated = (main_status(pod).get("state") or {}).get("terminated") or {}
    try:
        batch = termination.decode_batch(terminated.get("message"))
    except TerminationMessageError as exc:
        return Outcome(reason="ProbeError", message=str(exc))
    if batch is None:
        # The probe ended before its traces began (no torch, a refused launch, an image
        # that did not start): the pod's outcome is each trace's; a single result is the
        # first trace's own, the others are traced alone.
        if whole is not None and whole.result is not None and index > 0:
            return Outcome(reason=REQUEUE, message="solo")
        return whole
    entry = batch.entries[index] if index < len(batch.entries) else None
    if entry is not None and entry.status == "not_run":
        return Outcome(reason=REQUEUE, message="solo")
    if entry is not None and entry.ok:
        return Outcome(result=entry)
    if entry is not None:  # its own words (the pod's message is the whole batch's)
        text = entry.reason + ("\n" + "\n".join(entry.traceback.strip().splitlines()[
            -ctx.log_lines:]) if entry.traceback else "")
        return Outcome(reason=STATUS_REASONS.get(entry.status, "Error"), message=text)
    if phase == "Failed" and batch.running == index and whole is not None \
            and whole.result is None:
        return whole  # the trace under way when the pod died
    return Outcome(reason=REQUEUE, message="")


def siblings(ctx: Context, pod: Obj, gme: Obj) -> List[Obj]:
    """The other estimates a pod carries that still wait on it (a pod stopped before its
    probe ran ends them all alike)."""
    m = pod["metadata"]
    out: List[Obj] = []
    for trace in podspec.carried(pod):
        other = ctx.estimates.get(m.get("namespace", ""), trace["estimate"])
        if other is not None and other["metadata"]["name"] != gme["metadata"]["name"] and \
                records.phase(other) == records.RUNNING and \
                (other.get("status") or {}).get("podName") == m["name"]:
            out.append(other)
    return out


def requeue(ctx: Context, gme: Obj, status: Dict[str, Any], solo: bool, write: Any) -> None:
    """Back to the line, for a new attempt (alone, when ``solo``); the caller wakes the line."""
    key = (gme["metadata"]["namespace"], gme["metadata"]["name"])
    log.info("estimation %s was not traced in pod %s; it waits again%s", key[1],
             status.get("podName"), " for a pod of its own" if solo else "")
    if solo:
        ctx.line.solo.add(key)
    status = dict(status, phase=records.PENDING, attempt=records.attempt(gme) + 1)
    for field in ("podName", "startTime"):
        status.pop(field, None)
    write(ctx, gme, status)


def trace_view(pod: Obj, gme: Obj) -> Obj:
    """The pod as ``gme``'s own would have been: its command line in place of the first's
    (what ``records.reproduce`` quotes)."""
    for trace in podspec.carried(pod):
        if trace["estimate"] == gme["metadata"]["name"]:
            spec = dict(pod["spec"])
            container = {k: v for k, v in spec["containers"][0].items() if k != "args"}
            container["command"] = trace["words"]
            spec["containers"] = [container] + spec["containers"][1:]
            return dict(pod, spec=spec)
    return pod


def may_delete(ctx: Context, pod: Obj) -> bool:
    """Whether a finished pod may go: one of a single estimate, yes; one that carries several,
    once none of them still waits on it or failed in it."""
    traces = podspec.carried(pod)
    if not traces:
        return True
    m = pod["metadata"]
    for trace in traces:
        gme = ctx.estimates.get(m.get("namespace", ""), trace["estimate"])
        if gme is None or (gme.get("status") or {}).get("podName") != m["name"]:
            continue
        if records.phase(gme) in (records.PENDING, records.RUNNING, records.FAILED):
            return False
    return True
