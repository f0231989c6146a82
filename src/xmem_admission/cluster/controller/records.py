"""``GPUMemoryEstimate`` objects: the recorded estimate of one workload fingerprint.

One object per (namespace, fingerprint), named after the fingerprint so that two controllers,
or one restarted halfway, can never make two: the second create is a 409 AlreadyExists. No
workload owns it: it outlives the workloads that used it, and the controller deletes it once it
has been unused for the policy's ``estimation.cacheTTLSeconds`` (``estimate_cache``). Its
estimation pods are owned by it and go with it. A GME an older release made carries its
workloads as owner references; the controller drops them on its next pass over it.

``spec`` says what is estimated (fingerprint, first workload, target GPUs, and ``trial``:
its trial family and option values, see ``trials``); ``status`` carries
the estimation's state and result::

    phase: Pending | Running | Succeeded | Failed
    attempt, podName, startTime, completionTime, reason, message
    mode, steps, seconds, fallbackReason                  # from the probe
    lastUsedTime                  # when a workload last joined it or was sized from it
    imageID                       # the digest the estimation pod ran (containerStatuses imageID)
    stale: {reason, message, imageID, pod, time}  # a workload's pods ran another digest: the
                                  # next workload is estimated again (``estimate_cache``)
    peak: {gpu, largest, groups: [{module, category, op, bytes, size}],
           cachedBytes, fragmentationBytes}               # what holds the memory at the peak
    reproduce                                             # the `xmem estimate` command line
    allocationDigest              # the traced allocation sequence's digest (``trials``)
    sharedFrom: {estimate, workload, options, evidence, refuted}  # not traced: shared from
                                  # an estimate of its trial family (``trials``)
    estimates: [{gpu, capacityBytes, peakReservedBytes, totalBytes,
                 recommendedRequestBytes, fits, migProfile, lowBytes, highBytes}]
    range                                 # the chosen GPU's range, low-high ("=" when exact)
    gpu, estimateBytes, estimate, requestBytes, request   # the policy's choice, for kubectl
    claim                                                 # dra: the claim's form
    actualBytes, actual, error                            # actualBytes: set by whoever measures
    oomRetries: [{workload: {kind, name, uid}, ooms, pod, podUID, container, time, gpu,
                  backend, failedRequestBytes, requestBytes, migProfile, claim, source,
                  exception, askedBytes, allocatedBytes, reservedBytes, inUseBytes, needBytes,
                  gaveUp, message, outcome}]           # see ``oom_retries``
    runs: [{workload: {kind, name, uid}, gpu, estimateBytes, requestBytes, completed,
            finished, pods, observedPeakBytes, source, series,  # ``observed_peaks``
            peakReservedBytes, driverVersion}]    # ``learned_overhead``
    observedPeakBytes, observedPeak, observedRatio        # the latest run's peak, for kubectl
    overhead: {gpu, source, outsideAllocatorBytes, catalogueBytes, correctionBytes, applied,
               jobs, driverVersion, bounded}, overheadApplied   # what the memory outside
                                                  # the allocator moved the request by

``oomRetries`` has one entry per workload whose pods ran out of GPU memory (the newest
``MAX_RETRY_ENTRIES``): what the last out-of-memory message said (bytes asked for, allocated
and reserved by PyTorch, in use by the process), the request it failed at, how many in a row,
and either the request the workload's next pod gets or, once no larger request can help, the
terminal reason (``gaveUp``; ``requestBytes`` is then the last request tried).
``outcome`` is set once the workload ended (``Completed`` or ``Failed``): a retried workload
that completed is an OOM avoided on the second try.

``runs`` has one entry per finished workload of the fingerprint the controller saw end (the
newest ``MAX_RUNS``): the GPU model it ran on, the estimate its request was sized from (the
estimator's figure, ``xmem.io/estimate-bytes``, never a corrected one), the request, whether it
completed, and the peak its pods used per GPU as Prometheus saw it (absent when no series
covered the pods). ``policy.right_sizing`` corrects the next run's estimate from them.
A new attempt (the same fingerprint held again after a failure) bumps ``attempt`` and names a
new pod ``<name>-<attempt>``.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Dict, List, Optional

from xmem_admission.cluster import labels
from xmem_admission.cluster.kube.client import GME, Obj
from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.policy.store import (
    EstimateRecord,
    GPUEstimate,
    RetryGrant,
    Run,
    WorkloadRef,
)

PENDING, RUNNING, SUCCEEDED, FAILED = "Pending", "Running", "Succeeded", "Failed"
TERMINAL = (SUCCEEDED, FAILED)
OOM_RETRIES = "oomRetries"
MAX_RETRY_ENTRIES = 50  # workloads of one fingerprint with out-of-memory history kept
RUNS = "runs"
MAX_RUNS = 100  # finished runs of one fingerprint kept: policy.model.MAX_RIGHT_SIZING_RUNS
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


def new(workload: Obj, fingerprint: str, gpu_keys: List[str], image: str) -> Obj:
    """A fresh GME for a workload (status is written separately: it is a subresource). No owner
    reference: the estimate outlives the workload, and sharing it asks no permission on it."""
    m = workload["metadata"]
    return {
        "apiVersion": GME.api_version, "kind": GME.kind,
        "metadata": {
            "name": name_for(fingerprint), "namespace": m["namespace"],
            "labels": {FINGERPRINT_LABEL: fingerprint, MANAGED_BY[0]: MANAGED_BY[1]},
        },
        "spec": {
            "fingerprint": fingerprint,
            "workload": {"apiVersion": workload["apiVersion"], "kind": workload["kind"],
                         "name": m["name"]},
            "gpus": list(gpu_keys),
            "image": image,
        },
    }


def legacy_owners(gme: Obj) -> List[Dict[str, Any]]:
    """The owner references an older release wrote (one per workload that used the GME)."""
    refs = gme["metadata"].get("ownerReferences") or []
    return [r for r in refs if isinstance(r, dict) and r.get("kind") != GME.kind]


def without_owners(gme: Obj) -> Optional[Obj]:
    """The GME without the workloads' owner references, or None when it has none."""
    refs = gme["metadata"].get("ownerReferences") or []
    kept = [r for r in refs if not (isinstance(r, dict) and r.get("kind") != GME.kind)]
    if len(kept) == len(refs):
        return None
    metadata = dict(gme["metadata"])
    if kept:
        metadata["ownerReferences"] = kept
    else:
        metadata.pop("ownerReferences", None)
    return dict(gme, metadata=metadata)


def is_stale(gme: Optional[Obj]) -> bool:
    """Whether a workload's pods ran another image digest than the estimation pod did."""
    return bool(((gme or {}).get("status") or {}).get("stale"))


def usable(gme: Optional[Obj]) -> bool:
    """A succeeded estimate that is not stale: what a workload may be sized from."""
    return phase(gme) == SUCCEEDED and not is_stale(gme)


def estimates_from(gpus: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Termination-message GPU rows to the status's camelCase form (``highBytes``: the range's
    high end, where the probe bundle gave one)."""
    return [{"gpu": g["gpu"], "capacityBytes": g["capacity_bytes"],
             "peakReservedBytes": g["peak_reserved_bytes"], "totalBytes": g["total_bytes"],
             "recommendedRequestBytes": g["recommended_request_bytes"], "fits": bool(g["fits"]),
             "migProfile": g["mig_profile"],
             **({"highBytes": g["high_bytes"], "lowBytes": g["low_bytes"]}
                if g.get("high_bytes") is not None else {})}
            for g in gpus]


def peak_from(result: Any) -> Optional[Dict[str, Any]]:
    """A version-2 result's itemised peak in the status's form (None for a version-1 result)."""
    if not result.peak_groups:
        return None
    groups = [{"module": g["module"], "category": g["category"], "op": g["op"],
               "bytes": g["bytes"], "size": human(g["bytes"])} for g in result.peak_groups]
    return {"gpu": result.peak_gpu, "largest": largest_text(groups[0]), "groups": groups,
            "cachedBytes": result.peak_cached_bytes,
            "fragmentationBytes": result.peak_fragmentation_bytes}


def largest_text(group: Dict[str, Any]) -> str:
    """A peak group in words, for the kubectl column and the Event."""
    op = f" ({group['op']})" if group.get("op") else ""
    return f"{group['module']} {group['category']}{op} {human(int(group['bytes']))}"[:200]


def reproduce(gme: Obj, pod: Obj, steps: int, mode: str) -> str:
    """The ``xmem estimate`` command that reproduces an estimation pod's estimate locally: its
    container's command and arguments, for the estimate's GPUs, steps and mode."""
    import shlex

    container = (pod.get("spec") or {}).get("containers") or [{}]
    words = [str(w) for w in (container[0].get("command") or []) + (container[0].get("args")
                                                                    or [])]
    gpus = ",".join((gme.get("spec") or {}).get("gpus") or [])
    flags = ["--gpu", gpus] if gpus else []
    if mode and mode != "auto":
        flags += ["--mode", mode]
    return shlex.join(["xmem", "estimate", *flags, "--steps", str(steps), "--", *words])[:4000]


def record(gme: Obj) -> Optional[EstimateRecord]:
    """The store's record for a succeeded GME (None for any other phase, a stale or a malformed
    one)."""
    status = gme.get("status") or {}
    if status.get("phase") != SUCCEEDED or status.get("stale"):
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
                  "fits": e.get("fits"), "mig_profile": e.get("migProfile"),
                  "high_bytes": e.get("highBytes")}
                 for e in status.get("estimates") or []],
    }
    from xmem_admission.contract.errors import EstimateRecordError

    try:
        found = EstimateRecord.from_dict(raw, f"GPUMemoryEstimate {gme['metadata'].get('name')}")
    except EstimateRecordError:
        return None
    runs = tuple(run for run in (_run(e) for e in run_entries(gme)) if run is not None)
    return dataclasses.replace(found, runs=runs) if runs else found


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
            "migProfile": g.mig_profile,
            **({"highBytes": g.high_bytes} if g.high_bytes is not None else {})}


def range_text(estimates: List[Dict[str, Any]], gpu: str) -> str:
    """The kubectl column of a GPU's range from the status's ``estimates``: ``3.1-3.6Gi``,
    ``exact`` when both ends are the point, '' for an estimate without one."""
    entry = next((e for e in estimates if e.get("gpu") == gpu), None)
    if not entry or entry.get("highBytes") is None or entry.get("lowBytes") is None:
        return ""
    low, high = int(entry["lowBytes"]), int(entry["highBytes"])
    return "exact" if low == high == int(entry["totalBytes"]) else f"{gib(low)}-{gib(high)}Gi"


def human(size: int) -> str:
    """Bytes as kubectl columns show them: ``12.3Gi``."""
    return f"{gib(size)}Gi"


def error_text(estimate_bytes: int, actual_bytes: int) -> str:
    """Estimate vs measured, signed: ``+3.1%`` over-estimates, ``-2.0%`` under-estimates."""
    if actual_bytes <= 0:
        return ""
    return f"{100.0 * (estimate_bytes - actual_bytes) / actual_bytes:+.1f}%"


def _entries(gme: Optional[Obj], field: str) -> List[Dict[str, Any]]:
    """A status list of per-workload entries (malformed ones skipped)."""
    found = ((gme or {}).get("status") or {}).get(field) or []
    if not isinstance(found, list):
        return []
    return [e for e in found if isinstance(e, dict) and isinstance(e.get("workload"), dict)]


def _entry(gme: Optional[Obj], field: str, workload_uid: str) -> Optional[Dict[str, Any]]:
    for entry in _entries(gme, field):
        if entry["workload"].get("uid") == workload_uid:
            return entry
    return None


def retry_entries(gme: Optional[Obj]) -> List[Dict[str, Any]]:
    """The ``status.oomRetries`` entries (malformed ones skipped)."""
    return _entries(gme, OOM_RETRIES)


def retry_entry(gme: Optional[Obj], workload_uid: str) -> Optional[Dict[str, Any]]:
    """The entry of one workload, by uid, or None."""
    return _entry(gme, OOM_RETRIES, workload_uid)


def retry_grants(gme: Obj) -> List[RetryGrant]:
    """The webhook's view of ``status.oomRetries``: one grant per workload with a request."""
    namespace = gme["metadata"].get("namespace", "")
    out: List[RetryGrant] = []
    for entry in retry_entries(gme):
        uid, gpu, request = entry["workload"].get("uid"), entry.get("gpu"), \
            entry.get("requestBytes")
        ooms = entry.get("ooms")
        if not isinstance(uid, str) or not uid or not isinstance(gpu, str) or \
                isinstance(request, bool) or not isinstance(request, int) or request <= 0 or \
                isinstance(ooms, bool) or not isinstance(ooms, int):
            continue
        profile = entry.get("migProfile")
        gave_up = entry.get("gaveUp")
        # A JobSet's or TrainJob's pods are created by its Jobs: the grant goes by their uids.
        owners = [u for u in entry.get("podOwners") or [] if isinstance(u, str) and u] or [uid]
        out.extend(RetryGrant(namespace, owner, gpu, request, ooms,
                              profile if isinstance(profile, str) else None,
                              gave_up if isinstance(gave_up, str) and gave_up else None)
                   for owner in owners)
    return out


def _count(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def run_entries(gme: Optional[Obj]) -> List[Dict[str, Any]]:
    """The ``status.runs`` entries (malformed ones skipped)."""
    return _entries(gme, RUNS)


def run_entry(gme: Optional[Obj], workload_uid: str) -> Optional[Dict[str, Any]]:
    """The run of one workload, by uid, or None."""
    return _entry(gme, RUNS, workload_uid)


def _run(entry: Dict[str, Any]) -> Optional[Run]:
    """A run as right-sizing reads it (None without the figures it needs)."""
    gpu, estimate, peak = entry.get("gpu"), _count(entry.get("estimateBytes")), \
        _count(entry.get("observedPeakBytes"))
    finished = parse_time(entry.get("finished"))
    if not isinstance(gpu, str) or estimate is None or peak is None or finished is None:
        return None
    return Run(gpu, estimate, peak, entry.get("completed") is True, finished.timestamp())


def ratio_text(peak_bytes: int, estimate_bytes: int) -> str:
    """Observed peak / estimate for the kubectl column: ``1.08`` (above 1: used more)."""
    return f"{peak_bytes / estimate_bytes:.2f}" if estimate_bytes > 0 else ""


def with_run(status: Dict[str, Any], entry: Dict[str, Any]) -> Dict[str, Any]:
    """The status with the workload's run replaced (the newest ``MAX_RUNS`` kept) and the
    kubectl columns showing the newest run with a peak."""
    uid = entry["workload"]["uid"]
    kept = [e for e in run_entries({"status": status}) if e["workload"].get("uid") != uid]
    kept = (kept + [entry])[-MAX_RUNS:]
    out = dict(status, **{RUNS: kept})
    peak, estimate = _count(entry.get("observedPeakBytes")), _count(entry.get("estimateBytes"))
    if peak is not None and estimate is not None:
        out.update(observedPeakBytes=peak, observedPeak=human(peak),
                   observedRatio=ratio_text(peak, estimate))
    return out
