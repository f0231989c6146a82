"""The webhook's estimate store, backed by ``GPUMemoryEstimate`` resources.

Implements ``xmem_admission.cluster.policy.store.EstimateStore``: ``get`` answers from memory (it
is on the API server's request path), from a cache an informer keeps in step with every
succeeded GME in the cluster; ``put`` records an estimate as a GME (created, then its status
written: status is a subresource), in the namespace of the record's workload. Lookups are
namespaced (``policy.store.choose``): a GME sizes the workloads of its own namespace and of the
namespaces the policy shares estimates with, never others; within one namespace the most
recently completed record wins. ``xmem serve`` uses it in a cluster instead of the in-memory
store (``KubeStore(kube).start()``).

``retry`` answers, by (namespace, workload uid), the grant the controller recorded in a GME's
``status.oomRetries`` after that workload's pod ran out of GPU memory: indexed from
every GME whatever its phase, and only ever for the GME's own namespace.
"""

from __future__ import annotations

import threading
from typing import Collection, Dict, Optional, Tuple

from xmem_admission.cluster.controller import records
from xmem_admission.cluster.kube.client import GME, Kube, Obj
from xmem_admission.cluster.kube.informer import Informer
from xmem_admission.cluster.policy.store import EstimateRecord, RetryGrant, choose
from xmem_admission.contract.errors import KubeApiError


class KubeStore:
    """See the module docstring."""

    def __init__(self, kube: Kube, default_namespace: str = "default") -> None:
        self.kube = kube
        self.default_namespace = default_namespace
        self._lock = threading.Lock()
        self._records: Dict[str, Dict[Tuple[str, str], EstimateRecord]] = {}
        self._best: Dict[str, Dict[str, EstimateRecord]] = {}  # fingerprint -> namespace -> newest
        self._where: Dict[Tuple[str, str], str] = {}  # (namespace, name) -> fingerprint
        self._grants: Dict[Tuple[str, str], Dict[str, RetryGrant]] = {}  # (ns, name) -> by uid
        self._retries: Dict[Tuple[str, str], RetryGrant] = {}  # (namespace, workload uid)
        self.informer = Informer(kube, GME, self._on_event)

    def start(self, timeout: float = 30.0) -> KubeStore:
        self.informer.start()
        self.informer.synced.wait(timeout)
        return self

    def stop(self) -> None:
        self.informer.stop()

    def __len__(self) -> int:
        return sum(len(found) for found in self._best.values())

    def get(self, fingerprint: str, namespace: str,
            shared: Collection[str] = ()) -> Optional[EstimateRecord]:
        found = self._best.get(fingerprint)  # a dict read: atomic, no lock on the hot path
        return choose(found, namespace, shared) if found else None

    def retry(self, namespace: str, workload_uid: str) -> Optional[RetryGrant]:
        return self._retries.get((namespace, workload_uid))

    def put(self, record: EstimateRecord) -> None:
        namespace = record.workload.namespace if record.workload and record.workload.namespace \
            else self.default_namespace
        obj = records.from_record(record, namespace)
        status = obj.pop("status")
        try:
            created = self.kube.create(GME, namespace, obj)
        except KubeApiError as exc:
            if not exc.already_exists:
                raise
            created = self.kube.get(GME, namespace, obj["metadata"]["name"])
        written = self.kube.replace_status(GME, records.with_status(created, status))
        self._on_event("MODIFIED", written)

    def _on_event(self, kind: str, gme: Obj) -> None:
        m = gme["metadata"]
        key = (m.get("namespace", ""), m["name"])
        record = None if kind == "DELETED" else records.record(gme)
        grants = {} if kind == "DELETED" else {g.workload_uid: g for g in records.retry_grants(gme)}
        with self._lock:
            retries = dict(self._retries)
            for uid in self._grants.pop(key, {}):
                retries.pop((key[0], uid), None)
            if grants:
                self._grants[key] = grants
                retries.update({(key[0], uid): g for uid, g in grants.items()})
            self._retries = retries  # replaced whole: readers never see it half-built
            old = self._where.pop(key, None)
            if old is not None:
                self._records.get(old, {}).pop(key, None)
                self._refresh(old)
            if record is not None:
                self._where[key] = record.fingerprint
                self._records.setdefault(record.fingerprint, {})[key] = record
                self._refresh(record.fingerprint)

    def _refresh(self, fingerprint: str) -> None:
        found = self._records.get(fingerprint) or {}
        if not found:
            self._records.pop(fingerprint, None)
            self._best.pop(fingerprint, None)
            return
        newest: Dict[str, EstimateRecord] = {}
        for (namespace, _name), record in found.items():
            if namespace not in newest or (record.created or "") > (newest[namespace].created or ""):
                newest[namespace] = record
        self._best[fingerprint] = newest  # replaced whole: readers never see it half-built
