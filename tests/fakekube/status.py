"""The API server's failures, built as the ``metav1.Status`` objects a real server sends.

Every handler raises ``ApiStatusError`` (from ``xmem_admission.contract.errors``) through one of the
helpers below and the HTTP layer writes it as JSON (``kind: Status``, ``reason``, ``code``,
``details``), because clients branch on the reason and code: the official client raises
``ApiException`` with ``status`` set from it, and a controller's conflict handling is only
tested if the 409 reads like a real one.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from tests.fakekube.errors import ApiStatusError

REASONS = {
    400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
    405: "MethodNotAllowed", 409: "Conflict", 410: "Expired", 415: "UnsupportedMediaType",
    422: "Invalid", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
    504: "Timeout",
}


def error(code: int, message: str, reason: Optional[str] = None,
          details: Optional[Dict[str, Any]] = None,
          headers: Optional[Dict[str, str]] = None) -> ApiStatusError:
    """A failure with the standard reason for its code unless one is given."""
    return ApiStatusError(code, reason or REASONS.get(code, "Unknown"), message, details, headers)


def body(exc: ApiStatusError) -> Dict[str, Any]:
    """The JSON ``Status`` object for a failure."""
    out: Dict[str, Any] = {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": exc.message, "reason": exc.reason, "code": exc.code,
    }
    if exc.details:
        out["details"] = exc.details
    return out


def bad_request(message: str) -> ApiStatusError:
    return error(400, message)


def _qualified(resource: str, group: str) -> str:
    return f"{resource}.{group}" if group else resource


def not_found(resource: str, group: str, name: str) -> ApiStatusError:
    return error(404, f'{_qualified(resource, group)} "{name}" not found',
                 details={"name": name, "group": group, "kind": resource})


def already_exists(resource: str, group: str, name: str) -> ApiStatusError:
    return error(409, f'{_qualified(resource, group)} "{name}" already exists', "AlreadyExists",
                 details={"name": name, "group": group, "kind": resource})


def conflict(resource: str, group: str, name: str, why: str) -> ApiStatusError:
    return error(409, f'Operation cannot be fulfilled on {_qualified(resource, group)} "{name}": {why}',
                 details={"name": name, "group": group, "kind": resource})


STALE = "the object has been modified; please apply your changes to the latest version and try again"


def invalid(kind: str, group: str, name: str, causes: List[Dict[str, str]]) -> ApiStatusError:
    """A 422 in the real format: ``Job.batch "x" is invalid: spec.template: ...``."""
    text = "; ".join(f"{c['field']}: {c['message']}" for c in causes)
    return error(
        422, f'{_qualified(kind, group)} "{name}" is invalid: {text}',
        details={"name": name, "group": group, "kind": kind,
                 "causes": [{"reason": c.get("reason", "FieldValueInvalid"),
                             "message": c["message"], "field": c["field"]} for c in causes]},
    )
