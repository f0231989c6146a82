"""DRA: the request as a ``resource.k8s.io/v1`` claim the kube-scheduler allocates itself.

Pod ``spec.resourceClaims`` cannot change after creation, so the webhook writes them at Pod
CREATE (as every backend writes its form): an entry ``xmem-gpu`` naming a ResourceClaimTemplate,
and ``resources.claims: [{name: xmem-gpu}]`` in each GPU container, whose ``nvidia.com/gpu`` is
dropped (a node managed by a DRA driver runs no device plugin, so nothing advertises it).

The template itself is an object the webhook cannot create (admission is on the API server's
request path, no I/O beyond a cache lookup: DESIGN, "The admission flow"). The xmem controller
creates it when it releases the workload, owned by the workload (garbage-collected with it),
after it has looked at the cluster's ResourceSlices (``controller/dra_claims.py``): its name is a
function of the workload and the request (``template_name``), so the webhook and the controller
agree without talking. One template per workload and request size; the kube-controller-manager's
resourceclaim controller makes one ResourceClaim per pod from it.

The claim, per driver convention (``policy.model.DraDriver``), in ``resource.k8s.io/v1`` terms
(k8s.io/api/resource/v1 types.go: DeviceRequest.Exactly -> ExactDeviceRequest{deviceClassName,
selectors, allocationMode, count, capacity: CapacityRequirements{requests}}):

- ``Nvidia`` (sigs.k8s.io/dra-driver-nvidia-gpu, cmd/gpu-kubelet-plugin/consumable_shares.go,
  ConsumableShares mode ``memory``; the gate is alpha, off by default, from the driver's 0.5
  line, pkg/featuregates/featuregates.go: v0.4.1 publishes no shared form): each GPU is published with ``allowMultipleAllocations: true``
  and capacity ``memory`` in bytes, request policy default = the whole GPU, validRange min 1Mi,
  step 1Mi; attributes (deviceinfo.go GpuInfo.Attributes) ``type`` "gpu", ``productName``,
  ``architecture``, ``cudaComputeCapability``, ``driverVersion`` under the domain
  ``gpu.nvidia.com``. The claim asks ``capacity.requests.memory``: the request.
- ``HAMi`` (Project-HAMi/k8s-dra-driver, cmd/hami-kubelet-plugin/hami_core.go
  HAMiGpuInfo.GetDevice: ``hami-gpu-<minor>``, ``type`` "hami-gpu", shared, capacity ``memory``
  in bytes, step 1Mi, and ``cores`` 0-100, default 100): ``capacity.requests`` ``memory`` and
  ``cores``, enforced at run time by HAMi-core (CUDA_DEVICE_MEMORY_LIMIT, CUDA_DEVICE_SM_LIMIT
  from the claim's consumedCapacity).
- ``NvidiaMIG``: the same driver's MIG devices (deviceinfo.go MigDeviceInfo.GetDevice: ``type``
  "mig", capacity ``memory`` of the GPU instance profile, ``memorySlice<N>``) are not shared; the
  claim asks no capacity and a CEL selector picks a device by its ``memory``: at least the
  request and less than the next larger MIG size of the target GPU (``gpus.MigProfile``), which is
  the smallest slice that fits, whatever its profile name.

Where ``spec.dra.pinProduct`` is on, a selector ``device.attributes["<domain>"].productName ==
"<the GPU's CUDA/NVML name>"`` keeps the pod on the model the estimate was made for.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List, Mapping, Optional, Sequence

from xmem_admission.cluster.backends.base import (
    Applied,
    Backend,
    Existing,
    GpuContainer,
    drop_resource,
    mib,
)
from xmem_admission.cluster.integrations.base import TemplateRef
from xmem_admission.cluster.kube.jsonpatch import Draft
from xmem_admission.cluster.kube.quantity import MiB, gib
from xmem_admission.cluster.kube.resources import (
    NVIDIA_GPU,
    XMEM_CLAIM,
    XMEM_TEMPLATE,
    Slot,
    slot_field,
)
from xmem_admission.cluster.policy.model import (
    BackendName,
    Dra,
    DraDriver,
    ExistingClaim,
)
from xmem_admission.contract import gpus

API_VERSION = "resource.k8s.io/v1"
CLAIM = XMEM_CLAIM  # the pod's resourceClaims entry and the containers' claims name
REQUEST = "gpu"  # the device request's name inside the claim
# On a workload and its GPU pod templates: why no claim is written (the controller found no
# device of the class that could hold it, and released the workload as written): the webhook
# then leaves the pod's GPUs as they are.
UNSATISFIABLE = "xmem.io/dra-unsatisfiable"
# The attribute and capacity domain each driver publishes (its driver name).
DOMAINS = {DraDriver.NVIDIA: "gpu.nvidia.com", DraDriver.NVIDIA_MIG: "gpu.nvidia.com",
           DraDriver.HAMI: "hami-core-gpu.project-hami.io"}
# The capacities each driver convention's claim asks (``claim_template``): a shared device's
# other capacities are consumed as a claim that names none of them consumes them (KEP-5075: its
# request policy's default, else the whole; ``controller.dra_claims.Device.whole``).
ASKS = {DraDriver.NVIDIA: ("memory",), DraDriver.NVIDIA_MIG: (),
        DraDriver.HAMI: ("memory", "cores")}
_NAME = XMEM_TEMPLATE
MAX_NAME = 253  # a ResourceClaimTemplate's name is a DNS subdomain


def template_name(workload: str, request_bytes: int, count: int = 1) -> str:
    """The ResourceClaimTemplate for a workload's request: ``<workload>-xmem-<MiB>mi[-x<N>]``.

    A workload name too long to fit keeps its first part and a hash of the whole, so two long
    names never share a template."""
    tail = f"-xmem-{mib(request_bytes)}mi" + (f"-x{count}" if count > 1 else "")
    if len(workload) + len(tail) > MAX_NAME:
        digest = hashlib.sha256(workload.encode()).hexdigest()[:10]
        workload = workload[: MAX_NAME - len(tail) - 11].rstrip("-.") + "-" + digest
    return workload + tail


def request_of(name: str) -> Optional[int]:
    """The bytes per GPU a template name says (None: not a name ``template_name`` made)."""
    found = _NAME.search(name)
    return int(found.group(1)) * MiB if found else None


def count_of(name: str) -> int:
    """The GPUs per pod a template name says (1 without an ``-x<N>`` suffix)."""
    found = _NAME.search(name)
    return int(found.group(2)) if found and found.group(2) else 1


def workload_of(root: Mapping[str, Any]) -> Optional[str]:
    """The workload a pod template belongs to: a Pod's controlling owner, else the object."""
    meta = root.get("metadata") or {}
    if root.get("kind") != "Pod":
        return meta.get("name") or None
    for ref in meta.get("ownerReferences") or []:
        if isinstance(ref, dict) and ref.get("controller") and ref.get("name"):
            return str(ref["name"])
    return None


def _claims(container: Mapping[str, Any]) -> List[str]:
    raw = (container.get("resources") or {}).get("claims") or []
    return [c["name"] for c in raw if isinstance(c, dict) and isinstance(c.get("name"), str)]


def _pod_claims(template: Mapping[str, Any]) -> List[Dict[str, Any]]:
    raw = (template.get("spec") or {}).get("resourceClaims") or []
    return [c for c in raw if isinstance(c, dict)]


def round_up(request_bytes: int, policy: Optional[Mapping[str, int]],
             valid_values: Sequence[int] = ()) -> Optional[int]:
    """A capacity request rounded as the scheduler rounds it to a device's ``requestPolicy``
    (k8s.io/api/resource/v1 CapacityRequestPolicy: ``validValues`` the smallest listed value at
    least the request; ``validRange`` min + a whole number of steps, at least min; at most max).
    ``policy`` holds ``min``/``max``/``step`` in bytes. None when no valid value holds it."""
    if valid_values:
        fitting = [v for v in sorted(valid_values) if v >= request_bytes]
        return fitting[0] if fitting else None
    if not policy:
        return request_bytes
    low, step, high = policy.get("min", 0), policy.get("step", 0), policy.get("max")
    value = max(request_bytes, low)
    if step > 0:
        value = low + -(-(value - low) // step) * step
    if high is not None and value > high:
        return None
    return value


def mig_bounds(gpu: gpus.GPU, request_bytes: int) -> Optional[tuple[int, Optional[int]]]:
    """(least, below) memory of the MIG devices that are the smallest to hold the request: at
    least the request, and below the midpoint between that slice size and the next larger one
    of the GPU (None: no bound). The midpoint, not the next size itself, because the catalogue's
    slice figures (``nvidia-smi mig -lgip``, rounded to 0.01 GiB in gpus.py) and the driver's
    published ``memory`` (the profile's MemorySizeMB) may differ by a few MiB. None when no
    slice of the GPU holds it."""
    profile = gpus.smallest_mig_profile(gpu, request_bytes)
    if profile is None:
        return None
    larger = sorted({p.memory_bytes for p in gpu.mig_profiles if p.memory_bytes >
                     profile.memory_bytes})
    return request_bytes, ((profile.memory_bytes + larger[0]) // 2 if larger else None)


def selectors(dra: Dra, gpu: gpus.GPU, request_bytes: int) -> List[Dict[str, Any]]:
    """The claim's CEL selectors: the product pin, and for MIG the memory bounds."""
    domain = DOMAINS[dra.driver]
    out: List[str] = []
    if dra.pin_product:
        out.append(f'device.attributes["{domain}"].productName == "{gpu.cuda_name}"')
    if dra.driver is DraDriver.NVIDIA_MIG:
        bounds = mig_bounds(gpu, request_bytes)
        if bounds is not None:
            memory = f'device.capacity["{domain}"].memory'
            out.append(f'{memory}.compareTo(quantity("{bounds[0]}")) >= 0')
            if bounds[1] is not None:
                out.append(f'{memory}.compareTo(quantity("{bounds[1]}")) < 0')
    return [{"cel": {"expression": e}} for e in out]


def claim_template(namespace: str, owner: Mapping[str, Any], request_bytes: int, count: int,
                   gpu: gpus.GPU, dra: Dra, capacity_bytes: Optional[int] = None) -> Dict[str, Any]:
    """The ResourceClaimTemplate for a workload (owned by it, so it goes when the workload goes).

    ``capacity_bytes`` is the request rounded up to the class's request policy where the
    controller read one (``round_up``), else the request in whole MiB."""
    meta = owner["metadata"]
    exactly: Dict[str, Any] = {"deviceClassName": dra.device_class,
                               "allocationMode": "ExactCount", "count": count}
    found = selectors(dra, gpu, request_bytes)
    if found:
        exactly["selectors"] = found
    if dra.driver is not DraDriver.NVIDIA_MIG:
        requests = {"memory": str(capacity_bytes or mib(request_bytes) * MiB)}
        if dra.driver is DraDriver.HAMI:
            # HAMi's devices publish cores with request policy default 100 (hami_core.go
            # HAMiGpuInfo.GetDevice): a claim that asks none takes every core and so the whole
            # GPU. It asks the policy's percentage, else 0 (the range's minimum, HAMi's
            # default gpucores: no SM limit).
            requests["cores"] = str(dra.cores_percent or 0)
        exactly["capacity"] = {"requests": requests}
    return {
        "apiVersion": API_VERSION, "kind": "ResourceClaimTemplate",
        "metadata": {
            "name": template_name(meta["name"], request_bytes, count), "namespace": namespace,
            "labels": {"app.kubernetes.io/managed-by": "xmem-admission"},
            "ownerReferences": [{"apiVersion": owner.get("apiVersion"), "kind": owner.get("kind"),
                                 "name": meta["name"], "uid": meta.get("uid")}],
        },
        "spec": {"spec": {"devices": {"requests": [{"name": REQUEST, "exactly": exactly}]}}},
    }


def describe(dra: Dra, gpu: gpus.GPU, request_bytes: int) -> str:
    """What the claim asks, as the Event and the kubectl warning say it."""
    if dra.driver is DraDriver.NVIDIA_MIG:
        bounds = mig_bounds(gpu, request_bytes)
        top = f" < {gib(bounds[1])} GiB" if bounds and bounds[1] else ""
        return f"DRA claim {dra.device_class}: a MIG device with memory >= " \
               f"{gib(request_bytes)} GiB{top}"
    cores = f", cores {dra.cores_percent or 0}" if dra.driver is DraDriver.HAMI else ""
    return f"DRA claim {dra.device_class}: memory {mib(request_bytes)}Mi{cores}"


def claim_form(dra: Dra, gpu: gpus.GPU, request_bytes: int) -> str:
    """What the claim asks, in a few words for ``kubectl get gme`` (``status.claim``):
    ``gpu.nvidia.com memory=18Gi``, HAMi's with ``cores=<N>``, and for MIG the least memory
    the selector asks with the slice it picks: ``mig.nvidia.com memory>=15Gi (1g.20gb)``."""
    whole = mib(request_bytes)
    size = f"{whole // 1024}Gi" if whole % 1024 == 0 else f"{whole}Mi"
    if dra.driver is DraDriver.NVIDIA_MIG:
        profile = gpus.smallest_mig_profile(gpu, request_bytes)
        return f"{dra.device_class} memory>={size}" + (f" ({profile.name})" if profile else "")
    cores = f" cores={dra.cores_percent or 0}" if dra.driver is DraDriver.HAMI else ""
    return f"{dra.device_class} memory={size}{cores}"


class DraBackend(Backend):
    name = BackendName.DRA

    def __init__(self, dra: Optional[Dra] = None):
        self.dra = dra or Dra()

    def existing(
        self, template: Mapping[str, Any], slot: Slot, container: Mapping[str, Any], gpu: gpus.GPU
    ) -> Optional[Existing]:
        names = _claims(container)
        if not names:
            return None
        entries = {c.get("name"): c for c in _pod_claims(template)}
        field = f"{slot_field(slot)}.resources.claims"
        if CLAIM in names:
            ours = str(entries.get(CLAIM, {}).get("resourceClaimTemplateName") or "")
            return Existing(f"claim {CLAIM} ({ours})", request_of(ours), field)
        if self.dra.existing_claim is ExistingClaim.REPLACE:
            return None
        return Existing(f"claim {names[0]} (left as written: spec.dra.existingClaim Leave)",
                        None, field)

    def refusal(self, root: Mapping[str, Any], template: Mapping[str, Any], request_bytes: int,
                gpu: gpus.GPU) -> Optional[str]:
        why = ((template.get("metadata") or {}).get("annotations") or {}).get(UNSATISFIABLE)
        if why:
            return f"xmem: dra: no claim written ({why}); left as written"[:500]
        if workload_of(root) is None:
            return "xmem: dra: a Pod with no controlling owner has no workload to own its " \
                   "ResourceClaimTemplate; left as written"
        if self.dra.driver is DraDriver.NVIDIA_MIG and mig_bounds(gpu, request_bytes) is None:
            return f"xmem: no MIG slice of {gpu.key} holds {gib(request_bytes)} GiB; whole " \
                   "GPUs kept"
        return None

    def apply(
        self,
        draft: Draft,
        ref: TemplateRef,
        containers: Sequence[GpuContainer],
        request_bytes: int,
        gpu: gpus.GPU,
    ) -> Applied:
        pending = self.pending(ref, containers, gpu)
        left = [f"xmem: {found.what}" for found in (
            self.existing(ref.template, slot, c, gpu) for slot, c, _n in containers)
            if found is not None and found.bytes_per_gpu is None]
        if not pending:
            return Applied(warnings=left)
        refusal = self.refusal(draft.root, ref.template, request_bytes, gpu)
        if refusal is not None:
            return Applied(warnings=[refusal])
        workload = workload_of(draft.root)
        assert workload is not None  # refusal() said so otherwise
        count = max(c[2] for c in pending)
        name = template_name(workload, request_bytes, count)
        entries = draft.get(ref.at("spec", "resourceClaims"))
        entries = list(entries) if isinstance(entries, list) else []
        out = Applied(warnings=left)
        replaced = []
        for slot, container, _count in pending:
            names = _claims(container)
            for index, entry in enumerate(entries):  # existingClaim Replace: the user's claim
                if isinstance(entry, dict) and entry.get("name") in names:
                    draft.set(ref.at("spec", "resourceClaims", index),
                              {"name": entry["name"], "resourceClaimTemplateName": name})
                    replaced.append(entry["name"])
            if not names:
                current = draft.get(ref.at("spec", *slot, "resources", "claims"))
                draft.set(ref.at("spec", *slot, "resources", "claims"),
                          (list(current) if isinstance(current, list) else []) + [{"name": CLAIM}])
            drop_resource(draft, ref, slot, NVIDIA_GPU)
        if any(not _claims(c) for _s, c, _n in pending):
            entries = draft.get(ref.at("spec", "resourceClaims"))
            entries = list(entries) if isinstance(entries, list) else []
            if not any(isinstance(e, dict) and e.get("name") == CLAIM for e in entries):
                draft.set(ref.at("spec", "resourceClaims"),
                          entries + [{"name": CLAIM, "resourceClaimTemplateName": name}])
        for claim in dict.fromkeys(replaced):
            out.warnings.append(f"xmem: claim {claim} now sized by xmem (spec.dra.existingClaim "
                                f"Replace)")
        out.written.append(f"{describe(self.dra, gpu, request_bytes)} (template {name})")
        return out

    def rewrite(
        self,
        draft: Draft,
        ref: TemplateRef,
        containers: Sequence[GpuContainer],
        request_bytes: int,
        gpu: gpus.GPU,
    ) -> Applied:
        """Point the pod's ``xmem-gpu`` entry at the workload's template for ``request_bytes``
        (a retry after a CUDA OOM: the pod's claims are written at its CREATE, the one
        moment they may change; the controller made that template before recording the retry).
        The GPU count stays what the entry's template said."""
        refusal = self.refusal(draft.root, ref.template, request_bytes, gpu)
        if refusal is not None:
            return Applied(warnings=[refusal])
        workload = workload_of(draft.root)
        assert workload is not None  # refusal() said so otherwise
        for index, entry in enumerate(_pod_claims(ref.template)):
            if entry.get("name") != CLAIM:
                continue
            count = count_of(str(entry.get("resourceClaimTemplateName") or ""))
            name = template_name(workload, request_bytes, count)
            draft.set(ref.at("spec", "resourceClaims", index, "resourceClaimTemplateName"), name)
            return Applied(written=[f"{describe(self.dra, gpu, request_bytes)} (template {name})"])
        return Applied()
