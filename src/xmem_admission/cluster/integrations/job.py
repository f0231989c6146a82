"""batch/v1 Job: one pod template, held with ``spec.suspend`` (GA since Kubernetes 1.24).

While a Job is suspended and has never started, its pod template's labels, annotations, node
selector, affinity, tolerations and scheduling gates may be changed (Kubernetes 1.27+), which is
how the controller writes the estimate before releasing it.
"""

from __future__ import annotations

from typing import Any, List, Mapping

from xmem_admission.cluster.integrations.base import Integration, TemplateRef, object_at, register


@register
class JobIntegration(Integration):
    group = "batch"
    versions = ("v1",)
    kind = "Job"
    plural = "jobs"
    can_hold = True
    suspend_path = ("spec", "suspend")
    # The Job controller's terminal conditions (batch/v1 JobConditionType: Complete, Failed).
    completed_conditions = ("Complete",)
    failed_conditions = ("Failed",)

    def pod_templates(self, obj: Mapping[str, Any]) -> List[TemplateRef]:
        path = ("spec", "template")
        template = object_at(obj, path)
        object_at(obj, path + ("spec",))
        return [TemplateRef("", path, template)]
