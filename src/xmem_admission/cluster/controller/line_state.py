"""The line's state (``Line``), held by the context: grants, the round-robin cursor, refusals
and their back-off, recent durations, the workloads told. ``estimation_line`` dispatches from
it."""

from __future__ import annotations

import collections
import datetime
import itertools
import threading
import time
from dataclasses import dataclass
from typing import Deque, Dict, Iterable, List, Optional, Set, Tuple

from xmem_admission.cluster.controller import records
from xmem_admission.cluster.kube.client import Obj

RECENT = 20  # finished estimations whose durations predict the wait
BACKOFF_FIRST = 5.0  # seconds before a refused estimation pod is tried again, doubling ...
BACKOFF_MAX = 60.0  # ... up to this
# seconds a workload first seen by this controller keeps its place in its namespace's line
# before its reconcile has asked for its estimate (the workloads after it wait for it)
KEEP_PLACE_SECONDS = 30.0

Key = Tuple[str, str]  # (namespace, estimate name)


@dataclass
class Refusal:
    """An estimation pod the API server refused, tried again after ``until``."""

    until: datetime.datetime
    failures: int
    quota: bool



class Line:
    """The controller's state of the line: grants, the round-robin cursor, refusals, recent
    durations, the workloads told. Kept in memory; a controller that leads again starts over
    from the API objects (``reset``)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # caps, grants and pod creation, checked together
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.grants: Dict[Key, float] = {}
            self.cursor: Optional[str] = None
            self._seen: Dict[str, int] = {}
            self._seen_at: Dict[str, float] = {}  # uid -> time.monotonic() when first seen
            self._counter = itertools.count()
            self.refusals: Dict[Key, Refusal] = {}
            self.durations: Deque[float] = collections.deque(maxlen=RECENT)
            self.seeded = False
            self.told: Set[str] = set()  # workload uids told of the backlog
            self.published: Set[str] = set()  # namespaces with gauge series
            self.shareable: Set[Key] = set()  # waiting estimates a traced one serves now
            self.riders: Dict[Key, List[Key]] = {}  # a granted estimate's riders (``batches``)
            self.riding: Dict[Key, Key] = {}  # a rider's granted estimate
            self.solo: Set[Key] = set()  # estimates a batch could not trace: alone from now

    # --- arrival order ----------------------------------------------------------------------

    def saw(self, obj: Obj) -> None:
        """Note the order in which workloads are first seen (ties of creation seconds)."""
        uid = obj["metadata"].get("uid")
        if uid and uid not in self._seen:
            with self.lock:
                if uid not in self._seen:
                    self._seen[uid] = next(self._counter)
                    self._seen_at[uid] = time.monotonic()

    def forget(self, obj: Obj) -> None:
        with self.lock:
            self._seen.pop(obj["metadata"].get("uid", ""), None)
            self._seen_at.pop(obj["metadata"].get("uid", ""), None)
            self.told.discard(obj["metadata"].get("uid", ""))

    def seq(self, uid: str) -> int:
        return self._seen.get(uid, 1 << 62)

    def keeps_place(self, uid: str, now: float) -> bool:
        """Was this workload first seen less than ``KEEP_PLACE_SECONDS`` before ``now``
        (``time.monotonic()``)?"""
        seen = self._seen_at.get(uid)
        return seen is not None and now - seen < KEEP_PLACE_SECONDS

    # --- grants -----------------------------------------------------------------------------

    def granted(self, key: Key) -> bool:
        with self.lock:
            return key in self.grants

    def started(self, key: Key) -> None:
        """The pod of a granted estimate exists: the grant is used up, any refusal is over."""
        with self.lock:
            self.grants.pop(key, None)
            self.refusals.pop(key, None)

    def release(self, key: Key) -> None:
        with self.lock:
            self.grants.pop(key, None)
            self.drop_riders(key)

    def riders_of(self, key: Key) -> List[Key]:
        with self.lock:
            return list(self.riders.get(key, ()))

    def drop_riders(self, key: Key) -> None:
        """The riders of ``key``'s grant go back to the line (or are in its pod now)."""
        with self.lock:
            for rider in self.riders.pop(key, ()):
                self.riding.pop(rider, None)

    def refused(self, key: Key, now: datetime.datetime, quota: bool) -> Tuple[float, bool]:
        """Record a refused pod: the seconds to wait, and whether it is the first of a run of
        refusals (to be said once)."""
        with self.lock:
            self.grants.pop(key, None)
            self.drop_riders(key)
            before = self.refusals.get(key)
            failures = before.failures + 1 if before is not None else 1
            delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (failures - 1))
            self.refusals[key] = Refusal(now + datetime.timedelta(seconds=delay), failures, quota)
            return delay, before is None

    def backing_off(self, key: Key, now: datetime.datetime) -> Optional[Refusal]:
        refusal = self.refusals.get(key)
        return refusal if refusal is not None and now < refusal.until else None

    # --- durations --------------------------------------------------------------------------

    def finished(self, seconds: float) -> None:
        with self.lock:
            self.durations.append(max(0.0, seconds))

    def recent(self) -> List[float]:
        with self.lock:
            return list(self.durations)

    def seed(self, gmes: Iterable[Obj]) -> None:
        """The latest finished estimations' durations, read once from the estimates."""
        if self.seeded:
            return
        done: List[Tuple[datetime.datetime, float]] = []
        for gme in gmes:
            status = gme.get("status") or {}
            started = records.parse_time(status.get("startTime"))
            ended = records.parse_time(status.get("completionTime"))
            if records.phase(gme) in records.TERMINAL and started and ended and ended >= started:
                done.append((ended, (ended - started).total_seconds()))
        with self.lock:
            if not self.seeded:
                for _, seconds in sorted(done)[-RECENT:]:
                    self.durations.append(seconds)
                self.seeded = True
