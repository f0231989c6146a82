"""Workloads and policies for the tests on the real control plane (plain dicts, as kubectl sends)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from localkube.kwok import GPU_TOLERATION
from xmem_admission.cluster import labels
from xmem_admission.contract import gpus

NEED, ENFORCER = "oom-test/need-bytes", "oom-test/enforcer"
GPU_POOL = {"pool": "gpu-processes"}  # the node selector of pods that must run on a "GPU"

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
TINY_GPT = ["--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "100",
            "--seq-len", "32", "--batch-size", "2"]
GPUS = ("A100-80GB", "H100-80GB")
# Controller Lease timing for tests that watch leadership change hands (seconds).
QUICK_LEASE = ("--lease-duration", "4", "--renew-deadline", "3", "--retry-period", "0.5")


def policy(name: str, backend: str = "HAMi", gpus: Sequence[str] = GPUS,
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
    """The training code, shipped as users often do: a ConfigMap mounted at /app (the example
    GPT script and the e2e tests' own scripts)."""
    data = {"train_gpt.py": (ROOT / "examples/train_gpt.py").read_text()}
    for script in (ROOT / "tests/e2e_real/scripts").glob("*.py"):
        data[script.name] = script.read_text()
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "code", "namespace": namespace}, "data": data}


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


def oom_job(name: str, namespace: str, gpu: str, need: int, enforcer: str,
            restart_policy: str = "Never", backoff_limit: int = 1,
            hold_seconds: Optional[int] = None) -> Dict[str, Any]:
    """A Job running tests/e2e_real/scripts/oom_job.py on the GPU process node, pinned to
    ``gpu``: its step needs ``need`` bytes on the GPU (pod label, so Jobs that need different
    amounts share one fingerprint and one estimation), ``enforcer`` says how the device limits
    it (hami, kai: HAMi-core's limit; mig: the slice); ``backoff_limit`` failures are retried;
    a step that fits stays up ``hold_seconds`` (part of the fingerprint: an env value)."""
    slices = ",".join(str(p.memory_bytes) for p in gpus.lookup("A100-40GB").mig_profiles)
    body = job(name, namespace, args=(), node_selector=GPU_POOL, backoffLimit=backoff_limit,
               pod_labels={NEED: str(need), ENFORCER: enforcer})
    template = body["spec"]["template"]
    template["spec"]["restartPolicy"] = restart_policy
    template["metadata"]["annotations"] = {labels.GPU_MODEL: gpu}
    container = template["spec"]["containers"][0]
    container["command"] = ["python", "/app/oom_job.py"]

    def field(path: str) -> Dict[str, Any]:
        return {"fieldRef": {"fieldPath": path}}

    container["env"] = [
        {"name": "NEED_BYTES", "valueFrom": field(f"metadata.labels['{NEED}']")},
        {"name": "ENFORCER", "valueFrom": field(f"metadata.labels['{ENFORCER}']")},
        {"name": "GRANTED_BYTES",
         "valueFrom": field(f"metadata.annotations['{labels.REQUEST_BYTES}']")},
        {"name": "MIG_SLICE_BYTES", "value": slices},
    ]
    if hold_seconds is not None:
        container["env"].append({"name": "HOLD_SECONDS", "value": str(hold_seconds)})
    return body


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
