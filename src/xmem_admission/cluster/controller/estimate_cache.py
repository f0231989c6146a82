"""How long a ``GPUMemoryEstimate`` lives, who waits on it, and when it is stale.

Lifetime. No workload owns an estimate (``records.new``): deleting the Job that made it, or a
Job's ``ttlSecondsAfterFinished``, leaves it and its right-sizing history for the next job of the
same program, and a workload that joins it writes nothing on it but its ``status.lastUsedTime``.
That time is set when a workload joins the estimate (``join``), when one is released sized from
it (``used``), and when one the webhook sized at CREATE appears (``sized_at_create``, at the
workload's ``creationTimestamp``, so that a restarted controller re-reading old workloads moves
nothing); it is written at most once every ``TOUCH_EVERY`` seconds per estimate, so a hundred
copies of a job cost one status write a minute, not a hundred. ``collect`` deletes the estimates
unused for longer than the namespace's ``spec.estimation.cacheTTLSeconds`` (by uid and
resourceVersion, so one used meanwhile stays), except one a held workload waits on (an
estimation whose workloads all went is collected too, once past the TTL). An estimate an older release made, with its workloads as owner references,
loses them on the controller's first pass over it (``collect``), so it too outlives its jobs.

Waiting. Which held workloads wait on an estimate is kept in memory (``waiters.Waiters``), filled by
``join`` from the reconcile of each held workload (and each Kueue Workload whose check is
pending); a restarted controller fills it again from its first pass over the held workloads.
The estimation pod is built from the first live waiter (``waiter``); the workloads are woken
when the estimate changes (``wake``).

Staleness. The estimation pod's image digest (``status.containerStatuses[].imageID``) is
recorded as ``status.imageID``. When a sized workload's pod runs the estimate's image under
another digest (the same tag pushed again), the estimate is marked ``status.stale`` with a
Warning Event on it and on the workload (``check_image``): the webhook's store stops serving it
and the next held workload gets a new estimation attempt (``records.usable``), whose result
replaces it. ``oomRetries`` stay (they size running workloads' next pods); ``runs`` go, as they
measured the other image. The ConfigMaps the estimation pod's template mounts or reads are
recorded with their uid and resourceVersion as ``status.inputs`` when the pod starts
(``record_inputs``); one that changed since, as the controller's ConfigMap cache sees it, marks
the estimate stale (``ConfigMapChanged``, ``check_inputs`` on each ``collect`` pass): workloads
that read the edited ConfigMap have another fingerprint, so another estimate, and one still
waiting on this estimate is estimated again, from what its pods will read.
"""

from __future__ import annotations

import datetime
import logging
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Set, Tuple

from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import records
from xmem_admission.cluster.kube.client import GME, Obj
from xmem_admission.cluster.policy import fingerprint
from xmem_admission.contract.errors import KubeApiError

if TYPE_CHECKING:  # the context imports this module
    from xmem_admission.cluster.controller.context import Context, Workload

log = logging.getLogger(__name__)

LAST_USED = "lastUsedTime"
TOUCH_EVERY = 60.0  # seconds: lastUsedTime is written at most this often per estimate
STALE_EVENT = "EstimateStale"
INPUTS = "inputs"  # status: the ConfigMaps the estimation read, by uid and resourceVersion
MAX_SEEN = 50_000  # pods whose image was checked, remembered (then forgotten all at once)


# --- lastUsedTime ---------------------------------------------------------------------------

def last_used(gme: Obj) -> Optional[datetime.datetime]:
    """When the estimate was last used: its ``lastUsedTime``, else when it completed or was
    created (whichever is latest)."""
    status = gme.get("status") or {}
    times = [records.parse_time(status.get(LAST_USED)),
             records.parse_time(status.get("completionTime")),
             records.parse_time(gme["metadata"].get("creationTimestamp"))]
    found = [t for t in times if t is not None]
    return max(found) if found else None


def touch(ctx: Context, gme: Obj, when: Optional[datetime.datetime] = None) -> Obj:
    """Record a use at ``when`` (now by default) unless one within ``TOUCH_EVERY`` seconds
    before it is recorded already; best effort (a conflict leaves it to the next use)."""
    when = when or ctx.now()
    status = dict(gme.get("status") or {})
    recorded = records.parse_time(status.get(LAST_USED))
    if recorded is not None and when <= recorded + datetime.timedelta(seconds=TOUCH_EVERY):
        return gme
    if "uid" not in gme["metadata"]:
        return gme  # not created yet (a test's or a dry run's object)
    status[LAST_USED] = records.stamp(when)
    try:
        written = ctx.kube.replace_status(GME, records.with_status(gme, status, ctx.now()))
    except KubeApiError as exc:
        if exc.conflict or exc.not_found:
            return gme
        raise
    ctx.estimates.put(written)
    return written


def used(ctx: Context, gmes: List[Obj]) -> None:
    """Workloads were released sized from these estimates."""
    for gme in gmes:
        touch(ctx, gme)


def sized_at_create(obj: Obj) -> bool:
    """A workload that is not held and carries a fingerprint: the webhook sized it at CREATE
    (or the controller released it); what ``reconcile_used`` looks at."""
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    return labels.FINGERPRINT in annotations and labels.HELD_REASON not in annotations


def reconcile_used(ctx: Context, kind: str, namespace: str, name: str) -> Optional[float]:
    """A workload sized without a hold: its estimate was used when the workload was created."""
    workload = ctx.workloads.get(kind)
    obj = workload.informer.get(namespace, name) if workload is not None else None
    if obj is None or not sized_at_create(obj):
        return None
    created = records.parse_time(obj["metadata"].get("creationTimestamp"))
    fp = (obj["metadata"].get("annotations") or {}).get(labels.FINGERPRINT)
    gme = ctx.estimates.get(namespace, records.name_for(fp)) if isinstance(fp, str) else None
    if gme is None or created is None or not records.usable(gme):
        return None
    touch(ctx, gme, min(created, ctx.now()))
    return None


# --- waiters --------------------------------------------------------------------------------

def wait_on(ctx: Context, gme: Obj, obj: Obj) -> bool:
    """Remember that a held workload waits on this estimate (its estimation pod is built from a
    waiter, and waiters are woken when it changes); a new waiter queues the estimate."""
    m, gm = obj["metadata"], gme["metadata"]
    if ctx.waiters.add(gm["namespace"], gm["name"], str(obj.get("kind", "")), m["name"],
                       m["uid"]):
        ctx.queue.add(("estimate", gm["namespace"], gm["name"]))
        return True
    return False


def join(ctx: Context, gme: Obj, obj: Obj) -> Obj:
    """A held workload joins an existing estimate: ``wait_on``, drop the owner references an
    older release wrote, and record the use."""
    new = wait_on(ctx, gme, obj)
    bare = records.without_owners(gme)
    if bare is not None:
        gme = ctx.kube.replace(GME, bare)
        ctx.estimates.put(gme)
    # A running one is kept for its waiters (``collect``): no write each resync while waiting.
    return touch(ctx, gme) if new or records.phase(gme) in records.TERMINAL else gme


def _live(ctx: Context, namespace: str, kind: str, name: str,
          uid: Optional[str]) -> Optional[Tuple[Workload, Obj]]:
    workload = ctx.workloads.get(kind)
    if workload is None:
        return None
    obj = workload.informer.get(namespace, name)
    if obj is None or "deletionTimestamp" in obj["metadata"] or \
            (uid is not None and obj["metadata"].get("uid") != uid):
        return None
    return workload, obj


def waiter(ctx: Context, gme: Obj) -> Optional[Tuple[Workload, Obj]]:
    """The workload the estimation pod is built from: the first live waiter, else an owner an
    older release recorded, else the workload the estimate was made for (``spec.workload``)."""
    namespace, name = gme["metadata"]["namespace"], gme["metadata"]["name"]
    for kind, workload, uid in ctx.waiters.of(namespace, name):
        found = _live(ctx, namespace, kind, workload, uid)
        if found is not None:
            return found
        ctx.waiters.drop(namespace, name, uid)
    for ref in records.legacy_owners(gme):
        found = _live(ctx, namespace, str(ref.get("kind", "")), str(ref.get("name", "")),
                      ref.get("uid"))
        if found is not None:
            return found
    first = (gme.get("spec") or {}).get("workload") or {}
    return _live(ctx, namespace, str(first.get("kind", "")), str(first.get("name", "")), None)


def waiting(ctx: Context, gme: Obj) -> List[Tuple[str, str, str]]:
    """(kind, name, uid) of the workloads to wake when the estimate changes: the waiters and
    the owners an older release recorded."""
    namespace, name = gme["metadata"]["namespace"], gme["metadata"]["name"]
    out = list(ctx.waiters.of(namespace, name))
    out += [(str(r.get("kind", "")), str(r.get("name", "")), str(r.get("uid", "")))
            for r in records.legacy_owners(gme)]
    return out


def wake(ctx: Context, gme: Obj) -> None:
    """Queue the held workloads that wait on this estimate; forget those that no longer do."""
    namespace, gme_name = gme["metadata"]["namespace"], gme["metadata"]["name"]
    for kind, name, uid in waiting(ctx, gme):
        if kind not in ctx.workloads:
            continue
        ctx.queue.add(("workload", kind, namespace, name))
        found = _live(ctx, namespace, kind, name, uid)
        if found is None or not _waits(*found):
            ctx.waiters.drop(namespace, gme_name, uid)


def _waits(workload: Workload, obj: Obj) -> bool:
    """Whether a workload still waits for its estimate: held by xmem, or suspended by Kueue
    while its check is pending (a released one runs, or is its owner's to unsuspend)."""
    if _held(obj):
        return True
    queue = labels.kueue_queue((obj.get("metadata") or {}).get("labels"))
    return bool(queue) and workload.integration.is_suspended(obj)


# --- collection -----------------------------------------------------------------------------

def _held(obj: Obj) -> bool:
    return labels.HELD_REASON in ((obj.get("metadata") or {}).get("annotations") or {})


def _waited_on(ctx: Context, namespace: str) -> Optional[Set[str]]:
    """The estimates of a namespace that a held workload waits on (by name), or None when that
    cannot be told now (a held workload whose programs cannot be read): then none is deleted."""
    from xmem_admission.cluster.integrations import NotResolved, estimation_units

    names = set()
    for ns, name in ctx.waiters.keys():
        if ns != namespace:
            continue
        for kind, workload_name, uid in ctx.waiters.of(ns, name):
            found = _live(ctx, ns, kind, workload_name, uid)
            if found is not None and _waits(*found):
                names.add(name)
            else:
                ctx.waiters.drop(ns, name, uid)
    settings = ctx.settings(namespace)
    for workload in ctx.workloads.values():
        for obj in workload.informer.find(
                lambda o: o["metadata"].get("namespace") == namespace and _held(o)):
            fp = (obj["metadata"].get("annotations") or {}).get(labels.FINGERPRINT)
            if isinstance(fp, str):
                names.add(records.name_for(fp))
            if settings is None:
                return None
            try:
                resolved = workload.integration.resolve(obj, ctx.kube)
                names.update(records.name_for(u.fingerprint) for u in estimation_units(
                    workload.integration, resolved, settings.gpu_keys,
                    ctx.versions(namespace)))
            except NotResolved:
                return None
            except Exception:  # noqa: BLE001 - an unreadable workload: keep every estimate
                log.debug("cannot read held %s %s/%s", workload.kind.kind, namespace,
                          obj["metadata"].get("name"), exc_info=True)
                return None
    return names


def collect(ctx: Context) -> Optional[float]:
    """One pass over every estimate: drop an older release's owner references, and delete the
    ones unused past the namespace's ``cacheTTLSeconds`` that nothing waits on."""
    now = ctx.now()
    waited: Dict[str, Optional[Set[str]]] = {}
    for gme in ctx.estimates.items():
        m = gme["metadata"]
        namespace = m.get("namespace", "")
        if "deletionTimestamp" in m:
            continue
        check_inputs(ctx, gme)
        if records.legacy_owners(gme):
            bare = records.without_owners(gme)
            if bare is not None:
                try:
                    ctx.estimates.put(ctx.kube.replace(GME, bare))
                except KubeApiError as exc:
                    if not (exc.conflict or exc.not_found):
                        raise
                continue  # looked at again on the next pass, from the written object
        settings = ctx.settings(namespace)
        if settings is None:
            continue
        ttl = datetime.timedelta(seconds=settings.estimation.cache_ttl_seconds)
        when = last_used(gme)
        if when is None or now < when + ttl:
            continue
        if namespace not in waited:
            waited[namespace] = _waited_on(ctx, namespace)
        names = waited[namespace]
        if names is None or m["name"] in names:
            continue
        _delete(ctx, gme, now - when)
    return None


def _delete(ctx: Context, gme: Obj, idle: datetime.timedelta) -> None:
    m = gme["metadata"]
    body = {"preconditions": {"uid": m.get("uid"), "resourceVersion": m.get("resourceVersion")}}
    try:
        ctx.kube.call(ctx.kube.custom.delete_namespaced_custom_object, GME.group, GME.version,
                      m["namespace"], GME.plural, m["name"], body=body,
                      propagation_policy="Background")
    except KubeApiError as exc:
        if exc.conflict or exc.not_found:
            return  # used (or deleted) meanwhile
        raise
    ctx.waiters.forget(m["namespace"], m["name"])
    log.info("deleted GPUMemoryEstimate %s/%s: unused for %ds (cacheTTLSeconds)",
             m["namespace"], m["name"], int(idle.total_seconds()))


# --- staleness ------------------------------------------------------------------------------

def digest(image_id: str) -> str:
    """The repository digest in an imageID (``docker.io/library/python@sha256:...`` from
    containerd and CRI-O, ``docker-pullable://python@sha256:...`` from cri-dockerd), '' when it
    names none (a local image's config id, ``docker://sha256:...``): only repository digests are
    compared, so runtimes that report the same image differently never make an estimate
    stale."""
    return image_id.rsplit("@", 1)[1] if "@" in image_id else ""


def ran_image(pod: Obj) -> str:
    """The imageID the estimation pod's main container ran ('' when the runtime gave none)."""
    containers = (pod.get("spec") or {}).get("containers") or []
    if not containers:
        return ""
    return _image_ids(pod).get(str(containers[0].get("name", "")), "")


def _image_ids(pod: Obj) -> Dict[str, str]:
    out: Dict[str, str] = {}
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        if isinstance(status, dict) and isinstance(status.get("imageID"), str) and \
                status["imageID"]:
            out[str(status.get("name", ""))] = status["imageID"]
    return out


def runs_image(pod: Obj) -> bool:
    """A sized pod with a container the runtime reported an image digest for."""
    annotations = pod["metadata"].get("annotations") or {}
    return labels.REQUEST_BYTES in annotations and bool(_image_ids(pod))


def check_image(ctx: Context, namespace: str, name: str) -> Optional[float]:
    """A sized workload's pod: mark its estimate stale when the pod runs the estimate's image
    under another digest than the estimation pod ran."""
    if ctx.sized_pods is None:
        return None
    pod = ctx.sized_pods.get(namespace, name)
    if pod is None or not runs_image(pod):
        return None
    ids = _image_ids(pod)
    key = (str(pod["metadata"].get("uid")), ",".join(sorted(ids.values())))
    if key in ctx.waiters.seen:
        return None
    owner = _controlling_workload(ctx, pod)
    if owner is None:
        return None
    fp = (owner["metadata"].get("annotations") or {}).get(labels.FINGERPRINT)
    gme = ctx.estimates.get(namespace, records.name_for(fp)) if isinstance(fp, str) else None
    if gme is None or not records.usable(gme):
        return None
    done = records.parse_time((gme.get("status") or {}).get("completionTime"))
    created = records.parse_time(pod["metadata"].get("creationTimestamp"))
    if done is None or created is None or created < done:
        return None  # a pod from before this estimate was made says nothing about it
    recorded = str((gme.get("status") or {}).get("imageID") or "")
    image = str((gme.get("spec") or {}).get("image") or "")
    if not recorded or not image:
        return None  # an estimate from before imageIDs were recorded: nothing to compare
    seen = [ids[c["name"]] for c in (pod.get("spec") or {}).get("containers") or []
            if c.get("image") == image and c.get("name") in ids]
    if len(ctx.waiters.seen) >= MAX_SEEN:
        ctx.waiters.seen.clear()
    ctx.waiters.seen.add(key)
    other = next((i for i in seen if digest(i) and digest(recorded)
                  and digest(i) != digest(recorded)), None)
    if other is None:
        return None
    message = (f"pod {name} of {owner.get('kind')} {owner['metadata']['name']} runs image "
               f"{image} as {other}, the estimate was made from {recorded}: the next workload "
               f"of this program is estimated again")
    status = dict(gme.get("status") or {})
    status["stale"] = {"reason": "ImageChanged", "message": message, "imageID": other,
                       "pod": name, "time": records.stamp(ctx.now())}
    written = ctx.kube.replace_status(GME, records.with_status(gme, status, ctx.now()))
    ctx.estimates.put(written)
    ctx.emit(written, "Warning", STALE_EVENT, f"xmem: {message}")
    ctx.emit(owner, "Warning", STALE_EVENT, f"xmem: estimate {gme['metadata']['name']} is "
             f"stale: {message}")
    log.info("GPUMemoryEstimate %s/%s is stale: %s", namespace, gme["metadata"]["name"], message)
    return None


def record_inputs(ctx: Context, gme: Obj, template: Mapping[str, Any],
                  status: Dict[str, Any]) -> None:
    """Record in ``status`` the ConfigMaps the estimation pod's template mounts or reads, with
    the uid and resourceVersion the controller's cache knows (those it does not know left out)."""
    found = fingerprint.inputs_of([template], ctx.versions(gme["metadata"]["namespace"]))
    inputs = [{"kind": kind, "name": name, "uid": uid, "resourceVersion": version}
              for kind, name, uid, version in found if name and uid and version]
    if inputs:
        status[INPUTS] = inputs
    else:
        status.pop(INPUTS, None)


def check_inputs(ctx: Context, gme: Obj) -> None:
    """Mark a usable estimate stale when a ConfigMap it recorded changed (another uid or
    resourceVersion in the controller's cache; one the cache does not know says nothing)."""
    inputs = (gme.get("status") or {}).get(INPUTS)
    if not isinstance(inputs, list) or not inputs or not records.usable(gme):
        return
    versions = ctx.versions(gme["metadata"]["namespace"])
    if versions is None:
        return
    for entry in inputs:
        if not isinstance(entry, dict):
            continue
        kind, name = str(entry.get("kind", "")), str(entry.get("name", ""))
        now = versions(kind, name) if kind and name else None
        if now is None or now == (entry.get("uid"), entry.get("resourceVersion")):
            continue
        how = f"was replaced (uid {now[0]})" if now[0] != entry.get("uid") else \
            f"changed (resourceVersion {entry.get('resourceVersion')} -> {now[1]})"
        message = (f"{kind} {name} {how} since the estimate was made: workloads that read it "
                   f"now have another fingerprint, and one waiting on this estimate is "
                   f"estimated again")
        status = dict(gme.get("status") or {})
        status["stale"] = {"reason": "ConfigMapChanged", "message": message,
                           "time": records.stamp(ctx.now())}
        try:
            written = ctx.kube.replace_status(GME, records.with_status(gme, status, ctx.now()))
        except KubeApiError as exc:
            if exc.conflict or exc.not_found:
                return  # read again on the next pass
            raise
        ctx.estimates.put(written)
        ctx.emit(written, "Warning", STALE_EVENT, f"xmem: {message}")
        log.info("GPUMemoryEstimate %s/%s is stale: %s", gme["metadata"]["namespace"],
                 gme["metadata"]["name"], message)
        return


def _controlling_workload(ctx: Context, pod: Obj) -> Optional[Obj]:
    namespace = pod["metadata"].get("namespace", "")
    for ref in pod["metadata"].get("ownerReferences") or []:
        if isinstance(ref, dict) and ref.get("controller") is True:
            found = _live(ctx, namespace, str(ref.get("kind", "")), str(ref.get("name", "")),
                          ref.get("uid"))
            return found[1] if found is not None else None
    return None


def new_attempt(gme: Obj) -> Dict[str, Any]:
    """The status of a new estimation attempt for a failed or stale estimate: what sizes
    running workloads (``oomRetries``) and when it was used are kept; its conditions say so."""
    status = gme.get("status") or {}
    out: Dict[str, Any] = {"phase": records.PENDING, "attempt": records.attempt(gme) + 1}
    for key in (records.OOM_RETRIES, LAST_USED):
        if key in status:
            out[key] = status[key]
    return records.with_conditions(gme, out)
