"""Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1, Trainer v2.3.0): held with
``spec.suspend``; its pod templates are resolved from the runtime it references.

A TrainJob carries no pod template. Trainer builds a JobSet of the same name from the runtime
``spec.runtimeRef`` names (a ``ClusterTrainingRuntime``, the default kind, or a namespaced
``TrainingRuntime``; its ``spec.template`` is a JobSet template) and the TrainJob's own fields;
``resolve`` does the same, in Trainer's order (pkg/runtime/core/trainingruntime.go
``newRuntimeInfo``, pkg/runtime/framework/plugins/torch/torch.go ``EnforceMLPolicy``,
pkg/runtime/framework/plugins/jobset/builder.go ``Trainer``, all at v2.3.0):

1. ``spec.runtimePatches``, in order, merged into the runtime's replicated Jobs by name: each
   pod template's labels and annotations, its containers' (and init containers') ``env`` by
   name and ``volumeMounts`` by path, ``nodeSelector`` merged, ``tolerations``, ``affinity``
   and the other pod fields replaced (a subset of Trainer's strategic merge patch: what a
   patch may set, ``trainjob_types.go`` ``PodSpecPatch``, and what the estimate reads);
2. the trainer step (the replicated Job labelled ``trainer.kubeflow.org/trainjob-ancestor-step:
   trainer``), container ``node``: ``spec.trainer.resourcesPerNode`` merged over its resources
   per resource name, then ``spec.trainer.env`` upserted by name, then ``image``, ``command``
   and ``args`` replaced; its pod count (``parallelism``) is ``spec.trainer.numNodes``, else the
   runtime's ``spec.mlPolicy.numNodes``, else 1;
3. with a torch ML policy, torchrun's world in container ``node``'s environment as Trainer
   writes it: ``PET_NNODES`` (the pod count), ``PET_NPROC_PER_NODE`` (``spec.trainer.
   numProcPerNode``, else ``auto``: torchrun starts one process per GPU, or, with no GPU in
   the resources, one per CPU of the request), ``PET_NODE_RANK`` (the Job's completion index),
   ``PET_MASTER_ADDR`` (``<name>-node-0-0.<name>``) and ``PET_MASTER_PORT`` (29500,
   constants.ContainerTrainerPort).

Sizing: a TrainJob cannot set resources through its runtime patches, so its pods are sized at
CREATE, like a batch Job's. The controller writes the sizing annotations and the opt-in label
into the pod templates through a runtime patch of its own (``MANAGER``; ``spec.runtimePatches``
is a list keyed by ``manager``, so it replaces its own entry, never adds a second), in the same
update that unsuspends it: Trainer's validating webhook allows runtime patches to change while
the TrainJob is suspended before or after the update (plugins/jobset/jobset.go
``checkRuntimePatchesImmutability``). Trainer copies them into the JobSet's pod templates, the
JobSet controller into its Jobs, the Job controller into the pods, and the webhook turns
``xmem.io/request-bytes`` into the backend's request at Pod CREATE. ``pod_templates`` therefore
addresses each template at its place in that patch (the content is the resolved template):
``unresolved`` drops what the patch does not need before the object is written.
"""

from __future__ import annotations

import copy
from typing import Any, Dict, List, Mapping, Optional, Tuple

from xmem_admission.cluster.integrations.base import (
    Integration,
    NotResolved,
    Reader,
    TemplateRef,
    gpu_templates,
    register,
)
from xmem_admission.cluster.integrations.jobset import REPLICATED_JOB_LABEL
from xmem_admission.cluster.kube.client import Kind
from xmem_admission.contract.errors import InvalidObjectError, KubeApiError, KubeUnavailable

GROUP = "trainer.kubeflow.org"
VERSION = "v1alpha1"
CLUSTER_RUNTIME = Kind(GROUP, VERSION, "clustertrainingruntimes", "ClusterTrainingRuntime")
RUNTIME = Kind(GROUP, VERSION, "trainingruntimes", "TrainingRuntime")
# The runtime patch the xmem controller owns (a domain-prefixed path, as Trainer's webhook
# requires of ``manager``: validation.IsDomainPrefixedPath).
MANAGER = "xmem.io/controller"
# Kueue's own entry (pkg/controller/jobs/trainjob/trainjob_controller.go
# runtimePatchManagerName, kueue v0.17.0): written from the AdmissionCheck's podSetUpdates.
KUEUE_MANAGER = "kueue.x-k8s.io/manager"
# Trainer's constants (pkg/constants/constants.go, v2.3.0).
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
ANCESTOR_TRAINER = "trainer"
NODE = "node"
TRAINER_PORT = "29500"  # ContainerTrainerPort
COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# Where ``resolve`` keeps what it resolved, on a copy of the object (never written).
RESOLVED = "xmem.io/resolved"
_POD_PATH = ("template", "spec", "template")


def _upsert(items: List[Any], new: List[Any], key: str) -> List[Any]:
    """``items`` with each of ``new`` replacing the entry of the same ``key``, else appended."""
    out = [copy.deepcopy(i) for i in items]
    for item in new:
        if not isinstance(item, dict):
            continue
        at = next((n for n, old in enumerate(out) if isinstance(old, dict)
                   and old.get(key) == item.get(key)), None)
        if at is None:
            out.append(copy.deepcopy(item))
        else:
            out[at] = copy.deepcopy(item)
    return out


def _merge_container(container: Dict[str, Any], patch: Mapping[str, Any]) -> None:
    for field, key in (("env", "name"), ("volumeMounts", "mountPath")):
        if isinstance(patch.get(field), list):
            container[field] = _upsert(container.get(field) or [], patch[field], key)
    if isinstance(patch.get("securityContext"), dict):
        container["securityContext"] = copy.deepcopy(patch["securityContext"])


def _merge_pod(template: Dict[str, Any], patch: Mapping[str, Any]) -> None:
    """One runtime patch's pod template (``PodTemplatePatch``) merged into a pod template."""
    meta = patch.get("metadata")
    if isinstance(meta, dict):
        mine = template.setdefault("metadata", {})
        for field in ("labels", "annotations"):
            if isinstance(meta.get(field), dict):
                mine[field] = dict(mine.get(field) or {}, **meta[field])
    spec_patch = patch.get("spec")
    if not isinstance(spec_patch, dict):
        return
    spec = template.setdefault("spec", {})
    for field in ("containers", "initContainers"):
        for cpatch in spec_patch.get(field) or []:
            if not isinstance(cpatch, dict):
                continue
            for container in spec.get(field) or []:
                if isinstance(container, dict) and container.get("name") == cpatch.get("name"):
                    _merge_container(container, cpatch)
    if isinstance(spec_patch.get("nodeSelector"), dict):
        spec["nodeSelector"] = dict(spec.get("nodeSelector") or {}, **spec_patch["nodeSelector"])
    for field, key in (("volumes", "name"), ("schedulingGates", "name"),
                       ("imagePullSecrets", "name")):
        if isinstance(spec_patch.get(field), list):
            spec[field] = _upsert(spec.get(field) or [], spec_patch[field], key)
    for field in ("tolerations", "affinity", "securityContext", "serviceAccountName",
                  "terminationGracePeriodSeconds"):
        if spec_patch.get(field) is not None:
            spec[field] = copy.deepcopy(spec_patch[field])


def _positive(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def _gpus(resources: Mapping[str, Any]) -> int:
    """GPUs per node in resources, as Trainer counts them (runtime.GetNumGPUPerNode: the
    limits' ``nvidia.com/gpu``... any ``*/gpu`` resource)."""
    for section in ("limits", "requests"):
        for name, value in (resources.get(section) or {}).items():
            if str(name).endswith("/gpu") and str(value).isdigit() and int(value) > 0:
                return int(value)
    return 0


def _cpus(resources: Mapping[str, Any]) -> int:
    """CPUs per node as torch.go ``getNumCPUPerNode`` counts them: the request, else the limit,
    whole CPUs (a millicore quantity rounds up, as resource.Quantity.Value does)."""
    for section in ("requests", "limits"):
        text = str((resources.get(section) or {}).get("cpu") or "").strip()
        if text.endswith("m") and text[:-1].isdigit():
            return -(-int(text[:-1]) // 1000)
        if text.isdigit():
            return int(text)
    return 0


@register
class TrainJobIntegration(Integration):
    group = GROUP
    versions = (VERSION,)
    kind = "TrainJob"
    plural = "trainjobs"
    can_hold = True
    suspend_path = ("spec", "suspend")
    # TrainJob condition types (pkg/apis/trainer/v1alpha1/trainjob_types.go, v2.3.0).
    completed_conditions = ("Complete",)
    failed_conditions = ("Failed",)
    resolves = True
    # Its pods are a JobSet's: each names its replicated Job, the runtime's name for it.
    role_label = REPLICATED_JOB_LABEL

    # --- resolution -------------------------------------------------------------------------

    def runtime_ref(self, obj: Mapping[str, Any]) -> Tuple[Kind, str]:
        """The runtime's kind and name (``spec.runtimeRef``; kind ClusterTrainingRuntime and
        group trainer.kubeflow.org by default, as the CRD defaults them)."""
        ref = (obj.get("spec") or {}).get("runtimeRef")
        if not isinstance(ref, dict) or not isinstance(ref.get("name"), str) or not ref["name"]:
            raise InvalidObjectError("spec.runtimeRef.name: required")
        group = ref.get("apiGroup") or GROUP
        kind = ref.get("kind") or CLUSTER_RUNTIME.kind
        if group != GROUP or kind not in (CLUSTER_RUNTIME.kind, RUNTIME.kind):
            raise InvalidObjectError(f"spec.runtimeRef: {kind}.{group} is not a Trainer runtime "
                                     f"(ClusterTrainingRuntime or TrainingRuntime of {GROUP})")
        return (CLUSTER_RUNTIME if kind == CLUSTER_RUNTIME.kind else RUNTIME), ref["name"]

    def read_runtime(self, obj: Mapping[str, Any], reader: Optional[Reader]) -> Dict[str, Any]:
        kind, name = self.runtime_ref(obj)
        what = f"{kind.kind} {name!r} (spec.runtimeRef)"
        if reader is None:
            raise NotResolved(f"{what}: xmem has no API access to read it")
        namespace = str((obj.get("metadata") or {}).get("namespace") or "")
        try:
            if kind is CLUSTER_RUNTIME:
                return reader.get_cluster(kind, name)
            return reader.get(kind, namespace, name)
        except KubeApiError as exc:
            if exc.not_found:
                raise NotResolved(f"{what} does not exist"
                                  + (f" in namespace {namespace}" if kind is RUNTIME else "")
                                  + "; create it, or name one that exists") from None
            raise NotResolved(f"{what} could not be read: HTTP {exc.status} {exc.reason}"
                              f"{': ' + exc.message if exc.message else ''}") from None
        except KubeUnavailable as exc:
            raise NotResolved(f"{what} could not be read: {exc}") from None

    def resolve(self, obj: Dict[str, Any], reader: Optional[Reader]) -> Dict[str, Any]:
        if RESOLVED in obj:
            return obj
        return self.resolve_with(obj, self.read_runtime(obj, reader))

    def resolve_with(self, obj: Dict[str, Any], runtime: Mapping[str, Any]) -> Dict[str, Any]:
        """``resolve`` with the runtime at hand."""
        runtime_spec = runtime.get("spec") or {}
        jobs = ((runtime_spec.get("template") or {}).get("spec") or {}).get("replicatedJobs")
        if not isinstance(jobs, list) or not jobs:
            raise NotResolved(f"{runtime.get('kind', 'runtime')} "
                              f"{(runtime.get('metadata') or {}).get('name')!r} has no "
                              "spec.template.spec.replicatedJobs")
        jobs = copy.deepcopy(jobs)
        spec = obj.get("spec") or {}
        patches = spec.get("runtimePatches") or []
        for patch in patches if isinstance(patches, list) else []:
            rjobs = (((patch.get("trainingRuntimeSpec") or {}).get("template") or {})
                     .get("spec") or {}).get("replicatedJobs") if isinstance(patch, dict) else None
            for rpatch in rjobs or []:
                pod = ((rpatch.get("template") or {}).get("spec") or {}).get("template") \
                    if isinstance(rpatch, dict) else None
                for job in jobs:
                    if isinstance(pod, dict) and job.get("name") == rpatch.get("name"):
                        _merge_pod(_pod(job), pod)
        self._trainer(obj, runtime_spec, jobs)
        out = dict(obj)
        out[RESOLVED] = {"replicatedJobs": jobs}
        out["spec"] = dict(spec, runtimePatches=self._with_own_patch(patches, jobs))
        return out

    def _trainer(self, obj: Mapping[str, Any], runtime_spec: Mapping[str, Any],
                 jobs: List[Dict[str, Any]]) -> None:
        trainer = (obj.get("spec") or {}).get("trainer")
        trainer = trainer if isinstance(trainer, dict) else {}
        ml = runtime_spec.get("mlPolicy") or {}
        for job in jobs:
            labels = ((job.get("template") or {}).get("metadata") or {}).get("labels") or {}
            if labels.get(ANCESTOR_LABEL) != ANCESTOR_TRAINER:
                continue
            nodes = _positive(trainer.get("numNodes")) or _positive(ml.get("numNodes")) or 1
            job_spec = job.setdefault("template", {}).setdefault("spec", {})
            job_spec["parallelism"] = job_spec["completions"] = nodes
            pod = _pod(job)
            for container in (pod.get("spec") or {}).get("containers") or []:
                if not isinstance(container, dict) or container.get("name") != NODE:
                    continue
                resources = container.get("resources") or {}
                given = trainer.get("resourcesPerNode")
                if isinstance(given, dict):
                    resources = {section: dict(resources.get(section) or {},
                                               **(given.get(section) or {}))
                                 for section in ("limits", "requests", "claims")
                                 if resources.get(section) or given.get(section)}
                    container["resources"] = resources
                if isinstance(trainer.get("env"), list):
                    container["env"] = _upsert(container.get("env") or [], trainer["env"], "name")
                for field in ("image", "command", "args"):
                    if trainer.get(field) is not None:
                        container[field] = copy.deepcopy(trainer[field])
                if "torch" in ml:
                    container["env"] = _upsert(container.get("env") or [],
                                               self._torch_env(obj, nodes, resources), "name")

    def _torch_env(self, obj: Mapping[str, Any], nodes: int,
                   resources: Mapping[str, Any]) -> List[Dict[str, Any]]:
        trainer = (obj.get("spec") or {}).get("trainer") or {}
        declared = _positive(trainer.get("numProcPerNode"))
        nproc = str(declared) if declared else (
            "auto" if _gpus(resources) else str(max(1, _cpus(resources))))
        name = str((obj.get("metadata") or {}).get("name") or "")
        return [{"name": "PET_NNODES", "value": str(nodes)},
                {"name": "PET_NPROC_PER_NODE", "value": nproc},
                {"name": "PET_NODE_RANK",
                 "valueFrom": {"fieldRef": {"fieldPath": COMPLETION_INDEX}}},
                {"name": "PET_MASTER_ADDR", "value": f"{name}-{NODE}-0-0.{name}"},
                {"name": "PET_MASTER_PORT", "value": TRAINER_PORT}]

    @staticmethod
    def _with_own_patch(patches: Any, jobs: List[Dict[str, Any]]) -> List[Any]:
        """The runtime patches with xmem's entry present (last, when it was not there), holding
        one replicated Job entry per resolved Job, in the resolved order."""
        out: List[Any] = list(patches) if isinstance(patches, list) else []
        at = next((n for n, p in enumerate(out)
                   if isinstance(p, dict) and p.get("manager") == MANAGER), None)
        own: Dict[str, Any] = copy.deepcopy(out[at]) if at is not None else {"manager": MANAGER}
        runtime_spec = own.get("trainingRuntimeSpec")
        if not isinstance(runtime_spec, dict):
            runtime_spec = own["trainingRuntimeSpec"] = {}
        template = runtime_spec.get("template")
        if not isinstance(template, dict):
            template = runtime_spec["template"] = {}
        existing = {str(r.get("name")): r for r in
                    (template.get("spec") or {}).get("replicatedJobs") or [] if isinstance(r, dict)}
        entries = []
        for job in jobs:
            entry = existing.get(str(job.get("name"))) or {"name": job.get("name")}
            node: Dict[str, Any] = entry
            for part in _POD_PATH:
                node = node.setdefault(part, {})
            entries.append(entry)
        template["spec"] = dict(template.get("spec") or {}, replicatedJobs=entries)
        if at is None:
            out.append(own)
        else:
            out[at] = own
        return out

    def unresolved(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        out = dict(obj)
        out.pop(RESOLVED, None)
        spec = dict(out.get("spec") or {})
        kept = []
        for patch in spec.get("runtimePatches") or []:
            if isinstance(patch, dict) and patch.get("manager") == MANAGER:
                patch = _pruned(patch)
                if patch is None:
                    continue
            kept.append(patch)
        if kept:
            spec["runtimePatches"] = kept
        else:
            spec.pop("runtimePatches", None)
        out["spec"] = spec
        return out

    # --- the Integration interface ------------------------------------------------------------

    def pod_templates(self, obj: Mapping[str, Any]) -> List[TemplateRef]:
        resolved = obj.get(RESOLVED)
        if not isinstance(resolved, dict):
            raise NotResolved("the TrainJob's pod templates come from its runtime, which was "
                              "not read")
        at = next(n for n, p in enumerate((obj.get("spec") or {}).get("runtimePatches") or [])
                  if isinstance(p, dict) and p.get("manager") == MANAGER)
        base = ("spec", "runtimePatches", at, "trainingRuntimeSpec", "template", "spec",
                "replicatedJobs")
        out: List[TemplateRef] = []
        for index, job in enumerate(resolved["replicatedJobs"]):
            pod = _pod(job)
            if not isinstance(pod.get("spec"), dict):
                raise InvalidObjectError(f"runtime replicatedJobs[{index}]: no pod template spec")
            out.append(TemplateRef(str(job.get("name") or index), base + (index,) + _POD_PATH,
                                   pod))
        return out

    def rank0_environment(self, obj: Mapping[str, Any]) -> Dict[str, str]:
        """The torchrun world Trainer gives rank 0 (see the module docstring): ``PET_NNODES``
        pods of ``PET_NPROC_PER_NODE`` processes, ``auto`` counted as torchrun counts it (one
        per GPU of the node container; the estimation pod has none to count), node rank 0,
        and the variables torchrun then gives its first worker (``RANK``, ``LOCAL_RANK``,
        ``WORLD_SIZE``), as for a PyTorchJob's master."""
        resolved = obj.get(RESOLVED)
        if not isinstance(resolved, dict):
            return {}
        for ref, containers in gpu_templates(self, obj):
            job: Dict[str, Any] = next((j for j in resolved["replicatedJobs"]
                                        if str(j.get("name")) == ref.role), {})
            job_meta = (job.get("template") or {}).get("metadata") or {}
            if (job_meta.get("labels") or {}).get(ANCESTOR_LABEL) != ANCESTOR_TRAINER:
                continue
            env = {e.get("name"): e.get("value") for _, c, _ in containers
                   for e in c.get("env") or [] if isinstance(e, dict)}
            nodes = int(env.get("PET_NNODES") or 1)
            declared = str(env.get("PET_NPROC_PER_NODE") or "auto")
            nproc = int(declared) if declared.isdigit() else \
                max(1, sum(n for _, _, n in containers))
            return {"WORLD_SIZE": str(nodes * nproc), "RANK": "0", "LOCAL_RANK": "0",
                    "PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": str(nproc),
                    "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "localhost",
                    "PET_MASTER_PORT": TRAINER_PORT, "MASTER_ADDR": "localhost",
                    "MASTER_PORT": TRAINER_PORT}
        return {}


def _pod(job: Dict[str, Any]) -> Dict[str, Any]:
    node = job
    for part in _POD_PATH:
        node = node.setdefault(part, {})
    return node


def _pruned(patch: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """xmem's runtime patch without replicated Job entries that carry nothing (None when none
    carries anything)."""
    template = (patch.get("trainingRuntimeSpec") or {}).get("template") or {}
    entries = []
    for entry in (template.get("spec") or {}).get("replicatedJobs") or []:
        pod = ((entry.get("template") or {}).get("spec") or {}).get("template") or {}
        meta = pod.get("metadata") or {}
        if meta.get("labels") or meta.get("annotations") or pod.get("spec"):
            entries.append(entry)
    if not entries:
        return None
    out = copy.deepcopy(patch)
    out["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"] = entries
    return out
