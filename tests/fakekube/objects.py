"""The stand-in API server's storage: objects, resource versions, watch history, deletion, GC.

What it keeps as a real API server (etcd plus the generic registry) keeps it:

- one global, strictly increasing ``resourceVersion``, stamped on every write and on every
  list; ``uid``, ``creationTimestamp`` and ``generation`` (bumped when anything outside
  ``metadata`` and ``status`` changes) are set by the server and survive updates;
- a bounded history of watch events (``ADDED``/``MODIFIED``/``DELETED``, each with the object
  before and after) from which watches resume at a resourceVersion; a version older than the
  history is answered ``410 Gone`` (``compact()`` forgets the history on purpose);
- deletion with ``preconditions``, ``finalizers`` (the object stays, with
  ``deletionTimestamp``, until its finalizers are removed), a grace period for pods bound to a
  node (the kubelet finishes the deletion), and the three propagation policies: ``Orphan``
  (owner references to the object are removed from its dependents), ``Background`` (the
  garbage collector deletes dependents whose owners are all gone, and drops dangling owner
  references of dependents that still have a live owner) and ``Foreground`` (the owner waits,
  with the ``foregroundDeletion`` finalizer, until its dependents are gone).

The garbage collector is a thread, as in a real cluster, so dependents vanish shortly after
their owner, not in the same request.
"""

from __future__ import annotations

import collections
import datetime
import itertools
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

import orjson

from tests.fakekube.status import already_exists, conflict, error, not_found

Key = Tuple[str, str]  # (group, plural)
Obj = Dict[str, Any]
FOREGROUND = "foregroundDeletion"


def clone(obj: Any) -> Any:
    """A deep copy (JSON round trip: objects are JSON by construction, and this is fast)."""
    return orjson.loads(orjson.dumps(obj))


def now() -> str:
    """RFC 3339, seconds, UTC: the format of ``metav1.Time``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Resource:
    """One kind the server serves: where it lives in the REST tree and how it behaves."""

    group: str
    version: str
    kind: str
    plural: str
    namespaced: bool
    status: bool = False  # has a status subresource
    short_names: Tuple[str, ...] = ()
    subresources: Tuple[str, ...] = ()  # beyond status: "log", "binding"
    schema: Optional[Dict[str, Any]] = None  # openAPIV3Schema of a custom resource
    default_propagation: str = "Background"

    @property
    def key(self) -> Key:
        return (self.group, self.plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def builtin(self) -> bool:
        return self.schema is None

    @property
    def singular(self) -> str:
        return self.kind.lower()


@dataclass
class WatchEvent:
    """One entry of the watch history."""

    rv: int
    type: str
    key: Key
    obj: Obj
    old: Optional[Obj] = None


def meta(obj: Obj) -> Dict[str, Any]:
    return obj.setdefault("metadata", {})


def spec_part(obj: Obj) -> Dict[str, Any]:
    """Everything that counts for ``generation``: all but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


@dataclass
class Storage:
    """Every object, the resource version counter, the watch history and the GC."""

    history_size: int = 50_000
    lock: threading.RLock = field(default_factory=threading.RLock)
    resources: Dict[Key, Resource] = field(default_factory=dict)
    # Pods bound to a node are finished off by a kubelet when one is registered.
    kubelet_present: Callable[[], bool] = lambda: False

    def __post_init__(self) -> None:
        self.changed = threading.Condition(self.lock)
        self._rv = 1000
        self._objects: Dict[Key, Dict[Tuple[str, str], Obj]] = collections.defaultdict(dict)
        self._uids: Dict[str, Tuple[Key, str, str]] = {}
        self._history: Deque[WatchEvent] = collections.deque(maxlen=self.history_size)
        self._oldest = self._rv  # watches may resume from this version on
        self._gc_wake = threading.Event()
        self._stopped = threading.Event()
        self._gc = threading.Thread(target=self._gc_loop, name="standin-gc", daemon=True)
        self._gc.start()

    # --- reading ----------------------------------------------------------------------------

    @property
    def resource_version(self) -> int:
        return self._rv

    @property
    def oldest_version(self) -> int:
        return self._oldest

    def find(self, res: Resource, namespace: str, name: str) -> Optional[Obj]:
        """The stored object itself (no copy) or None; callers hold ``lock``."""
        return self._objects[res.key].get((namespace, name))

    def get(self, res: Resource, namespace: str, name: str) -> Obj:
        with self.lock:
            obj = self.find(res, namespace, name)
            if obj is None:
                raise not_found(res.plural, res.group, name)
            return clone(obj)

    def list(self, res: Resource, namespace: Optional[str]) -> Tuple[List[Obj], int]:
        with self.lock:
            items = [clone(o) for (ns, _), o in sorted(self._objects[res.key].items())
                     if namespace is None or ns == namespace]
            return items, self._rv

    def events_after(self, rv: int) -> Iterator[WatchEvent]:
        """History entries newer than ``rv``; callers hold ``lock``. 410 when ``rv`` is too old."""
        if rv < self._oldest:
            raise error(410, f"too old resource version: {rv} ({self._oldest})", "Expired")
        for event in reversed(self._history):
            if event.rv <= rv:
                break
            yield event

    def compact(self) -> None:
        """Forget the watch history: watches resuming from before now get 410 Gone."""
        with self.lock:
            self._history.clear()
            self._oldest = self._rv

    # --- writing ----------------------------------------------------------------------------

    def _bump(self) -> int:
        self._rv += 1
        return self._rv

    def _record(self, type_: str, res: Resource, obj: Obj, old: Optional[Obj]) -> None:
        if len(self._history) == self._history.maxlen:
            self._oldest = self._history[0].rv
        self._history.append(WatchEvent(self._rv, type_, res.key, clone(obj), old))
        self.changed.notify_all()

    def insert(self, res: Resource, obj: Obj) -> Obj:
        """Create: stamps uid, creationTimestamp, resourceVersion and generation."""
        with self.lock:
            m = meta(obj)
            ns, name = m.get("namespace", ""), m["name"]
            if (ns, name) in self._objects[res.key]:
                raise already_exists(res.plural, res.group, name)
            m.setdefault("uid", str(uuid.uuid4()))
            m.setdefault("creationTimestamp", now())
            if "spec" in obj:
                m["generation"] = 1
            m.pop("deletionTimestamp", None)
            m["resourceVersion"] = str(self._bump())
            self._objects[res.key][(ns, name)] = obj
            self._uids[m["uid"]] = (res.key, ns, name)
            self._record("ADDED", res, obj, None)
            if m.get("ownerReferences"):
                self._gc_wake.set()
            return clone(obj)

    def update(self, res: Resource, obj: Obj, expected_rv: Optional[str] = None) -> Obj:
        """Replace the stored object; ``expected_rv`` (when given) must still be current."""
        with self.lock:
            m = meta(obj)
            ns, name = m.get("namespace", ""), m["name"]
            old = self.find(res, ns, name)
            if old is None:
                raise not_found(res.plural, res.group, name)
            om = old["metadata"]
            if expected_rv and expected_rv != om["resourceVersion"]:
                raise conflict(res.plural, res.group, name,
                               "the object has been modified; please apply your changes to the "
                               "latest version and try again")
            for kept in ("uid", "creationTimestamp", "deletionTimestamp",
                         "deletionGracePeriodSeconds"):
                if kept in om:
                    m[kept] = om[kept]
                else:
                    m.pop(kept, None)
            if "generation" in om:
                changed = orjson.dumps(spec_part(obj), option=orjson.OPT_SORT_KEYS) != \
                    orjson.dumps(spec_part(old), option=orjson.OPT_SORT_KEYS)
                m["generation"] = om["generation"] + (1 if changed else 0)
            m["resourceVersion"] = om["resourceVersion"]
            if orjson.dumps(obj, option=orjson.OPT_SORT_KEYS) == orjson.dumps(
                    old, option=orjson.OPT_SORT_KEYS):
                return clone(old)  # a no-op update writes nothing, as on a real server
            m["resourceVersion"] = str(self._bump())
            self._objects[res.key][(ns, name)] = obj
            if "deletionTimestamp" in m and not m.get("finalizers"):
                self._remove(res, obj)
                return clone(obj)
            self._record("MODIFIED", res, obj, clone(old))
            if m.get("ownerReferences") or om.get("ownerReferences") or FOREGROUND in (m.get("finalizers") or []):
                self._gc_wake.set()
            return clone(obj)

    def _remove(self, res: Resource, obj: Obj) -> None:
        m = obj["metadata"]
        ns, name = m.get("namespace", ""), m["name"]
        old = self._objects[res.key].pop((ns, name), None)
        self._uids.pop(m["uid"], None)
        m["resourceVersion"] = str(self._bump())
        self._record("DELETED", res, obj, old)
        self._gc_wake.set()
        if res.kind == "Namespace":
            self._empty_namespace(name)

    def _empty_namespace(self, namespace: str) -> None:
        for key, objects in list(self._objects.items()):
            for (ns, _name), obj in list(objects.items()):
                if ns == namespace:
                    self._remove(self.resources[key], obj)

    def delete(self, res: Resource, namespace: str, name: str, propagation: Optional[str] = None,
               preconditions: Optional[Dict[str, Any]] = None,
               grace_seconds: Optional[int] = None) -> Obj:
        """Delete (or start deleting) an object; returns it as the API returns it."""
        with self.lock:
            obj = self.find(res, namespace, name)
            if obj is None:
                raise not_found(res.plural, res.group, name)
            m = obj["metadata"]
            for field_name in ("uid", "resourceVersion"):
                want = (preconditions or {}).get(field_name)
                if want and want != m.get(field_name):
                    raise conflict(res.plural, res.group, name,
                                   f"Precondition failed: {field_name} in precondition: {want}, "
                                   f"{field_name} in object meta: {m.get(field_name)}")
            policy = propagation or res.default_propagation
            if policy not in ("Orphan", "Background", "Foreground"):
                raise error(400, f"unknown propagationPolicy {policy!r}")
            if policy == "Orphan":
                self._orphan(m["uid"])
            obj = clone(obj)
            m = obj["metadata"]
            finalizers = list(m.get("finalizers") or [])
            if policy == "Foreground" and FOREGROUND not in finalizers and self._dependents(m["uid"]):
                finalizers.append(FOREGROUND)
            grace = grace_seconds
            if res.kind == "Pod" and obj.get("spec", {}).get("nodeName") and self.kubelet_present():
                if grace is None:
                    grace = int(obj["spec"].get("terminationGracePeriodSeconds", 30))
            else:
                grace = 0
            if finalizers or grace:
                if "deletionTimestamp" not in m:
                    stored = self.find(res, namespace, name)
                    assert stored is not None
                    before = clone(stored)
                    stored["metadata"].update(
                        deletionTimestamp=now(), deletionGracePeriodSeconds=grace,
                        finalizers=finalizers)
                    stored["metadata"]["resourceVersion"] = str(self._bump())
                    self._record("MODIFIED", res, stored, before)
                    self._gc_wake.set()
                    return clone(stored)
                return obj
            self._remove(res, obj)
            return obj

    # --- garbage collection -----------------------------------------------------------------

    def _dependents(self, uid: str) -> List[Tuple[Resource, Obj]]:
        out = []
        for key, objects in self._objects.items():
            for obj in objects.values():
                refs = obj["metadata"].get("ownerReferences") or []
                if any(r.get("uid") == uid for r in refs):
                    out.append((self.resources[key], obj))
        return out

    def _orphan(self, uid: str) -> None:
        for res, dep in self._dependents(uid):
            new = clone(dep)
            refs = [r for r in new["metadata"]["ownerReferences"] if r.get("uid") != uid]
            new["metadata"]["ownerReferences"] = refs
            if not refs:
                del new["metadata"]["ownerReferences"]
            self.update(res, new)

    def collect(self) -> None:
        """One garbage-collector pass (the thread runs it; tests may call it to be quick)."""
        with self.lock:
            for key, objects in list(self._objects.items()):
                res = self.resources[key]
                for (ns, name), obj in list(objects.items()):
                    if objects.get((ns, name)) is not obj:
                        continue  # removed or replaced earlier in this pass
                    m = obj["metadata"]
                    if FOREGROUND in (m.get("finalizers") or []) and "deletionTimestamp" in m:
                        dependents = self._dependents(m["uid"])
                        for dep_res, dep in dependents:
                            if "deletionTimestamp" not in dep["metadata"]:
                                self.delete(dep_res, dep["metadata"].get("namespace", ""),
                                            dep["metadata"]["name"], "Foreground")
                        if not dependents:
                            new = clone(obj)
                            new["metadata"]["finalizers"] = [
                                f for f in new["metadata"]["finalizers"] if f != FOREGROUND]
                            self.update(res, new)
                        continue
                    refs = m.get("ownerReferences") or []
                    if not refs or m.get("deletionTimestamp"):
                        continue
                    alive = [r for r in refs if r.get("uid") in self._uids and not self._deleting_foreground(r["uid"])]
                    if not alive:
                        self.delete(res, m.get("namespace", ""), m["name"], "Background")
                    elif len(alive) < len(refs):
                        new = clone(obj)
                        new["metadata"]["ownerReferences"] = [
                            r for r in refs if r.get("uid") in self._uids]
                        self.update(res, new)

    def _deleting_foreground(self, uid: str) -> bool:
        key, ns, name = self._uids[uid]
        owner = self._objects[key][(ns, name)]["metadata"]
        return "deletionTimestamp" in owner and FOREGROUND in (owner.get("finalizers") or [])

    def _gc_loop(self) -> None:
        while not self._stopped.is_set():
            if self._gc_wake.wait(0.5):
                self._gc_wake.clear()
                try:
                    self.collect()
                except Exception:  # noqa: BLE001 - the GC must outlive one bad object
                    import traceback

                    traceback.print_exc()

    def stop(self) -> None:
        self._stopped.set()
        with self.lock:
            self.changed.notify_all()


def generate_name(prefix: str, taken: Callable[[str], bool]) -> str:
    """``generateName``: the prefix plus five random characters, as the API server picks them."""
    alphabet = "bcdfghjklmnpqrstvwxz2456789"
    for _ in itertools.count():
        suffix = "".join(alphabet[b % len(alphabet)] for b in uuid.uuid4().bytes[:5])
        name = prefix[:58] + suffix
        if not taken(name):
            return name
    raise AssertionError("unreachable")
