"""MIG through the NVIDIA device plugin, both strategies (NVIDIA GPU operator docs, "MIG support").

- mixed: each slice is its own resource ``nvidia.com/mig-<profile>``; ``nvidia.com/gpu: N``
  becomes N of the smallest profile of the target GPU whose real slice memory holds the request
  (``gpus.smallest_mig_profile``: slice sizes from ``nvidia-smi mig -lgip``).
- single: slices are still ``nvidia.com/gpu``; nodes carry GPU Feature Discovery's
  ``nvidia.com/gpu.memory`` label (MiB of one slice), so the pod gets a required node-affinity
  term ``nvidia.com/gpu.memory Gt <request MiB - 1>``: any node whose slices hold the request.
When no slice of the GPU holds the request, the pod keeps whole GPUs and a warning says so.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

from xmem_admission.cluster.backends.base import (
    Applied,
    Backend,
    ContainerBackend,
    Existing,
    GpuContainer,
    drop_resource,
    mib,
    quantity_at,
    set_limit,
)
from xmem_admission.cluster.integrations.base import TemplateRef
from xmem_admission.cluster.kube import quantity
from xmem_admission.cluster.kube.jsonpatch import Draft
from xmem_admission.cluster.kube.quantity import MiB, gib
from xmem_admission.cluster.kube.resources import (
    GPU_MEMORY_LABEL,
    MIG_PREFIX,
    NVIDIA_GPU,
    Slot,
    mig_resources,
    slot_field,
)
from xmem_admission.cluster.policy.model import BackendName
from xmem_admission.contract import gpus

_TERMS = ("spec", "affinity", "nodeAffinity", "requiredDuringSchedulingIgnoredDuringExecution",
          "nodeSelectorTerms")


def _no_slice(gpu: gpus.GPU, request_bytes: int) -> Optional[str]:
    """The warning when no slice of ``gpu`` holds the request, else None.

    Both strategies refuse the same pods: mixed needs the profile to name, single must not send
    a pod to nodes whose slices can never hold it.
    """
    if gpus.smallest_mig_profile(gpu, request_bytes) is not None:
        return None
    return f"xmem: no MIG slice of {gpu.key} holds {gib(request_bytes)} GiB; whole GPUs kept"


class MigMixedBackend(ContainerBackend):
    name = BackendName.MIG_MIXED

    def existing(
        self, template: Mapping[str, Any], slot: Slot, container: Mapping[str, Any], gpu: gpus.GPU
    ) -> Optional[Existing]:
        migs = mig_resources(container)
        if not migs:
            return None
        name = next(iter(migs))
        profile = name[len(MIG_PREFIX):]
        known = {p.name: p.memory_bytes for p in gpu.mig_profiles}
        field = f"{slot_field(slot)}.resources.limits[{name}]"
        return Existing(f"{name}: {migs[name]}", known.get(profile), field)

    def refusal(
        self, pending: Sequence[GpuContainer], request_bytes: int, gpu: gpus.GPU
    ) -> Optional[str]:
        return _no_slice(gpu, request_bytes)

    def written_bytes(self, request_bytes: int, gpu: gpus.GPU) -> Optional[int]:
        profile = gpus.smallest_mig_profile(gpu, request_bytes)
        return profile.memory_bytes if profile is not None else None

    def withdraw(self, draft: Draft, ref: TemplateRef, target: GpuContainer) -> None:
        for name in mig_resources(target[1]):
            drop_resource(draft, ref, target[0], name)

    def write(
        self, draft: Draft, ref: TemplateRef, target: GpuContainer, request_bytes: int, gpu: gpus.GPU
    ) -> str:
        slot, _container, count = target
        profile = gpus.smallest_mig_profile(gpu, request_bytes)
        if profile is None:  # refusal() has stopped apply() with a warning before any write
            raise AssertionError(f"no MIG slice of {gpu.key} for {request_bytes} bytes")
        drop_resource(draft, ref, slot, NVIDIA_GPU)
        set_limit(draft, ref, slot, profile.resource_name, str(count))
        return f"{profile.resource_name}: {count}"


def _gpu_memory_terms(template: Mapping[str, Any]) -> List[Dict[str, Any]]:
    """The node-affinity expressions on ``nvidia.com/gpu.memory`` in a template, if any."""
    node: Any = template
    for part in _TERMS:
        node = node.get(part) if isinstance(node, dict) else None
    found = []
    for term in node if isinstance(node, list) else []:
        for expr in (term or {}).get("matchExpressions") or []:
            if isinstance(expr, dict) and expr.get("key") == GPU_MEMORY_LABEL:
                found.append(expr)
    return found


class MigSingleBackend(Backend):
    name = BackendName.MIG_SINGLE

    def existing(
        self, template: Mapping[str, Any], slot: Slot, container: Mapping[str, Any], gpu: gpus.GPU
    ) -> Optional[Existing]:
        selector = ((template.get("spec") or {}).get("nodeSelector") or {}).get(GPU_MEMORY_LABEL)
        exprs = _gpu_memory_terms(template)
        with quantity_at(GPU_MEMORY_LABEL):
            if selector is not None:
                field = f"spec.nodeSelector[{GPU_MEMORY_LABEL}]"
                size = quantity.parse_count(selector) * MiB
                return Existing(f"{GPU_MEMORY_LABEL}={selector}", size, field)
            if exprs:
                field = "spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                expr = exprs[0]
                values = [quantity.parse_count(v) for v in expr.get("values") or []]
                low: Optional[int] = None
                if expr.get("operator") == "Gt" and values:
                    low = (values[0] + 1) * MiB
                elif expr.get("operator") == "In" and values:
                    low = min(values) * MiB
                return Existing(f"{GPU_MEMORY_LABEL} {expr.get('operator')} {values}", low, field)
        return None

    def apply(
        self,
        draft: Draft,
        ref: TemplateRef,
        containers: Sequence[GpuContainer],
        request_bytes: int,
        gpu: gpus.GPU,
    ) -> Applied:
        out = Applied()
        if not self.pending(ref, containers, gpu):
            return out
        refusal = _no_slice(gpu, request_bytes)
        if refusal is not None:
            out.warnings.append(refusal)
            return out
        expr = {"key": GPU_MEMORY_LABEL, "operator": "Gt", "values": [str(mib(request_bytes) - 1)]}
        terms = draft.get(ref.at(*_TERMS))
        if not isinstance(terms, list) or not terms:
            draft.set(ref.at(*_TERMS), [{"matchExpressions": [expr]}])
        else:
            # Terms are ORed: the slice-size requirement must hold in every one of them.
            for position in range(len(terms)):
                current = draft.get(ref.at(*_TERMS, position, "matchExpressions")) or []
                draft.set(ref.at(*_TERMS, position, "matchExpressions"), list(current) + [expr])
        out.written.append(f"node {GPU_MEMORY_LABEL} >= {mib(request_bytes)} MiB")
        return out

    def rewrite(
        self,
        draft: Draft,
        ref: TemplateRef,
        containers: Sequence[GpuContainer],
        request_bytes: int,
        gpu: gpus.GPU,
    ) -> Applied:
        refusal = _no_slice(gpu, request_bytes)
        if refusal is not None:
            return Applied(warnings=[refusal])
        terms = draft.get(ref.at(*_TERMS))
        for position in range(len(terms) if isinstance(terms, list) else 0):
            current = draft.get(ref.at(*_TERMS, position, "matchExpressions")) or []
            for index, expr in enumerate(current):
                if isinstance(expr, dict) and expr.get("key") == GPU_MEMORY_LABEL and \
                        expr.get("operator") == "Gt":
                    draft.set(ref.at(*_TERMS, position, "matchExpressions", index, "values"),
                              [str(mib(request_bytes) - 1)])
        return Applied(written=[f"node {GPU_MEMORY_LABEL} >= {mib(request_bytes)} MiB"])
