"""Workloads and policies for the tests on the real control plane (plain dicts, as kubectl sends)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from tests.realkube.kwok import GPU_TOLERATION
from xmem_admission.cluster import labels

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
TINY_GPT = ["--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "100",
            "--seq-len", "32", "--batch-size", "2"]
GPUS = ("A100-80GB", "H100-80GB")
# Controller Lease timing for tests that watch leadership change hands (seconds).
QUICK_LEASE = ("--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "0.5")


def policy(name: str, backend: str = "hami", gpus: Sequence[str] = GPUS,
           **spec: Any) -> Dict[str, Any]:
    """A GPUAdmissionPolicy: one backend for every target GPU, quick estimation settings."""
    estimation = {"resources": {"cpu": "1", "memory": "2Gi"}, "activeDeadlineSeconds": 180,
                  "maxHoldSeconds": 600, "steps": 2}
    estimation.update(spec.pop("estimation", {}))
    body: Dict[str, Any] = {"targets": [{"gpu": g, "backend": backend} for g in gpus],
                            "estimation": estimation, "minimumRequest": "1Gi",
                            "granularity": "256Mi"}
    body.update(spec)
    return {"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
            "metadata": {"name": name}, "spec": body}


def code_map(namespace: str) -> Dict[str, Any]:
    """The training code, shipped as users often do: a ConfigMap mounted at /app."""
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "code", "namespace": namespace},
            "data": {"train_gpt.py": (ROOT / "examples/train_gpt.py").read_text()}}


def job(name: str, namespace: str, opt_in: bool = True, gpu_resources: Optional[Dict[str, str]] = None,
        args: Sequence[str] = tuple(TINY_GPT), node_selector: Optional[Dict[str, str]] = None,
        pod_labels: Optional[Dict[str, str]] = None, **spec: Any) -> Dict[str, Any]:
    """A Job asking for one GPU (tolerating GPU nodes' taint), running the example GPT script."""
    limits = {"nvidia.com/gpu": "1", "cpu": "4", "memory": "16Gi"}
    limits.update(gpu_resources or {})
    pod_spec: Dict[str, Any] = {
        "restartPolicy": "Never", "tolerations": [GPU_TOLERATION],
        "containers": [{"name": "train", "image": IMAGE, "command": ["python", "/app/train_gpt.py"],
                        "args": list(args), "resources": {"limits": limits},
                        "volumeMounts": [{"name": "code", "mountPath": "/app"}]}],
        "volumes": [{"name": "code", "configMap": {"name": "code"}}]}
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    body: Dict[str, Any] = {"backoffLimit": 0, "template": {
        "metadata": {"labels": {"app": name, **(pod_labels or {})}}, "spec": pod_spec}}
    body.update(spec)
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {labels.OPT_IN: "true"} if opt_in else {}},
            "spec": body}


def pytorchjob(name: str, namespace: str) -> Dict[str, Any]:
    """A Kubeflow PyTorchJob with one master replica (single-process training)."""
    template = job(name, namespace)["spec"]["template"]
    template["spec"]["restartPolicy"] = "OnFailure"
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name, "namespace": namespace, "labels": {labels.OPT_IN: "true"}},
            "spec": {"runPolicy": {"cleanPodPolicy": "None"}, "pytorchReplicaSpecs": {
                "Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}}}


def template_annotations(obj: Dict[str, Any]) -> Dict[str, str]:
    return obj["spec"]["template"]["metadata"].get("annotations") or {}


def held(obj: Dict[str, Any]) -> bool:
    return labels.HELD_REASON in (obj["metadata"].get("annotations") or {})


def names(objects: List[Dict[str, Any]]) -> List[str]:
    return sorted(o["metadata"]["name"] for o in objects)
