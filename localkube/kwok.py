"""Fake GPU nodes: kwok keeps Node objects alive (status, Lease) and plays their pods.

``Kwok(plane).start()`` runs ``kwok`` against the API server with the Stages copied from kwok's
own module by the build (node-fast: a node turns Ready; heartbeat-with-lease: its status is
refreshed while kwok renews its Lease; pod-ready: a pod bound to a kwok node
turns Running; pod-delete: a deleted pod goes away). ``pod-complete`` (Job pods succeed at once)
is left out unless asked for: a GPU job on a fake GPU keeps running and keeps its GPU, which is
what scheduling and bin-packing tests need. kwok manages only nodes annotated
``kwok.x-k8s.io/node: fake``.

``gpu_node(...)`` is one such node: one or more GPUs of a catalogue model, advertised the ways the
backends ask for them (whole ``nvidia.com/gpu`` or HAMi's split count, ``nvidia.com/gpumem`` in
MiB, Volcano's and gpushare's resources, MIG slices), the GPU-feature-discovery labels, and the
``nvidia.com/gpu=present:NoSchedule`` taint GPU nodes carry, so CPU pods (estimation pods among
them) never land there and GPU workloads tolerate it.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import yaml

from localkube import tools
from localkube.controlplane import LOOPBACK, ControlPlane, free_port, stop_process
from xmem_admission.contract import gpus

GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
TEST_STAGES = ("node-initialize", "node-heartbeat-with-lease", "pod-ready", "pod-delete")


def _stage_files(names: Iterable[str]) -> List[Path]:
    wanted = set(names)
    found = [p for p in sorted(tools.kwok_stages().glob("*.yaml")) if p.stem in wanted]
    missing = wanted - {p.stem for p in found}
    if missing:
        raise tools.ToolsMissing(f"kwok Stages {sorted(missing)} missing from "
                                 f"{tools.kwok_stages()}: run `make tools`")
    return found


class Kwok:
    """See the module docstring."""

    def __init__(self, plane: ControlPlane, stages: Iterable[str] = TEST_STAGES) -> None:
        self.plane = plane
        self.stages = list(stages)
        self.process: Optional[subprocess.Popen] = None

    def start(self) -> Kwok:
        documents: List[Dict[str, Any]] = []
        for path in _stage_files(self.stages):
            documents.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
        config = self.plane.root / "kwok.yaml"
        config.write_text(yaml.safe_dump_all(documents))
        self.process = self.plane._spawn("kwok", [
            tools.binary("kwok"), "--kubeconfig", str(self.plane.admin_kubeconfig),
            "--config", str(config),
            "--manage-nodes-with-annotation-selector", "kwok.x-k8s.io/node=fake",
            "--node-lease-duration-seconds", "40", "--node-ip", LOOPBACK,
            "--server-address", f"{LOOPBACK}:{free_port()}"])
        return self

    def stop(self) -> None:
        process = self.plane.processes.pop("kwok", None)
        if process is not None:
            stop_process(process)


def gpu_node(name: str, gpu: str = "A100-80GB", count: int = 1, split: int = 10,
             labels: Optional[Dict[str, str]] = None, mig: Optional[Dict[str, int]] = None,
             whole_gpus_only: bool = False) -> Dict[str, Any]:
    """A kwok Node with ``count`` GPUs of catalogue model ``gpu``.

    Shared (default): HAMi's ``nvidia.com/gpu`` = count x ``split`` and ``nvidia.com/gpumem`` in
    MiB, Volcano's ``volcano.sh/vgpu-number``/``vgpu-memory`` and gpushare's
    ``aliyun.com/gpu-mem`` (GiB). ``whole_gpus_only``: ``nvidia.com/gpu`` = count, nothing more.
    ``mig``: ``{"1g.10gb": 7}`` adds ``nvidia.com/mig-1g.10gb: 7`` per GPU (mixed strategy).
    """
    model = gpus.lookup(gpu)
    mib = model.capacity_bytes // (1 << 20)
    capacity: Dict[str, str] = {"cpu": "64", "memory": "512Gi", "pods": "110",
                                "ephemeral-storage": "1Ti"}
    if whole_gpus_only:
        capacity["nvidia.com/gpu"] = str(count)
    else:
        capacity.update({
            "nvidia.com/gpu": str(count * split), "nvidia.com/gpumem": str(count * mib),
            "volcano.sh/vgpu-number": str(count * split),
            "volcano.sh/vgpu-memory": str(count * mib),
            "aliyun.com/gpu-mem": str(count * (mib // 1024)),
            "aliyun.com/gpu-count": str(count)})
    for profile, per_gpu in (mig or {}).items():
        capacity[f"nvidia.com/mig-{profile}"] = str(per_gpu * count)
    node_labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                   "kubernetes.io/arch": "amd64", "type": "kwok",
                   "nvidia.com/gpu.product": model.key, "nvidia.com/gpu.count": str(count),
                   "nvidia.com/gpu.memory": str(mib)}
    node_labels.update(labels or {})
    return {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "labels": node_labels,
                     "annotations": {"kwok.x-k8s.io/node": "fake"}},
        "spec": {"taints": [GPU_TAINT]},
        "status": {"capacity": capacity, "allocatable": dict(capacity)},
    }
