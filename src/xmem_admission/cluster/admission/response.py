"""Building AdmissionReview responses: one function for all of them, and the ranking of errors.

Every answer the webhook gives goes through ``build``: it echoes the request ``uid`` in the
request's API version, base64-encodes the JSON patch (``patchType: JSONPatch``) only when there
is one, and keeps each warning within the 256 characters (4096 in all) the API server passes on
and the status message within 4096. ``verdict_for_error`` ranks
what went wrong (kopf's shape):

- denied: the workload breaks the policy (``Verdict.deny``, status 403 Forbidden);
- errored: the review is unusable (``AdmissionError``: 400 BadRequest), the API server shows
  the message to the user;
- an opted-in object that cannot be read (422 Invalid: a field of the wrong shape, a quantity
  out of range; or a bug of ours) is ``unreadable``: refused where the namespace's policy
  enforces (fails closed), admitted unchanged with a warning where it warns (fails open); the
  answer says which;
- anything else unexpected is a bug of ours: allowed unchanged with a warning, logged, counted.
"""

from __future__ import annotations

import base64
import enum
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import orjson

from xmem_admission.cluster.admission import review
from xmem_admission.contract.errors import AdmissionError


class Decision(str, enum.Enum):
    """What happened to a request (a metrics label and the shape of the response)."""

    ALLOWED = "allowed"  # allowed unchanged
    MUTATED = "mutated"  # allowed with a patch
    HELD = "held"  # allowed with a patch that holds the workload
    DENIED = "denied"  # refused by policy
    ERRORED = "errored"  # refused: the review or object is unusable
    FAILED_CLOSED = "failed-closed"  # refused: an enforced object that could not be read
    FAILED_OPEN = "failed-open"  # allowed unchanged: could not be read, and nothing enforces


@dataclass
class Verdict:
    """The outcome of one review, before it is written on the wire."""

    decision: Decision
    patch: List[Dict[str, Any]] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    code: Optional[int] = None
    reason: str = ""
    message: str = ""
    audit: Dict[str, str] = field(default_factory=dict)  # the API server's audit log gets these

    @property
    def allowed(self) -> bool:
        return self.decision not in (Decision.DENIED, Decision.ERRORED, Decision.FAILED_CLOSED)

    @classmethod
    def deny(cls, message: str, warnings: Sequence[str] = ()) -> Verdict:
        return cls(Decision.DENIED, warnings=list(warnings), code=403, reason="Forbidden",
                   message=message)


def verdict_for_error(exc: BaseException) -> Verdict:
    """Rank an exception: input errors are refused with their 400-class code, bugs fail open."""
    if isinstance(exc, AdmissionError):
        return Verdict(Decision.ERRORED, code=exc.status_code, reason=exc.reason, message=str(exc))
    return Verdict(
        Decision.FAILED_OPEN,
        warnings=[f"xmem: internal error ({type(exc).__name__}); admitted unchanged"],
    )


def unreadable(exc: BaseException, kind: str, enforcing: bool) -> Verdict:
    """An opted-in object the webhook could not read: fail closed when the policy enforces,
    open when it warns, and say which."""
    what = str(exc) if isinstance(exc, AdmissionError) else f"internal error ({type(exc).__name__})"
    if enforcing:
        code, reason = ((exc.status_code, exc.reason) if isinstance(exc, AdmissionError)
                        else (403, "Forbidden"))
        return Verdict(Decision.FAILED_CLOSED, code=code, reason=reason, message=(
            f"xmem: cannot read this {kind}: {what}; the namespace's policy enforces GPU memory "
            f"estimates, so it is refused (fails closed)"))
    return Verdict(Decision.FAILED_OPEN, warnings=[
        f"xmem: cannot read this {kind}: {what}; admitted unchanged (Warn mode fails open)"])


def short(text: str, limit: int = review.MAX_WARNING_CHARS) -> str:
    """Text on one line within ``limit`` characters; a longer one keeps its start and its end
    (where the figures are) around an ellipsis."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    head = (limit - 5) * 2 // 3
    return text[:head] + " ... " + text[-(limit - 5 - head):]


def _warnings(warnings: Sequence[str]) -> List[str]:
    """The warnings to send, each within the per-warning limit and all within the total."""
    out: List[str] = []
    total = 0
    for warning in dict.fromkeys(warnings):
        line = short(warning)
        if total + len(line) > review.MAX_WARNINGS_CHARS - 40:
            out.append(f"xmem: {len(set(warnings)) - len(out)} more warnings omitted")
            break
        out.append(line)
        total += len(line)
    return out


def build(uid: str, verdict: Verdict, api_version: str = review.API_VERSION) -> bytes:
    """The AdmissionReview response for a verdict, serialised."""
    response: review.AdmissionResponse = {"uid": uid, "allowed": verdict.allowed}
    if verdict.patch and verdict.allowed:
        response["patchType"] = review.PATCH_TYPE
        response["patch"] = base64.b64encode(orjson.dumps(verdict.patch)).decode("ascii")
    if verdict.code is not None:
        status: review.Status = {"code": verdict.code,
                                 "message": short(verdict.message, review.MAX_MESSAGE_CHARS)}
        if verdict.reason:
            status["reason"] = verdict.reason
        response["status"] = status
    if verdict.warnings:
        response["warnings"] = _warnings(verdict.warnings)
    if verdict.audit:
        response["auditAnnotations"] = dict(verdict.audit)
    out: review.AdmissionReview = {"apiVersion": api_version, "kind": review.KIND,
                                   "response": response}
    return orjson.dumps(out)
