"""Reading an AdmissionReview request: only the fields the webhook needs, each checked.

Validating the whole review with a model costs more than the rest of the admission (the object
inside can be 20 KB), so this reads the envelope by hand, field by field, typed as the wire
types of ``review`` say (each checked, since JSON promises nothing), and leaves the object as
parsed JSON;
integrations check the parts of it they use. Anything wrong raises ``MalformedReviewError``,
which the response builder turns into a 400-class AdmissionResponse, never an HTTP error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import orjson

from xmem_admission.cluster.admission import review
from xmem_admission.contract.errors import MalformedReviewError

OPERATIONS = ("CREATE", "UPDATE", "DELETE", "CONNECT")
# JSON values a review may hold (each object, array and separator counts): a 1.5 MiB object
# (etcd's limit) and its old version hold a few hundred thousand; parsing bodies made of
# nothing but tiny values would cost far more memory than their size (an empty dict is 64
# bytes for its 3 bytes of JSON), so they are refused before parsing.
MAX_JSON_VALUES = 1_000_000


@dataclass(frozen=True)
class Request:
    """The parts of an admission request the webhook acts on."""

    api_version: str
    uid: str
    group: str
    version: str
    kind: str
    operation: str
    namespace: str
    name: str
    obj: Optional[Dict[str, Any]]
    old_obj: Optional[Dict[str, Any]]
    dry_run: bool
    sub_resource: str
    user: str = ""  # userInfo.username: who asked (see ``trust``)
    groups: Tuple[str, ...] = ()  # userInfo.groups (the strings among them)


@dataclass(frozen=True)
class Envelope:
    """What could be read before something went wrong: enough to answer in kind."""

    api_version: str = review.API_VERSION
    uid: str = ""


def _str(request: review.AdmissionRequest, key: str, required: bool = False) -> str:
    value = request.get(key)
    if value is None:
        if required:
            raise MalformedReviewError(f"request.{key} is required")
        return ""
    if not isinstance(value, str):
        raise MalformedReviewError(f"request.{key} must be a string")
    return value


def envelope(document: Any) -> Envelope:
    """The api version and uid to answer with, as far as the document gives them."""
    if not isinstance(document, dict):
        return Envelope()
    api_version = document.get("apiVersion")
    request: Optional[review.AdmissionRequest] = document.get("request")
    uid = request.get("uid") if isinstance(request, dict) else None
    return Envelope(
        api_version=api_version if api_version == review.API_VERSION else review.API_VERSION,
        uid=uid if isinstance(uid, str) else "",
    )


def decode(body: bytes) -> Any:
    """Parse the HTTP body as JSON."""
    if not body:
        raise MalformedReviewError("empty body: expected an AdmissionReview")
    # Every value takes at least 2 bytes ("1," or "{}"): a shorter body cannot hold too many.
    if len(body) > 2 * MAX_JSON_VALUES and \
            body.count(b",") + body.count(b"{") + body.count(b"[") > MAX_JSON_VALUES:
        raise MalformedReviewError(
            f"body holds more than {MAX_JSON_VALUES} JSON values: not an AdmissionReview an API "
            f"server sends")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise MalformedReviewError(f"body is not JSON: {exc}") from None


def parse(document: Any) -> Request:
    """Read a decoded AdmissionReview into a ``Request``."""
    if not isinstance(document, dict):
        raise MalformedReviewError("expected an AdmissionReview object")
    if document.get("kind") != review.KIND:
        raise MalformedReviewError(f"kind must be {review.KIND}, got {document.get('kind')!r}")
    if document.get("apiVersion") != review.API_VERSION:
        raise MalformedReviewError(
            f"apiVersion must be {review.API_VERSION} (set admissionReviewVersions to [v1]),"
            f" got {document.get('apiVersion')!r}"
        )
    request: Optional[review.AdmissionRequest] = document.get("request")
    if not isinstance(request, dict):
        raise MalformedReviewError("request is required and must be an object")
    uid = _str(request, "uid", required=True)
    if not uid:
        raise MalformedReviewError("request.uid must not be empty")
    gvk: Optional[review.GroupVersionKind] = request.get("kind")
    if not isinstance(gvk, dict) or not all(
        isinstance(gvk.get(k), str) for k in ("group", "version", "kind")
    ):
        raise MalformedReviewError("request.kind must be an object with group, version and kind")
    operation = _str(request, "operation", required=True)
    if operation not in OPERATIONS:
        raise MalformedReviewError(f"request.operation {operation!r} is not one of {OPERATIONS}")
    obj = request.get("object")
    old_obj = request.get("oldObject")
    if obj is not None and not isinstance(obj, dict):
        raise MalformedReviewError("request.object must be an object or null")
    if old_obj is not None and not isinstance(old_obj, dict):
        raise MalformedReviewError("request.oldObject must be an object or null")
    if operation in ("CREATE", "UPDATE") and obj is None:
        raise MalformedReviewError(f"request.object is required for {operation}")
    dry_run: Optional[bool] = request.get("dryRun", False)
    if dry_run is None:
        dry_run = False
    if not isinstance(dry_run, bool):
        raise MalformedReviewError("request.dryRun must be true or false")
    user_info = request.get("userInfo")
    user = user_info.get("username") if isinstance(user_info, dict) else None
    groups = user_info.get("groups") if isinstance(user_info, dict) else None
    return Request(
        api_version=review.API_VERSION,
        uid=uid,
        group=gvk["group"],
        version=gvk["version"],
        kind=gvk["kind"],
        operation=operation,
        namespace=_str(request, "namespace"),
        name=_str(request, "name"),
        obj=obj,
        old_obj=old_obj,
        dry_run=dry_run,
        sub_resource=_str(request, "subResource"),
        user=user if isinstance(user, str) else "",
        groups=tuple(g for g in groups if isinstance(g, str)) if isinstance(groups, list) else (),
    )
