"""Fluent builders for workloads and AdmissionReviews (Kueue's testing shape).

    make_job("train", "ml").gpus(1).opt_in().obj()
    make_pod("p", "ml").owned_by("Job", "train").gpus(2).obj()
    make_pytorchjob("ddp", "ml").workers(2).gpus(1).obj()
    review(obj, operation="CREATE", dry_run=True)

Every builder writes plain dicts shaped exactly as the API server sends them in a review.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Dict, List, Optional, Tuple

from xmem_admission.cluster import labels
from xmem_admission.cluster.admission.trust import JOB_CONTROLLER

_uids = itertools.count(1)


class _Builder:
    """Common parts: a workload whose pod templates are at ``self._template_paths``."""

    def __init__(self, obj: Dict[str, Any], template_paths: List[Tuple[str, ...]]):
        self._obj = obj
        self._template_paths = template_paths

    # --- helpers ---
    def _templates(self) -> List[Dict[str, Any]]:
        out = []
        for path in self._template_paths:
            node = self._obj
            for part in path:
                node = node[part]
            out.append(node)
        return out

    def _containers(self) -> List[Dict[str, Any]]:
        return [t["spec"]["containers"][0] for t in self._templates()]

    # --- workload metadata ---
    def label(self, key: str, value: str) -> _Builder:
        self._obj["metadata"].setdefault("labels", {})[key] = value
        return self

    def opt_in(self) -> _Builder:
        return self.label(labels.OPT_IN, labels.OPT_IN_VALUE)

    def annotation(self, key: str, value: str) -> _Builder:
        self._obj["metadata"].setdefault("annotations", {})[key] = value
        return self

    def field(self, path: Tuple[str, ...], value: Any) -> _Builder:
        """Set any field (including ones Kubernetes does not know, to test they survive)."""
        node = self._obj
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
        return self

    # --- pod templates ---
    def template_annotation(self, key: str, value: str) -> _Builder:
        for template in self._templates():
            template.setdefault("metadata", {}).setdefault("annotations", {})[key] = value
        return self

    def gpus(self, count: int, resource: str = "nvidia.com/gpu") -> _Builder:
        for container in self._containers():
            container.setdefault("resources", {}).setdefault("limits", {})[resource] = str(count)
        return self

    def limit(self, name: str, value: str, request: bool = False) -> _Builder:
        for container in self._containers():
            section = "requests" if request else "limits"
            container.setdefault("resources", {}).setdefault(section, {})[name] = value
        return self

    def image(self, image: str) -> _Builder:
        for container in self._containers():
            container["image"] = image
        return self

    def args(self, *args: str) -> _Builder:
        for container in self._containers():
            container["args"] = list(args)
        return self

    def env(self, name: str, value: str) -> _Builder:
        for container in self._containers():
            container.setdefault("env", []).append({"name": name, "value": value})
        return self

    def sidecar(self, name: str = "logger", gpus: int = 0) -> _Builder:
        """Add a container after the training one (GPU-less unless ``gpus``)."""
        for template in self._templates():
            sidecar: Dict[str, Any] = {"name": name, "image": "busybox:1.36"}
            if gpus:
                sidecar["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
            template["spec"]["containers"].append(sidecar)
        return self

    def node_affinity(self, key: str, values: List[str]) -> _Builder:
        for template in self._templates():
            template["spec"]["affinity"] = {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": key, "operator": "In", "values": values}]},
                ]},
            }}
        return self

    def obj(self) -> Dict[str, Any]:
        return copy.deepcopy(self._obj)


def _pod_template(image: str = "ghcr.io/acme/train:1.0") -> Dict[str, Any]:
    return {
        "metadata": {"labels": {"app": "train"}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "train",
                "image": image,
                "command": ["python", "train.py"],
                "args": ["--batch-size", "32"],
                "resources": {"limits": {"cpu": "4", "memory": "16Gi"}},
            }],
        },
    }


class JobBuilder(_Builder):
    def suspended(self, value: bool = True) -> JobBuilder:
        self._obj["spec"]["suspend"] = value
        return self


def make_job(name: str, namespace: str = "ml") -> JobBuilder:
    obj = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"backoffLimit": 0, "template": _pod_template()},
    }
    return JobBuilder(obj, [("spec", "template")])


class PodBuilder(_Builder):
    def owned_by(self, kind: str, name: str, api_version: str = "batch/v1") -> PodBuilder:
        self._obj["metadata"]["ownerReferences"] = [{
            "apiVersion": api_version, "kind": kind, "name": name,
            "uid": "8f4d3c2e-1111-4222-8333-444455556666", "controller": True,
            "blockOwnerDeletion": True,
        }]
        return self


def make_pod(name: str, namespace: str = "ml") -> PodBuilder:
    template = _pod_template()
    obj = {"apiVersion": "v1", "kind": "Pod",
           "metadata": dict(template["metadata"], name=name, namespace=namespace),
           "spec": template["spec"]}
    return PodBuilder(obj, [()])


class PyTorchJobBuilder(_Builder):
    def workers(self, replicas: int) -> PyTorchJobBuilder:
        self._obj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] = replicas
        return self

    def suspended(self, value: bool = True) -> PyTorchJobBuilder:
        self._obj["spec"].setdefault("runPolicy", {})["suspend"] = value
        return self


def make_pytorchjob(name: str, namespace: str = "ml") -> PyTorchJobBuilder:
    obj = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "runPolicy": {"cleanPodPolicy": "None"},
            "pytorchReplicaSpecs": {
                "Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": _pod_template()},
                "Worker": {"replicas": 1, "restartPolicy": "OnFailure", "template": _pod_template()},
            },
        },
    }
    paths = [("spec", "pytorchReplicaSpecs", role, "template") for role in ("Master", "Worker")]
    return PyTorchJobBuilder(obj, paths)


class JobSetBuilder(_Builder):
    def replicas(self, role: str, replicas: int, parallelism: int = 1) -> JobSetBuilder:
        job = next(j for j in self._obj["spec"]["replicatedJobs"] if j["name"] == role)
        job["replicas"] = replicas
        job["template"]["spec"]["parallelism"] = job["template"]["spec"]["completions"] = \
            parallelism
        return self

    def image_of(self, role: str, image: str) -> JobSetBuilder:
        job = next(j for j in self._obj["spec"]["replicatedJobs"] if j["name"] == role)
        job["template"]["spec"]["template"]["spec"]["containers"][0]["image"] = image
        return self

    def owned_by(self, kind: str, name: str, api_version: str) -> JobSetBuilder:
        self._obj["metadata"]["ownerReferences"] = [{
            "apiVersion": api_version, "kind": kind, "name": name,
            "uid": "5b0c6a3e-2222-4333-8444-555566667777", "controller": True,
            "blockOwnerDeletion": True,
        }]
        return self


def make_jobset(name: str, namespace: str = "ml",
                roles: Tuple[str, ...] = ("leader", "workers")) -> JobSetBuilder:
    """A JobSet (jobset.x-k8s.io/v1alpha2) with one replicated Job per role, one pod each."""
    jobs = [{"name": role, "replicas": 1,
             "template": {"spec": {"parallelism": 1, "completions": 1, "backoffLimit": 0,
                                   "template": _pod_template()}}} for role in roles]
    obj = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
           "metadata": {"name": name, "namespace": namespace},
           "spec": {"replicatedJobs": jobs}}
    paths = [("spec", "replicatedJobs", i, "template", "spec", "template")  # type: ignore[misc]
             for i in range(len(roles))]
    return JobSetBuilder(obj, paths)  # type: ignore[arg-type]


def templates_of(obj: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The pod templates of a workload the builders made (a Pod is its own)."""
    if obj["kind"] == "Pod":
        return [obj]
    if obj["kind"] == "Job":
        return [obj["spec"]["template"]]
    if obj["kind"] == "JobSet":
        return [j["template"]["spec"]["template"] for j in obj["spec"]["replicatedJobs"]]
    return [r["template"] for r in obj["spec"]["pytorchReplicaSpecs"].values()]


_GVK = {
    "Job": ("batch", "v1", "jobs"),
    "Pod": ("", "v1", "pods"),
    "PyTorchJob": ("kubeflow.org", "v1", "pytorchjobs"),
    "JobSet": ("jobset.x-k8s.io", "v1alpha2", "jobsets"),
    "TrainJob": ("trainer.kubeflow.org", "v1alpha1", "trainjobs"),
}


def review(
    obj: Optional[Dict[str, Any]],
    operation: str = "CREATE",
    dry_run: bool = False,
    uid: Optional[str] = None,
    old: Optional[Dict[str, Any]] = None,
    kind: Optional[str] = None,
    user: Optional[str] = None,
) -> Dict[str, Any]:
    """An AdmissionReview v1 request as the API server sends it.

    ``userInfo`` names who asks: ``user``, else the Job controller for a Pod a Job owns (as the
    API server reports the pods it creates), else the tenant ``alice``.
    """
    kind = kind or (obj or old or {}).get("kind", "Job")
    group, version, resource = _GVK.get(kind, ("example.com", "v1", kind.lower() + "s"))
    meta = (obj or old or {}).get("metadata", {})
    meta = meta if isinstance(meta, dict) else {}
    if user is None:
        owners = meta.get("ownerReferences") or []
        made_by_job = kind == "Pod" and any(
            isinstance(o, dict) and o.get("kind") in ("Job", "PyTorchJob") for o in owners)
        user = JOB_CONTROLLER if made_by_job else "alice"
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid or f"705ab4f5-6393-11e8-b7cc-{next(_uids):012d}",
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": resource},
            "requestKind": {"group": group, "version": version, "kind": kind},
            "requestResource": {"group": group, "version": version, "resource": resource},
            "name": meta.get("name", "") if isinstance(meta.get("name", ""), str) else "",
            "namespace": meta.get("namespace", "ml") if isinstance(meta.get("namespace", "ml"), str)
            else "ml",
            "operation": operation,
            "userInfo": {"username": user, "groups": ["system:authenticated"]},
            "object": obj,
            "oldObject": old,
            "dryRun": dry_run,
            "options": {"apiVersion": "meta.k8s.io/v1", "kind": "CreateOptions"},
        },
    }
