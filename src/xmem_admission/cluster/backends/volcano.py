"""Volcano vGPU: limits ``volcano.sh/vgpu-number`` (replacing ``nvidia.com/gpu``) and
``volcano.sh/vgpu-memory`` in MiB per vGPU (Volcano "GPU Sharing User guide").
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from xmem_admission.cluster.backends.base import (
    ContainerBackend,
    Existing,
    GpuContainer,
    drop_resource,
    mib,
    resource_request,
    set_limit,
)
from xmem_admission.cluster.integrations.base import TemplateRef
from xmem_admission.cluster.kube.jsonpatch import Draft
from xmem_admission.cluster.kube.quantity import MiB
from xmem_admission.cluster.kube.resources import (
    NVIDIA_GPU,
    VOLCANO_MEMORY,
    VOLCANO_NUMBER,
    Slot,
    resource_value,
)
from xmem_admission.cluster.policy.model import BackendName
from xmem_admission.contract import gpus


class VolcanoBackend(ContainerBackend):
    name = BackendName.VOLCANO

    def existing(
        self, template: Mapping[str, Any], slot: Slot, container: Mapping[str, Any], gpu: gpus.GPU
    ) -> Optional[Existing]:
        return resource_request(container, slot, VOLCANO_MEMORY, MiB)

    def write(
        self, draft: Draft, ref: TemplateRef, target: GpuContainer, request_bytes: int, gpu: gpus.GPU
    ) -> str:
        slot, container, count = target
        if resource_value(container, VOLCANO_NUMBER) is None:
            set_limit(draft, ref, slot, VOLCANO_NUMBER, str(count))
        drop_resource(draft, ref, slot, NVIDIA_GPU)
        set_limit(draft, ref, slot, VOLCANO_MEMORY, str(mib(request_bytes)))
        return f"{VOLCANO_MEMORY} {mib(request_bytes)} MiB"
