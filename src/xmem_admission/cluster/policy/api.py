"""The GPUAdmissionPolicy API: typed models of a policy's spec and status, the one source of
their schema.

These pydantic models validate a policy wherever it is read (``policy.model``: the webhook, the
controller, ``xmem serve --policy FILE``), and ``policy.schema`` generates from them the CRD's
``openAPIV3Schema`` (with its CEL rules) and the chart's ``values.schema.json`` policy part. A
field, bound, enum, default or description changes here and nowhere else. The status models
(``PolicyStatus``) are what the controller writes; readers check each range position with them.

A cross-field rule is a ``Rule`` on the model it reads: its CEL expression goes into the CRD's
``x-kubernetes-validations`` (the API server refuses a wrong policy with the field's path), and
its Python ``check`` is what the webhook and ``xmem serve`` apply, with the same message. Checks
the API server cannot make (the GPU catalogue, which grows with the webhook, not with a CRD that
``helm upgrade`` never updates; label key syntax in a map) are Python only.

Models are parsed once per policy change (``policy.model.Policy``); no request reads them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, List, Literal, Optional, Tuple, Type, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from typing_extensions import Annotated

from xmem_admission.cluster.kube import quantity
from xmem_admission.contract import gpus
from xmem_admission.contract.errors import QuantityError, UnknownGPUError


class BackendName(str, enum.Enum):
    """How a GPU memory request is expressed to the scheduler (``cluster/backends``: one each)."""

    ANNOTATION = "Annotation"  # xmem.io/ annotations only: for dashboards, or a custom scheduler
    HAMI = "HAMi"
    VOLCANO = "Volcano"
    GPUSHARE = "GPUShare"
    KAI = "KAI"
    MIG_MIXED = "MIGMixed"
    MIG_SINGLE = "MIGSingle"
    DRA = "DRA"  # a resource.k8s.io/v1 claim (docs/dra.md; settings: spec.dra)


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

    SUSPEND = "Suspend"  # the webhook suspends it and the controller releases it (no Kueue)
    KUEUE = "Kueue"  # Kueue holds it; the controller serves an AdmissionCheck instead, and the
    # webhook never touches the suspend flag of a workload that names a Kueue queue


class FailureAction(str, enum.Enum):
    """What the controller does with a held workload whose estimation failed or timed out."""

    RELEASE = "Release"  # release it unchanged, with a warning Event
    DEFAULT = "Default"  # release it with the policy's defaultRequest
    HOLD = "Hold"  # keep it held (until maxHoldSeconds) and report


class EstimationMode(str, enum.Enum):
    """How the probe runs the training step (``xmem estimate --mode``, in lower case)."""

    AUTO = "Auto"
    FAKE = "Fake"
    PROFILE = "Profile"


class DraDriver(str, enum.Enum):
    """Whose DRA conventions a claim follows (``backends/dra.py`` cites each driver's slices)."""

    NVIDIA = "Nvidia"  # sigs.k8s.io/dra-driver-nvidia-gpu, shared GPUs (ConsumableShares memory)
    NVIDIA_MIG = "NvidiaMIG"  # the same driver's MIG devices, chosen by their memory capacity
    HAMI = "HAMi"  # Project-HAMi/k8s-dra-driver: memory and cores, enforced by HAMi-core


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

# Patterns, as the API server and the webhook both check them. A quantity as
# k8s.io/apimachinery's resource.Quantity reads one; label keys and values and object names as
# k8s.io/apimachinery/pkg/util/validation does (IsQualifiedName, IsValidLabelValue,
# IsDNS1123Subdomain, IsDNS1123Label).
QUANTITY = (r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
            r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
LABEL_KEY = rf"^({_SUBDOMAIN}/)?{_NAME}$"
LABEL_VALUE = rf"^({_NAME})?$"
SUBDOMAIN = rf"^{_SUBDOMAIN}$"
NAMESPACE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
ABSOLUTE_PATH = "^/"
PROMETHEUS_URL = "^https?://[^/?#]+(/[^?#]*)?$"
# What a pattern means, in the words of an error message.
PATTERN_WORDS = {
    LABEL_KEY: "is not a label key ([prefix/]name: name up to 63 alphanumerics, '-', '_' or "
               "'.', beginning and ending alphanumeric)",
    LABEL_VALUE: "is not a label value (up to 63 alphanumerics, '-', '_' or '.', beginning and "
                 "ending alphanumeric)",
    SUBDOMAIN: "is not an object name (a DNS subdomain)",
    NAMESPACE: "is not a namespace name: sharing names namespaces exactly; patterns are not "
               "allowed",
    ABSOLUTE_PATH: "must be an absolute path in the controller's container",
    PROMETHEUS_URL: "must be http(s)://host[:port][/path]",
}


class FieldError(ValueError):
    """A model's check that names the field it is about (relative to the model)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class Rule:
    """A cross-field rule: CEL for the API server, ``check`` for the webhook, one message.

    ``inherited``: the rule reads fields an override may inherit from ``spec``, so the API
    server applies it to ``spec`` only, and Python to each namespace's resolved settings.
    ``check`` None: the CEL rule restates, for the API server, what the resolved settings'
    checks already refuse."""

    cel: str
    message: str
    field: str  # the field the message is about, relative to the model (CEL's fieldPath)
    check: Optional[Callable[[Any], bool]] = None
    reason: Optional[str] = None  # CEL's reason (FieldValueInvalid when unset)
    inherited: bool = False

    def crd(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"rule": self.cel, "message": self.message,
                               "fieldPath": "." + self.field}
        if self.reason:
            out["reason"] = self.reason
        if self.inherited:
            out[INHERITED] = True
        return out


INHERITED = "x-xmem-inherited"  # marks a rule the generator leaves out of overrides
SKIP_INHERITED = "skip_inherited"  # validation context: an override's own fields, unresolved


def _rules_schema(schema: Dict[str, Any], cls: Type[Any]) -> None:
    rules = getattr(cls, "rules", ())
    if rules:
        schema["x-kubernetes-validations"] = [r.crd() for r in rules]


class Model(BaseModel):
    """A part of the policy: camelCase fields, unknown fields refused, cross-field rules."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, frozen=True,
                              json_schema_extra=_rules_schema)
    rules: ClassVar[Tuple[Rule, ...]] = ()

    @model_validator(mode="after")
    def _check_rules(self, info: ValidationInfo) -> Any:
        skip = bool(info.context and info.context.get(SKIP_INHERITED))
        for rule in self.rules:
            if rule.check is not None and not (skip and rule.inherited) and not rule.check(self):
                raise FieldError(rule.field, rule.message)
        return self


# --- field types ------------------------------------------------------------------------------


def _quantity(positive: bool) -> Callable[[Any], Union[int, str]]:
    def check(value: Any) -> Union[int, str]:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"must be a quantity (e.g. 1Gi), got {value!r}")
        try:
            size = quantity.parse_bytes(value)
        except QuantityError as exc:
            raise ValueError(str(exc)) from None
        if positive and size <= 0:
            raise ValueError(f"must be positive, got {value!r}")
        return value
    return check


_QUANTITY_SCHEMA = {"x-kubernetes-int-or-string": True,
                    "anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY}
Quantity = Annotated[Union[int, str], PlainValidator(_quantity(False)),
                     WithJsonSchema(_QUANTITY_SCHEMA)]
PositiveQuantity = Annotated[Union[int, str], PlainValidator(_quantity(True)),
                             WithJsonSchema(_QUANTITY_SCHEMA)]


def _known_gpu(name: str) -> str:
    try:
        return gpus.lookup(name).key
    except UnknownGPUError as exc:
        raise ValueError(str(exc)) from None


GpuName = Annotated[StrictStr, Field(min_length=1), AfterValidator(_known_gpu)]
def _number(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"must be a number, got {value!r}")
    return float(value)


def _bounded(ge: Optional[float] = None, gt: Optional[float] = None,
             le: Optional[float] = None, lt: Optional[float] = None) -> Callable[[float], float]:
    def check(value: float) -> float:
        low = "" if ge is None else f"at least {ge:g}"
        low = low or ("" if gt is None else f"above {gt:g}")
        high = "" if le is None else f"at most {le:g}"
        high = high or ("" if lt is None else f"below {lt:g}")
        if (ge is not None and value < ge) or (gt is not None and value <= gt) or \
                (le is not None and value > le) or (lt is not None and value >= lt):
            raise ValueError(f"must be {' and '.join(w for w in (low, high) if w)}, "
                             f"got {value:g}")
        return value
    return check


def _number_schema(ge: Optional[float] = None, gt: Optional[float] = None,
                   le: Optional[float] = None, lt: Optional[float] = None) -> Dict[str, Any]:
    out: Dict[str, Any] = {"type": "number"}
    if ge is not None or gt is not None:
        out["minimum"] = ge if ge is not None else gt
        if gt is not None:
            out["exclusiveMinimum"] = True
    if le is not None or lt is not None:
        out["maximum"] = le if le is not None else lt
        if lt is not None:
            out["exclusiveMaximum"] = True
    return out


# Numbers with bounds: an integer is a number too, true is not. Percentages are integers.
TimeoutSeconds = Annotated[
    float, PlainValidator(_number), AfterValidator(_bounded(gt=0, le=MAX_PROMETHEUS_SECONDS)),
    WithJsonSchema(_number_schema(gt=0, le=MAX_PROMETHEUS_SECONDS))]
SlackSeconds = Annotated[
    float, PlainValidator(_number), AfterValidator(_bounded(ge=0, le=MAX_PROMETHEUS_SECONDS)),
    WithJsonSchema(_number_schema(ge=0, le=MAX_PROMETHEUS_SECONDS))]


def _list_map(key: str) -> Dict[str, Any]:
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": [key]}


# --- the models -------------------------------------------------------------------------------


class TargetSpec(Model):
    """A GPU model workloads may run on, and the backend its requests are written for."""

    gpu: GpuName = Field(description="A GPU model of the catalogue (`xmem gpus`), e.g. A100-80GB.")
    backend: BackendName = Field(description="How the request is expressed to the scheduler.")

    @model_validator(mode="after")
    def _mig_needs_profiles(self) -> TargetSpec:
        if self.backend in (BackendName.MIG_MIXED, BackendName.MIG_SINGLE) and \
                not gpus.lookup(self.gpu).mig_profiles:
            raise FieldError("backend", f"{self.gpu} has no MIG profiles")
        return self


TARGETS_DESCRIPTION = (
    "GPU models workloads may run on, in order of preference, each with the backend its "
    "requests are written for. A workload goes to the first GPU whose capacity holds its "
    "estimate (or the one it pins with xmem.io/gpu-model).")


class OnEstimationFailureSpec(Model):
    """What happens to a held workload whose estimation fails or times out."""

    rules = (Rule("!has(self.action) || self.action != 'Default' || has(self.defaultRequest)",
                  "action Default needs a defaultRequest (the request per GPU it releases with)",
                  "defaultRequest", reason="FieldValueRequired", inherited=True,
                  check=lambda m: m.action is not FailureAction.DEFAULT
                  or m.default_request is not None),)

    action: FailureAction = Field(
        default=FailureAction.RELEASE,
        description="Release unchanged (with a warning Event), release "
        "with defaultRequest, or keep held (never past estimation.maxHoldSeconds).")
    default_request: Optional[PositiveQuantity] = Field(
        default=None, description="Request per GPU used by action Default (a quantity).")


class ResourcesSpec(Model):
    """CPU and memory limits of an estimation pod."""

    cpu: PositiveQuantity = "2"
    memory: PositiveQuantity = "8Gi"


class TolerationSpec(Model):
    """A taint estimation pods tolerate (core/v1 Toleration)."""

    rules = (
        Rule("!has(self.operator) || self.operator != 'Exists' || !has(self.value) || "
             "self.value == ''", "value must be empty when operator is Exists", "value",
             check=lambda t: t.operator != "Exists" or not t.value),
        Rule("(has(self.key) && self.key != '') || (has(self.operator) && "
             "self.operator == 'Exists')",
             "operator must be Exists when key is empty (a toleration of every taint)",
             "operator", check=lambda t: bool(t.key) or t.operator == "Exists"),
        Rule("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
             "tolerationSeconds is for effect NoExecute only", "tolerationSeconds",
             check=lambda t: t.toleration_seconds is None or t.effect == "NoExecute"),
    )

    key: StrictStr = Field(default="", pattern=rf"^$|{LABEL_KEY}")
    operator: Literal["Equal", "Exists"] = "Equal"
    value: StrictStr = Field(default="", pattern=LABEL_VALUE)
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = ""
    toleration_seconds: Optional[StrictInt] = Field(default=None, ge=0)


class PlacementSpec(Model):
    """Where estimation pods run, set on every estimation pod as given (the workload's own node
    selector and tolerations, aimed at GPU nodes, are never copied): node labels, tolerations,
    a PriorityClass."""

    node_selector: Dict[StrictStr, Annotated[StrictStr, Field(pattern=LABEL_VALUE)]] = Field(
        default_factory=dict, description="Node labels an estimation pod's node must have.")
    tolerations: List[TolerationSpec] = Field(
        default_factory=list, description="Taints estimation pods tolerate (core/v1 Toleration).")
    priority_class_name: Optional[StrictStr] = Field(
        default=None, max_length=253, pattern=SUBDOMAIN,
        description="The PriorityClass of estimation pods (it must exist).")

    @field_validator("node_selector")
    @classmethod
    def _label_keys(cls, value: Dict[str, str]) -> Dict[str, str]:
        import re

        for key in value:
            if not re.match(LABEL_KEY, key) or len(key.rpartition("/")[0]) > 253:
                raise FieldError(f"[{key!r}]",
                                 f"{key!r} {PATTERN_WORDS[LABEL_KEY]}")
        return value


class EstimationOverrideSpec(Model):
    """How the controller runs estimation pods."""

    steps: StrictInt = Field(default=3, ge=1, description="Optimizer steps traced.")
    mode: EstimationMode = EstimationMode.AUTO
    active_deadline_seconds: StrictInt = Field(default=900, ge=1,
                                               description="Deadline of an estimation pod.")
    max_hold_seconds: StrictInt = Field(default=3600, ge=1,
                                        description="No workload stays held longer than this.")
    max_concurrent_per_namespace: StrictInt = Field(
        default=4, ge=1, description="Estimation pods running at once in one namespace.")
    cache_ttl_seconds: StrictInt = Field(default=30 * 24 * 3600, ge=1, alias="cacheTTLSeconds",
        description="A recorded GPUMemoryEstimate that no workload joined or was sized from for "
        "this long is deleted by the controller (default 30 days). One that a held workload "
        "waits on is kept.")
    resources: ResourcesSpec = Field(default=ResourcesSpec(),
                                     description="CPU and memory limits of an estimation pod.")
    placement: PlacementSpec = Field(default=PlacementSpec())


class EstimationSpec(EstimationOverrideSpec):
    """How the controller runs estimation pods."""

    max_concurrent: StrictInt = Field(
        default=32, ge=1, description="Estimation pods running at once in the whole cluster.")


class DraSpec(Model):
    """How the DRA backend writes a request as a resource.k8s.io/v1 claim (docs/dra.md): the
    DeviceClass, whose driver conventions the claim follows, whether it pins the estimated GPU
    model (a CEL selector on productName), what happens to a GPU container that already
    references a claim, and what the controller does when the class has no shareable device
    with a memory capacity."""

    rules = (Rule("!has(self.cores) || (has(self.driver) && self.driver == 'HAMi')",
                  "cores is HAMi's capacity (driver HAMi) only", "cores", inherited=True,
                  check=lambda d: d.cores is None or d.driver is DraDriver.HAMI),)

    driver: DraDriver = Field(
        default=DraDriver.NVIDIA,
        description="Nvidia: dra-driver-nvidia-gpu's shared GPUs (capacity "
        "memory); NvidiaMIG: its MIG devices, chosen by their memory; HAMi: HAMi's DRA driver "
        "(memory and cores, enforced by HAMi-core).")
    device_class: Optional[StrictStr] = Field(
        default=None, min_length=1, max_length=253,
        description="The DeviceClass of the claim; unset, "
        "the driver's (gpu.nvidia.com, mig.nvidia.com, hami-core-gpu.project-hami.io).")
    pin_product: StrictBool = Field(
        default=True,
        description="Whether the claim selects devices of the estimated GPU model only.")
    existing_claim: ExistingClaim = Field(
        default=ExistingClaim.LEAVE, description="A GPU container that already references a claim: "
        "Leave it, or point that claim at xmem's sized template (Replace). The kubectl warning "
        "says which.")
    fallback: DraFallback = Field(
        default=DraFallback.RELEASE, description="The class has no shareable device with a memory "
        "capacity: Release the workload as written (whole GPUs), or Hold it (until "
        "maxHoldSeconds); a Warning Event says why either way.")
    # HAMi-core's SM limit is a percentage (CUDA_DEVICE_SM_LIMIT, HAMi-core README).
    cores: Optional[StrictInt] = Field(
        default=None, ge=0, le=100,
        description="HAMi only, the percent of the GPU's SMs each claim asks "
        "(capacity cores); unset, 0 (no SM limit): HAMi's devices default a claim that asks no "
        "cores to all 100, which would take the whole GPU.")


class OomRetrySpec(Model):
    """What happens after a pod of a sized workload fails with a CUDA out-of-memory error (never
    OOMKilled, which is host memory): its next pod is sized from the error's figures plus
    safetyMarginPercent, each further OOM grows the request by at least growthPercent, never
    past maxRequest or the GPU's capacity (MIG: the next profile up); a workload that runs out
    at the largest size ends with a reason."""

    enabled: StrictBool = Field(
        default=True, description="Whether a workload's next pod is retried bigger after an OOM.")
    max_request: Optional[PositiveQuantity] = Field(
        default=None,
        description="The most a retry may ask for per GPU (a quantity); unset, the GPU's "
        "capacity.")
    growth_percent: StrictInt = Field(
        default=50, gt=0, le=MAX_GROWTH_PERCENT, description="Each OOM after the first grows the request by at least this much.")


class PrometheusSpec(Model):
    """Where the controller reads the peak GPU memory a finished workload's pods used (HAMi's
    per-container series, DCGM exporter's per device or MIG slice). Unset - no peak is observed
    and no request is corrected. Cluster-wide (not in overrides). Credentials are files in the
    controller's container (the chart's controller.prometheus mounts them)."""

    rules = (Rule("!has(self.caFile) || self.url.startsWith('https://')",
                  "caFile is for an https url", "caFile",
                  check=lambda p: p.ca_file is None or p.url.startswith("https://")),)

    url: StrictStr = Field(pattern=PROMETHEUS_URL, description="The query API's base, e.g. "
                           "http://prometheus.monitoring:9090.")
    bearer_token_file: Optional[StrictStr] = Field(default=None, pattern=ABSOLUTE_PATH)
    ca_file: Optional[StrictStr] = Field(default=None, pattern=ABSOLUTE_PATH)
    tenant: Optional[StrictStr] = Field(
        default=None, min_length=1, description="Sent as X-Scope-OrgID (Cortex, Mimir, Thanos).")
    timeout_seconds: TimeoutSeconds = Field(
        default=10.0, description="For all the queries of one workload's read together.")
    slack_seconds: SlackSeconds = Field(
        default=15.0,
        description="Each pod's window widened by this on both sides (the last scrape "
        "may be stamped up to one scrape interval after the pod ended).")


class RightSizingOverrideSpec(Model):
    """How the peak GPU memory earlier runs of a workload used (same fingerprint, same
    namespace) corrects its next request."""

    runs: StrictInt = Field(
        default=3, ge=0, le=MAX_RIGHT_SIZING_RUNS, description="How many of the "
                            "fingerprint's latest runs count (0 - none).")
    lower_requests: StrictBool = Field(
        default=False,
        description="Whether an observed peak below the estimate may lower the request; "
        "false - observed peaks only ever raise it.")


class RightSizingSpec(RightSizingOverrideSpec):
    """How the peak GPU memory earlier runs of a workload used (same fingerprint, same
    namespace) corrects its next request."""

    prometheus: Optional[PrometheusSpec] = None


class PinnedSpec(Model):
    """A figure the admin measured for one GPU model."""

    gpu: GpuName
    outside_allocator: PositiveQuantity

    @field_validator("outside_allocator")
    @classmethod
    def _at_most(cls, value: Union[int, str]) -> Union[int, str]:
        if quantity.parse_bytes(value) > MAX_PINNED_OVERHEAD:
            raise ValueError(f"must be at most 64Gi, got {value!r}")
        return value


class LearnedOverheadSpec(Model):
    """What each GPU model keeps outside PyTorch's caching allocator (CUDA context, library
    kernels), learned by the controller from finished jobs (observed peak minus the estimate's
    simulated reserved peak, a high quantile per GPU model and driver) and applied to new
    estimates in place of the catalogue's figure. Cluster-wide (not in overrides); the learned
    figures are in status.learnedOverhead."""

    rules = (Rule("(has(self.minJobs) ? self.minJobs : 5) <= "
                  "(has(self.recentJobs) ? self.recentJobs : 50)",
                  "minJobs is above recentJobs - no figure could ever be learned", "minJobs",
                  check=lambda o: o.min_jobs <= o.recent_jobs),)

    enabled: StrictBool = Field(
        default=True, description="false - nothing is learned (pinned figures "
                                "still apply).")
    min_jobs: StrictInt = Field(
        default=5, ge=1, le=MAX_OVERHEAD_JOBS, description="Jobs on one GPU "
                                "model and driver before a figure is learned.")
    recent_jobs: StrictInt = Field(default=50, ge=1, le=MAX_OVERHEAD_JOBS,
                                   description="The newest jobs per GPU model that count.")
    jobs_per_namespace: StrictInt = Field(
        default=10, ge=1, le=MAX_OVERHEAD_JOBS, description="At most "
                                          "this many of them from any one namespace.")
    percentile: StrictInt = Field(
        default=90, ge=50, le=100, description="The high percentile taken (the sorted value at "
        "floor(p/100*(n-1)): never the single largest while p < 100).")
    max_correction: Quantity = Field(
        default="1Gi", description="The most a learned figure moves an estimate, up or down.")
    pinned: List[PinnedSpec] = Field(
        default_factory=list, description="Figures the admin measured (nvidia-smi's figure "
        "minus torch.cuda.max_memory_reserved()), applied as given in place of learned ones.")

    @field_validator("max_correction")
    @classmethod
    def _at_most(cls, value: Union[int, str]) -> Union[int, str]:
        if quantity.parse_bytes(value) > MAX_PINNED_OVERHEAD:
            raise ValueError(f"must be at most 64Gi, got {value!r}")
        return value

    @field_validator("pinned")
    @classmethod
    def _once_each(cls, value: List[PinnedSpec]) -> List[PinnedSpec]:
        seen: List[str] = []
        for index, item in enumerate(value):
            if item.gpu in seen:
                raise FieldError(f"[{index}].gpu", f"{item.gpu} is pinned twice")
            seen.append(item.gpu)
        return value


class SharingSpec(Model):
    """A group of namespaces, named exactly, that may use each other's estimates."""

    namespaces: List[Annotated[StrictStr, Field(min_length=1, pattern=NAMESPACE)]] = Field(
        min_length=2)


class _Fields(Model):
    """The fields of ``spec`` an override may set too (``targets``, ``estimation`` and
    ``rightSizing`` are declared by each side, an override's without cluster-wide parts)."""

    enabled: StrictBool = Field(default=True, description="false turns xmem off (workloads pass "
                                "unchanged).")
    safety_margin_percent: StrictInt = Field(ge=0, le=100,
        default=5, description="Added to the estimate before rounding.")
    overcommit_percent: StrictInt = Field(ge=0, lt=100,
        default=0,
        description="How far below the estimate a request may go (accepted risk): lowers "
        "the requests xmem writes, and is the allowance for requests set by hand.")
    minimum_request: Quantity = Field(default="1Gi", description="Smallest request written (a "
                                      "quantity, e.g. 1Gi).")
    granularity: PositiveQuantity = Field(
        default="256Mi", description="Requests are rounded up to a "
                                          "multiple of this (a quantity).")
    enforcement: Enforcement = Field(
        default=Enforcement.WARN,
        description="Enforce denies workloads whose estimate fits no target "
        "GPU, requests set by hand below the estimate less the overcommit allowance, and bare "
        "Pods without an estimate; Warn admits them with a kubectl warning.")
    on_estimation_failure: OnEstimationFailureSpec = Field(default=OnEstimationFailureSpec())
    untrusted_annotations: UntrustedAnnotations = Field(
        default=UntrustedAnnotations.STRIP, description="What happens to xmem.io/request-bytes and "
        "xmem.io/estimate-bytes written by anyone but the xmem controller: Strip removes them "
        "(the workload is sized or held as if they were not there), Deny refuses the request.")
    integration: IntegrationMode = Field(
        default=IntegrationMode.SUSPEND, description="Who holds a workload until it is estimated. "
        "Suspend: the webhook suspends it and the xmem controller releases it. Kueue: Kueue "
        "holds it; the webhook never touches the suspend flag of a workload with the "
        "kueue.x-k8s.io/queue-name label, and the controller serves a Kueue AdmissionCheck "
        "(docs/kueue.md).")
    oom_retry: OomRetrySpec = Field(default=OomRetrySpec())
    dra: DraSpec = Field(default=DraSpec())


def _targets_once(targets: Optional[List[TargetSpec]]) -> Optional[List[TargetSpec]]:
    """A GPU model listed twice (under two of its names): the API server's list-map keys see
    the names only."""
    seen: List[str] = []
    for index, target in enumerate(targets or ()):
        if target.gpu in seen:
            raise FieldError(f"[{index}].gpu", f"{target.gpu} is listed twice")
        seen.append(target.gpu)
    return targets


class SettingsSpec(_Fields):
    """A namespace's settings: ``spec``'s own fields, or an override merged onto them."""

    targets: List[TargetSpec] = Field(min_length=1, description=TARGETS_DESCRIPTION,
                                      json_schema_extra=_list_map("gpu"))
    estimation: EstimationSpec = Field(default=EstimationSpec())
    right_sizing: RightSizingSpec = Field(default=RightSizingSpec())

    targets_once = field_validator("targets")(_targets_once)


class OverrideSpec(_Fields):
    """A refinement for the namespaces it names: any spec field but the cluster-wide ones."""

    namespaces: List[Annotated[StrictStr, Field(min_length=1)]] = Field(
        min_length=1, description="Names or shell-style patterns (team-*), first match wins.")
    targets: Optional[List[TargetSpec]] = Field(default=None, min_length=1,
                                                json_schema_extra=_list_map("gpu"))
    estimation: Optional[EstimationOverrideSpec] = None
    right_sizing: Optional[RightSizingOverrideSpec] = None

    targets_once = field_validator("targets")(_targets_once)


# Fields an override may not set, and why (the error says so, not merely "unknown field").
CLUSTER_WIDE = {
    "learnedOverhead": "is cluster-wide (what a GPU model and driver keep outside the "
                       "allocator is no namespace's): set it in spec.learnedOverhead",
    "estimation.maxConcurrent": "is cluster-wide: set it in spec.estimation",
    "rightSizing.prometheus": "is cluster-wide (the controller reads every namespace's peaks "
                              "from it): set it in spec.rightSizing",
    "overrides": "cannot nest: an override refines spec, never another override",
    "estimateSharing": "is cluster-wide: set it in spec.estimateSharing",
}


class PolicySpec(SettingsSpec):
    """How xmem-admission sizes the GPU memory requests of opted-in workloads (label
    xmem.io/estimate=true on the namespace or the workload). spec holds the defaults;
    spec.overrides refine them for namespaces matched by name."""

    rules = (Rule(
        "!has(self.overrides) || self.overrides.all(o, !has(o.onEstimationFailure) || "
        "!has(o.onEstimationFailure.action) || o.onEstimationFailure.action != 'Default' || "
        "has(o.onEstimationFailure.defaultRequest) || (has(self.onEstimationFailure) && "
        "has(self.onEstimationFailure.defaultRequest)))",
        "an override's onEstimationFailure.action Default needs a defaultRequest (its own or "
        "spec.onEstimationFailure's)", "overrides", reason="FieldValueRequired"),)

    overrides: List[OverrideSpec] = Field(
        default_factory=list, description="Per-namespace refinements, first match wins. Each "
        "entry names namespaces (shell-style patterns such as team-*) and any spec field but "
        "the cluster-wide ones (overrides, estimateSharing, learnedOverhead, "
        "estimation.maxConcurrent, rightSizing.prometheus).")
    estimate_sharing: List[SharingSpec] = Field(
        default_factory=list, description="Groups of namespaces, named exactly, whose recorded "
        "estimates may size each other's workloads. Estimates are otherwise used only in the "
        "namespace that recorded them (the estimation pod runs that namespace's own code).")
    learned_overhead: LearnedOverheadSpec = Field(default=LearnedOverheadSpec())


# The spec fields that are not a namespace's settings.
TOP_LEVEL_FIELDS = ("overrides", "estimateSharing", "learnedOverhead")


# --- the status (the controller's: the status subresource) -----------------------------------


class ConditionStatus(Model):
    """A condition as Kubernetes writes them (metav1.Condition)."""

    type: StrictStr = Field(max_length=316)
    status: Literal["True", "False", "Unknown"]
    observed_generation: Optional[StrictInt] = Field(default=None, ge=0)
    last_transition_time: StrictStr = Field(json_schema_extra={"format": "date-time"})
    reason: StrictStr = Field(max_length=1024)
    message: StrictStr = Field(max_length=32768)


class LearnedOverheadStatus(Model):
    """What one GPU model and driver kept outside the allocator in recent finished jobs."""

    gpu: StrictStr
    driver_version: StrictStr
    outside_allocator_bytes: StrictInt
    outside_allocator: StrictStr
    jobs: StrictInt
    namespaces: StrictInt


class RangePositionStatus(Model):
    """Where in their range the recent finished jobs with one landed on one GPU model."""

    gpu: GpuName
    position_percent: StrictInt = Field(
        ge=0, le=100, description="The largest position of the window's runs, in whole percent "
        "rounded up (0 - the point, 100 - the high end): a new estimate's request covers this "
        "share of its range.")
    jobs: StrictInt = Field(ge=1, le=MAX_OVERHEAD_JOBS, description="The runs it was learned "
                            "from.")
    namespaces: StrictInt = Field(ge=1, le=MAX_OVERHEAD_JOBS, description="The namespaces "
                                  "those runs came from.")
    above: StrictInt = Field(ge=0, le=MAX_OVERHEAD_JOBS, description="Of them, runs that "
                             "landed above their high end (counted, never followed).")


class PolicyStatus(Model):
    """Written by the xmem controller (the status subresource)."""

    observed_generation: Optional[StrictInt] = Field(
        default=None, description="The generation the controller last judged (the conditions "
        "say what it found).")
    conditions: Optional[List[ConditionStatus]] = Field(
        default=None, json_schema_extra=_list_map("type"), description="Accepted - the "
        "controller and the webhook could load this generation (False - the message names the "
        "field, e.g. a GPU model the catalogue lacks); Ready - a generation of this policy is "
        "in force.")
    learned: Optional[StrictStr] = Field(
        default=None, description="The learned figures in words, for kubectl get.")
    learned_at: Optional[StrictStr] = None
    learned_overhead: Optional[List[LearnedOverheadStatus]] = Field(
        default=None, description="What each GPU model and driver kept outside the allocator "
        "in recent finished jobs (observed peak minus simulated reserved peak), learned by the "
        "controller under spec.learnedOverhead; the webhook and the controller apply it to new "
        "estimates.")
    range_positions: Optional[List[RangePositionStatus]] = Field(
        default=None, description="Where in their range (an estimate's point to its high end) "
        "recent finished jobs with a range landed, per GPU model, learned by the controller "
        "under spec.learnedOverhead (its window, minJobs and maxCorrection); the webhook and "
        "the controller narrow the high end a new estimate's request covers to it. Absent - "
        "nothing learned: requests cover whole ranges.")


def status_schema() -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """``PolicyStatus``'s JSON Schema and its definitions, apart (``policy.schema`` turns them
    into the CRD's ``status`` node)."""
    raw = PolicyStatus.model_json_schema(by_alias=True)
    return raw, raw.pop("$defs", {})
