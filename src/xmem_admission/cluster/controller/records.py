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

    conditions: [{type, status, reason, message, observedGeneration, lastTransitionTime}]
    observedGeneration                                    # see "Conditions" below
    phase: Pending | Running | Succeeded | Failed         # what the conditions say, in a word
    attempt, podName, startTime, completionTime, reason, message
    mode, steps, seconds, fallbackReason                  # from the probe (mode: Fake | Profile)
    lastUsedTime                  # when a workload last joined it or was sized from it
    imageID                       # the digest the estimation pod ran (containerStatuses imageID)
    inputs: [{kind, name, uid, resourceVersion}]  # the ConfigMaps the estimation pod read
    stale: {reason, message, imageID, pod, time}  # a workload's pods ran another digest, or
                                  # an input changed: the next workload is estimated again
                                  # (``estimate_cache``)
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
    actualBytes, actual, relativeErrorPercent             # actualBytes: set by whoever measures
    oomRetries: [{workload: {kind, name, uid}, ooms, pod, podUID, container, time, gpu,
                  backend, failedRequestBytes, requestBytes, migProfile, claim, source,
                  exception, askedBytes, allocatedBytes, reservedBytes, inUseBytes, needBytes,
                  gaveUp, message, outcome}]           # see ``oom_retries``
    runs: [{workload: {kind, name, uid}, gpu, estimateBytes, requestBytes, completed,
            finished, pods, observedPeakBytes, source, series,  # ``observed_peaks``
            peakReservedBytes, driverVersion}]    # ``learned_overhead``
    observedPeakBytes, observedPeak, observedPercent      # the latest run's peak, for kubectl
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

Conditions (``metav1.Condition``, written with every status write: ``with_status``), in this
order, so that the first true one's reason says where the estimate stands (the kubectl column):

- ``Failed``: the estimation failed (reason ``ScriptFailed``, ``OOMKilled``, ... as
  ``status.reason``; the message quotes the script's last lines);
- ``Stale``: the estimate no longer matches what runs (reason ``ImageChanged``: a sized
  workload's pod ran another image digest; ``ConfigMapChanged``: a ConfigMap the estimation
  read changed); the next workload is estimated again;
- ``Estimating``: an attempt is in progress (``Queued``: waiting for its estimation pod;
  ``PodRunning``);
- ``Estimated``: an estimate is recorded (``Traced``; ``SharedFromTrial``: shared from a traced
  estimate of its trial family; ``Recorded``: put by ``xmem serve``'s store).

``lastTransitionTime`` moves only when a condition's status changes; each condition and
``status.observedGeneration`` carry the ``metadata.generation`` written from.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any, Dict, List, Optional

from xmem_admission.cluster import labels
from xmem_admission.cluster.kube.client import GME, Obj
from xmem_admission.cluster.kube.conditions import merged, without_times
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
ESTIMATED, STALE, ESTIMATING = "Estimated", "Stale", "Estimating"  # and FAILED: condition types
CONDITION_MESSAGE_LIMIT = 32768  # metav1.Condition's message
OOM_RETRIES = "oomRetries"
MAX_RETRY_ENTRIES = 50  # workloads of one fingerprint with out-of-memory history kept
RUNS = "runs"
MAX_RUNS = 100  # finished runs of one fingerprint kept: policy.model.MAX_RIGHT_SIZING_RUNS
FINGERPRINT_LABEL = labels.FINGERPRINT  # label on GMEs and estimation pods
# status.mode as the API spells it, from the probe's word; an older GME's lower-case value reads
# the same. runs[].source likewise (an older GME wrote hami/dcgm).
MODES = {"fake": "Fake", "profile": "Profile"}
RUN_SOURCES = {"hami": "HAMi", "dcgm": "DCGM"}
MANAGED_BY = ("app.kubernetes.io/managed-by", "xmem-admission")
COMPONENT = ("app.kubernetes.io/component", "estimation")


def mode_name(word: Any) -> Any:
    """``status.mode`` as the API spells it: ``Fake`` or ``Profile``, from the probe's
    ``fake``/``profile`` or an older GME's value (anything else as it is)."""
    return MODES.get(word.lower(), word) if isinstance(word, str) else word


def run_source(value: Any) -> Any:
    """A run's ``source`` as the API spells it: ``HAMi`` or ``DCGM`` (an older GME's
    ``hami``/``dcgm`` read the same; anything else as it is)."""
    return RUN_SOURCES.get(value.lower(), value) if isinstance(value, str) else value


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


def relative_error_percent(estimate_bytes: int, actual_bytes: int) -> Optional[int]:
    """(estimate - measured) / measured in whole percent, signed: ``3`` over-estimates, ``-2``
    under-estimates (None without a measurement)."""
    if actual_bytes <= 0:
        return None
    return round(100 * (estimate_bytes - actual_bytes) / actual_bytes)


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


def observed_percent(peak_bytes: int, estimate_bytes: int) -> Optional[int]:
    """Observed peak as a whole percent of the estimate: ``108`` (above 100: used more)."""
    return round(100 * peak_bytes / estimate_bytes) if estimate_bytes > 0 else None


def with_run(status: Dict[str, Any], entry: Dict[str, Any]) -> Dict[str, Any]:
    """The status with the workload's run replaced (the newest ``MAX_RUNS`` kept) and the
    kubectl columns showing the newest run with a peak."""
    uid = entry["workload"]["uid"]
    kept = [e for e in run_entries({"status": status}) if e["workload"].get("uid") != uid]
    # an older GME's runs carry hami/dcgm: the list is rewritten whole, in the API's spelling
    kept = [dict(e, source=run_source(e["source"])) if "source" in e else e for e in kept]
    kept = (kept + [entry])[-MAX_RUNS:]
    out = dict(status, **{RUNS: kept})
    peak, estimate = _count(entry.get("observedPeakBytes")), _count(entry.get("estimateBytes"))
    if peak is not None and estimate is not None:
        out.update(observedPeakBytes=peak, observedPeak=human(peak),
                   observedPercent=observed_percent(peak, estimate))
    return out


# --- conditions -----------------------------------------------------------------------------

def _condition(kind: str, true: bool, reason: str, message: str) -> Dict[str, Any]:
    return {"type": kind, "status": "True" if true else "False", "reason": reason,
            "message": message[-CONDITION_MESSAGE_LIMIT:]}


def _estimated(status: Dict[str, Any], at: str) -> Dict[str, Any]:
    """The ``Estimated`` condition of a status (``at``: its phase)."""
    if at != SUCCEEDED:
        return _condition(ESTIMATED, False, "EstimationFailed" if at == FAILED else "InProgress",
                          "no estimate is recorded: " + ("the estimation failed" if at == FAILED
                                                         else "its estimation is in progress"))
    shared = status.get("sharedFrom")
    if isinstance(shared, dict) and shared.get("estimate"):
        options = ", ".join(str(o) for o in shared.get("options") or [])
        how, reason = (f"shared from {shared['estimate']}, which differs only in {options} "
                       "(options that do not change the program's memory)"), "SharedFromTrial"
    else:
        how, reason = "", "Traced" if status.get("mode") else "Recorded"
    gpu, estimate, request = status.get("gpu"), status.get("estimate"), status.get("request")
    if gpu == "none fits":
        what = f"fits none of the policy's GPU models (the smallest estimate is {estimate})"
    elif isinstance(gpu, str) and gpu and estimate:
        what = f"{estimate} on {gpu}" + (f", request {request}" if request else "")
    else:
        gpus = ", ".join(str(e.get("gpu")) for e in status.get("estimates") or []
                         if isinstance(e, dict))
        what = f"estimated for {gpus or 'no GPU model'}"
    return _condition(ESTIMATED, True, reason, what + (f"; {how}" if how else ""))


def conditions(gme: Obj, status: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The conditions a status stands for (without lastTransitionTime), in the order of the
    module docstring."""
    at = status.get("phase") or PENDING
    tries = f"attempt {int(status.get('attempt') or 1)}"
    if at == FAILED:
        reason = str(status.get("reason") or "Error")
        failed = _condition(FAILED, True, reason, str(status.get("message") or reason))
    else:
        failed = _condition(FAILED, False, "Succeeded" if at == SUCCEEDED else "InProgress",
                            "the estimation succeeded" if at == SUCCEEDED
                            else f"{tries} is in progress")
    stale_entry = status.get("stale")
    if isinstance(stale_entry, dict) and stale_entry:
        stale = _condition(STALE, True, str(stale_entry.get("reason") or "Stale"),
                           str(stale_entry.get("message") or "the estimate is stale"))
    elif at == SUCCEEDED:
        stale = _condition(STALE, False, "Current", "no pod sized from it ran another image "
                           "digest, and no ConfigMap it read changed")
    else:
        stale = _condition(STALE, False, "NoEstimate", "no estimate is recorded")
    if at == RUNNING:
        pod = status.get("podName")
        estimating = _condition(ESTIMATING, True, "PodRunning", f"{tries}: estimation pod "
                                f"{pod} runs" if pod else f"{tries}: its estimation pod runs")
    elif at == PENDING:
        estimating = _condition(ESTIMATING, True, "Queued", f"{tries} waits for its estimation "
                                "pod (the estimation line: the policy's concurrency caps)")
    else:
        estimating = _condition(ESTIMATING, False, at, "no estimation is in progress")
    out = [failed, stale, estimating, _estimated(status, at)]
    generation = _generation(gme)
    if generation is not None:
        for condition in out:
            condition["observedGeneration"] = generation
    return out


def _generation(gme: Obj) -> Optional[int]:
    found = (gme.get("metadata") or {}).get("generation")
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def with_conditions(gme: Obj, status: Dict[str, Any],
                    now: Optional[datetime.datetime] = None) -> Dict[str, Any]:
    """``status`` with its conditions and ``observedGeneration`` (lastTransitionTime kept
    from ``gme``'s conditions where a condition's status did not change)."""
    old = (gme.get("status") or {}).get("conditions")
    out = dict(status, conditions=merged(old, conditions(gme, status), stamp(now)))
    generation = _generation(gme)
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def with_status(gme: Obj, status: Dict[str, Any],
                now: Optional[datetime.datetime] = None) -> Obj:
    """The GME to write with ``status`` (``replace_status``), its conditions brought along."""
    return dict(gme, status=with_conditions(gme, status, now))


def conditions_lag(gme: Obj) -> bool:
    """Whether the GME's conditions or observedGeneration do not say what its status does (an
    estimate an older release wrote, or a spec changed since)."""
    status = gme.get("status") or {}
    generation = _generation(gme)
    return without_times(status.get("conditions")) != conditions(gme, status) or \
        (generation is not None and status.get("observedGeneration") != generation)
