"""JobSet (jobset.x-k8s.io/v1alpha2): one pod template per replicated Job, held with
``spec.suspend`` (sigs.k8s.io/jobset v0.12.0, api/jobset/v1alpha2/jobset_types.go).

Each replicated Job's pod template is at ``spec.replicatedJobs[i].template.spec.template``; its
role is the replicated Job's name (unique within the JobSet, and the name Kueue gives its
podSet: pkg/controller/jobs/jobset, kueue v0.17.0). Templates are listed in the JobSet's own
order, which is stable, so the fingerprint is.

While a JobSet is suspended its pod templates' labels and annotations may change (JobSet's
validating webhook, pkg/webhooks/jobset_webhook.go ``ValidateUpdate``: "Allow pod template to be
mutated for suspended JobSets"), which is where the controller writes the estimate before
releasing it; the JobSet controller copies them into the Jobs it creates, the Job controller
into the pods, and the webhook turns them into the backend's request at Pod CREATE.

A JobSet that a TrainJob made (its controlling owner) is part of that TrainJob, which is the
workload xmem holds and sizes: the webhook passes it unchanged
(``base.part_of_held_workload``), as it passes the Jobs a JobSet makes.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Sequence

from xmem_admission.cluster.integrations.base import (
    Integration,
    TemplateRef,
    gpu_templates,
    object_at,
    register,
)
from xmem_admission.contract.errors import InvalidObjectError

# The label JobSet gives each Job it makes and that Job's pods: the replicated Job's name
# (api/jobset/v1alpha2/jobset_types.go ReplicatedJobNameKey; jobset_controller.go
# labelAndAnnotateObject, v0.12.0). A TrainJob's pods carry it too: Trainer makes a JobSet.
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
# torchrun's default rendezvous port (torch/distributed/run.py, --master-port default 29500):
# what rank 0 listens on; the probe traces one process, so only its presence matters.
MASTER_PORT = "29500"


@register
class JobSetIntegration(Integration):
    group = "jobset.x-k8s.io"
    versions = ("v1alpha2",)
    kind = "JobSet"
    plural = "jobsets"
    can_hold = True
    suspend_path = ("spec", "suspend")
    # JobSetConditionType (api/jobset/v1alpha2/jobset_types.go, v0.12.0): Completed and
    # Failed are terminal.
    completed_conditions = ("Completed",)
    failed_conditions = ("Failed",)
    # Its world (replicas x parallelism) is not in its templates: part of the fingerprint.
    world_in_fingerprint = True
    role_label = REPLICATED_JOB_LABEL

    def pod_templates(self, obj: Mapping[str, Any]) -> List[TemplateRef]:
        spec = object_at(obj, ("spec",))
        jobs = spec.get("replicatedJobs")
        if not isinstance(jobs, list) or not jobs:
            raise InvalidObjectError("spec.replicatedJobs: needs at least one replicated Job")
        out: List[TemplateRef] = []
        for index, job in enumerate(jobs):
            if not isinstance(job, dict):
                raise InvalidObjectError(f"spec.replicatedJobs[{index}]: expected an object")
            path = ("spec", "replicatedJobs", index, "template", "spec", "template")
            try:
                template = object_at(job, path[3:])
                object_at(job, path[3:] + ("spec",))
            except InvalidObjectError as exc:
                raise InvalidObjectError(f"spec.replicatedJobs[{index}].{exc}") from None
            out.append(TemplateRef(str(job.get("name") or index), path, template))
        return out

    def rank0_environment(self, obj: Mapping[str, Any]) -> Dict[str, str]:
        """Where the JobSet is a distributed job (more than one GPU pod), the world its rank 0
        runs in: every GPU pod is a node, ``replicas`` (default 1, the CRD's) x the Job's
        ``parallelism`` (default 1, batch/v1's) summed over the GPU replicated Jobs, each with
        one process per GPU of its pod (the largest pod's count).

        JobSet itself sets no torchrun variables (it gives each pod its indices as labels and
        annotations, ``jobset.sigs.k8s.io/job-index`` and the Job's completion index, and a
        stable host name for rank 0's pod); the user's command or environment wires them into
        torchrun. These ``PET_*`` values are torchrun's option defaults
        (torch/distributed/argparse_util.py ``env``), so a command line that names its own
        ``--nnodes``/``--nproc-per-node`` still wins, as it does in the real pods."""
        return self.unit_environment(obj, [ref.role for ref, _ in gpu_templates(self, obj)])

    def unit_environment(self, obj: Mapping[str, Any], roles: Sequence[str]) -> Dict[str, str]:
        """The world of the GPU replicated Jobs named by ``roles`` (see ``rank0_environment``):
        replicated Jobs that run different programs are estimated each in its own."""
        nodes = 0
        per_pod = 1
        jobs = (obj.get("spec") or {}).get("replicatedJobs") or []
        for ref, containers in gpu_templates(self, obj):
            if ref.role not in roles:
                continue
            job = next((j for j in jobs if isinstance(j, dict)
                        and str(j.get("name")) == ref.role), {})
            job_spec = (job.get("template") or {}).get("spec") or {}
            nodes += _count(job.get("replicas"), 1) * _count(job_spec.get("parallelism"), 1)
            per_pod = max(per_pod, sum(n for _, _, n in containers))
        if nodes <= 1:
            return {}
        return {"WORLD_SIZE": str(nodes * per_pod), "RANK": "0", "LOCAL_RANK": "0",
                "PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(per_pod),
                "PET_NODE_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": MASTER_PORT}


def _count(value: Any, default: int) -> int:
    """A replica or parallelism count as the API defaults it (0 is none)."""
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return max(value, 0)
    return default

