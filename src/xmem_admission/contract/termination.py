"""The estimation pod's answer: a compact JSON result that fits a termination message.

The probe, running inside the user's image, writes it to the container's
``terminationMessagePath``; the kubelet copies that file into the pod status
(``state.terminated.message``), where the controller reads it without any other channel to the
pod. The kubelet keeps at most 4096 bytes per container, so the result is built to fit: GPU
rows are positional arrays, and free text (reason, traceback) is cut from the front until the
whole message fits, because the end of a traceback is the useful part.

Format, version 2 (one JSON object)::

    {"v": 2, "status": "ok", "mode": "fake", "steps": 3, "seconds": 12.4,
     "fallback": "",                       # why fake mode fell back to profile, if it did
     "gpus": [[gpu, capacity_bytes, peak_reserved_bytes, total_bytes,
               recommended_request_bytes, fits, mig_profile, high_bytes, low_bytes], ...],
                                           # the ends of the estimate's range (an older
                                           # bundle's rows stop before them)
     "peak": {"gpu": "H100-80GB",          # the first target GPU's peak, itemised:
              "groups": [[module, category, op, bytes], ...],   # largest first, at most 3
              "cached": cached_free_bytes, "fragmentation": bytes},
     "digest": "<32 hex>"}                 # of the traced allocation sequence and the rows

    {"v": 2, "status": "script_error" | "no_step" | "needs_real_values" | "unsupported" |
     "probe_error" | "no_torch", "reason": "...", "exit_code": 1, "traceback": "..."}

A batch (several estimates traced in one pod, ``probe_env.BATCH``) is one message of entries,
one per trace in the order the pod lists them, each a result as above without ``"v"``, or null
for a trace not run yet; ``running`` names the trace under way when the message was written
(the probe writes it before each trace, so a pod that dies mid-way still tells the finished
traces' results)::

    {"v": 2, "status": "batch", "traces": [{...}, {...}, null], "running": 2}

To fit, the entries' peak groups go first, then each entry's free text is cut to an equal share.
``batch_capacity`` says how many entries fit for a list of target GPU models.

Version 1 (an older probe bundle's) is the same without ``peak``, and is still read; a result
without ``digest`` (an older bundle's) is read too, and never judged equal to another. When a
result would pass the limit, the peak's groups go first (from the last), then free text.

Both halves of the house import this module (it is in the probe bundle and the controller reads
it), so it is standard library only and Python 3.9 compatible.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence

from xmem_admission.contract.errors import TerminationMessageError

VERSION = 2
READABLE = (1, 2)
LIMIT_BYTES = 4096  # kubelet: at most 4096 bytes of a termination message per container
COLUMNS = ("gpu", "capacity_bytes", "peak_reserved_bytes", "total_bytes",
           "recommended_request_bytes", "fits", "mig_profile")
# After COLUMNS, optional: the ends of the estimate's range (``xmem estimate``'s high_bytes and
# low_bytes), both or neither.
OPTIONAL_COLUMNS = ("high_bytes", "low_bytes")
PEAK_COLUMNS = ("module", "category", "op", "bytes")
FAILURES = ("script_error", "no_step", "needs_real_values", "unsupported", "probe_error",
            "no_torch",
            # a trace of a batch: past its own deadline, killed by SIGKILL (the pod's memory
            # limit, most likely), or not run (its command line is not the process's)
            "deadline_exceeded", "oom_killed", "not_run")
BATCH = "batch"
_ROOM = 2 ** 47  # a byte count of the largest GPU in the catalogue and then some (128 TiB)


def _dump(data: Dict[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def encode_ok(mode: str, steps: int, seconds: float, gpus: Sequence[Dict[str, Any]],
              fallback: str = "", peak: Optional[Dict[str, Any]] = None,
              digest: str = "") -> str:
    """The success message from per-GPU results (objects with the ``COLUMNS`` fields) and the
    first GPU's itemised peak (``{gpu, groups: [[module, category, op, bytes]], cached,
    fragmentation}``)."""
    rows: List[List[Any]] = [[g[c] for c in COLUMNS]
                             + ([g[c] for c in OPTIONAL_COLUMNS]
                                if all(g.get(c) is not None for c in OPTIONAL_COLUMNS) else [])
                             for g in gpus]
    data: Dict[str, Any] = {"v": VERSION, "status": "ok", "mode": mode, "steps": steps,
                            "seconds": round(float(seconds), 1), "gpus": rows}
    if fallback:
        data["fallback"] = fallback
    if digest:
        data["digest"] = digest
    if peak is not None:
        data["peak"] = {"gpu": peak["gpu"], "groups": [list(g) for g in peak["groups"]],
                        "cached": int(peak["cached"]),
                        "fragmentation": int(peak["fragmentation"])}
        while data["peak"]["groups"] and len(_dump(data).encode("utf-8")) > LIMIT_BYTES:
            data["peak"]["groups"].pop()
    return _fit(data, ("fallback",))


def encode_failure(status: str, reason: str, exit_code: int = 1, traceback: str = "") -> str:
    """A failure message; ``reason`` and ``traceback`` are shortened from the front to fit."""
    if status not in FAILURES:
        raise ValueError(f"unknown failure status {status!r}")
    data = {"v": VERSION, "status": status, "reason": reason, "exit_code": int(exit_code),
            "traceback": traceback}
    return _fit(data, ("traceback", "reason"))


def _fit(data: Dict[str, Any], cuttable: Sequence[str]) -> str:
    text = _dump(data)
    for key in cuttable:
        while len(text.encode("utf-8")) > LIMIT_BYTES and data.get(key):
            excess = len(text.encode("utf-8")) - LIMIT_BYTES
            value = data[key]
            keep = max(0, len(value) - excess - 8)
            data[key] = "..." + value[len(value) - keep:] if keep else ""
            text = _dump(data)
    if len(text.encode("utf-8")) > LIMIT_BYTES:
        raise TerminationMessageError(
            f"estimation result is {len(text.encode('utf-8'))} bytes, over the {LIMIT_BYTES}-byte "
            f"termination message limit (too many target GPU models?)")
    return text


def encode_batch(entries: Sequence[Optional[str]], running: Optional[int] = None) -> str:
    """One message for the traces of a batch, from each trace's own message (``encode_ok`` or
    ``encode_failure``; None for a trace not run yet); ``running``: the trace under way."""
    traces: List[Optional[Dict[str, Any]]] = []
    for text in entries:
        if text is None:
            traces.append(None)
            continue
        data = json.loads(text)
        data.pop("v", None)
        traces.append(data)
    data = {"v": VERSION, "status": BATCH, "traces": traces}
    if running is not None:
        data["running"] = int(running)

    def size() -> int:
        return len(_dump(data).encode("utf-8"))

    if size() > LIMIT_BYTES:
        for entry in traces:
            if entry is not None and isinstance(entry.get("peak"), dict):
                entry["peak"]["groups"] = []
    if size() > LIMIT_BYTES:
        share = LIMIT_BYTES // max(1, len(traces))
        for entry in traces:
            for key in ("traceback", "reason", "fallback"):
                if entry is None or not entry.get(key):
                    continue
                excess = len(_dump(entry).encode("utf-8")) - share
                if excess > 0:
                    value = str(entry[key])
                    keep = max(0, len(value) - excess - 8)
                    entry[key] = "..." + value[len(value) - keep:] if keep else ""
    if size() > LIMIT_BYTES:
        raise TerminationMessageError(
            f"the batch's results are {size()} bytes, over the {LIMIT_BYTES}-byte termination "
            f"message limit ({len(traces)} traces: too many for one pod)")
    return _dump(data)


def batch_capacity(gpus: Sequence[str]) -> int:
    """How many traces' results fit one message, for these target GPU models (each entry as
    long as an ``ok`` result can be, with its peak's groups dropped)."""
    def row(gpu: str) -> List[Any]:
        return [gpu, _ROOM, _ROOM, _ROOM, _ROOM, True, "7g.141gb", _ROOM, _ROOM]

    entry = {"status": "ok", "mode": "profile", "steps": 9999, "seconds": 99999.9,
             "gpus": [row(g) for g in gpus or ["GPU"]], "digest": "f" * 32,
             "peak": {"gpu": "", "groups": [], "cached": _ROOM, "fragmentation": _ROOM}}
    each = len(_dump(entry).encode("utf-8")) + 1
    frame = len(_dump({"v": VERSION, "status": BATCH, "traces": [], "running": 9999}))
    return max(1, (LIMIT_BYTES - frame) // each)


class Batch:
    """A decoded batch: each trace's result (None where it has none), and the trace that was
    under way when the message was written (None once all were run)."""

    def __init__(self, entries: List[Optional[Result]], running: Optional[int]) -> None:
        self.entries = entries
        self.running = running


def decode_batch(text: Optional[str]) -> Optional[Batch]:
    """A batch message read (entries checked as ``decode`` checks a result), or None when the
    text is not a batch (a single result, or no message: the pod failed for every trace)."""
    if not text or not text.strip():
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("status") != BATCH:
        return None
    if data.get("v") not in READABLE or not isinstance(data.get("traces"), list):
        raise TerminationMessageError(f"malformed batch result: {text[:200]!r}")
    running = data.get("running")
    if running is not None and (not isinstance(running, int) or isinstance(running, bool)):
        raise TerminationMessageError(f"malformed batch result: running={running!r:.40}")
    entries: List[Optional[Result]] = []
    for entry in data["traces"]:
        if entry is None:
            entries.append(None)
            continue
        if not isinstance(entry, dict) or entry.get("status") == BATCH:
            raise TerminationMessageError(f"malformed batch entry: {entry!r:.200}")
        entries.append(decode(_dump(dict(entry, v=data["v"]))))
    return Batch(entries, running)


class Result:
    """A decoded termination message."""

    def __init__(self, data: Dict[str, Any]) -> None:
        self.status: str = data["status"]
        self.mode: str = data.get("mode", "")
        self.steps: int = int(data.get("steps", 0))
        self.seconds: float = float(data.get("seconds", 0.0))
        self.fallback: str = data.get("fallback", "")
        self.reason: str = data.get("reason", "")
        self.exit_code: int = int(data.get("exit_code", 0))
        self.traceback: str = data.get("traceback", "")
        self.gpus: List[Dict[str, Any]] = [dict(zip(COLUMNS + OPTIONAL_COLUMNS, row))
                                           for row in data.get("gpus") or []]
        self.version: int = int(data.get("v", 1))
        peak = data.get("peak") or {}
        self.peak_gpu: str = str(peak.get("gpu", ""))
        # the first GPU's largest groups at the peak: {module, category, op, bytes}
        self.peak_groups: List[Dict[str, Any]] = [
            dict(zip(PEAK_COLUMNS, g)) for g in peak.get("groups") or []]
        self.peak_cached_bytes: int = int(peak.get("cached", 0))
        self.peak_fragmentation_bytes: int = int(peak.get("fragmentation", 0))
        # the traced allocation sequence's digest ('' from an older probe bundle)
        self.digest: str = data.get("digest") or ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def decode(text: Optional[str]) -> Result:
    """Read a termination message; anything but a well-formed version-1 or -2 result is an
    error."""
    if not text or not text.strip():
        raise TerminationMessageError("the estimation container left no termination message")
    try:
        data = json.loads(text)
    except ValueError:
        raise TerminationMessageError(
            f"the termination message is not an estimation result: {text[:200]!r}") from None
    if not isinstance(data, dict) or data.get("v") not in READABLE or isinstance(data.get("v"),
                                                                                bool):
        raise TerminationMessageError(
            f"the termination message is not a version-1 or -2 estimation result: "
            f"{text[:200]!r}")
    status = data.get("status")
    if status == "ok":
        rows = data.get("gpus")
        if not isinstance(rows, list) or not rows or not all(
                isinstance(r, list) and len(r) in (len(COLUMNS),
                                                   len(COLUMNS) + len(OPTIONAL_COLUMNS))
                for r in rows):
            raise TerminationMessageError(f"malformed GPU rows in the estimation result: {rows!r}")
        for row in rows:
            if not isinstance(row[0], str) or not all(
                    isinstance(v, int) and not isinstance(v, bool) and v >= 0
                    for v in row[1:5] + row[len(COLUMNS):]):
                raise TerminationMessageError(f"malformed GPU row in the estimation result: {row!r}")
        _check_peak(data.get("peak"))
        digest = data.get("digest")
        if digest is not None and not (isinstance(digest, str) and 0 < len(digest) <= 64
                                       and all(c in "0123456789abcdef" for c in digest)):
            raise TerminationMessageError(
                f"malformed digest in the estimation result: {digest!r:.80}")
    elif status not in FAILURES:
        raise TerminationMessageError(f"unknown status {status!r} in the estimation result")
    return Result(data)


def _check_peak(peak: Any) -> None:
    """A version-2 result's ``peak``: absent, or the GPU, groups of [module, category, op,
    bytes] and two byte counts (the pod's own code wrote it: parsed strictly)."""
    if peak is None:
        return

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    groups = peak.get("groups") if isinstance(peak, dict) else None
    if not (isinstance(peak, dict) and isinstance(peak.get("gpu"), str)
            and isinstance(groups, list) and count(peak.get("cached", 0))
            and count(peak.get("fragmentation", 0))
            and all(isinstance(g, list) and len(g) == len(PEAK_COLUMNS)
                    and all(isinstance(v, str) for v in g[:3]) and count(g[3])
                    for g in groups)):
        raise TerminationMessageError(f"malformed peak in the estimation result: {peak!r:.200}")
