"""The cluster admin's GPU admission policy: model, per-namespace resolution, loading.

A policy is a cluster-scoped ``GPUAdmissionPolicy`` object (group ``xmem.io``, version
``v1alpha1``; CRD in ``helm/xmem-admission/crds/``). ``xmem serve --policy FILE`` reads the very
same object from a YAML file, so one schema serves both and ``examples/policy.yaml`` can be
``kubectl apply``-ed as it is. ``spec`` holds the defaults; ``spec.overrides`` refine them for
namespaces matched by name (shell-style patterns, first match wins). Namespaces are matched by
name because an AdmissionReview carries the namespace's name, not its labels.

Parsing is strict: an unknown field, a wrong type or an unknown GPU model is an error that names
the field (``spec.overrides[0].targets[1].backend: ...``), because a silently ignored typo in an
admission policy is an outage waiting to happen. The typed models of ``policy.api`` validate (the
CRD is generated from them); this module resolves them into per-namespace ``Settings``, once per
policy change: the webhook's requests read ``Settings`` only.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Tuple, Union

from pydantic import ValidationError

from xmem_admission.cluster.kube import quantity
from xmem_admission.cluster.policy import api
from xmem_admission.contract import gpus
from xmem_admission.contract.errors import PolicyError, UnknownGPUError

API_GROUP = "xmem.io"
API_VERSION = "v1alpha1"
KIND = "GPUAdmissionPolicy"
PLURAL = "gpuadmissionpolicies"
DEFAULT_NAME = "default"

# The policy's enums and bounds live with its models (``policy.api``); read from here too.
BackendName = api.BackendName
DraDriver = api.DraDriver
DraFallback = api.DraFallback
Enforcement = api.Enforcement
ExistingClaim = api.ExistingClaim
FailureAction = api.FailureAction
IntegrationMode = api.IntegrationMode
UntrustedAnnotations = api.UntrustedAnnotations
DRA_CLASSES = api.DRA_CLASSES
MAX_GROWTH_PERCENT = api.MAX_GROWTH_PERCENT
MAX_OVERHEAD_JOBS = api.MAX_OVERHEAD_JOBS
MAX_PINNED_OVERHEAD = api.MAX_PINNED_OVERHEAD
MAX_PROMETHEUS_SECONDS = api.MAX_PROMETHEUS_SECONDS
MAX_RIGHT_SIZING_RUNS = api.MAX_RIGHT_SIZING_RUNS
TOP_LEVEL_FIELDS = api.TOP_LEVEL_FIELDS


@dataclass(frozen=True)
class Dra:
    """``spec.dra``: how the ``DRA`` backend writes a claim (``docs/dra.md``)."""

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
    dra: Optional[Dra] = None  # the claim's settings, for backend DRA


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
    growth_percent: int = 50  # each OOM after the first grows the request by at least this


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
class RangePosition:
    """Where in their range the recent jobs with one landed on one GPU model, as the controller
    learned it from finished runs (``policy.range_position``): written on the policy's
    ``status.rangePositions`` by the controller, read back with the policy by every reader."""

    gpu: str  # catalogue key
    percent: int  # the window's largest position, in whole percent rounded up, within [0, 100]
    jobs: int  # the runs it was learned from
    namespaces: int  # how many namespaces those runs came from
    above: int = 0  # of them, runs that landed above their high end

    @property
    def position(self) -> float:
        """0: the point, 1: the high end."""
        return self.percent / 100

    def text(self) -> str:
        out = (f"jobs with a range on {self.gpu} landed at most {self.percent}% of the way to "
               f"its high end ({self.jobs} job(s) in {self.namespaces} namespace(s))")
        if self.above:
            out += f"; {self.above} landed above it"
        return out


@dataclass(frozen=True)
class LearnedOverhead:
    """How the memory outside the allocator is learned from finished jobs and applied to new
    estimates (the rule is ``policy/overhead.py``). Cluster-wide: the figures are
    facts of a GPU model and driver, never of a tenant."""

    enabled: bool = True  # learn from finished jobs (false: only pins, else the catalogue)
    min_jobs: int = 5  # jobs on one GPU model and driver before a figure is learned
    recent_jobs: int = 50  # the newest jobs per GPU model that count
    jobs_per_namespace: int = 10  # ... of which at most this many from any one namespace
    percentile: int = 90  # the high percentile taken (numpy's "lower" method: never the largest)
    max_correction_bytes: int = 1 << 30  # the most a learned figure moves an estimate, +/-
    pinned: Tuple[Tuple[str, int], ...] = ()  # (GPU key, outside bytes) the admin measured
    figures: Tuple[OverheadFigure, ...] = ()  # learned, from the policy's status
    positions: Tuple[RangePosition, ...] = ()  # learned, from the policy's status

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
    safety_margin_percent: int
    overcommit_percent: int
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
        """Whether Kueue holds this namespace's queued workloads (``integration: Kueue``)."""
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


STATUS_FIGURES = 200  # learned figures read from a policy's status (GPU models x drivers)
STATUS_POSITIONS = 100  # learned range positions read from a policy's status (GPU models)


def _where(prefix: str, loc: Tuple[Any, ...]) -> str:
    out, above = prefix, None
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and above != "nodeSelector":
            out += f".{part}"
        else:
            out += f"[{part!r}]"
        above = part
    return out


def _choices(expected: str) -> str:
    """pydantic's "'a', 'b' or 'c'" as "a, b, c"."""
    return ", ".join(re.findall(r"'([^']*)'", expected)) or expected


def _problem(error: Mapping[str, Any], prefix: str) -> str:
    """One of pydantic's errors as ``path: what is wrong``, the path as the admin wrote it."""
    loc, kind = tuple(error["loc"]), error["type"]
    ctx, value = error.get("ctx") or {}, error.get("input")
    if kind == "extra_forbidden":
        inner = ".".join(str(p) for p in loc[2:])
        if loc[:1] == ("overrides",) and inner in api.CLUSTER_WIDE:
            return f"{_where(prefix, loc)}: {api.CLUSTER_WIDE[inner]}"
        return f"{_where(prefix, loc[:-1])}: unknown field {loc[-1]!r}"
    cause = ctx.get("error")
    if isinstance(cause, api.FieldError):
        where = _where(prefix, loc)
        said = str(cause)  # a rule's message names its field first: the path names it here
        said = said[len(cause.field) + 1:] if said.startswith(cause.field + " ") else said
        return f"{where}{'' if cause.field.startswith('[') else '.'}{cause.field}: {said}"
    where = _where(prefix, loc)
    if kind in ("enum", "literal_error"):
        message = f"{value!r} is not one of {_choices(str(ctx.get('expected', '')))}"
    elif kind == "missing":
        message = "is required"
    elif kind in ("int_type", "int_parsing", "int_from_float"):
        message = f"must be an integer, got {value!r}"
    elif kind == "bool_type":
        message = f"must be true or false, got {value!r}"
    elif kind == "string_type":
        message = f"must be a string, got {value!r}"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        message = f"must be an object, got {value!r}"
    elif kind == "list_type":
        message = f"must be a list, got {value!r}"
    elif kind == "too_short":
        least = ctx.get("min_length", 1)
        message = "must be a non-empty list" if least == 1 else \
            f"must list at least {least} items, got {len(value or ())}"
    elif kind == "string_too_short":
        message = "must not be empty"
    elif kind == "string_too_long":
        message = f"must be at most {ctx.get('max_length')} characters"
    elif kind == "string_pattern_mismatch":
        words = api.PATTERN_WORDS.get(str(ctx.get("pattern")))
        message = (f"{words}, got {value!r}" if words.startswith("must") else
                   f"{value!r} {words}") if words else f"{value!r} does not match {ctx.get('pattern')}"
    elif kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        word = {"greater_than_equal": "at least", "greater_than": "above",
                "less_than_equal": "at most", "less_than": "below"}[kind]
        bound = next(iter(ctx.values()), "?")
        message = f"must be {word} {bound}, got {value!r}"
    elif cause is not None:
        message = str(cause)
    else:
        message = str(error.get("msg"))
    return f"{where}: {message}"


def _invalid(exc: ValidationError, prefix: str = "spec",
             origin: Optional[Mapping[str, str]] = None) -> PolicyError:
    """A PolicyError naming each wrong field; ``origin`` maps a resolved field to where it was
    written (``spec.overrides[1]``)."""
    problems: List[str] = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        where = origin.get(str(loc[0]), prefix) if origin and loc else prefix
        problems.append(_problem(error, where))
    return PolicyError("; ".join(dict.fromkeys(problems)))


def _bytes(value: Union[int, str]) -> int:
    return quantity.parse_bytes(value)


def _toleration(spec: api.TolerationSpec) -> Toleration:
    return Toleration(spec.key, spec.operator, spec.value, spec.effect, spec.toleration_seconds)


def _estimation(spec: api.EstimationSpec) -> Estimation:
    placement = spec.placement
    return Estimation(
        steps=spec.steps, mode=spec.mode.value.lower(),  # the probe's word
        active_deadline_seconds=spec.active_deadline_seconds,
        max_hold_seconds=spec.max_hold_seconds,
        cpu=str(spec.resources.cpu), memory=str(spec.resources.memory),
        max_concurrent_per_namespace=spec.max_concurrent_per_namespace,
        max_concurrent=spec.max_concurrent,
        placement=Placement(tuple(sorted(placement.node_selector.items())),
                            tuple(_toleration(t) for t in placement.tolerations),
                            placement.priority_class_name or None),
        cache_ttl_seconds=spec.cache_ttl_seconds,
    )


def _prometheus(spec: Optional[api.PrometheusSpec]) -> Optional[Prometheus]:
    if spec is None:
        return None
    return Prometheus(url=spec.url, bearer_token_file=spec.bearer_token_file,
                      ca_file=spec.ca_file, tenant=spec.tenant,
                      timeout_seconds=spec.timeout_seconds, slack_seconds=spec.slack_seconds)


def _dra(spec: api.DraSpec) -> Dra:
    return Dra(driver=spec.driver, device_class=spec.device_class or DRA_CLASSES[spec.driver],
               pin_product=spec.pin_product, existing_claim=spec.existing_claim,
               fallback=spec.fallback, cores_percent=spec.cores)


def _learned_overhead(spec: api.LearnedOverheadSpec) -> LearnedOverhead:
    return LearnedOverhead(
        enabled=spec.enabled, min_jobs=spec.min_jobs, recent_jobs=spec.recent_jobs,
        jobs_per_namespace=spec.jobs_per_namespace, percentile=spec.percentile,
        max_correction_bytes=_bytes(spec.max_correction),
        pinned=tuple((p.gpu, _bytes(p.outside_allocator)) for p in spec.pinned))


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


def range_positions(status: Any) -> Tuple[RangePosition, ...]:
    """The learned range positions of a policy's ``status.rangePositions`` (written by the
    controller alone). A status without them (an older controller's) learned none; entries
    that are not well formed (``api.RangePositionStatus``) or name a GPU model the catalogue
    lacks are skipped, never an error."""
    raw = status.get("rangePositions") if isinstance(status, dict) else None
    if not isinstance(raw, list):
        return ()
    out: List[RangePosition] = []
    for item in raw[:STATUS_POSITIONS]:
        try:
            entry = api.RangePositionStatus.model_validate(item)
        except ValidationError:
            continue
        out.append(RangePosition(entry.gpu, entry.position_percent, entry.jobs,
                                 entry.namespaces, entry.above))
    return tuple(out)


def _settings(raw: Mapping[str, Any], origin: Mapping[str, str]) -> Settings:
    """A namespace's settings from its resolved fields (``spec``'s, an override merged on
    top): the models' every check, including the rules that read inherited fields; an error
    names where its field was written (``origin``)."""

    def at(key: str) -> str:
        return f"{origin.get(key, 'spec')}.{key}"

    try:
        spec = api.SettingsSpec.model_validate(raw)
    except ValidationError as exc:
        raise _invalid(exc, "spec", origin) from None
    failure = spec.on_estimation_failure
    minimum = _bytes(spec.minimum_request)
    retry = spec.oom_retry
    cap = _bytes(retry.max_request) if retry.max_request is not None else None
    if cap is not None and cap < minimum:
        raise PolicyError(f"{at('oomRetry')}.maxRequest: is below minimumRequest: no retry "
                          "could grow")
    dra = _dra(spec.dra)
    targets = tuple(Target(gpus.lookup(t.gpu), t.backend,
                           dra if t.backend is BackendName.DRA else None) for t in spec.targets)
    if dra.driver is DraDriver.NVIDIA_MIG:
        for index, target in enumerate(targets):
            if target.backend is BackendName.DRA and not target.gpu.mig_profiles:
                raise PolicyError(f"{at('targets')}[{index}].backend: {target.gpu.key} has no "
                                  "MIG profiles (spec.dra.driver NvidiaMIG)")
    sizing = spec.right_sizing
    return Settings(
        enabled=spec.enabled,
        targets=targets,
        safety_margin_percent=spec.safety_margin_percent,
        overcommit_percent=spec.overcommit_percent,
        minimum_request_bytes=minimum,
        granularity_bytes=_bytes(spec.granularity),
        enforcement=spec.enforcement,
        on_failure=failure.action,
        default_request_bytes=_bytes(failure.default_request)
        if failure.default_request is not None else None,
        estimation=_estimation(spec.estimation),
        untrusted_annotations=spec.untrusted_annotations,
        integration=spec.integration,
        oom_retry=OomRetry(enabled=retry.enabled, max_request_bytes=cap,
                           growth_percent=retry.growth_percent),
        right_sizing=RightSizing(runs=sizing.runs, lower_requests=sizing.lower_requests,
                                 prometheus=_prometheus(sizing.prometheus)),
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

    def with_figures(self, figures: Tuple[OverheadFigure, ...],
                     positions: Tuple[RangePosition, ...] = ()) -> Policy:
        """This policy with what the controller learned (its status): the figures of the
        memory outside the allocator and where jobs land in their range."""
        return self.with_overhead(dataclasses.replace(self.learned_overhead, figures=figures,
                                                      positions=positions))

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
        """Parse a ``GPUAdmissionPolicy`` spec: the models check every field where it was
        written, then each namespace's resolved settings (``spec``, and each override merged
        onto it) pass the checks that read inherited fields."""
        if not isinstance(spec, dict):
            raise PolicyError("spec: must be an object")
        try:
            parsed = api.PolicySpec.model_validate(spec, context={api.SKIP_INHERITED: True})
        except ValidationError as exc:
            raise _invalid(exc) from None
        base = {k: v for k, v in spec.items() if k not in api.TOP_LEVEL_FIELDS}
        defaults = _settings(base, {})
        overrides: List[Tuple[Tuple[str, ...], Settings]] = []
        for index, item in enumerate(spec.get("overrides") or ()):
            where = f"spec.overrides[{index}]"
            fields = {k: v for k, v in item.items() if k != "namespaces"}
            overrides.append((tuple(item["namespaces"]),
                              _settings(merge(base, fields), {k: where for k in fields})))
        sharing = tuple(frozenset(group.namespaces) for group in parsed.estimate_sharing)
        policy = cls(name, defaults, tuple(overrides), sharing=sharing)
        return policy.with_overhead(_learned_overhead(parsed.learned_overhead))

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
        unknown = sorted(set(obj) - {"apiVersion", "kind", "metadata", "spec", "status"})
        if unknown:
            raise PolicyError(f"policy: unknown field {unknown[0]!r} (allowed: apiVersion, "
                              "kind, metadata, spec, status)")
        metadata = obj.get("metadata") or {}
        name = metadata.get("name", DEFAULT_NAME) if isinstance(metadata, dict) else DEFAULT_NAME
        policy = cls.from_spec(obj.get("spec"), name=str(name))
        figures, positions = overhead_figures(obj.get("status")), range_positions(obj.get("status"))
        if figures or positions:
            policy = policy.with_figures(figures, positions)
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
