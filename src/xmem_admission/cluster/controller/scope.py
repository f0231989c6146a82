"""Which workloads the controller caches: those it may act on, not every one in the cluster.

A cluster may run tens of thousands of Jobs, a few of them GPU workloads xmem sizes. The
workload informers hold (and tell the reconcilers of) only

- the workloads in an opted-in namespace (labelled ``xmem.io/estimate=true``), and
- anywhere else, the workloads that carry one of xmem's marks: an ``xmem.io/`` label or
  annotation on the workload or on one of its pod templates (the opt-in label, a hold, a
  fingerprint, a sizing; a workload held in a namespace that has since opted out is released
  all the same).

Every other workload is read once as it arrives and dropped. The opted-in namespaces are
watched (metadata only, label-selected); when a namespace opts in or out, the workload
informers list again, so a namespace labelled while the controller runs is served without a
restart.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, List, Set

from xmem_admission.cluster import labels
from xmem_admission.cluster.kube.client import NAMESPACE, Kube, Obj
from xmem_admission.cluster.kube.informer import Informer

log = logging.getLogger(__name__)

OPTED_IN_SELECTOR = f"{labels.OPT_IN}={labels.OPT_IN_VALUE}"


def carries_marks(obj: Any) -> bool:
    """Whether any ``labels`` or ``annotations`` map in the object (its own, its templates')
    holds an ``xmem.io/`` key; ``status`` is not looked in."""
    stack: List[Any] = [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("labels", "annotations") and isinstance(value, dict):
                    if any(isinstance(k, str) and k.startswith(labels.PREFIX) for k in value):
                        return True
                elif key not in ("status", "managedFields") and isinstance(value, (dict, list)):
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))
    return False


class OptedInNamespaces:
    """The namespaces labelled ``xmem.io/estimate=true``, from a metadata-only watch.

    ``changed`` is called when one opts in or out after ``seal()`` (the first listing is the
    starting point, not a change)."""

    def __init__(self, kube: Kube, changed: Callable[[], None]) -> None:
        self.changed = changed
        self.informer = Informer(kube, NAMESPACE, self._on_namespace,
                                 label_selector=OPTED_IN_SELECTOR, metadata_only=True)
        self._known: Set[str] = set()
        self._sealed = False
        self._lock = threading.Lock()

    def __contains__(self, namespace: object) -> bool:
        return isinstance(namespace, str) and self.informer.get("", namespace) is not None

    def seal(self) -> None:
        """What is listed now is where the workload informers start from."""
        with self._lock:
            self._known = {o["metadata"]["name"] for o in self.informer.items()}
            self._sealed = True

    def unseal(self) -> None:
        with self._lock:
            self._sealed = False

    def _on_namespace(self, type_: str, obj: Obj) -> None:
        name = obj["metadata"].get("name", "")
        with self._lock:
            if not self._sealed:
                return
            if (type_ == "DELETED") == (name not in self._known):
                return  # nothing new
            if type_ == "DELETED":
                self._known.discard(name)
            else:
                self._known.add(name)
        log.info("namespace %s %s: listing workloads again", name,
                 "opted out" if type_ == "DELETED" else "opted in")
        self.changed()

    def wanted(self, obj: Obj) -> bool:
        """Whether the controller holds this workload in its caches (see the module docstring)."""
        return (obj.get("metadata") or {}).get("namespace") in self or carries_marks(obj)
