"""``GPUMemoryEstimate`` objects: the recorded estimate of one workload fingerprint.

One object per (namespace, fingerprint), named after the fingerprint so that two controllers,
or one restarted halfway, can never make two: the second create is a 409 AlreadyExists. It is
owned by every workload that uses it (non-controller owner references), so it goes when the
last of them goes; its estimation pods are owned by it and go with it.

``spec`` says what is estimated (fingerprint, first workload, target GPUs); ``status`` carries
the estimation's state and result::

    phase: Pending | Running | Succeeded | Failed
    attempt, podName, startTime, completionTime, reason, message
    mode, steps, seconds, fallbackReason                  # from the probe
    estimates: [{gpu, capacityBytes, peakReservedBytes, totalBytes,
                 recommendedRequestBytes, fits, migProfile}]
    gpu, estimateBytes, estimate, requestBytes, request   # the policy's choice, for kubectl
    actualBytes, actual, error                            # actualBytes: set by whoever measures

A new attempt (the same fingerprint held again after a failure) bumps ``attempt`` and names a
new pod ``<name>-<attempt>``.
"""

from __future__ import annotations

import datetime
from typing import Any, Dict, List, Optional

from xmem_admission.cluster import labels
from xmem_admission.cluster.kube.client import GME, Obj
from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.policy.store import EstimateRecord, GPUEstimate, WorkloadRef

PENDING, RUNNING, SUCCEEDED, FAILED = "Pending", "Running", "Succeeded", "Failed"
TERMINAL = (SUCCEEDED, FAILED)
FINGERPRINT_LABEL = labels.FINGERPRINT  # label on GMEs and estimation pods
MANAGED_BY = ("app.kubernetes.io/managed-by", "xmem-admission")
COMPONENT = ("app.kubernetes.io/component", "estimation")


def name_for(fingerprint: str) -> str:
    """The object's name: deterministic, so a duplicate create is a 409, never a second object."""
    return f"gme-{fingerprint}"


def pod_name(gme: Obj) -> str:
    return f"{gme['metadata']['name']}-{attempt(gme)}"


def attempt(gme: Obj) -> int:
    return int((gme.get("status") or {}).get("attempt") or 1)


def phase(gme: Optional[Obj]) -> str:
    return ((gme or {}).get("status") or {}).get("phase") or PENDING


def stamp(when: Optional[datetime.datetime] = None) -> str:
    when = when or datetime.datetime.now(datetime.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_time(value: Any) -> Optional[datetime.datetime]:
    """An RFC 3339 time (``metav1.Time`` or ``MicroTime``), None when absent or unreadable."""
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.timezone.utc)


def owner_ref(workload: Obj) -> Dict[str, Any]:
    m = workload["metadata"]
    return {"apiVersion": workload["apiVersion"], "kind": workload["kind"], "name": m["name"],
            "uid": m["uid"]}


def new(workload: Obj, fingerprint: str, gpu_keys: List[str], image: str) -> Obj:
    """A fresh GME for a workload (status is written separately: it is a subresource)."""
    m = workload["metadata"]
    return {
        "apiVersion": GME.api_version, "kind": GME.kind,
        "metadata": {
            "name": name_for(fingerprint), "namespace": m["namespace"],
            "labels": {FINGERPRINT_LABEL: fingerprint, MANAGED_BY[0]: MANAGED_BY[1]},
            "ownerReferences": [owner_ref(workload)],
        },
        "spec": {
            "fingerprint": fingerprint,
            "workload": {"apiVersion": workload["apiVersion"], "kind": workload["kind"],
                         "name": m["name"]},
            "gpus": list(gpu_keys),
            "image": image,
        },
    }


def with_owner(gme: Obj, workload: Obj) -> Optional[Obj]:
    """The GME with the workload added to its owners, or None when it is already one."""
    refs = list(gme["metadata"].get("ownerReferences") or [])
    if any(r.get("uid") == workload["metadata"]["uid"] for r in refs):
        return None
    out = dict(gme, metadata=dict(gme["metadata"], ownerReferences=refs + [owner_ref(workload)]))
    return out


def estimates_from(gpus: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Termination-message GPU rows to the status's camelCase form."""
    return [{"gpu": g["gpu"], "capacityBytes": g["capacity_bytes"],
             "peakReservedBytes": g["peak_reserved_bytes"], "totalBytes": g["total_bytes"],
             "recommendedRequestBytes": g["recommended_request_bytes"], "fits": bool(g["fits"]),
             "migProfile": g["mig_profile"]} for g in gpus]


def record(gme: Obj) -> Optional[EstimateRecord]:
    """The store's record for a succeeded GME (None for any other phase or a malformed one)."""
    status = gme.get("status") or {}
    if status.get("phase") != SUCCEEDED:
        return None
    spec = gme.get("spec") or {}
    raw = {
        "fingerprint": spec.get("fingerprint"),
        "created": status.get("completionTime"),
        "workload": {"namespace": gme["metadata"].get("namespace", ""),
                     "kind": (spec.get("workload") or {}).get("kind", ""),
                     "name": (spec.get("workload") or {}).get("name", "")},
        "gpus": [{"gpu": e.get("gpu"), "capacity_bytes": e.get("capacityBytes"),
                  "peak_reserved_bytes": e.get("peakReservedBytes"),
                  "total_bytes": e.get("totalBytes"),
                  "recommended_request_bytes": e.get("recommendedRequestBytes"),
                  "fits": e.get("fits"), "mig_profile": e.get("migProfile")}
                 for e in status.get("estimates") or []],
    }
    from xmem_admission.contract.errors import EstimateRecordError

    try:
        return EstimateRecord.from_dict(raw, f"GPUMemoryEstimate {gme['metadata'].get('name')}")
    except EstimateRecordError:
        return None


def from_record(rec: EstimateRecord, namespace: str) -> Obj:
    """A GME (spec and succeeded status) for a record given to the store's ``put``."""
    workload = rec.workload or WorkloadRef(namespace, "", "")
    return {
        "apiVersion": GME.api_version, "kind": GME.kind,
        "metadata": {"name": name_for(rec.fingerprint), "namespace": namespace,
                     "labels": {FINGERPRINT_LABEL: rec.fingerprint, MANAGED_BY[0]: MANAGED_BY[1]}},
        "spec": {"fingerprint": rec.fingerprint,
                 "workload": {"apiVersion": "", "kind": workload.kind, "name": workload.name},
                 "gpus": [g.gpu for g in rec.gpus], "image": ""},
        "status": {"phase": SUCCEEDED, "attempt": 1, "completionTime": rec.created or stamp(),
                   "estimates": [_estimate_from(g) for g in rec.gpus]},
    }


def _estimate_from(g: GPUEstimate) -> Dict[str, Any]:
    return {"gpu": g.gpu, "capacityBytes": g.capacity_bytes,
            "peakReservedBytes": g.peak_reserved_bytes, "totalBytes": g.total_bytes,
            "recommendedRequestBytes": g.recommended_request_bytes, "fits": g.fits,
            "migProfile": g.mig_profile}


def human(size: int) -> str:
    """Bytes as kubectl columns show them: ``12.3Gi``."""
    return f"{gib(size)}Gi"


def error_text(estimate_bytes: int, actual_bytes: int) -> str:
    """Estimate vs measured, signed: ``+3.1%`` over-estimates, ``-2.0%`` under-estimates."""
    if actual_bytes <= 0:
        return ""
    return f"{100.0 * (estimate_bytes - actual_bytes) / actual_bytes:+.1f}%"
