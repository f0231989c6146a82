"""Recorded GPU memory estimates, looked up by namespace and workload fingerprint.

One interface, ``EstimateStore`` (``get`` and ``put``), two homes: stand-alone it is the
in-memory ``MemoryStore`` below, seedable from a directory of JSON files; in a cluster the
controller backs it with ``GPUMemoryEstimate`` resources. The webhook calls ``get`` on the API
server's request path, so an implementation must answer from memory (a cache fed by a watch),
never with a network round trip.

Estimates are namespaced: the estimation pod runs the tenant's own code, so its result may only
size that tenant's workloads. ``get`` answers with a record of the workload's own namespace,
else of a namespace the admin's policy shares estimates with (``spec.estimateSharing``), never
one from anywhere else. A record without a namespace can only come from the admin's own files
(``xmem serve --estimates``) and serves every namespace.

Estimate file format (``xmem serve --estimates DIR`` reads every ``*.json`` in DIR): one record
object, or a list of them. A record is the output of ``xmem estimate --json`` plus the
fingerprint it belongs to, so the usual way to make one is to add a ``fingerprint`` key to that
output::

    {
      "fingerprint": "3f2a...",                 # required: fingerprint.of_templates(...)
      "created": "2026-01-31T12:00:00Z",        # optional, RFC 3339
      "workload": {"namespace": "ml", "kind": "Job", "name": "train"},   # optional
      "gpus": [                                 # required, one entry per GPU model
        {"gpu": "A100-80GB",                    # any name the GPU catalogue accepts
         "capacity_bytes": 84970559242,
         "peak_reserved_bytes": 12884901888,
         "total_bytes": 13589544960,            # what the process shows on the GPU
         "recommended_request_bytes": 14269022208,
         "fits": true,
         "mig_profile": "2g.20gb"}              # or null
      ]
    }

Other keys (``mode``, ``steps``, ``seconds``, ``breakdown``, ...) are allowed and ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
from dataclasses import dataclass
from typing import Any, Collection, Dict, Iterable, List, Mapping, Optional, Protocol, Tuple

from xmem_admission.contract import gpus
from xmem_admission.contract.errors import EstimateRecordError, UnknownGPUError


@dataclass(frozen=True)
class GPUEstimate:
    """The estimate for one GPU model: the per-GPU object of ``xmem estimate --json``."""

    gpu: str  # catalogue key
    capacity_bytes: int
    peak_reserved_bytes: int
    total_bytes: int
    recommended_request_bytes: int
    fits: bool
    mig_profile: Optional[str] = None
    # the high end of the estimate's range (None: an older estimate's, the point)
    high_bytes: Optional[int] = None

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "gpu": self.gpu,
            "capacity_bytes": self.capacity_bytes,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "total_bytes": self.total_bytes,
            "recommended_request_bytes": self.recommended_request_bytes,
            "fits": self.fits,
            "mig_profile": self.mig_profile,
        }
        if self.high_bytes is not None:
            out["high_bytes"] = self.high_bytes
        return out


@dataclass(frozen=True)
class WorkloadRef:
    """Which workload an estimate was made for (informational: lookups go by fingerprint)."""

    namespace: str
    kind: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.kind}/{self.name}"


@dataclass(frozen=True)
class Run:
    """One earlier run of a fingerprint in a namespace, as the controller recorded it when the
    workload finished (``GPUMemoryEstimate`` ``status.runs``; ``policy.right_sizing``)."""

    gpu: str  # catalogue key of the GPU model it ran on
    estimate_bytes: int  # the estimate (total bytes for that GPU) its request was sized from
    peak_bytes: int  # the observed peak per GPU (``observations.ObservedPeak.peak_bytes``)
    completed: bool  # the workload succeeded (not failed, evicted or deleted before the end)
    finished: float  # when it finished (Unix seconds): the latest runs count


@dataclass(frozen=True)
class EstimateRecord:
    """Every GPU model's estimate for one fingerprint, and what the fingerprint's
    earlier runs in the record's namespace used."""

    fingerprint: str
    gpus: Tuple[GPUEstimate, ...]
    workload: Optional[WorkloadRef] = None
    created: Optional[str] = None
    runs: Tuple[Run, ...] = ()  # only ever the record's own namespace's (``choose``)

    def for_gpu(self, key: str) -> Optional[GPUEstimate]:
        """The estimate for a catalogue key, or None when this record does not cover it."""
        for estimate in self.gpus:
            if estimate.gpu == key:
                return estimate
        return None

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "fingerprint": self.fingerprint,
            "gpus": [g.to_dict() for g in self.gpus],
        }
        if self.workload is not None:
            out["workload"] = {
                "namespace": self.workload.namespace,
                "kind": self.workload.kind,
                "name": self.workload.name,
            }
        if self.created is not None:
            out["created"] = self.created
        return out

    @classmethod
    def from_dict(cls, data: Any, where: str = "record") -> EstimateRecord:
        """Read a record, checking every field; errors name the field (``gpus[1].total_bytes``)."""
        if not isinstance(data, dict):
            raise EstimateRecordError(f"{where}: expected a JSON object")
        fingerprint = data.get("fingerprint")
        if not isinstance(fingerprint, str) or not fingerprint:
            raise EstimateRecordError(f"{where}: 'fingerprint' must be a non-empty string")
        entries = data.get("gpus")
        if not isinstance(entries, list) or not entries:
            raise EstimateRecordError(f"{where}: 'gpus' must be a non-empty list")
        estimates = tuple(_gpu_estimate(e, f"{where}: gpus[{i}]") for i, e in enumerate(entries))
        workload = None
        if data.get("workload") is not None:
            raw = data["workload"]
            if not isinstance(raw, dict) or not all(
                isinstance(raw.get(k), str) for k in ("namespace", "kind", "name")
            ):
                raise EstimateRecordError(
                    f"{where}: 'workload' must have string namespace, kind and name"
                )
            workload = WorkloadRef(raw["namespace"], raw["kind"], raw["name"])
        created = data.get("created")
        if created is not None and not isinstance(created, str):
            raise EstimateRecordError(f"{where}: 'created' must be an RFC 3339 string")
        return cls(fingerprint, estimates, workload, created)


def _int(entry: Mapping[str, Any], key: str, where: str) -> int:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise EstimateRecordError(f"{where}.{key}: must be a non-negative integer (bytes)")
    return value


def _gpu_estimate(entry: Any, where: str) -> GPUEstimate:
    if not isinstance(entry, dict):
        raise EstimateRecordError(f"{where}: expected a JSON object")
    name = entry.get("gpu")
    if not isinstance(name, str):
        raise EstimateRecordError(f"{where}.gpu: must be a GPU name")
    try:
        key = gpus.lookup(name).key
    except UnknownGPUError as exc:
        raise EstimateRecordError(f"{where}.gpu: {exc}") from None
    fits = entry.get("fits")
    if not isinstance(fits, bool):
        raise EstimateRecordError(f"{where}.fits: must be true or false")
    mig = entry.get("mig_profile")
    if mig is not None and not isinstance(mig, str):
        raise EstimateRecordError(f"{where}.mig_profile: must be a profile name or null")
    return GPUEstimate(
        gpu=key,
        capacity_bytes=_int(entry, "capacity_bytes", where),
        peak_reserved_bytes=_int(entry, "peak_reserved_bytes", where),
        total_bytes=_int(entry, "total_bytes", where),
        recommended_request_bytes=_int(entry, "recommended_request_bytes", where),
        fits=fits,
        mig_profile=mig,
        high_bytes=None if entry.get("high_bytes") is None else _int(entry, "high_bytes", where),
    )


@dataclass(frozen=True)
class RetryGrant:
    """What the next pod of one workload asks for after its pods ran out of GPU memory.

    The controller writes it on the workload's ``GPUMemoryEstimate`` (``status.oomRetries``,
    writable by the controller only); the webhook applies it at Pod CREATE to the pods that
    workload's controller creates, by the workload's uid, in the workload's own namespace only:
    the out-of-memory message it grew from was written by the tenant's code.
    """

    namespace: str
    workload_uid: str
    gpu: str  # catalogue key the growth was computed for
    request_bytes: int  # per GPU; after giving up, the last request tried
    ooms: int  # out-of-memory failures in a row
    mig_profile: Optional[str] = None
    gave_up: Optional[str] = None  # the terminal reason, once no larger request can help


class EstimateStore(Protocol):
    """Where recorded estimates live; ``get`` must answer from memory (it is on the request path)."""

    def get(self, fingerprint: str, namespace: str,
            shared: Collection[str] = ()) -> Optional[EstimateRecord]:
        """The record for a fingerprint in ``namespace``, else in one of ``shared``, or None."""

    def put(self, record: EstimateRecord) -> None:
        """Record (or replace) the estimate for ``record.fingerprint`` in its namespace."""

    def retry(self, namespace: str, workload_uid: str) -> Optional[RetryGrant]:
        """The grant for a workload's next pod after an out-of-memory failure, or None."""


ANY_NAMESPACE = ""  # where a record without a namespace (the admin's own files) is kept


def choose(found: Mapping[str, EstimateRecord], namespace: str,
           shared: Collection[str] = ()) -> Optional[EstimateRecord]:
    """Of one fingerprint's records by namespace: the workload's own, else the newest of the
    namespaces shared with it, else one recorded for every namespace; never any other.

    The runs (what earlier runs used) come only with the workload's own namespace's record:
    those peaks were produced by that namespace's code, so an estimate shared with another
    namespace goes without them."""
    own = found.get(namespace)
    if own is not None:
        return own
    allowed = [found[n] for n in shared if n != namespace and n in found]
    other = max(allowed, key=lambda r: r.created or "") if allowed else found.get(ANY_NAMESPACE)
    return dataclasses.replace(other, runs=()) if other is not None and other.runs else other


def namespace_of(record: EstimateRecord) -> str:
    return record.workload.namespace if record.workload is not None else ANY_NAMESPACE


class MemoryStore:
    """A thread-safe in-memory store: stand-alone serving and tests."""

    def __init__(self, records: Iterable[EstimateRecord] = ()):
        self._lock = threading.Lock()
        self._records: Dict[str, Dict[str, EstimateRecord]] = {}
        self._retries: Dict[Tuple[str, str], RetryGrant] = {}
        for record in records:
            self.put(record)

    def get(self, fingerprint: str, namespace: str,
            shared: Collection[str] = ()) -> Optional[EstimateRecord]:
        found = self._records.get(fingerprint)  # a dict read: atomic, no lock on the hot path
        return choose(found, namespace, shared) if found else None

    def put(self, record: EstimateRecord) -> None:
        with self._lock:
            found = dict(self._records.get(record.fingerprint) or {})
            found[namespace_of(record)] = record
            self._records[record.fingerprint] = found

    def retry(self, namespace: str, workload_uid: str) -> Optional[RetryGrant]:
        return self._retries.get((namespace, workload_uid))

    def put_retry(self, grant: RetryGrant) -> None:
        """Record a grant (stand-alone serving has no controller to write one from an OOM)."""
        with self._lock:
            self._retries[(grant.namespace, grant.workload_uid)] = grant

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
            self._retries.clear()

    def __len__(self) -> int:
        return sum(len(found) for found in self._records.values())

    @classmethod
    def from_directory(cls, directory: str) -> MemoryStore:
        """Load every ``*.json`` file of a directory (see the module docstring for the format)."""
        if not os.path.isdir(directory):
            raise EstimateRecordError(f"{directory}: not a directory")
        records: List[EstimateRecord] = []
        for name in sorted(os.listdir(directory)):
            if not name.endswith(".json"):
                continue
            path = os.path.join(directory, name)
            try:
                with open(path, encoding="utf-8") as handle:
                    data = json.load(handle)
            except (OSError, UnicodeDecodeError) as exc:
                raise EstimateRecordError(f"{path}: cannot read: {exc}") from None
            except json.JSONDecodeError as exc:
                raise EstimateRecordError(f"{path}: not JSON: {exc}") from None
            items = data if isinstance(data, list) else [data]
            for index, item in enumerate(items):
                where = path if not isinstance(data, list) else f"{path}[{index}]"
                records.append(EstimateRecord.from_dict(item, where))
        return cls(records)
