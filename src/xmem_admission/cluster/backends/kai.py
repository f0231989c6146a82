"""NVIDIA KAI scheduler: pod annotation ``gpu-memory`` in MiB for one GPU share (KAI-Scheduler
GPU sharing docs); the share goes to the first container unless ``gpu-fraction-container-name``
names another, and the container must not also request ``nvidia.com/gpu``. KAI does not enforce
the limit: the annotation is for placement only. A share covers one device; containers asking
for several GPUs are left with whole GPUs.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from xmem_admission.cluster.backends.base import (
    Applied,
    Backend,
    Existing,
    GpuContainer,
    drop_resource,
    mib,
    quantity_at,
)
from xmem_admission.cluster.integrations.base import TemplateRef
from xmem_admission.cluster.kube import quantity
from xmem_admission.cluster.kube.jsonpatch import Draft
from xmem_admission.cluster.kube.quantity import MiB
from xmem_admission.cluster.kube.resources import (
    CONTAINERS,
    KAI_CONTAINER,
    KAI_FRACTION,
    KAI_MEMORY,
    NVIDIA_GPU,
    Slot,
    kai_target_index,
)
from xmem_admission.cluster.policy.model import BackendName
from xmem_admission.contract import gpus


def _annotations(template: Mapping[str, Any]) -> Mapping[str, Any]:
    """The pod template's annotations, where KAI keeps the share (empty when there are none)."""
    return (template.get("metadata") or {}).get("annotations") or {}


class KaiBackend(Backend):
    name = BackendName.KAI

    def existing(
        self, template: Mapping[str, Any], slot: Slot, container: Mapping[str, Any], gpu: gpus.GPU
    ) -> Optional[Existing]:
        annotations = _annotations(template)
        if slot != (CONTAINERS, kai_target_index(template)):
            return None
        if KAI_MEMORY in annotations:
            value = annotations[KAI_MEMORY]
            field = f"metadata.annotations[{KAI_MEMORY}]"
            with quantity_at(field):
                size = quantity.parse_count(value) * MiB
            return Existing(f"{KAI_MEMORY}: {value}", size, field)
        if KAI_FRACTION in annotations:
            value = annotations[KAI_FRACTION]
            field = f"metadata.annotations[{KAI_FRACTION}]"
            with quantity_at(field):
                share = int(quantity.parse(value) * gpu.capacity_bytes)
            return Existing(f"{KAI_FRACTION}: {value}", share, field)
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
        annotations = _annotations(ref.template)
        if KAI_MEMORY in annotations or KAI_FRACTION in annotations:
            return out  # the pod already has its share, set by hand or by an earlier pass
        if len(containers) != 1 or containers[0][2] != 1 or containers[0][0][0] != CONTAINERS:
            out.warnings.append(
                "xmem: a KAI gpu-memory share covers one GPU in one app container; left unchanged"
            )
            return out
        slot, container, _count = containers[0]
        drop_resource(draft, ref, slot, NVIDIA_GPU)
        draft.set(ref.at("metadata", "annotations", KAI_MEMORY), str(mib(request_bytes)))
        if slot[1] != 0:
            draft.set(ref.at("metadata", "annotations", KAI_CONTAINER), str(container.get("name")))
        out.written.append(f"{KAI_MEMORY} {mib(request_bytes)} MiB")
        return out

    def rewrite(
        self,
        draft: Draft,
        ref: TemplateRef,
        containers: Sequence[GpuContainer],
        request_bytes: int,
        gpu: gpus.GPU,
    ) -> Applied:
        if KAI_MEMORY not in _annotations(ref.template):
            return Applied()  # a gpu-fraction share is never xmem's
        draft.set(ref.at("metadata", "annotations", KAI_MEMORY), str(mib(request_bytes)))
        return Applied(written=[f"{KAI_MEMORY} {mib(request_bytes)} MiB"])
