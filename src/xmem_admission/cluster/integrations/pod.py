"""core/v1 Pod: its own template; it cannot be held.

A pod's extended resources can never change after creation, so the backend's request must be
written at Pod CREATE; that is where a held workload's estimate (the ``xmem.io/request-bytes``
annotation its template carries) turns into ``nvidia.com/gpumem`` and friends.
"""

from __future__ import annotations

from typing import Any, List, Mapping

from xmem_admission.cluster.integrations.base import Integration, TemplateRef, object_at, register


@register
class PodIntegration(Integration):
    group = ""
    versions = ("v1",)
    kind = "Pod"
    plural = "pods"
    can_hold = False

    def pod_templates(self, obj: Mapping[str, Any]) -> List[TemplateRef]:
        object_at(obj, ("spec",))
        return [TemplateRef("", (), obj)]
