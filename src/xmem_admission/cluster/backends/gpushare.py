"""Aliyun gpushare: container resource ``aliyun.com/gpu-mem`` in GiB (gpushare-scheduler-extender
user guide), instead of ``nvidia.com/gpu``. Across several GPUs (ACK multi-GPU sharing) the pod
label ``aliyun.com/gpu-count: M`` spreads ``gpu-mem`` N GiB as N/M per card, N/M a whole number
(Alibaba Cloud ACK docs, "multi-card sharing through shared GPU scheduling"). No isolation:
a job above its request takes memory from its neighbours, so the margin matters here.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from xmem_admission.cluster.backends.base import (
    ContainerBackend,
    Existing,
    GpuContainer,
    drop_resource,
    resource_request,
    set_limit,
)
from xmem_admission.cluster.integrations.base import TemplateRef
from xmem_admission.cluster.kube.jsonpatch import Draft
from xmem_admission.cluster.kube.quantity import GiB, ceil_div
from xmem_admission.cluster.kube.resources import (
    GPUSHARE_COUNT,
    GPUSHARE_MEM,
    NVIDIA_GPU,
    Slot,
    gpu_count,
)
from xmem_admission.cluster.policy.model import BackendName
from xmem_admission.contract import gpus


class GpushareBackend(ContainerBackend):
    name = BackendName.GPUSHARE

    def existing(
        self, template: Mapping[str, Any], slot: Slot, container: Mapping[str, Any], gpu: gpus.GPU
    ) -> Optional[Existing]:
        cards = max(1, gpu_count(container, template.get("metadata") or {}))
        return resource_request(container, slot, GPUSHARE_MEM, GiB, cards)

    def refusal(
        self, pending: Sequence[GpuContainer], request_bytes: int, gpu: gpus.GPU
    ) -> Optional[str]:
        # The gpu-count label is per pod, so every container must spread over the same count.
        if len({count for _, _, count in pending}) > 1:
            return "xmem: gpushare needs one GPU count per pod; GPU requests left unchanged"
        return None

    def written_bytes(self, request_bytes: int, gpu: gpus.GPU) -> Optional[int]:
        return ceil_div(request_bytes, GiB) * GiB

    def write(
        self, draft: Draft, ref: TemplateRef, target: GpuContainer, request_bytes: int, gpu: gpus.GPU
    ) -> str:
        slot, _container, count = target
        per_card = ceil_div(request_bytes, GiB)
        drop_resource(draft, ref, slot, NVIDIA_GPU)
        set_limit(draft, ref, slot, GPUSHARE_MEM, str(per_card * count))
        if count > 1:
            draft.set(ref.at("metadata", "labels", GPUSHARE_COUNT), str(count))
        return f"{GPUSHARE_MEM} {per_card * count} GiB"
