"""The line estimations wait in for an estimation pod: who starts next, and what a long line
means for the workloads that wait.

Estimation pods are capped by the policy (``estimation.maxConcurrentPerNamespace`` in a
namespace, ``maxConcurrent`` in the cluster). Which waiting estimate gets a free slot is decided
in one place, the ``DISPATCH`` work item, not by whichever estimate's reconcile runs first:

- in a namespace, first come, first served: by when the workloads waiting on the estimate were
  created (the hold begins at CREATE), the earliest of them; creation times have whole seconds,
  so within one second by the order the controller first saw the workloads in (after a restart,
  its first listing's: by namespace and name); a workload whose reconcile has not yet asked
  for its estimate keeps its place for a while (``line_state.KEEP_PLACE_SECONDS`` after this
  controller first saw it): the estimates behind it wait, so a controller that starts with a
  line of held workloads, or two workloads created in one second, serve them in order;
- across namespaces, round-robin: when the cluster cap is the limit, the free slots go to the
  namespaces with estimates waiting in turn, starting after the namespace served last;
- of a family of trials (one program, different option values), only the estimates that teach
  which options change memory, or that no traced estimate can serve, get a slot; the others
  wait for those traces and are then sized by sharing (``trials``);
- the estimates of one trial family chosen for a trace in one pass that get no slot ride in
  the pods of those that do (``batches``);
- a namespace whose first estimate in line was refused by a ResourceQuota waits out that
  estimate's back-off as a whole (its next pod is the same size); an estimate refused for
  another reason (a LimitRange, a missing service account) backs off alone.

A slot is granted to an estimate in memory: the grant counts against the caps until its
reconcile (``estimation_pods``) has created the pod, or until it lapses (``GRANT_SECONDS``).

Each dispatch also sizes the line. Per namespace: how many estimations wait, how long the oldest
has waited, and how many are expected to end after their workload's ``maxHoldSeconds`` (gauges,
``metrics``). Each waiting estimate's expected end is its place in its namespace's line over the
slots the namespace gets (its cap, or its round-robin share of the cluster's), times the mean
duration of the latest ``line_state.RECENT`` estimations (from their estimates' ``startTime`` and
``completionTime``); before any has finished, how long the running ones have taken so far, a
lower bound. A workload that would reach ``maxHoldSeconds`` before its estimate is told at once,
not at the deadline: a Warning Event ``EstimationBacklog`` with its place in line and the
expected wait (once per workload and controller).
"""

from __future__ import annotations

import collections
import datetime
import functools
import logging
import math
import time
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    Iterable,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
)

from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import batches, estimate_cache, podspec, records, trials
from xmem_admission.cluster.controller.line_state import Key
from xmem_admission.cluster.kube.client import GME, Obj

if TYPE_CHECKING:
    from xmem_admission.cluster.controller.context import Context

log = logging.getLogger(__name__)

DISPATCH: Tuple[str] = ("dispatch",)
DISPATCH_DELAY = 0.5  # seconds: the events of one moment are served by one dispatch
GRANT_SECONDS = 120.0  # a grant whose pod was not created by then is given to the line again
KEPT_PLACE_RECHECK = 1.0  # seconds: a line cut short by a kept place is dispatched again
BACKLOG = "EstimationBacklog"
QUOTA_REFUSED = "EstimationQuotaExceeded"
POD_REFUSED = "EstimationPodRefused"


def running(pod: Obj) -> bool:
    """An estimation pod that still holds a slot: not finished, not being deleted."""
    return (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed") and \
        "deletionTimestamp" not in pod["metadata"]


def is_estimation_pod(pod: Obj) -> bool:
    return any(ref.get("kind") == GME.kind for ref in pod["metadata"].get("ownerReferences") or [])


@dataclass(frozen=True)
class Waiting:
    """One estimate waiting for its pod: where it stands in its namespace's line."""

    key: Key
    since: datetime.datetime  # the earliest creation of the workloads waiting on it
    order: Tuple[Any, ...]
    workloads: Tuple[Obj, ...]  # the live workloads waiting on it


# --- the plan: pure functions ----------------------------------------------------------------

def plan(queues: Mapping[str, Sequence[Key]], free: Mapping[str, int], cluster_free: int,
         cursor: Optional[str], first: Optional[str] = None) -> Tuple[List[Key], Optional[str]]:
    """The estimates to start now, and the namespace served last.

    ``queues``: each namespace's waiting estimates in line order; ``free``: the slots each
    namespace has left under its cap; ``cluster_free``: those left under the cluster's;
    ``cursor``: the namespace served last (None: begin with ``first``, the namespace whose
    first estimate has waited longest). One estimate per namespace per round, namespaces in
    name order from the one after the cursor, until the cluster's slots or the line run out."""
    names = sorted(n for n, q in queues.items() if q and free.get(n, 0) > 0)
    if not names or cluster_free <= 0:
        return [], cursor
    if cursor is None and first in names:
        at = names.index(first)
        order = names[at:] + names[:at]
    elif cursor is None:
        order = names
    else:
        order = [n for n in names if n > cursor] + [n for n in names if n <= cursor]
    taken = {n: 0 for n in order}
    out: List[Key] = []
    while cluster_free > 0:
        progress = False
        for name in order:
            if cluster_free <= 0:
                break
            if taken[name] < min(free[name], len(queues[name])):
                out.append(queues[name][taken[name]])
                taken[name] += 1
                cluster_free -= 1
                cursor = name
                progress = True
        if not progress:
            break
    return out, cursor


def slots(caps: Mapping[str, int], cluster_cap: int, busy: Iterable[str]) -> Dict[str, float]:
    """The estimation pods each busy namespace may expect at a time: its own cap, or its
    round-robin share of the cluster's when that is smaller."""
    names = set(busy)
    share = cluster_cap / max(1, len(names))
    return {n: max(min(float(caps.get(n, 1)), share), 1e-9) for n in names}


def expected_end(position: int, slots_here: float, duration: float) -> float:
    """Seconds until the estimate at ``position`` (0: first) of a namespace's line is expected
    to have its result: the rounds of ``duration`` before a slot is its, then its own."""
    return math.ceil((position + 1) / slots_here) * duration + duration


def human(seconds: float) -> str:
    """A duration in words: 42 s, 7m05s, 2h10m."""
    seconds = max(0, int(round(seconds)))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"


# --- the dispatch ----------------------------------------------------------------------------

def wake(ctx: Context) -> None:
    """Ask for a dispatch soon (the events of one moment share it)."""
    ctx.queue.add(DISPATCH, DISPATCH_DELAY)


def held_by_estimate(ctx: Context, namespace: Optional[str] = None) -> Dict[Key, List[Obj]]:
    """The held workloads (of one namespace, or all), by the estimate their fingerprint
    (``xmem.io/fingerprint``, written by the webhook and the controller) names."""
    out: Dict[Key, List[Obj]] = {}
    for workload in ctx.workloads.values():
        for obj in workload.informer.find(lambda o: labels.HELD_REASON in (
                o["metadata"].get("annotations") or {}) and "deletionTimestamp" not in
                o["metadata"] and namespace in (None, o["metadata"].get("namespace"))):
            fp = obj["metadata"]["annotations"].get(labels.FINGERPRINT)
            if isinstance(fp, str) and fp:
                key = (obj["metadata"]["namespace"], records.name_for(fp))
                out.setdefault(key, []).append(obj)
    return out


def workloads_waiting(ctx: Context, gme: Obj,
                      held: Optional[Mapping[Key, List[Obj]]] = None) -> List[Obj]:
    """The live workloads waiting on an estimate: the held ones whose fingerprint names it,
    else the one its estimation pod is built from (a Kueue-queued job carries no hold; one
    program of a workload that runs several)."""
    m = gme["metadata"]
    index = held if held is not None else held_by_estimate(ctx, m["namespace"])
    found = list(index.get((m["namespace"], m["name"]), ()))
    if not found:
        first = estimate_cache.waiter(ctx, gme)  # the one its pod is built from
        if first is not None:
            found.append(first[1])
    return found


def created(obj: Obj) -> datetime.datetime:
    """When a workload's hold began: its creation (the webhook holds at CREATE)."""
    return _time(obj["metadata"].get("creationTimestamp")) or \
        datetime.datetime.now(datetime.timezone.utc)


@functools.lru_cache(maxsize=65536)
def _time(stamp: Any) -> Optional[datetime.datetime]:
    return records.parse_time(stamp)


def place(ctx: Context, obj: Obj) -> Tuple[Any, ...]:
    """A workload's place in its namespace's line: its creation, then the order this
    controller first saw it in, then its name."""
    return (created(obj), ctx.line.seq(obj["metadata"].get("uid", "")), obj["metadata"]["name"])


def waiting(ctx: Context, gme: Obj,
            held: Optional[Mapping[Key, List[Obj]]] = None) -> Optional[Waiting]:
    """The estimate as it waits for its pod, or None when it does not wait (running, finished,
    its pod there already, no workload waiting on it)."""
    m = gme["metadata"]
    if "deletionTimestamp" in m or records.phase(gme) != records.PENDING:
        return None
    if ctx.pods.get(m["namespace"], podspec.pod_name(gme)) is not None:
        return None
    found = workloads_waiting(ctx, gme, held)
    if not found:
        return None
    order = min(place(ctx, o) for o in found)
    return Waiting((m["namespace"], m["name"]), order[0], order + (m["name"],), tuple(found))


def ahead_of(queue: Sequence[Waiting], place: Optional[Tuple[Any, ...]]) -> List[Waiting]:
    """The part of a namespace's line ahead of ``place`` (a place kept by a workload whose
    estimate is not asked for yet; None: the whole line)."""
    return list(queue) if place is None else [e for e in queue if e.order < place]


def places_kept(ctx: Context, held: Mapping[Key, List[Obj]],
                now: float) -> Dict[str, Tuple[Any, ...]]:
    """Each namespace's earliest place kept by a held workload whose reconcile has not asked
    for its estimate yet: its fingerprint's estimate has no record, it waits on no other
    estimate (a trial sized by sharing), and this controller first saw it less than
    ``KEEP_PLACE_SECONDS`` before ``now`` (``time.monotonic()``)."""
    kept: Dict[str, Tuple[Any, ...]] = {}
    for (namespace, name), objs in held.items():
        if ctx.estimates.get(namespace, name) is not None:
            continue
        for obj in objs:
            uid = obj["metadata"].get("uid", "")
            if ctx.waiters.waits(uid) or not ctx.line.keeps_place(uid, now):
                continue
            here = place(ctx, obj)
            if namespace not in kept or here < kept[namespace]:
                kept[namespace] = here
    return kept


def dispatch(ctx: Context) -> Optional[float]:
    """Grant the free slots to the estimates whose turn it is (and queue them), publish the
    line's gauges, and tell the workloads the line will keep past ``maxHoldSeconds``."""
    policy = ctx.policy.current()
    if policy is None:
        return 5.0
    line = ctx.line
    now = ctx.now()
    line.seed(ctx.estimates.items())
    held = held_by_estimate(ctx)
    places = places_kept(ctx, held, time.monotonic())
    cut_short = False
    # Under the line's lock, from the pods in the cache: a pod an estimate's reconcile creates
    # meanwhile is in the cache by the time its grant is gone, never neither nor both.
    with line.lock:
        live = [p for p in ctx.pods.items() if running(p) and is_estimation_pod(p)]
        queues: Dict[str, List[Waiting]] = {}
        for gme in ctx.estimates.items():
            entry = waiting(ctx, gme, held)
            if entry is not None:
                queues.setdefault(entry.key[0], []).append(entry)
        for queue in queues.values():
            queue.sort(key=lambda e: e.order)
        caps: Dict[str, int] = {}
        for namespace in set(queues) | {p["metadata"]["namespace"] for p in live}:
            settings = ctx.settings(namespace)
            caps[namespace] = settings.estimation.max_concurrent_per_namespace if settings else 0
        cluster_cap = policy.max_concurrent
        keys = {e.key for q in queues.values() for e in q}
        lapse = time.monotonic() - GRANT_SECONDS
        for key, when in list(line.grants.items()):
            if key not in keys or when < lapse:
                line.grants.pop(key)
                line.drop_riders(key)
        for key in list(line.refusals):
            if key not in keys:
                line.refusals.pop(key)
        used = collections.Counter(p["metadata"]["namespace"] for p in live)
        used.update(ns for ns, _ in line.grants)
        free = {ns: caps.get(ns, 0) - used[ns] for ns in queues}
        cluster_free = cluster_cap - len(live) - len(line.grants)
        eligible: Dict[str, List[Waiting]] = {}
        for namespace, queue in queues.items():
            ahead = ahead_of(queue, places.get(namespace))
            cut_short = cut_short or len(ahead) < len(queue)
            candidates = [e for e in ahead if e.key not in line.grants and
                          e.key not in line.riding]
            head = line.backing_off(candidates[0].key, now) if candidates else None
            if head is not None and head.quota:
                continue  # the namespace's quota is full: its whole line waits
            eligible[namespace] = [e for e in candidates if not line.backing_off(e.key, now)]
        # Of a family of trials, only what teaches or cannot be shared is traced (``trials``).
        # Traced now: granted, riding in a granted one's pod, or in a live pod (whose status
        # may not say Running yet).
        tracing = set(line.grants) | set(line.riding) | {
            (p["metadata"]["namespace"], str(ref.get("name"))) for p in live
            for ref in p["metadata"].get("ownerReferences") or [] if ref.get("kind") == GME.kind}
        keep, shareable = trials.select(
            ctx, {ns: [e.key for e in q] for ns, q in eligible.items()}, tracing)
        for namespace, queue in eligible.items():
            kept = set(keep.get(namespace, ()))
            eligible[namespace] = [e for e in queue if e.key in kept]
        line.shareable = set(shareable)
        heads = [ns for ns, q in eligible.items() if q]
        oldest = min(heads, key=lambda ns: eligible[ns][0].order) if heads else None
        new, line.cursor = plan({ns: [e.key for e in q] for ns, q in eligible.items()}, free,
                                cluster_free, line.cursor, oldest)
        riders = batches.form(ctx, new, {ns: [e.key for e in q]
                                         for ns, q in eligible.items()}, line.solo)
        line.solo &= keys
        stamp = time.monotonic()
        for key in new:
            line.grants[key] = stamp
        for key, carried in riders.items():
            line.riders[key] = carried
            line.riding.update((rider, key) for rider in carried)
        granted = set(line.grants) | set(line.riding)
    for key in new:
        ctx.queue.add(("estimate",) + key)
    by_key = {e.key: e for q in queues.values() for e in q}
    for key in shareable:  # their workloads size themselves from a traced estimate
        for obj in by_key[key].workloads:
            ctx.queue.add(("workload", obj.get("kind", ""), key[0], obj["metadata"]["name"]))
    _size(ctx, queues, granted, caps, cluster_cap, live, now)
    return KEPT_PLACE_RECHECK if cut_short else None


def _duration(ctx: Context, live: List[Obj], now: datetime.datetime) -> Tuple[float, str]:
    """The expected duration of one estimation and how it is known ('' when it is not)."""
    recent = ctx.line.recent()
    if recent:
        mean = sum(recent) / len(recent)
        return mean, f"the latest {len(recent)} estimations took {human(mean)} on average"
    elapsed = [(now - t).total_seconds() for t in
               (records.parse_time(p["metadata"].get("creationTimestamp")) for p in live) if t]
    longest = max(elapsed, default=0.0)
    if longest >= 1.0:
        return longest, f"none has finished yet and the running ones have taken " \
                        f"{human(longest)} so far (a lower bound)"
    return 0.0, ""


def _size(ctx: Context, queues: Mapping[str, List[Waiting]], granted: Set[Key],
          caps: Mapping[str, int], cluster_cap: int, live: List[Obj],
          now: datetime.datetime) -> None:
    """The gauges, and the Events for workloads the line will keep past maxHoldSeconds."""
    duration, basis = _duration(ctx, live, now)
    busy = {ns for ns, q in queues.items() if q} | {p["metadata"]["namespace"] for p in live}
    share = slots(caps, cluster_cap, busy)
    stats: Dict[str, Tuple[int, float, int]] = {}
    tell: List[Tuple[Obj, str]] = []
    waiting_uids: Set[str] = set()
    for namespace, queue in queues.items():
        ahead = [e for e in queue if e.key not in granted]
        late = 0
        settings = ctx.settings(namespace)
        for position, entry in enumerate(ahead):
            waiting_uids.update(str(o["metadata"].get("uid")) for o in entry.workloads)
            if duration <= 0 or settings is None:
                continue
            end = now + datetime.timedelta(seconds=expected_end(position, share[namespace],
                                                                duration))
            hold = datetime.timedelta(seconds=settings.estimation.max_hold_seconds)
            behind = [o for o in entry.workloads if now < created(o) + hold < end]
            if behind:
                late += 1
            for obj in behind:
                if str(obj["metadata"].get("uid")) not in ctx.line.told:
                    tell.append((obj, _backlog_message(
                        namespace, position, len(ahead), caps.get(namespace, 0), cluster_cap,
                        len(busy), basis, (end - now).total_seconds(), created(obj) + hold,
                        settings)))
        oldest = max(((now - e.since).total_seconds() for e in ahead), default=0.0)
        if ahead:
            stats[namespace] = (len(ahead), max(0.0, oldest), late)
    with ctx.line.lock:
        ctx.line.told &= waiting_uids
        ctx.line.told.update(str(obj["metadata"].get("uid")) for obj, _ in tell)
        ctx.line.published = ctx.metrics.set_line(stats, ctx.line.published)
    for obj, message in tell:
        ctx.emit(obj, "Warning", BACKLOG, message)


def _backlog_message(namespace: str, position: int, waiting_here: int, cap: int,
                     cluster_cap: int, busy: int, basis: str, seconds: float,
                     deadline: datetime.datetime, settings: Any) -> str:
    room = f"{cap} estimation pod{'' if cap == 1 else 's'} at a time in {namespace}"
    if busy > 1:
        room += f", {cluster_cap} in the cluster shared by {busy} namespaces"
    return (f"xmem: estimation backlog: this workload's estimate is number {position + 1} of "
            f"{waiting_here} waiting in {namespace} ({room}); {basis}, so its estimate is "
            f"expected in {'at least' if 'lower bound' in basis else 'about'} "
            f"{human(seconds)}, after its maxHoldSeconds "
            f"({settings.estimation.max_hold_seconds}) end at {records.stamp(deadline)}, when "
            f"onEstimationFailure ({settings.on_failure.value}) applies. More room for "
            f"estimation pods (spec.estimation.maxConcurrentPerNamespace, maxConcurrent) or a "
            f"longer maxHoldSeconds avoids it")
