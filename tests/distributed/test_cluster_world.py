"""The cluster side gives an estimation pod its workload's rank-0 world: a PyTorchJob's replicas
times its processes per node; a Job carries its world on its torchrun command line."""

from __future__ import annotations

from xmem_admission.cluster.integrations.base import for_kind
from xmem_admission.contract import launch


def _template(gpus):
    return {"spec": {"containers": [{"name": "t", "image": "i", "command": ["torchrun", "t.py"],
                                     "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]}}


def _pytorchjob(nproc=None, workers=2):
    spec = {"pytorchReplicaSpecs": {"Master": {"replicas": 1, "template": _template(4)},
                                    "Worker": {"replicas": workers, "template": _template(4)}}}
    if nproc is not None:
        spec["nprocPerNode"] = nproc
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "p"},
            "spec": spec}


def test_a_pytorchjobs_rank_0_world_is_every_replica_times_its_processes():
    integration = for_kind("kubeflow.org", "v1", "PyTorchJob")
    env = integration.rank0_environment(_pytorchjob("4"))
    assert (env["WORLD_SIZE"], env["RANK"], env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == (
        "12", "0", "3", "4")
    # nprocPerNode "auto" (or absent): one process per GPU of a pod
    assert integration.rank0_environment(_pytorchjob("auto"))["WORLD_SIZE"] == "12"
    assert integration.rank0_environment(_pytorchjob(None, workers=0))["WORLD_SIZE"] == "4"


def test_torchrun_reads_the_world_a_pytorchjob_pod_is_given():
    env = for_kind("kubeflow.org", "v1", "PyTorchJob").rank0_environment(_pytorchjob("4"))
    found = launch.parse(["torchrun", "train.py"], environ=env)
    assert found is not None and (found.nnodes, found.nproc_per_node) == (3, 4)


def test_a_job_gets_no_world_from_its_controller():
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j"},
           "spec": {"template": _template(8)}}
    assert for_kind("batch", "v1", "Job").rank0_environment(job) == {}
