"""Building AdmissionReview responses: one function for all of them, and the ranking of errors.

Every answer the webhook gives goes through ``build``: it echoes the request ``uid`` in the
request's API version, base64-encodes the JSON patch (``patchType: JSONPatch``) only when there
is one, and keeps every warning under kubectl's 120 characters. ``verdict_for_error`` ranks
what went wrong (kopf's shape):

- denied: the workload breaks the policy (``Verdict.deny``, status 403 Forbidden);
- errored: the review or the object is unusable (``AdmissionError``: 400 BadRequest or
  422 Invalid), the API server shows the message to the user;
- anything unexpected is a bug of ours: the workload is allowed unchanged with a warning
  (fail open, like the chart's default ``failurePolicy: Ignore``), logged, and counted.
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
    FAILED_OPEN = "failed-open"  # a bug of ours: allowed unchanged


@dataclass
class Verdict:
    """The outcome of one review, before it is written on the wire."""

    decision: Decision
    patch: List[Dict[str, Any]] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    code: Optional[int] = None
    reason: str = ""
    message: str = ""

    @property
    def allowed(self) -> bool:
        return self.decision not in (Decision.DENIED, Decision.ERRORED)

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


def short(text: str) -> str:
    """A warning kubectl prints on one line: under 120 characters, cut with an ellipsis."""
    text = " ".join(text.split())
    limit = review.MAX_WARNING_CHARS - 1
    return text if len(text) <= limit else text[: limit - 3] + "..."


def build(uid: str, verdict: Verdict, api_version: str = review.API_VERSION) -> bytes:
    """The AdmissionReview response for a verdict, serialised."""
    response: review.AdmissionResponse = {"uid": uid, "allowed": verdict.allowed}
    if verdict.patch and verdict.allowed:
        response["patchType"] = review.PATCH_TYPE
        response["patch"] = base64.b64encode(orjson.dumps(verdict.patch)).decode("ascii")
    if verdict.code is not None:
        status: review.Status = {"code": verdict.code, "message": verdict.message}
        if verdict.reason:
            status["reason"] = verdict.reason
        response["status"] = status
    if verdict.warnings:
        response["warnings"] = [short(w) for w in dict.fromkeys(verdict.warnings)]
    out: review.AdmissionReview = {"apiVersion": api_version, "kind": review.KIND,
                                   "response": response}
    return orjson.dumps(out)
