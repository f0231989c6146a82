"""The cluster admin's GPU admission policy: model, per-namespace resolution, loading.

A policy is a cluster-scoped ``GPUAdmissionPolicy`` object (group ``xmem.io``, version
``v1alpha1``; CRD in ``helm/xmem-admission/crds/``). ``xmem serve --policy FILE`` reads the very
same object from a YAML file, so one schema serves both and ``examples/policy.yaml`` can be
``kubectl apply``-ed as it is. ``spec`` holds the defaults; ``spec.overrides`` refine them for
namespaces matched by name (shell-style patterns, first match wins). Namespaces are matched by
name because an AdmissionReview carries the namespace's name, not its labels.

Parsing is strict: an unknown field, a wrong type or an unknown GPU model is an error that names
the field (``spec.overrides[0].targets[1].backend: ...``), because a silently ignored typo in an
admission policy is an outage waiting to happen.
"""

from __future__ import annotations

import dataclasses
import enum
import fnmatch
import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Tuple

from xmem_admission.cluster.kube import quantity
from xmem_admission.contract import gpus
from xmem_admission.contract.errors import PolicyError, QuantityError, UnknownGPUError

API_GROUP = "xmem.io"
API_VERSION = "v1alpha1"
KIND = "GPUAdmissionPolicy"
PLURAL = "gpuadmissionpolicies"
DEFAULT_NAME = "default"


class BackendName(str, enum.Enum):
    """How a GPU memory request is expressed to the scheduler (``cluster/backends``: one each)."""

    ANNOTATION = "annotation"  # xmem.io/ annotations only: for dashboards, or a custom scheduler
    HAMI = "hami"
    VOLCANO = "volcano"
    GPUSHARE = "gpushare"
    KAI = "kai"
    MIG_MIXED = "mig-mixed"
    MIG_SINGLE = "mig-single"
    DRA = "dra"  # a resource.k8s.io/v1 claim (docs/dra.md; settings: spec.dra)


class Enforcement(str, enum.Enum):
    """Whether policy violations are denied or only reported as kubectl warnings."""

    WARN = "Warn"
    ENFORCE = "Enforce"


class UntrustedAnnotations(str, enum.Enum):
    """What the webhook does with ``xmem.io/`` sizing annotations that anyone but the xmem
    controller wrote (``admission.trust``)."""

    STRIP = "Strip"  # remove them and size (or hold) the workload as if they were not there
    DENY = "Deny"  # refuse the request, saying which annotation


class IntegrationMode(str, enum.Enum):
    """Who holds a workload until it is estimated (``docs/kueue.md``)."""

    SUSPEND = "suspend"  # the webhook suspends it and the controller releases it (no Kueue)
    KUEUE = "kueue"  # Kueue holds it; the controller serves an AdmissionCheck instead, and the
    # webhook never touches the suspend flag of a workload that names a Kueue queue


class FailureAction(str, enum.Enum):
    """What the controller does with a held workload whose estimation failed or timed out."""

    RELEASE = "Release"  # release it unchanged, with a warning Event
    DEFAULT = "Default"  # release it with the policy's defaultRequest
    HOLD = "Hold"  # keep it held (until maxHoldSeconds) and report


class DraDriver(str, enum.Enum):
    """Whose DRA conventions a claim follows (``backends/dra.py`` cites each driver's slices)."""

    NVIDIA = "nvidia"  # sigs.k8s.io/dra-driver-nvidia-gpu, shared GPUs (ConsumableShares memory)
    NVIDIA_MIG = "nvidia-mig"  # the same driver's MIG devices, chosen by their memory capacity
    HAMI = "hami"  # Project-HAMi/k8s-dra-driver: memory and cores, enforced by HAMi-core


class ExistingClaim(str, enum.Enum):
    """What the webhook does with a GPU container that already references a claim."""

    LEAVE = "Leave"  # keep the user's claim; the Event says it was left
    REPLACE = "Replace"  # point that claim at xmem's template, sized by the estimate


class DraFallback(str, enum.Enum):
    """What the controller does when the policy's DeviceClass has no shareable device with a
    ``memory`` capacity (a claim would never be allocated)."""

    RELEASE = "Release"  # release it as it was written (whole GPUs), with a Warning Event
    HOLD = "Hold"  # keep it held (until maxHoldSeconds), with a Warning Event


# The DeviceClass each driver's chart installs (dra-driver-nvidia-gpu deployments/helm:
# gpu.nvidia.com, mig.nvidia.com; HAMi k8s-dra-driver demo: hami-core-gpu.project-hami.io).
DRA_CLASSES = {DraDriver.NVIDIA: "gpu.nvidia.com", DraDriver.NVIDIA_MIG: "mig.nvidia.com",
               DraDriver.HAMI: "hami-core-gpu.project-hami.io"}


@dataclass(frozen=True)
class Dra:
    """``spec.dra``: how the ``dra`` backend writes a claim (``docs/dra.md``)."""

    driver: DraDriver = DraDriver.NVIDIA
    device_class: str = DRA_CLASSES[DraDriver.NVIDIA]
    pin_product: bool = True  # a CEL selector on productName for the estimated GPU model
    existing_claim: ExistingClaim = ExistingClaim.LEAVE
    fallback: DraFallback = DraFallback.RELEASE
    cores_percent: Optional[int] = None  # HAMi only: capacity ``cores`` (percent of the SMs)


@dataclass(frozen=True)
class Target:
    """A GPU model workloads may run on, and the backend its requests are written for."""

    gpu: gpus.GPU
    backend: BackendName
    dra: Optional[Dra] = None  # the claim's settings, for backend dra


@dataclass(frozen=True)
class Toleration:
    """One toleration of the estimation pods (``core/v1`` Toleration, its fields as named)."""

    key: str = ""
    operator: str = "Equal"  # Equal | Exists
    value: str = ""
    effect: str = ""  # "" (every effect) | NoSchedule | PreferNoSchedule | NoExecute
    toleration_seconds: Optional[int] = None  # NoExecute only

    def as_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"operator": self.operator}
        for name, value in (("key", self.key), ("value", self.value), ("effect", self.effect)):
            if value:
                out[name] = value
        if self.toleration_seconds is not None:
            out["tolerationSeconds"] = self.toleration_seconds
        return out


@dataclass(frozen=True)
class Placement:
    """Where estimation pods run (``spec.estimation.placement``): a node selector, tolerations
    and a PriorityClass, set on every estimation pod as given (the workload's own GPU placement
    is never copied)."""

    node_selector: Tuple[Tuple[str, str], ...] = ()
    tolerations: Tuple[Toleration, ...] = ()
    priority_class_name: Optional[str] = None


@dataclass(frozen=True)
class Estimation:
    """How the controller runs estimation pods (read by the controller, carried here)."""

    steps: int = 3  # optimizer steps traced: the estimator's default K
    mode: str = "auto"
    active_deadline_seconds: int = 900
    max_hold_seconds: int = 3600  # no workload stays held longer, whatever happens
    cpu: str = "2"
    memory: str = "8Gi"
    max_concurrent_per_namespace: int = 4  # estimation pods running at once in one namespace
    max_concurrent: int = 32  # ... in the whole cluster (spec.estimation only, not overrides)
    placement: Placement = field(default_factory=Placement)  # where estimation pods run
    # A recorded estimate no workload joined or was sized from for this long is deleted
    # (``controller.estimate_cache``): 30 days.
    cache_ttl_seconds: int = 30 * 24 * 3600


@dataclass(frozen=True)
class OomRetry:
    """What happens after a sized workload's pod runs out of GPU memory (the growth
    rule is ``policy/retry.py``)."""

    enabled: bool = True  # retry the workload's next pod with a larger request
    max_request_bytes: Optional[int] = None  # the most a retry may ask for; None: the GPU's
    growth_percent: float = 50  # each OOM after the first grows the request by at least this


@dataclass(frozen=True)
class Prometheus:
    """Where the controller reads what finished workloads used (``spec.rightSizing.prometheus``,
    cluster-wide; ``cluster.observations.PrometheusSource`` is built from it). Credentials are
    files in the controller's container (a mounted Secret: the chart's
    ``controller.prometheus``), never values in the policy, which every tenant may read."""

    url: str  # http(s)://host[:port][/path]: the query API's base
    bearer_token_file: Optional[str] = None  # read at each read, so a rotated token is used
    ca_file: Optional[str] = None  # CA bundle for an https URL (the system's when unset)
    tenant: Optional[str] = None  # sent as X-Scope-OrgID (Cortex, Mimir, Thanos)
    timeout_seconds: float = 10.0  # all the queries of one workload's read together
    slack_seconds: float = 15.0  # each pod's window widened by this on both sides: the last
    # scrape before the pod ended may be stamped up to one scrape interval later


@dataclass(frozen=True)
class RightSizing:
    """How the peaks that earlier runs of a workload used correct its next request."""

    runs: int = 3  # how many of a fingerprint's latest runs count (0: observed peaks never do)
    lower_requests: bool = False  # whether an observed peak may lower a request or only raise it
    prometheus: Optional[Prometheus] = None  # None: no peak is observed, nothing is corrected


@dataclass(frozen=True)
class OverheadFigure:
    """What one GPU model and driver keep outside PyTorch's caching allocator, as the controller
    learned it from finished jobs (``policy.overhead``): written on the policy's
    ``status.learnedOverhead`` by the controller, read back with the policy by every reader."""

    gpu: str  # catalogue key
    driver: str  # the NVIDIA driver version the jobs ran under ("unknown" when no source said)
    outside_bytes: int  # observed peak - simulated reserved peak: the learned high quantile
    jobs: int  # the jobs it was learned from
    namespaces: int  # how many namespaces those jobs came from


@dataclass(frozen=True)
class LearnedOverhead:
    """How the memory outside the allocator is learned from finished jobs and applied to new
    estimates (the rule is ``policy/overhead.py``). Cluster-wide: the figures are
    facts of a GPU model and driver, never of a tenant."""

    enabled: bool = True  # learn from finished jobs (false: only pins, else the catalogue)
    min_jobs: int = 5  # jobs on one GPU model and driver before a figure is learned
    recent_jobs: int = 50  # the newest jobs per GPU model that count
    jobs_per_namespace: int = 10  # ... of which at most this many from any one namespace
    quantile: float = 0.9  # the high quantile taken (numpy's "lower" method: never the largest)
    max_correction_bytes: int = 1 << 30  # the most a learned figure moves an estimate, +/-
    pinned: Tuple[Tuple[str, int], ...] = ()  # (GPU key, outside bytes) the admin measured
    figures: Tuple[OverheadFigure, ...] = ()  # learned, from the policy's status

    def pin(self, gpu: str) -> Optional[int]:
        for key, value in self.pinned:
            if key == gpu:
                return value
        return None


@dataclass(frozen=True)
class Settings:
    """The policy as it applies to one namespace: every field resolved."""

    enabled: bool
    targets: Tuple[Target, ...]
    safety_margin_percent: float
    overcommit_percent: float
    minimum_request_bytes: int
    granularity_bytes: int
    enforcement: Enforcement
    on_failure: FailureAction
    default_request_bytes: Optional[int]
    estimation: Estimation = field(default_factory=Estimation)
    untrusted_annotations: UntrustedAnnotations = UntrustedAnnotations.STRIP
    integration: IntegrationMode = IntegrationMode.SUSPEND
    oom_retry: OomRetry = field(default_factory=OomRetry)
    right_sizing: RightSizing = field(default_factory=RightSizing)
    learned_overhead: LearnedOverhead = field(default_factory=LearnedOverhead)

    @property
    def kueue(self) -> bool:
        """Whether Kueue holds this namespace's queued workloads (``integration: kueue``)."""
        return self.integration is IntegrationMode.KUEUE

    @property
    def enforcing(self) -> bool:
        return self.enforcement is Enforcement.ENFORCE

    @property
    def gpu_keys(self) -> Tuple[str, ...]:
        """Catalogue keys of the target GPUs, in policy (preference) order."""
        return tuple(t.gpu.key for t in self.targets)

    def target(self, key: str) -> Optional[Target]:
        for target in self.targets:
            if target.gpu.key == key:
                return target
        return None


SPEC_FIELDS = (
    "enabled", "targets", "safetyMarginPercent", "overcommitPercent", "minimumRequest",
    "granularity", "enforcement", "onEstimationFailure", "estimation", "untrustedAnnotations",
    "integration", "oomRetry", "rightSizing", "dra",
)
# spec only, never in an override (learnedOverhead: what a GPU model and driver keep outside the
# allocator is no namespace's)
TOP_LEVEL_FIELDS = ("overrides", "estimateSharing", "learnedOverhead")
# Defaults: choices of this project, not GPU facts. 5 % margin = the estimator's default
# (`xmem estimate --margin`); 256 MiB granularity keeps requests readable; a 1 GiB floor because
# the CUDA context alone is 527 MiB on an H200 (contract.overhead) and no training process needs
# less.
DEFAULTS: Dict[str, Any] = {
    "enabled": True,
    "safetyMarginPercent": 5,
    "overcommitPercent": 0,
    "minimumRequest": "1Gi",
    "granularity": "256Mi",
    "enforcement": Enforcement.WARN.value,
    "onEstimationFailure": {"action": FailureAction.RELEASE.value},
    "estimation": {},
    "untrustedAnnotations": UntrustedAnnotations.STRIP.value,
    "integration": IntegrationMode.SUSPEND.value,
    "oomRetry": {},
    "rightSizing": {},
    "dra": {},
}
# Bounds that keep arithmetic on policy input finite: a retry grows at most elevenfold per OOM,
# and at most the last 100 runs of a fingerprint count (choices of this project).
MAX_GROWTH_PERCENT = 1000
MAX_RIGHT_SIZING_RUNS = 100
MAX_PROMETHEUS_SECONDS = 300  # a read runs in a controller worker: minutes would stall others
# learnedOverhead: at most the runs a GME keeps per fingerprint (records.MAX_RUNS) per GPU model,
# and a pinned figure of at most 64 GiB (the CUDA context and libraries are well under 1 GiB on
# every GPU measured: 751-771 MiB on the H200, bench/data/H200/measurements.jsonl).
MAX_OVERHEAD_JOBS = 1000
MAX_PINNED_OVERHEAD = 64 << 30
STATUS_FIGURES = 200  # learned figures read from a policy's status (GPU models x drivers)


def _fail(where: str, message: str) -> PolicyError:
    return PolicyError(f"{where}: {message}")


def _check_keys(raw: Mapping[str, Any], allowed: Tuple[str, ...], where: str) -> None:
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise _fail(where, f"unknown field {unknown[0]!r} (allowed: {', '.join(allowed)})")


def _enum(cls: Any, value: Any, where: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(m.value for m in cls)
        raise _fail(where, f"{value!r} is not one of {choices}") from None


def _number(value: Any, where: str, low: float, high: float, high_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(where, f"must be a number, got {value!r}")
    if value < low or value > high or (high_open and value == high):
        bound = f"below {high}" if high_open else f"at most {high}"
        raise _fail(where, f"must be at least {low} and {bound}, got {value}")
    return float(value)


def _bytes(value: Any, where: str, positive: bool = True) -> int:
    try:
        size = quantity.parse_bytes(value)
    except QuantityError as exc:
        raise _fail(where, str(exc)) from None
    if positive and size <= 0:
        raise _fail(where, f"must be positive, got {value!r}")
    return size


def _int(value: Any, where: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise _fail(where, f"must be an integer >= {low}, got {value!r}")
    return value


def _gpu_entry(item: Any, keys: Tuple[str, ...], at: str) -> gpus.GPU:
    """The GPU model of a list entry that names one (``{gpu, ...}``), its fields checked."""
    if not isinstance(item, dict):
        raise _fail(at, f"must be an object with {' and '.join(keys)}")
    _check_keys(item, keys, at)
    if not isinstance(item.get("gpu"), str):
        raise _fail(f"{at}.gpu", "must be a GPU name")
    try:
        return gpus.lookup(item["gpu"])
    except UnknownGPUError as exc:
        raise _fail(f"{at}.gpu", str(exc)) from None


def _targets(raw: Any, where: str) -> Tuple[Target, ...]:
    if not isinstance(raw, list) or not raw:
        raise _fail(where, "must be a non-empty list of {gpu, backend}")
    out: List[Target] = []
    for index, item in enumerate(raw):
        at = f"{where}[{index}]"
        gpu = _gpu_entry(item, ("gpu", "backend"), at)
        if any(t.gpu.key == gpu.key for t in out):
            raise _fail(f"{at}.gpu", f"{gpu.key} is listed twice")
        backend = _enum(BackendName, item.get("backend"), f"{at}.backend")
        if backend in (BackendName.MIG_MIXED, BackendName.MIG_SINGLE) and not gpu.mig_profiles:
            raise _fail(f"{at}.backend", f"{gpu.key} has no MIG profiles")
        out.append(Target(gpu, backend))
    return tuple(out)


# Label keys and values, and object names, as the API server checks them
# (k8s.io/apimachinery/pkg/util/validation: IsQualifiedName, IsValidLabelValue, IsDNS1123Subdomain).
_NAME_PART = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
TOLERATION_OPERATORS = ("Equal", "Exists")
TAINT_EFFECTS = ("", "NoSchedule", "PreferNoSchedule", "NoExecute")


def _label_key(key: Any, where: str) -> str:
    if not isinstance(key, str) or not key:
        raise _fail(where, f"must be a label key, got {key!r}")
    prefix, _, name = key.rpartition("/")
    if not _NAME_PART.fullmatch(name) or (prefix and (
            len(prefix) > 253 or not _SUBDOMAIN.fullmatch(prefix))) or key.startswith("/"):
        raise _fail(where, f"{key!r} is not a label key ([prefix/]name: name up to 63 "
                    "alphanumerics, '-', '_' or '.', beginning and ending alphanumeric)")
    return key


def _label_value(value: Any, where: str) -> str:
    if not isinstance(value, str) or (value and not _NAME_PART.fullmatch(value)):
        raise _fail(where, f"must be a label value (up to 63 alphanumerics, '-', '_' or '.', "
                    f"beginning and ending alphanumeric), got {value!r}")
    return value


def _placement(raw: Any, where: str) -> Placement:
    if not isinstance(raw, dict):
        raise _fail(where, "must be an object with nodeSelector, tolerations, priorityClassName")
    _check_keys(raw, ("nodeSelector", "tolerations", "priorityClassName"), where)
    selector = raw.get("nodeSelector") or {}
    if not isinstance(selector, dict):
        raise _fail(f"{where}.nodeSelector", "must be a map of node label keys to values")
    pairs = tuple(sorted((_label_key(k, f"{where}.nodeSelector"),
                         _label_value(v, f"{where}.nodeSelector[{k!r}]"))
                        for k, v in selector.items()))
    items = raw.get("tolerations") or []
    if not isinstance(items, list):
        raise _fail(f"{where}.tolerations", "must be a list of tolerations")
    tolerations: List[Toleration] = []
    for index, item in enumerate(items):
        at = f"{where}.tolerations[{index}]"
        if not isinstance(item, dict):
            raise _fail(at, "must be an object with key, operator, value, effect")
        _check_keys(item, ("key", "operator", "value", "effect", "tolerationSeconds"), at)
        operator = item.get("operator", "Equal")
        if operator not in TOLERATION_OPERATORS:
            raise _fail(f"{at}.operator", f"{operator!r} is not one of Equal, Exists")
        key = _label_key(item["key"], f"{at}.key") if item.get("key") not in (None, "") else ""
        value = _label_value(item.get("value", ""), f"{at}.value")
        if operator == "Exists" and value:
            raise _fail(f"{at}.value", "must be empty when operator is Exists")
        if not key and operator != "Exists":
            raise _fail(f"{at}.operator", "must be Exists when key is empty (a toleration of "
                        "every taint)")
        effect = item.get("effect", "")
        if effect not in TAINT_EFFECTS:
            raise _fail(f"{at}.effect", f"{effect!r} is not one of NoSchedule, "
                        "PreferNoSchedule, NoExecute (or empty: every effect)")
        seconds = None
        if item.get("tolerationSeconds") is not None:
            if effect != "NoExecute":
                raise _fail(f"{at}.tolerationSeconds", "is for effect NoExecute only")
            seconds = _int(item["tolerationSeconds"], f"{at}.tolerationSeconds", 0)
        tolerations.append(Toleration(key, operator, value, effect, seconds))
    priority = raw.get("priorityClassName")
    if priority is not None and (not isinstance(priority, str) or len(priority) > 253
                                 or not _SUBDOMAIN.fullmatch(priority)):
        raise _fail(f"{where}.priorityClassName", f"must be a PriorityClass name (a DNS "
                    f"subdomain), got {priority!r}")
    return Placement(pairs, tuple(tolerations), priority or None)


def _estimation(raw: Any, where: str) -> Estimation:
    if not isinstance(raw, dict):
        raise _fail(where, "must be an object")
    keys = ("steps", "mode", "activeDeadlineSeconds", "maxHoldSeconds", "resources",
            "maxConcurrentPerNamespace", "maxConcurrent", "cacheTTLSeconds", "placement")
    _check_keys(raw, keys, where)
    base = Estimation()
    resources = raw.get("resources", {})
    if not isinstance(resources, dict):
        raise _fail(f"{where}.resources", "must be an object with cpu and memory")
    _check_keys(resources, ("cpu", "memory"), f"{where}.resources")
    for key in ("cpu", "memory"):
        if key in resources:
            _bytes(resources[key], f"{where}.resources.{key}")
    mode = raw.get("mode", base.mode)
    if mode not in ("auto", "fake", "profile"):
        raise _fail(f"{where}.mode", f"{mode!r} is not one of auto, fake, profile")
    return Estimation(
        steps=_int(raw.get("steps", base.steps), f"{where}.steps", 1),
        mode=mode,
        active_deadline_seconds=_int(
            raw.get("activeDeadlineSeconds", base.active_deadline_seconds),
            f"{where}.activeDeadlineSeconds", 1,
        ),
        max_hold_seconds=_int(
            raw.get("maxHoldSeconds", base.max_hold_seconds), f"{where}.maxHoldSeconds", 1
        ),
        cpu=str(resources.get("cpu", base.cpu)),
        memory=str(resources.get("memory", base.memory)),
        max_concurrent_per_namespace=_int(
            raw.get("maxConcurrentPerNamespace", base.max_concurrent_per_namespace),
            f"{where}.maxConcurrentPerNamespace", 1,
        ),
        max_concurrent=_int(raw.get("maxConcurrent", base.max_concurrent),
                            f"{where}.maxConcurrent", 1),
        cache_ttl_seconds=_int(raw.get("cacheTTLSeconds", base.cache_ttl_seconds),
                               f"{where}.cacheTTLSeconds", 1),
        placement=_placement(raw.get("placement", {}), f"{where}.placement"),
    )


def _oom_retry(raw: Any, where: str) -> OomRetry:
    if not isinstance(raw, dict):
        raise _fail(where, "must be an object")
    _check_keys(raw, ("enabled", "maxRequest", "growthPercent"), where)
    base = OomRetry()
    enabled = raw.get("enabled", base.enabled)
    if not isinstance(enabled, bool):
        raise _fail(f"{where}.enabled", "must be true or false")
    cap = _bytes(raw["maxRequest"], f"{where}.maxRequest") if "maxRequest" in raw else None
    growth = _number(raw.get("growthPercent", base.growth_percent), f"{where}.growthPercent",
                     0, MAX_GROWTH_PERCENT)
    if growth == 0:
        raise _fail(f"{where}.growthPercent", "must be above 0: a repeated OOM must grow the "
                    "request")
    return OomRetry(enabled=enabled, max_request_bytes=cap, growth_percent=growth)


def _text(raw: Mapping[str, Any], key: str, where: str) -> Optional[str]:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise _fail(f"{where}.{key}", f"must be a non-empty string, got {value!r}")
    return value


def _prometheus(raw: Any, where: str) -> Prometheus:
    if not isinstance(raw, dict):
        raise _fail(where, "must be an object with url")
    _check_keys(raw, ("url", "bearerTokenFile", "caFile", "tenant", "timeoutSeconds",
                      "slackSeconds"), where)
    url = _text(raw, "url", where)
    if url is None:
        raise _fail(f"{where}.url", "is required (the Prometheus query API's base URL)")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query:
        raise _fail(f"{where}.url", f"must be http(s)://host[:port][/path], got {url!r}")
    for key in ("bearerTokenFile", "caFile"):
        path = _text(raw, key, where)
        if path is not None and not path.startswith("/"):
            raise _fail(f"{where}.{key}", f"must be an absolute path in the controller's "
                        f"container, got {path!r}")
    if raw.get("caFile") is not None and parts.scheme != "https":
        raise _fail(f"{where}.caFile", "is for an https url")
    base = Prometheus(url)
    timeout = _number(raw.get("timeoutSeconds", base.timeout_seconds), f"{where}.timeoutSeconds",
                      0, MAX_PROMETHEUS_SECONDS)
    if timeout == 0:
        raise _fail(f"{where}.timeoutSeconds", "must be above 0")
    return Prometheus(url=url, bearer_token_file=_text(raw, "bearerTokenFile", where),
                      ca_file=_text(raw, "caFile", where), tenant=_text(raw, "tenant", where),
                      timeout_seconds=timeout,
                      slack_seconds=_number(raw.get("slackSeconds", base.slack_seconds),
                                            f"{where}.slackSeconds", 0, MAX_PROMETHEUS_SECONDS))


def _right_sizing(raw: Any, where: str) -> RightSizing:
    if not isinstance(raw, dict):
        raise _fail(where, "must be an object")
    _check_keys(raw, ("runs", "lowerRequests", "prometheus"), where)
    base = RightSizing()
    runs = _int(raw.get("runs", base.runs), f"{where}.runs", 0)
    if runs > MAX_RIGHT_SIZING_RUNS:
        raise _fail(f"{where}.runs", f"must be at most {MAX_RIGHT_SIZING_RUNS}, got {runs}")
    lower = raw.get("lowerRequests", base.lower_requests)
    if not isinstance(lower, bool):
        raise _fail(f"{where}.lowerRequests", "must be true or false")
    prometheus = _prometheus(raw["prometheus"], f"{where}.prometheus") \
        if raw.get("prometheus") is not None else None
    return RightSizing(runs=runs, lower_requests=lower, prometheus=prometheus)


def _dra(raw: Any, where: str) -> Dra:
    if not isinstance(raw, dict):
        raise _fail(where, "must be an object")
    _check_keys(raw, ("driver", "deviceClass", "pinProduct", "existingClaim", "fallback",
                      "cores"), where)
    driver = _enum(DraDriver, raw.get("driver", DraDriver.NVIDIA.value), f"{where}.driver")
    device_class = raw.get("deviceClass", DRA_CLASSES[driver])
    # A DeviceClass name is a DNS subdomain (resource.k8s.io/v1 ObjectMeta): at most 253.
    if not isinstance(device_class, str) or not device_class or len(device_class) > 253:
        raise _fail(f"{where}.deviceClass", f"must be a DeviceClass name, got {device_class!r}")
    pin = raw.get("pinProduct", True)
    if not isinstance(pin, bool):
        raise _fail(f"{where}.pinProduct", "must be true or false")
    cores = raw.get("cores")
    if cores is not None:
        if driver is not DraDriver.HAMI:
            raise _fail(f"{where}.cores", "is HAMi's capacity (driver: hami) only")
        # HAMi-core's SM limit is a percentage (CUDA_DEVICE_SM_LIMIT, HAMi-core README).
        if _int(cores, f"{where}.cores", 0) > 100:
            raise _fail(f"{where}.cores", f"must be a percentage, at most 100, got {cores}")
    return Dra(driver=driver, device_class=device_class, pin_product=pin,
               existing_claim=_enum(ExistingClaim, raw.get("existingClaim", "Leave"),
                                    f"{where}.existingClaim"),
               fallback=_enum(DraFallback, raw.get("fallback", "Release"), f"{where}.fallback"),
               cores_percent=cores)


def _learned_overhead(raw: Any, where: str) -> LearnedOverhead:
    if not isinstance(raw, dict):
        raise _fail(where, "must be an object")
    _check_keys(raw, ("enabled", "minJobs", "recentJobs", "jobsPerNamespace", "quantile",
                      "maxCorrection", "pinned"), where)
    base = LearnedOverhead()
    enabled = raw.get("enabled", base.enabled)
    if not isinstance(enabled, bool):
        raise _fail(f"{where}.enabled", "must be true or false")
    counts: Dict[str, int] = {}
    for key, default in (("minJobs", base.min_jobs), ("recentJobs", base.recent_jobs),
                         ("jobsPerNamespace", base.jobs_per_namespace)):
        counts[key] = _int(raw.get(key, default), f"{where}.{key}", 1)
        if counts[key] > MAX_OVERHEAD_JOBS:
            raise _fail(f"{where}.{key}", f"must be at most {MAX_OVERHEAD_JOBS}, got "
                        f"{counts[key]}")
    if counts["minJobs"] > counts["recentJobs"]:
        raise _fail(f"{where}.minJobs", f"is above recentJobs ({counts['recentJobs']}): no "
                    "figure could ever be learned")
    quantile = _number(raw.get("quantile", base.quantile), f"{where}.quantile", 0.5, 1)
    bound = _bytes(raw["maxCorrection"], f"{where}.maxCorrection", positive=False) \
        if "maxCorrection" in raw else base.max_correction_bytes
    if bound > MAX_PINNED_OVERHEAD:
        raise _fail(f"{where}.maxCorrection", f"must be at most 64Gi, got {raw['maxCorrection']!r}")
    pins = raw.get("pinned", [])
    if not isinstance(pins, list):
        raise _fail(f"{where}.pinned", "must be a list of {gpu, outsideAllocator}")
    pinned: List[Tuple[str, int]] = []
    for index, item in enumerate(pins):
        at = f"{where}.pinned[{index}]"
        key = _gpu_entry(item, ("gpu", "outsideAllocator"), at).key
        if any(k == key for k, _ in pinned):
            raise _fail(f"{at}.gpu", f"{key} is pinned twice")
        if "outsideAllocator" not in item:
            raise _fail(f"{at}.outsideAllocator", "is required (the bytes outside PyTorch's "
                        "allocator on this GPU: nvidia-smi's figure minus "
                        "torch.cuda.max_memory_reserved())")
        value = _bytes(item["outsideAllocator"], f"{at}.outsideAllocator")
        if value > MAX_PINNED_OVERHEAD:
            raise _fail(f"{at}.outsideAllocator", f"must be at most 64Gi, got "
                        f"{item['outsideAllocator']!r}")
        pinned.append((key, value))
    return LearnedOverhead(enabled=enabled, min_jobs=counts["minJobs"],
                           recent_jobs=counts["recentJobs"],
                           jobs_per_namespace=counts["jobsPerNamespace"], quantile=quantile,
                           max_correction_bytes=bound, pinned=tuple(pinned))


def overhead_figures(status: Any) -> Tuple[OverheadFigure, ...]:
    """The learned figures of a policy's ``status.learnedOverhead`` (written by the controller
    alone: the status subresource). Entries that are not well formed are skipped, never an
    error: a policy's spec stays in force whatever its status says."""
    raw = status.get("learnedOverhead") if isinstance(status, dict) else None
    if not isinstance(raw, list):
        return ()
    out: List[OverheadFigure] = []
    for item in raw[:STATUS_FIGURES]:
        if not isinstance(item, dict):
            continue
        gpu, driver = item.get("gpu"), item.get("driverVersion")
        values = [v for v in (item.get(k) for k in ("outsideAllocatorBytes", "jobs", "namespaces"))
                  if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= MAX_PINNED_OVERHEAD]
        if not isinstance(gpu, str) or not isinstance(driver, str) or len(values) != 3:
            continue
        try:
            key = gpus.lookup(gpu).key
        except UnknownGPUError:
            continue
        out.append(OverheadFigure(key, driver[:64], values[0], values[1], values[2]))
    return tuple(out)


def _settings(raw: Mapping[str, Any], origin: Mapping[str, str]) -> Settings:
    """Build Settings from merged raw fields; ``origin`` says where each field was written."""

    def at(key: str) -> str:
        return f"{origin.get(key, 'spec')}.{key}"

    if "targets" not in raw:
        raise _fail("spec.targets", "is required (the GPU models workloads may run on)")
    enabled = raw["enabled"]
    if not isinstance(enabled, bool):
        raise _fail(at("enabled"), "must be true or false")
    failure = raw["onEstimationFailure"]
    if not isinstance(failure, dict):
        raise _fail(at("onEstimationFailure"), "must be an object")
    _check_keys(failure, ("action", "defaultRequest"), at("onEstimationFailure"))
    action = _enum(
        FailureAction, failure.get("action", "Release"), at("onEstimationFailure") + ".action"
    )
    default_request = None
    if "defaultRequest" in failure:
        default_request = _bytes(failure["defaultRequest"], at("onEstimationFailure") + ".defaultRequest")
    if action is FailureAction.DEFAULT and default_request is None:
        raise _fail(at("onEstimationFailure"), "action Default needs a defaultRequest")
    minimum = _bytes(raw["minimumRequest"], at("minimumRequest"), positive=False)
    oom_retry = _oom_retry(raw["oomRetry"], at("oomRetry"))
    if oom_retry.max_request_bytes is not None and oom_retry.max_request_bytes < minimum:
        raise _fail(at("oomRetry") + ".maxRequest", "is below minimumRequest: no retry could grow")
    dra = _dra(raw["dra"], at("dra"))
    targets = tuple(dataclasses.replace(t, dra=dra) if t.backend is BackendName.DRA else t
                    for t in _targets(raw["targets"], at("targets")))
    if dra.driver is DraDriver.NVIDIA_MIG:
        for index, target in enumerate(targets):
            if target.backend is BackendName.DRA and not target.gpu.mig_profiles:
                raise _fail(f"{at('targets')}[{index}].backend",
                            f"{target.gpu.key} has no MIG profiles (spec.dra.driver nvidia-mig)")
    return Settings(
        enabled=enabled,
        targets=targets,
        safety_margin_percent=_number(raw["safetyMarginPercent"], at("safetyMarginPercent"), 0, 100),
        overcommit_percent=_number(
            raw["overcommitPercent"], at("overcommitPercent"), 0, 100, high_open=True
        ),
        minimum_request_bytes=minimum,
        granularity_bytes=_bytes(raw["granularity"], at("granularity")),
        enforcement=_enum(Enforcement, raw["enforcement"], at("enforcement")),
        on_failure=action,
        default_request_bytes=default_request,
        estimation=_estimation(raw["estimation"], at("estimation")),
        untrusted_annotations=_enum(UntrustedAnnotations, raw["untrustedAnnotations"],
                                    at("untrustedAnnotations")),
        integration=_enum(IntegrationMode, raw["integration"], at("integration")),
        oom_retry=oom_retry,
        right_sizing=_right_sizing(raw["rightSizing"], at("rightSizing")),
    )


def merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> Dict[str, Any]:
    """``over`` on top of ``base``, field by field at every depth: an object in ``over`` refines
    the object below it (unset fields keep the values above), anything else replaces it."""
    out = dict(base)
    for key, value in over.items():
        below = out.get(key)
        out[key] = merge(below, value) if isinstance(below, dict) and isinstance(value, dict) \
            else value
    return out


def _sharing(raw: Any) -> Tuple[FrozenSet[str], ...]:
    """``spec.estimateSharing``: groups of named namespaces that may use each other's
    estimates (estimates are otherwise never used outside the namespace that recorded them)."""
    where = "spec.estimateSharing"
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _fail(where, "must be a list of {namespaces: [...]}")
    groups: List[FrozenSet[str]] = []
    for index, item in enumerate(raw):
        at = f"{where}[{index}]"
        if not isinstance(item, dict):
            raise _fail(at, "must be an object with namespaces")
        _check_keys(item, ("namespaces",), at)
        names = item.get("namespaces")
        if not isinstance(names, list) or len(names) < 2 or not all(
                isinstance(n, str) and n for n in names):
            raise _fail(f"{at}.namespaces", "must list at least two namespace names")
        for position, name in enumerate(names):
            if any(c in name for c in "*?[]"):
                raise _fail(f"{at}.namespaces[{position}]", f"{name!r}: sharing names namespaces "
                            "exactly; patterns are not allowed")
        groups.append(frozenset(names))
    return tuple(groups)


class Policy:
    """A parsed policy: defaults plus ordered namespace overrides."""

    def __init__(
        self,
        name: str,
        defaults: Settings,
        overrides: Tuple[Tuple[Tuple[str, ...], Settings], ...] = (),
        generation: Optional[int] = None,
        sharing: Tuple[FrozenSet[str], ...] = (),
    ):
        self.name = name
        self.defaults = defaults
        self.overrides = overrides
        self.generation = generation
        self.sharing = sharing
        self._cache: Dict[str, Settings] = {}

    def shares_with(self, namespace: str) -> FrozenSet[str]:
        """The namespaces whose recorded estimates may size this namespace's workloads: itself,
        and the other members of every ``estimateSharing`` group that names it."""
        out = {namespace}
        for group in self.sharing:
            if namespace in group:
                out |= group
        return frozenset(out)

    @property
    def prometheus(self) -> Optional[Prometheus]:
        """Where finished workloads' peaks are read (``spec.rightSizing.prometheus``)."""
        return self.defaults.right_sizing.prometheus

    @property
    def learned_overhead(self) -> LearnedOverhead:
        """How the memory outside the allocator is learned and applied (cluster-wide)."""
        return self.defaults.learned_overhead

    def with_overhead(self, learned: LearnedOverhead) -> Policy:
        """This policy with ``learned`` in every namespace's settings (the sizing reads it
        there): ``spec.learnedOverhead`` and, from the policy's status, its figures."""
        def add(settings: Settings) -> Settings:
            return dataclasses.replace(settings, learned_overhead=learned)
        return Policy(self.name, add(self.defaults),
                      tuple((p, add(s)) for p, s in self.overrides), self.generation,
                      self.sharing)

    def with_figures(self, figures: Tuple[OverheadFigure, ...]) -> Policy:
        """This policy with the controller's learned figures (its status)."""
        return self.with_overhead(dataclasses.replace(self.learned_overhead, figures=figures))

    @property
    def max_concurrent(self) -> int:
        """Estimation pods running at once in the whole cluster (``spec.estimation``)."""
        return self.defaults.estimation.max_concurrent

    def for_namespace(self, namespace: str) -> Settings:
        """The settings for a namespace: the first override whose pattern matches, else defaults."""
        hit = self._cache.get(namespace)
        if hit is not None:
            return hit
        resolved = self.defaults
        for patterns, settings in self.overrides:
            if any(fnmatch.fnmatchcase(namespace, p) for p in patterns):
                resolved = settings
                break
        if len(self._cache) > 10_000:  # namespaces come and go; keep the cache bounded
            self._cache.clear()
        self._cache[namespace] = resolved
        return resolved

    @classmethod
    def from_spec(cls, spec: Any, name: str = DEFAULT_NAME) -> Policy:
        """Parse a ``GPUAdmissionPolicy`` spec."""
        if not isinstance(spec, dict):
            raise _fail("spec", "must be an object")
        _check_keys(spec, SPEC_FIELDS + TOP_LEVEL_FIELDS, "spec")
        base = {k: v for k, v in spec.items() if k not in TOP_LEVEL_FIELDS}
        merged = merge(DEFAULTS, base)
        defaults = _settings(merged, {})
        overrides: List[Tuple[Tuple[str, ...], Settings]] = []
        raw_overrides = spec.get("overrides", [])
        if not isinstance(raw_overrides, list):
            raise _fail("spec.overrides", "must be a list")
        for index, item in enumerate(raw_overrides):
            where = f"spec.overrides[{index}]"
            if not isinstance(item, dict):
                raise _fail(where, "must be an object")
            if "learnedOverhead" in item:
                raise _fail(f"{where}.learnedOverhead", "is cluster-wide (what a GPU model and "
                            "driver keep outside the allocator is no namespace's): set it in "
                            "spec.learnedOverhead")
            _check_keys(item, ("namespaces",) + SPEC_FIELDS, where)
            patterns = item.get("namespaces")
            if (
                not isinstance(patterns, list)
                or not patterns
                or not all(isinstance(p, str) and p for p in patterns)
            ):
                raise _fail(f"{where}.namespaces", "must be a non-empty list of names or patterns")
            fields = {k: v for k, v in item.items() if k != "namespaces"}
            if "maxConcurrent" in (fields.get("estimation") or {}):
                raise _fail(f"{where}.estimation.maxConcurrent", "is cluster-wide: set it in "
                            "spec.estimation")
            if isinstance(fields.get("rightSizing"), dict) and \
                    "prometheus" in fields["rightSizing"]:
                raise _fail(f"{where}.rightSizing.prometheus", "is cluster-wide (the "
                            "controller reads every namespace's peaks from it): set it in "
                            "spec.rightSizing")
            origin = {k: where for k in fields}
            overrides.append((tuple(patterns), _settings(merge(merged, fields), origin)))
        learned = _learned_overhead(spec.get("learnedOverhead", {}), "spec.learnedOverhead")
        policy = cls(name, defaults, tuple(overrides), sharing=_sharing(spec.get("estimateSharing")))
        return policy.with_overhead(learned)

    @classmethod
    def from_object(cls, obj: Any) -> Policy:
        """Parse a whole ``GPUAdmissionPolicy`` object (from the API server or a YAML file)."""
        if not isinstance(obj, dict):
            raise PolicyError("a policy must be a GPUAdmissionPolicy object (a YAML mapping)")
        expected = f"{API_GROUP}/{API_VERSION}"
        if obj.get("apiVersion") != expected or obj.get("kind") != KIND:
            raise PolicyError(
                f"expected apiVersion {expected} and kind {KIND}, got "
                f"{obj.get('apiVersion')!r} and {obj.get('kind')!r}"
            )
        _check_keys(obj, ("apiVersion", "kind", "metadata", "spec", "status"), "policy")
        metadata = obj.get("metadata") or {}
        name = metadata.get("name", DEFAULT_NAME) if isinstance(metadata, dict) else DEFAULT_NAME
        policy = cls.from_spec(obj.get("spec"), name=str(name))
        figures = overhead_figures(obj.get("status"))
        if figures:
            policy = policy.with_figures(figures)
        generation = metadata.get("generation") if isinstance(metadata, dict) else None
        policy.generation = generation if isinstance(generation, int) else None
        return policy

    @classmethod
    def from_yaml(cls, text: str, source: str = "policy") -> Policy:
        """Parse a YAML document holding one ``GPUAdmissionPolicy``."""
        import yaml  # server extra; imported here so the CLI parser stays light

        try:
            documents = [d for d in yaml.safe_load_all(text) if d is not None]
        except yaml.YAMLError as exc:
            raise PolicyError(f"{source}: not valid YAML: {exc}") from None
        if len(documents) != 1:
            raise PolicyError(f"{source}: expected one GPUAdmissionPolicy, found {len(documents)}")
        try:
            return cls.from_object(documents[0])
        except PolicyError as exc:
            raise PolicyError(f"{source}: {exc}") from None

    @classmethod
    def from_file(cls, path: str) -> Policy:
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise PolicyError(f"{path}: cannot read: {exc}") from None
        return cls.from_yaml(text, source=path)
