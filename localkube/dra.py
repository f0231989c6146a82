"""DRA devices for kwok GPU nodes: ResourceSlices and DeviceClasses as the real drivers publish them.

No kubelet plugin runs on a kwok node, so the test publishes what the driver's plugin would:

- ``nvidia_slice``: sigs.k8s.io/dra-driver-nvidia-gpu in its ConsumableShares mode ``memory``
  (cmd/gpu-kubelet-plugin/consumable_shares.go on the driver's main branch; the gate is alpha
  from its 0.5 line, not in v0.4.1): each GPU ``gpu-<minor>`` with
  ``allowMultipleAllocations: true``, capacity ``memory`` (bytes, rounded down to 1Mi) whose
  request policy is default = the whole GPU, validRange min 1Mi, max the whole GPU, step 1Mi;
  attributes as deviceinfo.go GpuInfo.Attributes (``type`` "gpu", ``productName``,
  ``architecture``, ``cudaComputeCapability``, ``driverVersion``); MIG devices as
  MigDeviceInfo.GetDevice (``type`` "mig", ``profile``, capacity ``memory`` of the profile and
  one ``memorySlice<N>`` per memory slice it spans), not shared.
- ``hami_slice``: Project-HAMi/k8s-dra-driver (cmd/hami-kubelet-plugin/hami_core.go):
  ``hami-gpu-<minor>``, ``type`` "hami-gpu", shared, capacity ``memory`` in bytes (step 1Mi) and
  ``cores`` 0-100 (default 100), under the driver ``hami-core-gpu.project-hami.io``.
- ``example_slice``: sigs.k8s.io/dra-example-driver v0.4.0 (internal/profiles/gpu/gpu.go) with
  its chart's ``gpuAllowMultipleAllocations: true``, as ``localkube/dra_plugin.py`` runs it on a
  real node: ``gpu-<i>``, shared, capacities ``memory`` 80Gi (min and step 1Gi) and ``compute``
  100 (min and step 1), each with request policy default = the whole, under ``gpu.example.com``
  (its DeviceClass is ``dra_plugin.device_class``).
- ``device_classes``: the classes the drivers' charts install, selecting by driver and type.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from xmem_admission.contract import gpus

NVIDIA = "gpu.nvidia.com"
HAMI = "hami-core-gpu.project-hami.io"
EXAMPLE = "gpu.example.com"  # dra-example-driver's DEVICE_PROFILE "gpu" (dra_plugin.DRIVER)
MiB = 1 << 20
# Attributes NVML reports on the GPUs of the ground-truth runs (bench/data/H200: driver
# 580.159.04; architecture names as the driver's nvlib.go maps compute capabilities).
ARCHITECTURE = {(8, 0): "Ampere", (9, 0): "Hopper"}
DRIVER_VERSION = "580.159.4"  # 580.159.04 as a semantic version (the driver parses it so)
# What NVML reports as the GPU's memory (nvmlDeviceGetMemoryInfo total, the figure nvidia-smi
# shows and the driver publishes): H200 143,771 MiB (/work/shared/data/gpu-truth-h200/README.md,
# the H200 of bench/data/H200). Models not listed publish the catalogue's capacity.
NVML_MEMORY = {"H200": 143_771 * MiB}


def _memory(capacity_bytes: int) -> int:
    """The capacity the driver publishes: rounded down to its 1Mi step."""
    return capacity_bytes // MiB * MiB


def nvidia_gpu(gpu: gpus.GPU, minor: int = 0, capacity_bytes: Optional[int] = None,
               shared: bool = True) -> Dict[str, Any]:
    """One GPU device: shared (ConsumableShares mode ``memory``), or as the driver publishes it
    without ConsumableShares (``shared=False``: whole, its ``memory`` capacity with no request
    policy; the API server refuses a request policy on a device that is not shared)."""
    memory = _memory(capacity_bytes if capacity_bytes is not None else
                     NVML_MEMORY.get(gpu.key, gpu.capacity_bytes))
    cc = gpu.compute_capability
    if not shared:
        return {"name": f"gpu-{minor}",
                "attributes": nvidia_gpu(gpu, minor, memory)["attributes"],
                "capacity": {"memory": {"value": f"{memory // MiB}Mi"}}}
    return {
        "name": f"gpu-{minor}",
        "allowMultipleAllocations": True,
        "attributes": {
            "type": {"string": "gpu"},
            "productName": {"string": gpu.cuda_name},
            "architecture": {"string": ARCHITECTURE.get(cc, "unknown")},
            "cudaComputeCapability": {"version": f"{cc[0]}.{cc[1]}.0"},
            "driverVersion": {"version": DRIVER_VERSION},
        },
        "capacity": {"memory": {
            "value": f"{memory // MiB}Mi",
            "requestPolicy": {"default": f"{memory // MiB}Mi", "validRange": {
                "min": "1Mi", "max": f"{memory // MiB}Mi", "step": "1Mi"}},
        }},
    }


def nvidia_mig(gpu: gpus.GPU, profile: str, minor: int = 0, start: int = 0,
               slices: int = 1) -> Dict[str, Any]:
    """One MIG device of a GPU's profile (memory from the catalogue's ``mig -lgip`` figure)."""
    found = next(p for p in gpu.mig_profiles if p.name == profile)
    capacity: Dict[str, Any] = {"memory": {"value": f"{found.memory_bytes // MiB}Mi"}}
    for index in range(start, start + slices):
        capacity[f"memorySlice{index}"] = {"value": "1"}
    return {
        "name": f"gpu-{minor}-mig-{profile.replace('.', '')}-{start}",  # a DNS label
        "attributes": {"type": {"string": "mig"}, "profile": {"string": profile},
                       "productName": {"string": gpu.cuda_name}},
        "capacity": capacity,
    }


def nvidia_slice(node: str, devices: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    return _slice(NVIDIA, node, devices)


def hami_gpu(gpu: gpus.GPU, minor: int = 0) -> Dict[str, Any]:
    """One GPU as HAMi's DRA driver shares it (hami_core.go HAMiGpuInfo.GetDevice): memory in
    bytes (step 1Mi) and cores 0-100, whose default 100 is what a claim asking none consumes."""
    memory = NVML_MEMORY.get(gpu.key, gpu.capacity_bytes)
    return {
        "name": f"hami-gpu-{minor}",
        "allowMultipleAllocations": True,
        "attributes": {"type": {"string": "hami-gpu"}, "minor": {"int": minor},
                       "productName": {"string": gpu.cuda_name}},
        "capacity": {
            "cores": {"value": "100", "requestPolicy": {
                "default": "100", "validRange": {"min": "0", "max": "100", "step": "1"}}},
            "memory": {"value": str(memory), "requestPolicy": {
                "default": str(memory),
                "validRange": {"min": "1Mi", "max": str(memory), "step": "1Mi"}}},
        },
    }


def hami_slice(node: str, devices: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    return _slice(HAMI, node, devices)


def example_gpu(index: int = 0) -> Dict[str, Any]:
    """One simulated GPU of the example driver, shared (the chart's gpuAllowMultipleAllocations):
    a claim that asks no ``compute`` consumes its default, all 100."""
    def whole(value: str, step: str) -> Dict[str, Any]:
        return {"value": value, "requestPolicy": {
            "default": value, "validRange": {"min": step, "max": value, "step": step}}}
    return {
        "name": f"gpu-{index}",
        "allowMultipleAllocations": True,
        "attributes": {"index": {"int": index}, "uuid": {"string": f"gpu-{index}-uuid"},
                       "model": {"string": "LATEST-GPU-MODEL"},
                       "driverVersion": {"version": "1.0.0"}},
        "capacity": {"memory": whole("80Gi", "1Gi"), "compute": whole("100", "1")},
    }


def example_slice(node: str, devices: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    return _slice(EXAMPLE, node, devices)


def _slice(driver: str, node: str, devices: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-{driver}"},
        "spec": {"driver": driver, "nodeName": node,
                 "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
                 "devices": list(devices)},
    }


def device_classes() -> List[Dict[str, Any]]:
    """gpu.nvidia.com and mig.nvidia.com (by driver and ``type``), and HAMi's class."""
    def klass(name: str, expression: str) -> Dict[str, Any]:
        return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
                "metadata": {"name": name},
                "spec": {"selectors": [{"cel": {"expression": expression}}]}}
    return [
        klass("gpu.nvidia.com", f"device.driver == '{NVIDIA}' && "
                                f"device.attributes['{NVIDIA}'].type == 'gpu'"),
        klass("mig.nvidia.com", f"device.driver == '{NVIDIA}' && "
                                f"device.attributes['{NVIDIA}'].type == 'mig'"),
        klass(HAMI, f"device.driver == '{HAMI}' && "
                    f"device.attributes['{HAMI}'].type == 'hami-gpu'"),
    ]
