"""Look before writing a claim: the cluster's DRA devices, and the templates the pods will use.

``DeviceView`` mirrors the cluster's ResourceSlices and DeviceClasses (``resource.k8s.io/v1``,
cluster-scoped; two informers, list and watch). For the policy's DeviceClass it says which
devices a claim could get: for the shared forms (``Nvidia``, ``HAMi``) devices published with
``allowMultipleAllocations: true`` and a ``memory`` capacity (KEP-5075 consumable capacity), for
``NvidiaMIG`` MIG devices whose ``memory`` is within the bounds the claim selects; of the
estimated GPU model where the policy pins it (attribute ``productName`` under the driver's
domain). The request is rounded up to the device's ``requestPolicy`` as the scheduler will
(``backends.dra.round_up``), so the template asks what the allocation will record.

A shared device may publish capacities the claim does not ask (``backends.dra.ASKS``: ``memory``,
and HAMi's ``cores``). A claim that names none of a capacity consumes its request policy's
``default``, or the whole capacity where there is no policy or no default (k8s.io/api
resource/v1 types.go CapacityRequestPolicy.Default and DeviceCapacity.RequestPolicy; the
scheduler's allocator, k8s.io/dynamic-resource-allocation structured/internal/incubating
consumable_capacity.go fillEmptyRequest). Where that is the whole capacity (``Device.whole``),
one claim takes the device: sigs.k8s.io/dra-example-driver v0.4.0's ``compute`` (default 100 of
100) is one. The claim can still be allocated, so the workload is released with it, but when
every device that could hold it is taken whole that way a Warning Event says the claims will not
share (``DeviceView.takes_whole``, ``exclusive``).

Which devices a DeviceClass holds is read from its CEL selectors' plain clauses
(``device.driver == "..."`` and ``device.attributes["..."].<name> == "..."``); a clause of any
other shape is not evaluated here, so the view errs towards "a device exists", never towards
holding a workload that the scheduler could place.

``prepare`` runs at release, before the workload is unsuspended: the ResourceClaimTemplate of
every GPU pod template is created (owned by the workload; one that exists is kept), or, when the
class has no device that could ever hold the request, the reason is returned and the policy's
``spec.dra.fallback`` applies (``workloads``).

``reconcile`` serves a workload the controller did not release itself: one the webhook sized at
its CREATE from a recorded estimate (its template references ours already), or one Kueue
admitted with xmem's podSetUpdates (its template carries the request): its pods reference the
template, and the resourceclaim controller makes their claims once it exists, so it is created
here at once; if no device could hold it, a Warning Event says so (the pods exist already and
cannot change), as one does, when it makes a template, that the claims take whole devices.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from xmem_admission.cluster import labels
from xmem_admission.cluster.backends import dra
from xmem_admission.cluster.integrations import gpu_templates
from xmem_admission.cluster.kube import quantity
from xmem_admission.cluster.kube.client import Kind, Kube, Obj
from xmem_admission.cluster.kube.informer import Informer
from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.policy import sizing
from xmem_admission.cluster.policy.model import BackendName, Dra, DraDriver, Settings, Target
from xmem_admission.cluster.policy.sizing import Plan
from xmem_admission.contract import gpus
from xmem_admission.contract.errors import KubeApiError, QuantityError

RESOURCE_SLICE = Kind("resource.k8s.io", "v1", "resourceslices", "ResourceSlice")
DEVICE_CLASS = Kind("resource.k8s.io", "v1", "deviceclasses", "DeviceClass")
CLAIM_TEMPLATE = Kind("resource.k8s.io", "v1", "resourceclaimtemplates",
                      "ResourceClaimTemplate")
UNSATISFIABLE = dra.UNSATISFIABLE  # why no claim was written (the workload's condition)
WHOLE_DEVICE = "ClaimTakesWholeDevice"  # the Warning Event's reason (``takes_whole``)

_DRIVER = re.compile(r"""device\.driver\s*==\s*["']([^"']+)["']""")
_ATTRIBUTE = re.compile(
    r"""device\.attributes\[\s*["']([^"']+)["']\s*\]\.(\w+)\s*==\s*["']([^"']*)["']""")


@dataclass(frozen=True)
class Whole:
    """A capacity that a claim naming none of it consumes whole (see the module)."""

    name: str  # as published (a name without a domain is the driver's)
    value: str  # as published, e.g. "100"
    by_default: bool  # its request policy's default is the whole; else there is no default


@dataclass(frozen=True)
class Device:
    """One device of a ResourceSlice, as far as a memory claim cares."""

    driver: str
    name: str
    attributes: Mapping[str, Any]  # unqualified name -> plain value
    memory: Optional[int]  # capacity "memory" in bytes
    shared: bool  # allowMultipleAllocations
    policy: Optional[Mapping[str, int]]  # validRange min/max/step, in bytes
    valid_values: Tuple[int, ...]
    whole: Tuple[Whole, ...] = ()  # shared only: what a claim asking none of it takes whole


def _bytes(value: Any) -> Optional[int]:
    try:
        return quantity.parse_bytes(value)
    except QuantityError:
        return None


def _whole(name: str, capacity: Any) -> Optional[Whole]:
    """The capacity as a ``Whole`` if a claim that asks none of it consumes all of it."""
    if not isinstance(capacity, dict):
        return None
    published, default = capacity.get("value"), (capacity.get("requestPolicy") or {}).get("default")
    if published is None:
        return None
    try:
        value = quantity.parse(published)
        consumed = value if default is None else quantity.parse(default)
    except QuantityError:
        return None  # not a quantity: the API server would not have stored it
    if value <= 0 or consumed < value:
        return None
    return Whole(name, str(published), default is not None)


def _attribute(raw: Any) -> Any:
    """A DeviceAttribute's value (v1: exactly one of int, bool, string, version)."""
    if isinstance(raw, dict):
        for key in ("string", "int", "bool", "version"):
            if key in raw:
                return raw[key]
    return None


def devices_of(slice_: Obj) -> List[Device]:
    """The devices a ResourceSlice publishes (``spec.devices``)."""
    spec = slice_.get("spec") or {}
    driver = str(spec.get("driver") or "")
    out = []
    for raw in spec.get("devices") or []:
        if not isinstance(raw, dict):
            continue
        attributes = {str(k).rsplit("/", 1)[-1]: _attribute(v)
                      for k, v in (raw.get("attributes") or {}).items()}
        capacity = (raw.get("capacity") or {}).get("memory") or {}
        request_policy = capacity.get("requestPolicy") or {}
        valid_range = request_policy.get("validRange") or {}
        bounds = {k: _bytes(valid_range[k]) for k in ("min", "max", "step") if k in valid_range}
        shared = raw.get("allowMultipleAllocations") is True
        whole = [_whole(str(k), v) for k, v in (raw.get("capacity") or {}).items()] \
            if shared else []
        out.append(Device(
            driver=driver, name=str(raw.get("name") or ""), attributes=attributes,
            memory=_bytes(capacity["value"]) if "value" in capacity else None,
            shared=shared,
            policy={k: v for k, v in bounds.items() if v is not None} or None,
            valid_values=tuple(v for v in (_bytes(x) for x in
                                           request_policy.get("validValues") or [])
                               if v is not None),
            whole=tuple(sorted((w for w in whole if w is not None), key=lambda w: w.name)),
        ))
    return out


def in_class(device: Device, device_class: Obj) -> bool:
    """Whether the class's plain selector clauses let the device through (see the module)."""
    for selector in (device_class.get("spec") or {}).get("selectors") or []:
        expression = str(((selector or {}).get("cel") or {}).get("expression") or "")
        for driver in _DRIVER.findall(expression):
            if driver != device.driver:
                return False
        for domain, name, value in _ATTRIBUTE.findall(expression):
            if domain == device.driver and str(device.attributes.get(name)) != value:
                return False
    return True


class DeviceView:
    """The cluster's ResourceSlices and DeviceClasses, mirrored by two informers."""

    def __init__(self, slices: Informer, classes: Informer):
        self.slices = slices
        self.classes = classes

    @classmethod
    def of(cls, kube: Kube) -> DeviceView:
        return cls(Informer(kube, RESOURCE_SLICE), Informer(kube, DEVICE_CLASS))

    def informers(self) -> List[Informer]:
        return [self.slices, self.classes]

    def ready(self) -> bool:
        """Whether both have listed once (before that, no class would seem to exist)."""
        return self.slices.synced.is_set() and self.classes.synced.is_set()

    def members(self, target_dra: Dra, gpu: gpus.GPU) -> Optional[List[Device]]:
        """The devices of the policy's class (of the pinned model); None: no such class."""
        device_class = self.classes.get("", target_dra.device_class)
        if device_class is None:
            return None
        domain = dra.DOMAINS[target_dra.driver]
        listed = [d for s in self.slices.items() for d in devices_of(s)]
        members = [d for d in listed if in_class(d, device_class)]
        if target_dra.pin_product:
            members = [d for d in members if d.driver != domain or
                       d.attributes.get("productName") == gpu.cuda_name]
        return members

    @staticmethod
    def holding(members: Sequence[Device], request_bytes: int) -> List[Tuple[Device, int]]:
        """(device, what the claim asks of it) for each shared device whose ``memory`` holds the
        request rounded up to its request policy."""
        out = []
        for device in members:
            if not device.shared or device.memory is None:
                continue
            rounded = dra.round_up(request_bytes, device.policy, device.valid_values)
            if rounded is not None and rounded <= device.memory:
                out.append((device, rounded))
        return out

    def capacity(self, target_dra: Dra, gpu: gpus.GPU, request_bytes: int) -> Tuple[Optional[int], str]:
        """(what the claim asks, '') when a device of the class could hold the request, else
        (None, why not). The asked figure is the request rounded up to the device's request
        policy (None for the MIG form, which asks no capacity)."""
        name = target_dra.device_class
        members = self.members(target_dra, gpu)
        if members is None:
            return None, f"DeviceClass {name} does not exist"
        of = f" of model {gpu.cuda_name!r}" if target_dra.pin_product else ""
        if target_dra.driver is DraDriver.NVIDIA_MIG:
            bounds = dra.mig_bounds(gpu, request_bytes)
            for device in members:
                if device.memory is not None and bounds is not None and \
                        device.memory >= bounds[0] and (bounds[1] is None or
                                                        device.memory < bounds[1]):
                    return None, ""
            return None, (f"DeviceClass {name} has no MIG device{of} with memory between "
                          f"{gib(request_bytes)} GiB and the next larger slice "
                          f"({len(members)} devices in its ResourceSlices)")
        asks = [asked for _device, asked in self.holding(members, request_bytes)]
        if asks:
            return max(asks), ""
        return None, (f"DeviceClass {name} has no shareable device (allowMultipleAllocations "
                      f"with a memory capacity){of} that holds {gib(request_bytes)} GiB "
                      f"({len(members)} devices in its ResourceSlices)")

    def takes_whole(self, target_dra: Dra, gpu: gpus.GPU, request_bytes: int) -> str:
        """'' unless every shared device that could hold the claim has a capacity the claim
        does not ask (``backends.dra.ASKS``) and so takes whole (``Device.whole``); then what
        the Warning Event says. A MIG device is not shared: its claim takes it by design."""
        members = self.members(target_dra, gpu)
        if members is None or target_dra.driver is DraDriver.NVIDIA_MIG:
            return ""
        asked = dra.ASKS[target_dra.driver]
        taken: Dict[Tuple[str, str], bool] = {}
        for device, _asked in self.holding(members, request_bytes):
            unasked = [w for w in device.whole if w.name not in asked and
                       w.name not in (f"{device.driver}/{a}" for a in asked)]
            if not unasked:
                return ""  # this device shares
            taken.update(((w.name, w.value), w.by_default) for w in unasked)
        if not taken:
            return ""
        names = " and ".join(f"`{n}` ({v})" for n, v in sorted(taken))
        why = "its request policy's default" if all(taken.values()) else \
            "no default in its request policy" if not any(taken.values()) else \
            "its request policy's default, or no default"
        return (f"claims of DeviceClass {target_dra.device_class} take the whole {names} of a "
                f"device: {why}, which a claim that asks none of it consumes; one claim per "
                f"device, no sharing")


def target_of(annotations: Mapping[str, Any], settings: Settings) -> Target:
    """A pod template's target: the GPU model it pins (``xmem.io/gpu-model``), else the
    policy's first."""
    pinned = sizing.pinned_gpu(annotations)
    return (settings.target(pinned) if pinned else None) or settings.targets[0]


def exclusive(view: Optional[DeviceView], wanted: Sequence[Tuple[Plan, Dra, int]]) -> List[str]:
    """What a Warning Event says for each claim that takes a whole device
    (``DeviceView.takes_whole``); none without a view."""
    if view is None:
        return []
    notes = (view.takes_whole(settings, plan.target.gpu, plan.request_bytes)
             for plan, settings, _count in wanted)
    return list(dict.fromkeys(n for n in notes if n))


def dra_plans(integration: Any, obj: Obj, plans: Sequence[Optional[Plan]]
              ) -> List[Tuple[Plan, Dra, int]]:
    """(plan, its claim settings, GPUs per pod) for every pod template sized by ``DRA``."""
    out = []
    for (_ref, containers), plan in zip(gpu_templates(integration, obj), plans):
        if plan is None or plan.target.backend is not BackendName.DRA or plan.target.dra is None:
            continue
        out.append((plan, plan.target.dra, max(c[2] for c in containers)))
    return out


def prepare(kube: Kube, view: Optional[DeviceView], integration: Any, obj: Obj,
            plans: Sequence[Optional[Plan]]) -> str:
    """Create the ResourceClaimTemplates a released workload's pods will reference; returns
    why none could be allocated ('' when every claim can be, or none is needed)."""
    return make_templates(kube, view, obj, dra_plans(integration, obj, plans))


def make_templates(kube: Kube, view: Optional[DeviceView], obj: Obj,
                   wanted: Sequence[Tuple[Plan, Dra, int]]) -> str:
    """Create a template per (plan, claim settings, GPUs per pod), after the device check."""
    return _make(kube, view, obj, wanted)[0]


def _make(kube: Kube, view: Optional[DeviceView], obj: Obj,
          wanted: Sequence[Tuple[Plan, Dra, int]]) -> Tuple[str, List[Tuple[Plan, Dra, int]]]:
    """``make_templates``, and the wanted entries whose template this call created (not found
    already there)."""
    made: Dict[str, Obj] = {}
    of: Dict[str, Tuple[Plan, Dra, int]] = {}
    created: List[Tuple[Plan, Dra, int]] = []
    namespace = obj["metadata"]["namespace"]
    for plan, settings, count in wanted:
        asked: Optional[int] = None
        if view is not None:
            asked, why = view.capacity(settings, plan.target.gpu, plan.request_bytes)
            if why:
                return why, []
        body = dra.claim_template(namespace, obj, plan.request_bytes, count, plan.target.gpu,
                                  settings, asked)
        made[body["metadata"]["name"]] = body
        of[body["metadata"]["name"]] = (plan, settings, count)
    for name, body in made.items():
        try:
            kube.create(CLAIM_TEMPLATE, namespace, body)
            created.append(of[name])
        except KubeApiError as exc:
            if not exc.already_exists:  # made at an earlier release of the same workload
                raise
    return "", created


def carried(integration: Any, obj: Obj, settings: Settings) -> List[Tuple[Plan, Dra, int]]:
    """(plan, claim settings, GPUs per pod) of every GPU pod template that carries a request in
    ``xmem.io/request-bytes`` for a ``DRA`` target, unless marked unsatisfiable: its pods get the
    claim at Pod CREATE (a Job Kueue admitted with xmem's podSetUpdates is one). The webhook
    removes sizing annotations anyone but the controller wrote."""
    plans: List[Optional[Plan]] = []
    for ref, _containers in gpu_templates(integration, obj):
        annotations = (ref.template.get("metadata") or {}).get("annotations") or {}
        try:
            request = quantity.parse_digits(annotations.get(labels.REQUEST_BYTES))
        except QuantityError:
            request = 0
        target = target_of(annotations, settings)
        plans.append(Plan(target, 0, request) if request > 0 and
                     UNSATISFIABLE not in annotations else None)
    return dra_plans(integration, obj, plans)


def retry_plans(integration: Any, obj: Obj, settings: Settings, gpu: str,
                request_bytes: int) -> List[Tuple[Plan, Dra, int]]:
    """(plan, claim settings, GPUs per pod) of the claims a workload's pods ask after a retry
    grew its request to ``request_bytes`` on GPU model ``gpu`` (``controller.oom_retries``):
    one per GPU pod template whose target (its pinned model, else the policy's first) is that
    model under ``DRA``. The webhook points a retry pod at the template of the grown request
    (``admission.mutation.grow_after_oom``); the controller makes it first."""
    plans: List[Optional[Plan]] = []
    for ref, _containers in gpu_templates(integration, obj):
        annotations = (ref.template.get("metadata") or {}).get("annotations") or {}
        target = target_of(annotations, settings)
        plans.append(Plan(target, 0, request_bytes) if target.gpu.key == gpu else None)
    return dra_plans(integration, obj, plans)


def referenced(integration: Any, obj: Obj, settings: Settings) -> List[Tuple[Plan, Dra, int]]:
    """(plan, claim settings, GPUs per pod) of every pod template that already references an
    xmem claim template (the webhook wrote it at the workload's CREATE): its name says the
    request and the count (``dra.template_name``), its annotations the GPU model."""
    out = []
    for ref in integration.pod_templates(obj):
        template = ref.template
        annotations = (template.get("metadata") or {}).get("annotations") or {}
        for entry in (template.get("spec") or {}).get("resourceClaims") or []:
            name = str((entry or {}).get("resourceClaimTemplateName") or "")
            request = dra.request_of(name)
            if (entry or {}).get("name") != dra.CLAIM or request is None or \
                    name != dra.template_name(obj["metadata"]["name"], request,
                                              dra.count_of(name)):
                continue
            target = target_of(annotations, settings)
            if target.backend is BackendName.DRA and target.dra is not None:
                out.append((Plan(target, 0, request), target.dra, dra.count_of(name)))
    return out


def wants(ctx: Any, kind: str, obj: Obj) -> bool:
    """Whether a stored, unheld workload's pods may reference a template not made yet (cheap)."""
    settings = ctx.settings(obj["metadata"].get("namespace", ""))
    if settings is None or not any(t.backend is BackendName.DRA for t in settings.targets):
        return False
    if obj["metadata"].get("uid") in ctx.claimed:
        return False
    integration = ctx.workloads[kind].integration
    if integration.resolves:  # a TrainJob's templates are its runtime's: not read from a cache
        return False
    return integration.finished(obj) is None and bool(
        referenced(integration, obj, settings) or carried(integration, obj, settings))


def reconcile(ctx: Any, kind: str, namespace: str, name: str) -> Optional[float]:
    """Create the templates an unheld workload's pods reference (see the module docstring)."""
    workload = ctx.workloads[kind]
    obj = workload.informer.get(namespace, name)
    settings = ctx.settings(namespace)
    if obj is None or settings is None or "deletionTimestamp" in obj["metadata"]:
        return None
    if ctx.devices is not None and not ctx.devices.ready():
        return 1.0
    wanted = referenced(workload.integration, obj, settings) + \
        carried(workload.integration, obj, settings)
    why, created = _make(ctx.kube, ctx.devices, obj, wanted)
    if len(ctx.claimed) > 10_000:
        ctx.claimed.clear()
    ctx.claimed.add(obj["metadata"].get("uid"))
    if why:
        ctx.emit(obj, "Warning", "NoShareableDevice", f"xmem: its pods' claims cannot be "
                 f"allocated: {why}; sized at creation from a recorded estimate, they wait "
                 f"until such a device appears")
    else:  # said when its template is made: the workload's own release said it already
        for note in exclusive(ctx.devices, created):
            ctx.emit(obj, "Warning", WHOLE_DEVICE, f"xmem: {note}; its pods' claims can be "
                     f"allocated, each on a device of its own")
    return None
