"""How a pod asks for GPUs, in every form the supported backends use.

Counting GPUs must give the same answer before and after the webhook rewrites a request into a
backend's form (``nvidia.com/gpu: 1`` becomes ``nvidia.com/mig-3g.40gb: 1`` under MIG mixed, or
disappears in favour of a ``gpu-memory`` annotation under KAI): the fingerprint and the
"does this workload use a GPU" test both rely on it, and so does idempotence.

Resource names and units, from each system's own documentation:
NVIDIA device plugin ``nvidia.com/gpu`` (whole GPUs, or vGPUs under HAMi: HAMi's user guide)
and ``nvidia.com/mig-<profile>`` (MIG mixed strategy: NVIDIA k8s-device-plugin README and the
GPU Operator's "MIG support"); Volcano vGPU ``volcano.sh/vgpu-number`` (Volcano "GPU Sharing
User guide"); Aliyun gpushare ``aliyun.com/gpu-mem`` (GiB, gpushare-scheduler-extender user
guide) with the ``aliyun.com/gpu-count`` pod label for multi-GPU sharing (Alibaba Cloud ACK
docs, "multi-card sharing through shared GPU scheduling"); NVIDIA KAI scheduler ``gpu-memory`` /
``gpu-fraction`` pod annotations (one device; KAI-Scheduler GPU sharing docs). A DRA claim xmem
wrote (``backends/dra.py``: the pod's ``resourceClaims`` entry ``xmem-gpu`` naming a template
``<workload>-xmem-<MiB>mi[-x<N>]``, the container's ``resources.claims``) counts the GPUs its
template's name says.
"""

from __future__ import annotations

import re
from typing import Any, Dict, Iterator, Mapping, Optional, Tuple

from xmem_admission.cluster.kube import quantity
from xmem_admission.contract.errors import InvalidObjectError, QuantityError

NVIDIA_GPU = "nvidia.com/gpu"
MIG_PREFIX = "nvidia.com/mig-"
HAMI_GPUMEM = "nvidia.com/gpumem"  # HAMi: MiB per vGPU (HAMi docs, userguide "Allocate device memory")
HAMI_GPUMEM_PERCENT = "nvidia.com/gpumem-percentage"
VOLCANO_NUMBER = "volcano.sh/vgpu-number"
VOLCANO_MEMORY = "volcano.sh/vgpu-memory"  # Volcano vGPU: MiB per vGPU (volcano user guide)
GPUSHARE_MEM = "aliyun.com/gpu-mem"  # gpushare: GiB by default (gpushare-scheduler-extender docs)
GPUSHARE_COUNT = "aliyun.com/gpu-count"  # pod label, ACK multi-GPU sharing
KAI_MEMORY = "gpu-memory"  # KAI: pod annotation, MiB (KAI-Scheduler GPU sharing docs)
KAI_FRACTION = "gpu-fraction"
KAI_CONTAINER = "gpu-fraction-container-name"  # KAI: which container gets the share (default: first)
KAI_DEVICES = "gpu-fraction-num-devices"  # KAI: devices the fraction spans (default: one)
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"  # GPU Feature Discovery node label, MiB
XMEM_CLAIM = "xmem-gpu"  # the pod claim the DRA backend writes
# The ResourceClaimTemplate names the DRA backend writes: the request in MiB, the GPUs per pod.
XMEM_TEMPLATE = re.compile(r"-xmem-(\d+)mi(?:-x(\d+))?$")

# Where a container sits in a pod spec: ("containers", 0), ("initContainers", 1), ...
Slot = Tuple[str, int]
CONTAINERS = "containers"
CONTAINER_LISTS = (CONTAINERS, "initContainers", "ephemeralContainers")


def slot_field(slot: Slot) -> str:
    """The field path of a container slot, for messages: ``spec.initContainers[0]``."""
    return f"spec.{slot[0]}[{slot[1]}]"


def container_resources(
    container: Mapping[str, Any],
) -> Tuple[Mapping[str, Any], Mapping[str, Any]]:
    """The container's (limits, requests), each an empty map when absent."""
    resources = container.get("resources") or {}
    if not isinstance(resources, dict):
        raise InvalidObjectError("resources: expected an object")
    limits = resources.get("limits") or {}
    requests = resources.get("requests") or {}
    if not isinstance(limits, dict) or not isinstance(requests, dict):
        raise InvalidObjectError("resources.limits and resources.requests must be objects")
    return limits, requests


def resource_value(container: Mapping[str, Any], name: str) -> Optional[Any]:
    """The raw value of a resource, limits first (extended resources are read from limits)."""
    limits, requests = container_resources(container)
    if name in limits:
        return limits[name]
    return requests.get(name)


def _count(container: Mapping[str, Any], name: str) -> int:
    value = resource_value(container, name)
    if value is None:
        return 0
    try:
        return quantity.parse_count(value)
    except QuantityError as exc:
        raise InvalidObjectError(f"container {container.get('name')!r}: {name}: {exc}") from None


def mig_resources(container: Mapping[str, Any]) -> Dict[str, int]:
    """The ``nvidia.com/mig-*`` resources of a container with their counts."""
    limits, requests = container_resources(container)
    names = [n for n in list(limits) + list(requests) if n.startswith(MIG_PREFIX)]
    return {name: _count(container, name) for name in dict.fromkeys(names)}


def gpu_count(
    container: Mapping[str, Any],
    pod_meta: Optional[Mapping[str, Any]] = None,
    kai_target: bool = False,
) -> int:
    """How many GPUs (whole, virtual or MIG slices) a container asks for, in any backend's form.

    ``pod_meta`` is the pod (template) metadata: KAI's annotations and gpushare's count label
    live there. KAI and gpushare share one device unless they say otherwise. KAI's annotations
    are per pod and count for one container only, the ``kai_target`` (KAI gives the share to the
    first container unless ``gpu-fraction-container-name`` names another).
    """
    for name in (NVIDIA_GPU, VOLCANO_NUMBER):
        count = _count(container, name)
        if count:
            return count
    migs = sum(mig_resources(container).values())
    if migs:
        return migs
    annotations = (pod_meta or {}).get("annotations") or {}
    labels = (pod_meta or {}).get("labels") or {}
    if resource_value(container, GPUSHARE_MEM) is not None:
        raw = labels.get(GPUSHARE_COUNT, "1") if isinstance(labels, dict) else "1"
        try:
            return max(1, quantity.parse_count(raw))
        except QuantityError as exc:
            raise InvalidObjectError(f"label {GPUSHARE_COUNT}: {exc}") from None
    if isinstance(annotations, dict) and (KAI_MEMORY in annotations or KAI_FRACTION in annotations):
        if not kai_target:
            return 0
        try:
            return max(1, quantity.parse_count(annotations.get(KAI_DEVICES, "1")))
        except QuantityError as exc:
            raise InvalidObjectError(f"annotation {KAI_DEVICES}: {exc}") from None
    return 0


def kai_target_index(template: Mapping[str, Any]) -> int:
    """Index of the container KAI gives a pod's GPU share to (-1 when the named one is absent)."""
    annotations = (template.get("metadata") or {}).get("annotations") or {}
    name = annotations.get(KAI_CONTAINER) if isinstance(annotations, dict) else None
    if not name:
        return 0
    containers = (template.get("spec") or {}).get(CONTAINERS) or []
    for index, container in enumerate(containers if isinstance(containers, list) else ()):
        if isinstance(container, dict) and container.get("name") == name:
            return index
    return -1


def claimed_gpus(spec: Mapping[str, Any], container: Mapping[str, Any]) -> int:
    """The GPUs a container holds through the claim the DRA backend wrote (0: none): its
    ``nvidia.com/gpu`` is gone, its count lives in the template's name."""
    claims = (container.get("resources") or {}).get("claims") or []
    if not any(isinstance(c, dict) and c.get("name") == XMEM_CLAIM for c in claims):
        return 0
    for entry in spec.get("resourceClaims") or []:
        if isinstance(entry, dict) and entry.get("name") == XMEM_CLAIM:
            found = XMEM_TEMPLATE.search(str(entry.get("resourceClaimTemplateName") or ""))
            if found:
                return int(found.group(2) or 1)
    return 0


def gpu_containers(template: Mapping[str, Any]) -> Iterator[Tuple[Slot, Mapping[str, Any], int]]:
    """(slot, container, GPU count) for each container of a pod template that uses GPUs.

    Every kind of container counts: app containers first (in order), then init containers
    (sidecars are init containers with ``restartPolicy: Always``), then ephemeral ones; a GPU
    asked for by any of them is a GPU the pod holds while it runs.
    """
    spec = template.get("spec")
    if not isinstance(spec, dict):
        raise InvalidObjectError("spec: expected an object")
    if not isinstance(spec.get(CONTAINERS), list):
        raise InvalidObjectError("spec.containers: expected a list")
    meta = template.get("metadata") or {}
    if not isinstance(meta, dict):
        raise InvalidObjectError("metadata: expected an object")
    kai_index = kai_target_index(template)
    for kind in CONTAINER_LISTS:
        containers = spec.get(kind)
        if containers is None:
            continue
        if not isinstance(containers, list):
            raise InvalidObjectError(f"spec.{kind}: expected a list")
        for index, container in enumerate(containers):
            slot = (kind, index)
            if not isinstance(container, dict):
                raise InvalidObjectError(f"{slot_field(slot)}: expected an object")
            count = gpu_count(container, meta, kai_target=slot == (CONTAINERS, kai_index)) or \
                claimed_gpus(spec, container)
            if count:
                yield slot, container, count
