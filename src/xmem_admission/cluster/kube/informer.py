"""List-then-watch caches of API objects, and the work queue the reconcilers drain.

``Informer`` keeps an in-memory copy of one kind (cluster-wide, optionally label-selected) the
way client-go's informers do: list (in pages of ``page_size``: ``limit`` and ``continue``, an
expired continue token starting the listing over), remember the list's resourceVersion, watch
from it, apply each event to the cache and tell the handler; on ``410 Gone`` (history
compacted), on a dropped stream or any error, list again, so the cache converges whatever the
connection does. Reads come from the cache; writes go to the API with the cached
resourceVersion, and a 409 sends the reconcile back to the queue to try again on fresher state.

What the cache holds, for a big cluster: no object keeps its ``managedFields`` (often half an
object's size; an update that leaves them out keeps them on the server); with ``keep``, only
the objects it accepts are held and told to the handler (one that stops being accepted is told
as DELETED), and ``relist()`` lists again when what ``keep`` accepts has changed (a namespace
opted in).

``WorkQueue`` deduplicates keys (a key queued ten times is reconciled once), delays keys for
retries and deadlines (one timer a key, the earliest asked for: a resync that asks again does
not add another), and never hands one key to two workers at once. Keys that ``first`` picks
(by default the cluster-wide items, keys of one part such as the estimation line's dispatch)
go ahead of the others: a resync that queues thousands of held workloads does not hold back
the dispatch that starts their estimation pods.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Any, Callable, Dict, Generic, Hashable, List, Optional, Set, Tuple, TypeVar

from xmem_admission.cluster.kube.client import METADATA_LIST, METADATA_WATCH, Kind, Kube, Obj

log = logging.getLogger(__name__)

Handler = Callable[[str, Obj], None]  # (event type, object)
Key = Tuple[str, str]  # (namespace, name)
QueueKey = TypeVar("QueueKey", bound=Hashable)


def key_of(obj: Obj) -> Key:
    m = obj.get("metadata") or {}
    return (m.get("namespace", ""), m.get("name", ""))


class Informer:
    """A watch-fed cache of one kind; see the module docstring."""

    def __init__(self, kube: Kube, kind: Kind, handler: Optional[Handler] = None,
                 label_selector: str = "", watch_timeout: int = 60,
                 retry_seconds: float = 1.0, metadata_only: bool = False,
                 keep: Optional[Callable[[Obj], bool]] = None, page_size: int = 500) -> None:
        self.kube = kube
        self.kind = kind
        self.metadata_only = metadata_only  # PartialObjectMetadata: no data held or sent
        self.handler = handler
        self.label_selector = label_selector
        self.watch_timeout = watch_timeout
        self.retry_seconds = retry_seconds
        self.keep = keep
        self.page_size = page_size
        self.listed = 0  # objects the last listing brought, held or not
        self._again = threading.Event()  # a relist asked for
        self.synced = threading.Event()
        self.error: Optional[str] = None
        self._objects: Dict[Key, Obj] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch: Any = None
        self._thread: Optional[threading.Thread] = None

    # --- reading ----------------------------------------------------------------------------

    def get(self, namespace: str, name: str) -> Optional[Obj]:
        with self._lock:
            return self._objects.get((namespace, name))

    def items(self) -> List[Obj]:
        with self._lock:
            return list(self._objects.values())

    def find(self, predicate: Callable[[Obj], bool]) -> List[Obj]:
        with self._lock:
            return [o for o in self._objects.values() if predicate(o)]

    def versions(self, namespace: str) -> Callable[[str, str], Optional[Tuple[str, str]]]:
        """A lookup of (kind, name) in ``namespace`` to the cached object's (uid,
        resourceVersion), None when it is not there: what ``policy.fingerprint`` reads."""
        def lookup(kind: str, name: str) -> Optional[Tuple[str, str]]:
            found = self.get(namespace, name) if kind == self.kind.kind else None
            if found is None:
                return None
            m = found.get("metadata") or {}
            return str(m.get("uid") or ""), str(m.get("resourceVersion") or "")
        return lookup

    def put(self, obj: Obj) -> None:
        """Record what a write of ours returned, so the next reconcile sees it at once."""
        obj = _without_managed_fields(obj)
        with self._lock:
            key = key_of(obj)
            old = self._objects.get(key)
            if old is None or _newer(obj, old):
                self._objects[key] = obj

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)

    def relist(self) -> None:
        """List again soon (what ``keep`` accepts has changed): the watch is ended and the
        cache rebuilt from a fresh listing; objects no longer accepted are told as DELETED."""
        self._again.set()

        def interrupt() -> None:  # until the listing begins: a stream may be opening now
            deadline = time.monotonic() + 10.0
            while self._again.is_set() and not self._stop.is_set() and \
                    time.monotonic() < deadline:
                self._interrupt()
                self._stop.wait(0.05)
        threading.Thread(target=interrupt, name=f"relist-{self.kind.plural}", daemon=True).start()

    # --- running ----------------------------------------------------------------------------

    def start(self) -> Informer:
        """Start (or start again after ``stop``) from a fresh listing: every object is told
        as ADDED, so whoever restarts it sees the whole state again."""
        if self._thread is not None and self._thread.is_alive():
            # A stopped stream ends by itself at its server-side timeout at the latest.
            self._thread.join(self.watch_timeout + 5)
        self._stop.clear()
        self._again.clear()
        self.synced.clear()
        with self._lock:
            self._objects = {}
        self._thread = threading.Thread(target=self._run, name=f"informer-{self.kind.plural}",
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        deadline = time.monotonic() + timeout
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            self._interrupt()  # the stream may open just after a first attempt: keep trying
            self._thread.join(0.05)

    def _interrupt(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            interrupt_watch(self._watch)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                version = self._relist()
                while not self._stop.is_set() and not self._again.is_set():
                    version = self._stream(version)  # resume from the last version seen
            except Exception as exc:  # noqa: BLE001 - the cache must outlive any failure
                if self._stop.is_set():
                    return
                if self._again.is_set():
                    continue  # the stream was ended to list again
                message = f"{type(exc).__name__}: {exc}"
                if message != self.error:
                    log.warning("%s informer: %s; listing again", self.kind.plural, message)
                self.error = message
                self._stop.wait(self.retry_seconds)

    def _relist(self) -> str:
        self._again.clear()
        fresh: Dict[Key, Obj] = {}
        version, listed = "", 0
        for page in self.kube.list_pages(self.kind, self.label_selector,
                                         METADATA_LIST if self.metadata_only else None,
                                         self.page_size):
            if page.get("restarted"):
                fresh, listed = {}, 0
            for item in page.get("items") or []:
                listed += 1
                obj = self._kept(item)
                if self.keep is None or self.keep(obj):
                    fresh[key_of(obj)] = obj
            version = str((page.get("metadata") or {}).get("resourceVersion") or version)
        self.listed = listed
        with self._lock:
            gone = [o for k, o in self._objects.items() if k not in fresh]
            changed = [o for k, o in fresh.items() if self._objects.get(k) != o]
            self._objects = fresh
        self.error = None
        self.synced.set()
        for obj in gone:
            self._tell("DELETED", obj)
        for obj in changed:
            self._tell("ADDED", obj)
        return version

    def _stream(self, version: str) -> str:
        """Watch from ``version`` until the server ends the stream; the last version seen."""
        from kubernetes import watch

        self._watch = watch.Watch()  # type: ignore[no-untyped-call]  # kubernetes ships no types
        kwargs: Dict[str, Any] = {"resource_version": version, "timeout_seconds": self.watch_timeout,
                                  "allow_watch_bookmarks": True, "deserialize": False}
        if self.label_selector:
            kwargs["label_selector"] = self.label_selector
        if self.metadata_only:
            kwargs["_headers"] = METADATA_WATCH
        if self._again.is_set():
            return version
        for event in self._watch.stream(self.kube.list_function(self.kind), **kwargs):
            if self._stop.is_set() or self._again.is_set():
                return version
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                raise RuntimeError(f"watch error: {obj.get('message')}")
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if kind == "BOOKMARK":
                continue
            obj = self._kept(obj)
            if self.keep is not None and kind != "DELETED" and not self.keep(obj):
                kind = "DELETED"  # not (or no longer) one of ours: not held, not told
            with self._lock:
                if kind == "DELETED":
                    if self._objects.pop(key_of(obj), None) is None and self.keep is not None:
                        continue  # never held: nobody was told of it
                else:
                    self._objects[key_of(obj)] = obj
            self._tell(kind, obj)
        return version

    def _kept(self, obj: Obj) -> Obj:
        """What the cache keeps of an object: all of it, or with ``metadata_only`` its name,
        namespace, uid and resourceVersion (not its labels, annotations or managedFields, where
        ``kubectl apply`` keeps a copy of the data)."""
        if self.metadata_only:
            m = obj.get("metadata") or {}
            obj = {"metadata": {k: m[k] for k in ("name", "namespace", "uid", "resourceVersion")
                                if k in m}}
        return _with_kind(_without_managed_fields(obj), self.kind)

    def _tell(self, kind: str, obj: Obj) -> None:
        if self.handler is None:
            return
        try:
            self.handler(kind, obj)
        except Exception:  # noqa: BLE001 - a handler bug must not kill the watch
            log.exception("%s handler failed", self.kind.plural)


def interrupt_watch(watcher: Any) -> None:
    """Wake a thread blocked reading a ``watch.Watch`` stream: shut its socket down.

    Closing the response object from another thread does not wake a ``recv`` already blocked
    on the socket; shutting the socket down does, and the reader then sees the stream end.
    """
    import socket

    response = getattr(watcher, "_resp", None)
    if response is None:
        return
    sock = getattr(getattr(response, "connection", None), "sock", None)
    try:
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the other side


def _without_managed_fields(obj: Obj) -> Obj:
    """The object without ``metadata.managedFields`` (a shallow copy where it had them)."""
    m = obj.get("metadata")
    if isinstance(m, dict) and "managedFields" in m:
        obj = dict(obj, metadata={k: v for k, v in m.items() if k != "managedFields"})
    return obj


def _with_kind(obj: Obj, kind: Kind) -> Obj:
    """List items come without apiVersion/kind on a real server: put them back."""
    if obj.get("kind") != kind.kind or obj.get("apiVersion") != kind.api_version:
        obj = dict(obj, apiVersion=kind.api_version, kind=kind.kind)
    return obj


def _cluster_wide(key: Any) -> bool:
    """A work item of one part (``("dispatch",)``), not about one object."""
    return isinstance(key, tuple) and len(key) == 1


def _newer(a: Obj, b: Obj) -> bool:
    try:
        return int(a["metadata"]["resourceVersion"]) >= int(b["metadata"]["resourceVersion"])
    except (KeyError, ValueError, TypeError):
        return True  # resourceVersions are opaque on some servers: trust the latest write


class WorkQueue(Generic[QueueKey]):
    """Deduplicating, delaying work queue; see the module docstring."""

    def __init__(self, first: Optional[Callable[[QueueKey], bool]] = None) -> None:
        self._first = first or _cluster_wide
        self._cond = threading.Condition()
        self._ready: List[QueueKey] = []
        self._queued: Set[QueueKey] = set()
        self._active: Set[QueueKey] = set()
        self._again: Set[QueueKey] = set()  # queued while being processed
        self._delayed: List[Tuple[float, int, QueueKey]] = []
        # when each delayed key is due: one pending timer per key, the earliest asked for (a
        # heap entry whose time is not its key's here is stale and skipped)
        self._due: Dict[QueueKey, float] = {}
        self._counter = itertools.count()
        self._closed = False

    def add(self, key: QueueKey, delay: float = 0.0) -> None:
        with self._cond:
            if delay > 0:
                due = time.monotonic() + delay
                if self._due.get(key, due + 1) <= due:
                    return  # already due as early: one timer a key, as client-go's AddAfter
                self._due[key] = due
                heapq.heappush(self._delayed, (due, next(self._counter), key))
            elif key in self._active:
                self._again.add(key)
            elif key not in self._queued:
                self._queued.add(key)
                self._ready_add(key)
            self._cond.notify()

    def _ready_add(self, key: QueueKey) -> None:
        if self._first(key):
            self._ready.insert(0, key)
        else:
            self._ready.append(key)

    def get(self, timeout: float = 0.5) -> Optional[QueueKey]:
        """The next key to process (mark it ``done`` afterwards), or None after ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                self._promote()
                if self._ready:
                    key = self._ready.pop(0)
                    self._queued.discard(key)
                    self._active.add(key)
                    return key
                left = deadline - time.monotonic()
                if self._closed or left <= 0:
                    return None
                wait = left
                if self._delayed:
                    wait = min(wait, max(0.0, self._delayed[0][0] - time.monotonic()))
                self._cond.wait(wait)

    def done(self, key: QueueKey) -> None:
        with self._cond:
            self._active.discard(key)
            if key in self._again:
                self._again.discard(key)
                if key not in self._queued:
                    self._queued.add(key)
                    self._ready_add(key)
                self._cond.notify()

    def _promote(self) -> None:
        now = time.monotonic()
        while self._delayed and self._delayed[0][0] <= now:
            due, _, key = heapq.heappop(self._delayed)
            if self._due.get(key) != due:
                continue  # replaced by an earlier timer, which fired already
            del self._due[key]
            if key in self._active:
                self._again.add(key)
            elif key not in self._queued:
                self._queued.add(key)
                self._ready_add(key)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def reopen(self) -> None:
        """Empty and open again after ``close`` (a controller that leads again starts over)."""
        with self._cond:
            self._ready.clear()
            self._queued.clear()
            self._active.clear()
            self._again.clear()
            self._delayed.clear()
            self._due.clear()
            self._closed = False

    def __len__(self) -> int:
        with self._cond:
            return len(self._ready) + len(self._due)

    def pending(self, key: QueueKey) -> int:
        """How many entries wait for ``key``: ready now, and a timer (at most one of each)."""
        with self._cond:
            return int(key in self._queued) + int(key in self._due)
