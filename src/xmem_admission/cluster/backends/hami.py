"""HAMi: container limit ``nvidia.com/gpumem`` in MiB per vGPU; ``nvidia.com/gpu`` stays the
number of vGPUs. HAMi reads limits, then requests; without gpumem a vGPU gets the whole card
(HAMi docs, "Allocate device memory"). ``nvidia.com/gpumem-percentage`` is read as hand-set.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from xmem_admission.cluster.backends.base import (
    ContainerBackend,
    Existing,
    GpuContainer,
    mib,
    resource_request,
    set_limit,
)
from xmem_admission.cluster.integrations.base import TemplateRef
from xmem_admission.cluster.kube.jsonpatch import Draft
from xmem_admission.cluster.kube.quantity import MiB
from xmem_admission.cluster.kube.resources import HAMI_GPUMEM, HAMI_GPUMEM_PERCENT, Slot
from xmem_admission.cluster.policy.model import BackendName
from xmem_admission.contract import gpus


class HamiBackend(ContainerBackend):
    name = BackendName.HAMI

    def existing(
        self, template: Mapping[str, Any], slot: Slot, container: Mapping[str, Any], gpu: gpus.GPU
    ) -> Optional[Existing]:
        found = resource_request(container, slot, HAMI_GPUMEM, MiB)
        if found is not None:
            return found
        percent = resource_request(container, slot, HAMI_GPUMEM_PERCENT, gpu.capacity_bytes)
        if percent is None or percent.bytes_per_gpu is None:
            return None
        return Existing(percent.what, percent.bytes_per_gpu // 100, percent.field)

    def write(
        self, draft: Draft, ref: TemplateRef, target: GpuContainer, request_bytes: int, gpu: gpus.GPU
    ) -> str:
        set_limit(draft, ref, target[0], HAMI_GPUMEM, str(mib(request_bytes)))
        return f"{HAMI_GPUMEM} {mib(request_bytes)} MiB"
