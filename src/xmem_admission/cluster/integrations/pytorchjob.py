"""Kubeflow PyTorchJob (kubeflow.org/v1): one template per replica type, held with
``spec.runPolicy.suspend`` (training operator v1.7+; CRD in
tests/data/crds/kubeflow.org_pytorchjobs.yaml).

Replica types are listed in sorted order (Master before Worker) so the fingerprint is stable.
"""

from __future__ import annotations

from typing import Any, List, Mapping

from xmem_admission.cluster.integrations.base import Integration, TemplateRef, object_at, register
from xmem_admission.contract.errors import InvalidObjectError


@register
class PyTorchJobIntegration(Integration):
    group = "kubeflow.org"
    versions = ("v1",)
    kind = "PyTorchJob"
    plural = "pytorchjobs"
    can_hold = True
    suspend_path = ("spec", "runPolicy", "suspend")

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
