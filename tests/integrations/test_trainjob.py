"""TrainJob (trainer.kubeflow.org/v1alpha1): its pod templates resolved from the runtime and its
own trainer fields as Trainer v2.3.0 builds them, the torchrun world of rank 0, and xmem's own
runtime patch (one entry, replaced, never a second)."""

from __future__ import annotations

import copy
from typing import Any, Dict

import pytest

from xmem_admission.cluster import labels
from xmem_admission.cluster.integrations import NotResolved, for_kind, gpu_templates
from xmem_admission.cluster.integrations.trainjob import (
    MANAGER,
    RESOLVED,
    TrainJobIntegration,
)
from xmem_admission.cluster.policy import fingerprint
from xmem_admission.contract.errors import InvalidObjectError

TRAINJOB = TrainJobIntegration()
GPUS = ("H100-80GB",)

# Trainer's torch-distributed ClusterTrainingRuntime (manifests/base/runtimes/
# torch_distributed.yaml, v2.3.0), with a dataset initializer step as its other runtimes have.
RUNTIME: Dict[str, Any] = {
    "apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "ClusterTrainingRuntime",
    "metadata": {"name": "torch-distributed"},
    "spec": {
        "mlPolicy": {"numNodes": 1, "torch": {}},
        "template": {"spec": {"replicatedJobs": [
            {"name": "dataset-initializer",
             "template": {"metadata": {"labels": {
                 "trainer.kubeflow.org/trainjob-ancestor-step": "dataset-initializer"}},
                 "spec": {"template": {"spec": {"containers": [
                     {"name": "dataset-initializer", "image": "kubeflow/dataset-initializer",
                      "resources": {"limits": {"cpu": "2"}}}]}}}}},
            {"name": "node",
             "template": {"metadata": {"labels": {
                 "trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                 "spec": {"template": {"spec": {"containers": [
                     {"name": "node", "image": "pytorch/pytorch:2.13.0-cuda13.0-cudnn9-runtime",
                      "env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
                      "resources": {"limits": {"memory": "32Gi"}}}]}}}}},
        ]}},
    },
}


def trainjob(nodes: int = 2, procs: Any = 4, gpus: int = 4, **trainer: Any) -> Dict[str, Any]:
    spec: Dict[str, Any] = {
        "image": "ghcr.io/acme/train:1.0",
        "command": ["torchrun", "train.py"],
        "args": ["--batch-size", "32"],
        "env": [{"name": "EPOCHS", "value": "3"}],
        "numNodes": nodes,
        "resourcesPerNode": {"limits": {"nvidia.com/gpu": str(gpus), "cpu": "8"}},
    }
    if procs is not None:
        spec["numProcPerNode"] = procs
    spec.update(trainer)
    return {"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainJob",
            "metadata": {"name": "llm", "namespace": "ml",
                         "labels": {labels.OPT_IN: labels.OPT_IN_VALUE}},
            "spec": {"runtimeRef": {"name": "torch-distributed"}, "trainer": spec}}


def resolved(obj: Dict[str, Any]) -> Dict[str, Any]:
    return TRAINJOB.resolve_with(obj, RUNTIME)


def node_container(obj: Dict[str, Any]) -> Dict[str, Any]:
    ref = next(r for r in TRAINJOB.pod_templates(obj) if r.role == "node")
    container: Dict[str, Any] = ref.template["spec"]["containers"][0]
    return container


def test_the_webhook_finds_the_trainjob_integration_and_it_resolves_its_templates() -> None:
    found = for_kind("trainer.kubeflow.org", "v1alpha1", "TrainJob")
    assert found is not None and found.can_hold and found.resolves
    assert found.suspend_path == ("spec", "suspend")


def test_an_unresolved_trainjob_has_no_templates_to_read() -> None:
    with pytest.raises(NotResolved, match="runtime"):
        TRAINJOB.pod_templates(trainjob())


def test_without_api_access_the_runtime_cannot_be_read_and_the_error_says_which() -> None:
    with pytest.raises(NotResolved, match="ClusterTrainingRuntime 'torch-distributed'"):
        TRAINJOB.resolve(trainjob(), None)


def test_a_runtime_ref_of_another_kind_is_refused_with_the_field() -> None:
    obj = trainjob()
    obj["spec"]["runtimeRef"] = {"name": "x", "kind": "Deployment", "apiGroup": "apps"}
    with pytest.raises(InvalidObjectError, match="spec.runtimeRef"):
        TRAINJOB.resolve(obj, None)


def test_the_trainer_fields_replace_the_node_containers_program_and_merge_its_resources() -> None:
    container = node_container(resolved(trainjob()))
    assert container["image"] == "ghcr.io/acme/train:1.0"
    assert container["command"] == ["torchrun", "train.py"]
    assert container["args"] == ["--batch-size", "32"]
    # resourcesPerNode merged per resource name over the runtime's (memory kept)
    assert container["resources"]["limits"] == {"memory": "32Gi", "nvidia.com/gpu": "4",
                                                 "cpu": "8"}
    env = {e["name"]: e for e in container["env"]}
    assert env["NCCL_DEBUG"]["value"] == "WARN" and env["EPOCHS"]["value"] == "3"


def test_the_other_steps_keep_the_runtimes_containers() -> None:
    obj = resolved(trainjob())
    init = next(r for r in TRAINJOB.pod_templates(obj) if r.role == "dataset-initializer")
    assert init.template["spec"]["containers"][0]["image"] == "kubeflow/dataset-initializer"
    assert [r.role for r, _ in gpu_templates(TRAINJOB, obj)] == ["node"]


def test_the_trainer_step_gets_torchruns_world_as_trainer_writes_it() -> None:
    obj = resolved(trainjob(nodes=2, procs=4))
    env = {e["name"]: e for e in node_container(obj)["env"]}
    assert env["PET_NNODES"]["value"] == "2" and env["PET_NPROC_PER_NODE"]["value"] == "4"
    assert env["PET_NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    assert env["PET_MASTER_ADDR"]["value"] == "llm-node-0-0.llm"
    assert env["PET_MASTER_PORT"]["value"] == "29500"
    job = obj[RESOLVED]["replicatedJobs"][1]
    assert job["template"]["spec"]["parallelism"] == 2


def test_without_num_proc_per_node_torchrun_starts_one_process_per_gpu() -> None:
    obj = resolved(trainjob(procs=None, gpus=8))
    env = {e["name"]: e for e in node_container(obj)["env"]}
    assert env["PET_NPROC_PER_NODE"]["value"] == "auto"
    world = TRAINJOB.rank0_environment(obj)
    assert world["PET_NPROC_PER_NODE"] == "8" and world["WORLD_SIZE"] == "16"


def test_without_gpus_auto_is_one_process_per_cpu_of_the_request() -> None:
    obj = trainjob(procs=None)
    obj["spec"]["trainer"]["resourcesPerNode"] = {"requests": {"cpu": "1500m"}}
    env = {e["name"]: e for e in node_container(resolved(obj))["env"]}
    assert env["PET_NPROC_PER_NODE"]["value"] == "2"


def test_rank0_is_traced_in_the_world_of_all_nodes_and_processes() -> None:
    world = TRAINJOB.rank0_environment(resolved(trainjob(nodes=2, procs=4)))
    assert world["WORLD_SIZE"] == "8" and world["PET_NNODES"] == "2"
    assert world["PET_NPROC_PER_NODE"] == "4" and world["PET_NODE_RANK"] == "0"
    assert world["RANK"] == "0" and world["LOCAL_RANK"] == "0"


def test_num_nodes_defaults_to_the_runtimes_ml_policy() -> None:
    obj = trainjob()
    del obj["spec"]["trainer"]["numNodes"]
    runtime = copy.deepcopy(RUNTIME)
    runtime["spec"]["mlPolicy"]["numNodes"] = 3
    world = TRAINJOB.rank0_environment(TRAINJOB.resolve_with(obj, runtime))
    assert world["PET_NNODES"] == "3" and world["WORLD_SIZE"] == "12"


def test_runtime_patches_reach_the_pod_templates_and_the_fingerprint() -> None:
    plain = resolved(trainjob())
    patched_obj = trainjob()
    patched_obj["spec"]["runtimePatches"] = [{
        "manager": "example.com/team",
        "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": [{
            "name": "node", "template": {"spec": {"template": {
                "metadata": {"annotations": {"team": "nlp"}},
                "spec": {"nodeSelector": {"pool": "h100"},
                         "containers": [{"name": "node", "volumeMounts": [
                             {"name": "data", "mountPath": "/data"}]}]}}}}}]}}}}]
    patched = resolved(patched_obj)
    ref = next(r for r in TRAINJOB.pod_templates(patched) if r.role == "node")
    assert ref.template["metadata"]["annotations"]["team"] == "nlp"
    assert ref.template["spec"]["nodeSelector"] == {"pool": "h100"}
    assert ref.template["spec"]["containers"][0]["volumeMounts"][0]["mountPath"] == "/data"
    # annotations and placement do not change what the program allocates
    assert fingerprint.of_templates([r.template for r in TRAINJOB.pod_templates(plain)], GPUS) \
        == fingerprint.of_templates([r.template for r in TRAINJOB.pod_templates(patched)], GPUS)


def test_the_world_is_part_of_the_fingerprint() -> None:
    def fp(obj: Dict[str, Any]) -> str:
        return fingerprint.of_templates([r.template for r in TRAINJOB.pod_templates(obj)], GPUS)

    assert fp(resolved(trainjob(nodes=2, procs=4))) != fp(resolved(trainjob(nodes=1, procs=4)))


def test_templates_are_addressed_in_xmems_own_runtime_patch() -> None:
    obj = resolved(trainjob())
    ref = next(r for r in TRAINJOB.pod_templates(obj) if r.role == "node")
    patches = obj["spec"]["runtimePatches"]
    assert [p["manager"] for p in patches] == [MANAGER]
    assert ref.path[:3] == ("spec", "runtimePatches", 0)
    assert ref.field() == ("spec.runtimePatches[0].trainingRuntimeSpec.template.spec."
                           "replicatedJobs[1].template.spec.template")


def size(obj: Dict[str, Any], request: str) -> Dict[str, Any]:
    """What the controller does at release: annotate the GPU templates where they are
    addressed, then write the object back (``unresolved``)."""
    out = copy.deepcopy(obj)
    for ref, _ in gpu_templates(TRAINJOB, out):
        node: Any = out
        for part in ref.path:
            node = node[part]
        node.setdefault("metadata", {}).setdefault("annotations", {})[
            labels.REQUEST_BYTES] = request
        node["metadata"].setdefault("labels", {})[labels.OPT_IN] = labels.OPT_IN_VALUE
    return TRAINJOB.unresolved(out)


def test_an_object_written_back_carries_only_what_xmems_patch_sets() -> None:
    written = size(resolved(trainjob()), "1000")
    assert RESOLVED not in written
    (patch,) = written["spec"]["runtimePatches"]
    jobs = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert [j["name"] for j in jobs] == ["node"]  # the initializer's empty entry is dropped
    pod = jobs[0]["template"]["spec"]["template"]
    assert pod == {"metadata": {"annotations": {labels.REQUEST_BYTES: "1000"},
                                "labels": {labels.OPT_IN: labels.OPT_IN_VALUE}}}


def test_a_trainjob_with_nothing_to_write_gets_no_runtime_patch() -> None:
    assert "runtimePatches" not in TRAINJOB.unresolved(resolved(trainjob()))["spec"]


def test_sizing_again_replaces_xmems_entry_and_keeps_the_others() -> None:
    obj = trainjob()
    kueue = {"manager": "kueue.x-k8s.io/manager", "trainingRuntimeSpec": {"template": {}}}
    obj["spec"]["runtimePatches"] = [kueue]
    once = size(resolved(obj), "1000")
    twice = size(resolved(once), "2000")
    assert [p["manager"] for p in twice["spec"]["runtimePatches"]] == [
        "kueue.x-k8s.io/manager", MANAGER]
    ref = next(r for r in TRAINJOB.pod_templates(resolved(twice)) if r.role == "node")
    assert ref.template["metadata"]["annotations"][labels.REQUEST_BYTES] == "2000"
    assert size(resolved(twice), "2000") == twice


def test_completed_and_failed_are_read_from_the_trainjob_conditions() -> None:
    obj = trainjob()
    obj["status"] = {"conditions": [{"type": "Complete", "status": "True"}]}
    assert TRAINJOB.finished(obj) is True
    obj["status"] = {"conditions": [{"type": "Failed", "status": "True"}]}
    assert TRAINJOB.finished(obj) is False
