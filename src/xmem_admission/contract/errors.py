"""Every exception the project raises on purpose, in one place.

Each class says in one line when it is raised. The CLI turns any ``XmemError`` into a one-line
message on stderr and a non-zero exit; nothing here should ever surface as a traceback.
Standard library only: this module is part of the probe bundle.
"""

from __future__ import annotations

from typing import Optional


class XmemError(Exception):
    """Base class: raised for any input or situation the user must fix (never a bug)."""

    exit_code = 2


class TraceError(XmemError):
    """Raised when an allocation trace file is unreadable, malformed or inconsistent."""


class UnknownGPUError(XmemError):
    """Raised when a GPU name matches no model in the GPU catalogue (the message lists them)."""


class QuantityError(XmemError, ValueError):
    """Raised when a Kubernetes resource quantity ("20Gi", "1500m", 3) cannot be parsed."""


class PolicyError(XmemError):
    """Raised when a GPU admission policy (YAML file or GPUAdmissionPolicy object) is invalid."""


class EstimateRecordError(XmemError):
    """Raised when an estimate record (JSON file or object) is malformed or names an unknown GPU."""


class AdmissionError(XmemError):
    """Base of the webhook's input errors: each carries the 400-class code its response gets."""

    status_code = 400
    reason = "BadRequest"


class MalformedReviewError(AdmissionError):
    """Raised when an HTTP body is not a usable admission.k8s.io/v1 AdmissionReview request."""


class UnsupportedKindError(AdmissionError):
    """Raised when a review names a resource kind the webhook has no integration for."""


class InvalidObjectError(AdmissionError):
    """Raised when the object under review cannot be read as its kind (wrong types, bad values)."""

    status_code = 422
    reason = "Invalid"


class ServeError(XmemError):
    """Raised when ``xmem serve`` cannot start: missing or unreadable certificate, no policy."""


class AllocConfError(XmemError):
    """Raised when a PYTORCH_CUDA_ALLOC_CONF string is malformed or asks for what cannot be simulated."""


class SnapshotError(XmemError):
    """Raised when a memory-snapshot pickle is unreadable, truncated, not a snapshot, or holds objects."""


class AllocatorStateError(XmemError):
    """Raised when the simulated allocator is asked to free a block it did not hand out."""


class SimulatedOutOfMemory(XmemError):
    """Raised when the simulated caching allocator cannot satisfy a request, carrying its state then."""

    exit_code = 1

    def __init__(
        self,
        requested_bytes: int,
        allocation_bytes: int,
        stream: int,
        allocated_bytes: int,
        reserved_bytes: int,
        capacity_bytes: Optional[int],
        allowed_bytes: Optional[int] = None,
    ) -> None:
        self.requested_bytes = requested_bytes
        # The cudaMalloc size that failed: what PyTorch's message says it "tried to allocate".
        self.allocation_bytes = allocation_bytes
        self.stream = stream
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes
        # Reserved but not handed out: what PyTorch's message calls "reserved by PyTorch but
        # unallocated" (only split remainders are left after the release steps ran).
        self.free_cached_bytes = reserved_bytes - allocated_bytes
        self.capacity_bytes = capacity_bytes
        self.allowed_bytes = allowed_bytes
        limit = f"{allowed_bytes} bytes allowed by the memory fraction; " if allowed_bytes else ""
        cap = "unlimited" if capacity_bytes is None else f"{capacity_bytes} bytes"
        super().__init__(
            f"simulated CUDA out of memory: tried to allocate {allocation_bytes} bytes "
            f"(requested {requested_bytes}) on stream {stream}; capacity {cap}; {limit}"
            f"{allocated_bytes} bytes allocated, {reserved_bytes} reserved "
            f"({self.free_cached_bytes} reserved but unallocated)")


class EstimateError(XmemError):
    """Raised when a training command cannot be estimated (no script, no optimizer step...)."""


class LaunchError(EstimateError):
    """Raised when a distributed launcher's command line (torchrun, accelerate launch) cannot be read."""


class ProbeTimeout(EstimateError):
    """Raised when the traced script makes too few optimizer steps within the time limit."""


class ScriptFailed(EstimateError):
    """Raised when the traced script fails (raises or exits non-zero) before its last traced step."""

    def __init__(self, message: str, script_exit_code: int = 1) -> None:
        super().__init__(message)
        self.script_exit_code = script_exit_code


class RunsFileError(XmemError):
    """Raised when a benchmark runs file (xMem paper format) has a malformed row."""


class BenchError(XmemError):
    """Raised when ``xmem bench`` cannot find the benchmark (it needs the source checkout)."""


class TerminationMessageError(XmemError):
    """Raised when an estimation pod's termination message is missing, malformed or too large."""


class BundleError(XmemError):
    """Raised when the probe bundle cannot be built (unwritable target, a module outside the bundle)."""


class ControllerError(XmemError):
    """Raised when ``xmem controller`` cannot start: no cluster credentials, no policy, bad flags."""


class KubeApiError(Exception):
    """Raised by the controller's API facade for an answer the reconciler handles (404, 409, 422)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"{status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def conflict(self) -> bool:
        return self.status == 409 and self.reason != "AlreadyExists"

    @property
    def already_exists(self) -> bool:
        return self.status == 409 and self.reason == "AlreadyExists"

    @property
    def not_found(self) -> bool:
        return self.status == 404


class KubeUnavailable(Exception):
    """Raised by the controller's API facade when 429/5xx or connection failures outlast its retries."""


class NoClusterCredentials(XmemError):
    """Raised when neither in-cluster credentials nor a kubeconfig file can be loaded."""


class PrometheusQueryError(Exception):
    """Raised inside ``cluster.observations`` when a Prometheus query fails; its reader catches
    it (a warning and a metric), so no caller ever sees it."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # the metric's label: unreachable, timeout, http, response
