"""Kubeflow PyTorchJob (kubeflow.org/v1): one template per replica type, held with
``spec.runPolicy.suspend`` (training operator v1.7+; CRD in
tests/data/crds/kubeflow.org_pytorchjobs.yaml).

Replica types are listed in sorted order (Master before Worker) so the fingerprint is stable.

A PyTorchJob is distributed: the training operator gives every pod its world
(kubeflow/training-operator pkg/controller.v1/pytorch/envvar.go, ``setPodEnv``: ``WORLD_SIZE``
= all replicas x ``nprocPerNode``, ``RANK``/``PET_NODE_RANK`` the pod's index, master first,
``PET_NNODES`` and ``PET_NPROC_PER_NODE`` for torchrun, which reads ``PET_*`` variables as its
options' defaults). The estimation pod gets the master's: it traces rank 0 of that world.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping

from xmem_admission.cluster.integrations.base import (
    Integration,
    TemplateRef,
    gpu_templates,
    object_at,
    register,
)
from xmem_admission.contract.errors import InvalidObjectError


@register
class PyTorchJobIntegration(Integration):
    group = "kubeflow.org"
    versions = ("v1",)
    kind = "PyTorchJob"
    plural = "pytorchjobs"
    can_hold = True
    suspend_path = ("spec", "runPolicy", "suspend")
    # kubeflow/training-operator's JobConditionType (pkg/apis/kubeflow.org/v1/common_types.go):
    # Succeeded and Failed are terminal.
    completed_conditions = ("Succeeded",)
    failed_conditions = ("Failed",)
    # The replica type of each pod, lower case ("master"): pkg/apis/kubeflow.org/v1
    # ReplicaTypeLabel; roles are matched without case (``base.unit_of``).
    role_label = "training.kubeflow.org/replica-type"

    def pod_templates(self, obj: Mapping[str, Any]) -> List[TemplateRef]:
        replicas = object_at(obj, ("spec", "pytorchReplicaSpecs"))
        if not replicas:
            raise InvalidObjectError("spec.pytorchReplicaSpecs: needs at least one replica type")
        out: List[TemplateRef] = []
        for role in sorted(replicas):
            path = ("spec", "pytorchReplicaSpecs", role, "template")
            template = object_at(obj, path)
            object_at(obj, path + ("spec",))
            out.append(TemplateRef(role, path, template))
        return out

    def rank0_environment(self, obj: Mapping[str, Any]) -> Dict[str, str]:
        spec = obj.get("spec") or {}
        replicas = spec.get("pytorchReplicaSpecs") or {}
        # An unset replica count is 1 (the CRD's default); 0 is none.
        nodes = sum(_count(r.get("replicas"), 1, zero=True) for r in replicas.values()
                    if isinstance(r, dict))
        elastic = spec.get("elasticPolicy") or {}
        declared = spec.get("nprocPerNode", elastic.get("nProcPerNode"))
        # "auto"/"gpu" (or none): one process per GPU of the pod, as torchrun counts them.
        per_pod = [sum(n for _, _, n in containers) for _, containers in gpu_templates(self, obj)]
        nproc = _count(declared, max(per_pod, default=1))
        return {"WORLD_SIZE": str(max(nodes, 1) * nproc), "RANK": "0", "LOCAL_RANK": "0",
                "PET_NNODES": str(max(nodes, 1)), "PET_NPROC_PER_NODE": str(nproc),
                "PET_NODE_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "23456"}


def _count(value: Any, default: int, zero: bool = False) -> int:
    text = str(value).strip() if value is not None else ""
    return int(text) if text.isdigit() and (zero or int(text) > 0) else default
