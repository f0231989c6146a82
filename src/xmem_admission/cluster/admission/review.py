"""AdmissionReview admission.k8s.io/v1 wire types, exactly as Kubernetes spells them.

Logic-free on purpose (kopf's shape): these describe the JSON on the wire, camelCase and all;
``request.py`` reads it, ``response.py`` writes it. See the Kubernetes API reference,
"AdmissionReview v1" (k8s.io/api/admission/v1/types.go).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, TypedDict

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"
PATCH_TYPE = "JSONPatch"
# The API server may cut a warning beyond 256 characters and drops warnings beyond 4096 in all
# (Kubernetes docs, "Dynamic Admission Control", response warnings): stay within both.
MAX_WARNING_CHARS = 256
MAX_WARNINGS_CHARS = 4096
MAX_MESSAGE_CHARS = 4096  # a denial's status message: enough for every violation, never a dump


class GroupVersionKind(TypedDict):
    group: str
    version: str
    kind: str


class GroupVersionResource(TypedDict):
    group: str
    version: str
    resource: str


class UserInfo(TypedDict, total=False):
    username: str
    uid: str
    groups: List[str]
    extra: Dict[str, List[str]]


class AdmissionRequest(TypedDict, total=False):
    uid: str
    kind: GroupVersionKind
    resource: GroupVersionResource
    subResource: str
    requestKind: GroupVersionKind
    requestResource: GroupVersionResource
    requestSubResource: str
    name: str
    namespace: str
    operation: str  # CREATE, UPDATE, DELETE, CONNECT
    userInfo: UserInfo
    object: Optional[Dict[str, Any]]
    oldObject: Optional[Dict[str, Any]]
    dryRun: bool
    options: Optional[Dict[str, Any]]


class Status(TypedDict, total=False):
    code: int
    reason: str
    message: str


class AdmissionResponse(TypedDict, total=False):
    uid: str
    allowed: bool
    status: Status
    patch: str  # base64 of the RFC 6902 JSON patch
    patchType: str
    auditAnnotations: Dict[str, str]
    warnings: List[str]


class AdmissionReview(TypedDict, total=False):
    apiVersion: str
    kind: str
    request: AdmissionRequest
    response: AdmissionResponse
