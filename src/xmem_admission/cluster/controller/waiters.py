"""Which held workloads wait on which estimate, in memory (the context holds one ``Waiters``).

Filled by ``estimate_cache.join`` from the reconcile of each held workload (and each Kueue
Workload whose check is pending); a restarted controller fills it again from its first pass.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Set, Tuple


class Waiters:
    """(namespace, estimate name) -> the workloads waiting on it, by uid: (kind, name)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by: Dict[Tuple[str, str], Dict[str, Tuple[str, str]]] = {}
        self._estimates_of: Dict[str, int] = {}  # workload uid -> estimates it waits on
        self.seen: Set[Tuple[str, str]] = set()  # (pod uid, imageID) checked by check_image

    def add(self, namespace: str, name: str, kind: str, workload: str, uid: str) -> bool:
        """Record a waiter; True when it is new."""
        with self._lock:
            found = self._by.setdefault((namespace, name), {})
            if found.get(uid) == (kind, workload):
                return False
            if uid not in found:
                self._estimates_of[uid] = self._estimates_of.get(uid, 0) + 1
            found[uid] = (kind, workload)
            return True

    def waits(self, uid: str) -> bool:
        """Does this workload wait on an estimate?"""
        with self._lock:
            return uid in self._estimates_of

    def _dropped(self, uid: str) -> None:
        left = self._estimates_of.get(uid, 0) - 1
        if left > 0:
            self._estimates_of[uid] = left
        else:
            self._estimates_of.pop(uid, None)

    def of(self, namespace: str, name: str) -> List[Tuple[str, str, str]]:
        """(kind, name, uid) of each waiter, oldest first."""
        with self._lock:
            found = self._by.get((namespace, name)) or {}
            return [(kind, workload, uid) for uid, (kind, workload) in found.items()]

    def drop(self, namespace: str, name: str, uid: str) -> None:
        with self._lock:
            found = self._by.get((namespace, name))
            if found is not None:
                if found.pop(uid, None) is not None:
                    self._dropped(uid)
                if not found:
                    self._by.pop((namespace, name), None)

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            for uid in self._by.pop((namespace, name), None) or {}:
                self._dropped(uid)

    def keys(self) -> List[Tuple[str, str]]:
        with self._lock:
            return list(self._by)
