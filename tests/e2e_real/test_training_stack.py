"""The training stack under the JobSet and TrainJob tests is the real one: JobSet's controller and
Kubeflow Trainer's controller manager at the pinned releases (scripts/trainer-versions.env, built
by `make tools`), running beside the real control plane with their CRDs, their webhooks and the
``torch-distributed`` ClusterTrainingRuntime Trainer ships (the ``trainer`` fixture,
localkube/trainer.py). A JobSet becomes Jobs, the control plane's Job controller makes their
pods, the process node runs them and JobSet sees them complete; a TrainJob becomes a JobSet whose
pods carry the torchrun world Trainer's torch plugin gives each node; and Kueue, started with its
JobSet and TrainJob integrations, queues a TrainJob and starts it.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Dict, List, Optional

import pytest
from kubernetes import client

from localkube.controlplane import wait_for
from localkube.jobset import API_VERSION as JOBSET_API
from localkube.jobset import JOBSET_NAME_LABEL, REPLICATED_JOB_LABEL
from localkube.kueue import Kueue
from localkube.trainer import API_VERSION as TRAINER_API
from localkube.trainer import TORCH_RUNTIME
from tests.e2e_real.test_kueue import admitted
from xmem_admission.cluster import labels

_counter = itertools.count()
V1B2 = "kueue.x-k8s.io/v1beta2"
# Any image the process node "pulls": it runs the command with the host's Python.
IMAGE = "python:3.11-slim"
# What each pod prints: the torchrun variables it was given (PET_*), sorted, one line.
SHOW_PET = ("import os; print(' '.join(f'{k}={v}' for k, v in sorted(os.environ.items()) "
            "if k.startswith('PET_')))")


def namespace(cluster: Any) -> str:
    name = f"training-stack-{next(_counter)}"
    cluster.ensure_namespace(name)
    return name


def condition(obj: Optional[Dict[str, Any]], kind: str) -> bool:
    return any(c["type"] == kind and c["status"] == "True"
               for c in ((obj or {}).get("status") or {}).get("conditions") or [])


def pods_of(cluster: Any, ns: str, jobset: str, count: int) -> List[Dict[str, Any]]:
    def made() -> Optional[List[Dict[str, Any]]]:
        pods = cluster.list("v1", "Pod", ns, f"{JOBSET_NAME_LABEL}={jobset}")
        return pods if len(pods) == count else None
    return wait_for(made, 60, f"{count} pods of JobSet {jobset}")


def where_it_stands(cluster: Any, ns: str, name: str) -> str:
    """The TrainJob's and its JobSet's conditions and each pod's phase, for a wait that failed."""
    def conditions(obj: Optional[Dict[str, Any]]) -> List[str]:
        return [f"{c['type']}={c['status']} ({c.get('reason', '')})"
                for c in ((obj or {}).get("status") or {}).get("conditions") or []]
    pods = {p["metadata"]["name"]: (p.get("status") or {}).get("phase")
            for p in cluster.list("v1", "Pod", ns, f"{JOBSET_NAME_LABEL}={name}")}
    return (f"TrainJob {conditions(cluster.get(TRAINER_API, 'TrainJob', name, ns))}, "
            f"JobSet {conditions(cluster.get(JOBSET_API, 'JobSet', name, ns))}, pods {pods}")


def env_of(pod: Dict[str, Any], container: str) -> Dict[str, Any]:
    (found,) = [c for c in pod["spec"]["containers"] if c["name"] == container]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in found.get("env") or []}


def test_the_controllers_run_at_the_pinned_releases_with_their_webhooks_pointed_at_them(trainer):
    cluster = trainer.cluster
    for crd in ("jobsets.jobset.x-k8s.io", "trainjobs.trainer.kubeflow.org",
                "clustertrainingruntimes.trainer.kubeflow.org"):
        assert cluster.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", crd)
    assert cluster.get(TRAINER_API, "ClusterTrainingRuntime", TORCH_RUNTIME)
    for controller in (trainer, trainer.jobset):
        assert controller.process.poll() is None
        for doc in controller.webhooks:
            served = cluster.get(doc["apiVersion"], doc["kind"], doc["metadata"]["name"])
            urls = {w["clientConfig"]["url"] for w in served["webhooks"]}
            assert urls and all(u.startswith(f"https://127.0.0.1:{controller.webhook_port}/")
                                for u in urls)
    names = {d["metadata"]["name"] for d in trainer.jobset.webhooks + trainer.webhooks}
    # The release's names (JobSet's jobset- prefix; Trainer's patches rename its two).
    assert names == {"jobset-mutating-webhook-configuration",
                     "jobset-validating-webhook-configuration",
                     "defaulter.trainer.kubeflow.org", "validator.trainer.kubeflow.org"}
    assert "jobset" in cluster.log("jobset") and "trainer" in cluster.log("trainer")


def test_a_jobset_with_one_replicated_job_makes_its_job_and_pods_and_completes(trainer):
    cluster = trainer.cluster
    ns = namespace(cluster)
    cluster.apply({
        "apiVersion": JOBSET_API, "kind": "JobSet", "metadata": {"name": "hello", "namespace": ns},
        "spec": {"replicatedJobs": [{"name": "workers", "replicas": 1, "template": {"spec": {
            "parallelism": 2, "completions": 2, "backoffLimit": 0, "completionMode": "Indexed",
            "template": {"spec": {"restartPolicy": "Never", "containers": [{
                "name": "work", "image": IMAGE,
                "command": ["python", "-c", "print('hello from a JobSet')"]}]}}}}}]}})

    (job,) = wait_for(lambda: cluster.list("batch/v1", "Job", ns) or None, 60,
                      "JobSet hello's Job")
    assert job["metadata"]["name"] == "hello-workers-0"
    assert job["metadata"]["labels"][REPLICATED_JOB_LABEL] == "workers"
    assert [o["kind"] for o in job["metadata"]["ownerReferences"]] == ["JobSet"]
    pods = pods_of(cluster, ns, "hello", 2)
    assert {p["metadata"]["labels"][REPLICATED_JOB_LABEL] for p in pods} == {"workers"}
    # JobSet's defaulting webhook (the CRD defaults neither) turned DNS hostnames on, so the
    # controller gave every pod the JobSet's headless Service as its subdomain.
    stored = cluster.get(JOBSET_API, "JobSet", "hello", ns)
    assert stored["spec"]["network"] == {"enableDNSHostnames": True,
                                         "publishNotReadyAddresses": True}
    assert stored["spec"]["successPolicy"]["operator"] == "All"
    assert {p["spec"].get("subdomain") for p in pods} == {"hello"}

    done = wait_for(lambda: (lambda o: o if condition(o, "Completed") else None)(
        cluster.get(JOBSET_API, "JobSet", "hello", ns)), 120, "JobSet hello to complete")
    assert done["status"]["replicatedJobsStatus"][0]["succeeded"] == 1
    core = client.CoreV1Api(cluster.api)
    for pod in cluster.list("v1", "Pod", ns, f"{JOBSET_NAME_LABEL}=hello"):
        assert core.read_namespaced_pod_log(pod["metadata"]["name"], ns) == \
            "hello from a JobSet\n"


def test_a_torch_trainjob_of_two_nodes_by_four_processes_gives_each_pod_the_torchrun_world(
        trainer):
    cluster = trainer.cluster
    ns = namespace(cluster)
    cluster.apply({
        "apiVersion": TRAINER_API, "kind": "TrainJob", "metadata": {"name": "gpt", "namespace": ns},
        "spec": {"runtimeRef": {"name": TORCH_RUNTIME}, "trainer": {
            "image": IMAGE, "command": ["python", "-c", SHOW_PET],
            "numNodes": 2, "numProcPerNode": 4}}})

    jobset = wait_for(lambda: cluster.get(JOBSET_API, "JobSet", "gpt", ns), 60,
                      "Trainer to make TrainJob gpt's JobSet")
    assert [(o["kind"], o["name"]) for o in jobset["metadata"]["ownerReferences"]] == \
        [("TrainJob", "gpt")]
    (node,) = jobset["spec"]["replicatedJobs"]
    assert node["name"] == "node" and node["template"]["spec"]["parallelism"] == 2

    pods = pods_of(cluster, ns, "gpt", 2)
    for pod in pods:
        env = env_of(pod, "node")
        assert env["PET_NNODES"] == "2" and env["PET_NPROC_PER_NODE"] == "4"
        assert env["PET_NODE_RANK"] == {"fieldRef": {
            "apiVersion": "v1",
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
        assert env["PET_MASTER_ADDR"] == "gpt-node-0-0.gpt"
        assert env["PET_MASTER_PORT"] == "29500"

    # The pods run on the process node: each node sees its own rank.
    try:
        complete = wait_for(lambda: (lambda o: o if condition(o, "Complete") else None)(
            cluster.get(TRAINER_API, "TrainJob", "gpt", ns)), 120, "TrainJob gpt to complete")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; {where_it_stands(cluster, ns, 'gpt')}") from None
    assert complete["metadata"]["name"] == "gpt"
    core = client.CoreV1Api(cluster.api)
    lines = sorted(core.read_namespaced_pod_log(p["metadata"]["name"], ns).strip()
                   for p in cluster.list("v1", "Pod", ns, f"{JOBSET_NAME_LABEL}=gpt"))
    assert lines == [
        f"PET_MASTER_ADDR=gpt-node-0-0.gpt PET_MASTER_PORT=29500 PET_NNODES=2 "
        f"PET_NODE_RANK={rank} PET_NPROC_PER_NODE=4" for rank in (0, 1)]


def test_trainers_webhook_refuses_a_trainjob_that_sets_a_torchrun_variable_itself(trainer):
    cluster = trainer.cluster
    ns = namespace(cluster)
    with pytest.raises(client.ApiException) as refused:
        cluster.apply({
            "apiVersion": TRAINER_API, "kind": "TrainJob",
            "metadata": {"name": "own-rank", "namespace": ns},
            "spec": {"runtimeRef": {"name": TORCH_RUNTIME}, "trainer": {
                "image": IMAGE, "numNodes": 2, "env": [{"name": "PET_NODE_RANK", "value": "0"}]}}})
    assert refused.value.status == 403  # controller-runtime denies with 403 Forbidden
    message = json.loads(refused.value.body)["message"]
    assert 'admission webhook "validator.trainjob.trainer.kubeflow.org" denied the request' in message
    assert "must not have reserved envs" in message and "PET_NODE_RANK" in message
    assert cluster.get(TRAINER_API, "TrainJob", "own-rank", ns) is None


def test_kueue_with_its_trainjob_integration_holds_a_queued_trainjob_then_starts_it(trainer):
    cluster = trainer.cluster
    ns = namespace(cluster)
    kueue = Kueue(cluster, frameworks=("batch/job", "jobset.x-k8s.io/jobset",
                                       "trainer.kubeflow.org/trainjob")).start()
    try:
        cluster.apply({"apiVersion": V1B2, "kind": "ResourceFlavor",
                       "metadata": {"name": "training-stack"}})
        cluster.apply({"apiVersion": V1B2, "kind": "ClusterQueue",
                       "metadata": {"name": "training-stack"},
                       "spec": {"namespaceSelector": {}, "resourceGroups": [{
                           "coveredResources": ["cpu"], "flavors": [{
                               "name": "training-stack",
                               "resources": [{"name": "cpu", "nominalQuota": "8"}]}]}]}})
        cluster.apply({"apiVersion": V1B2, "kind": "LocalQueue",
                       "metadata": {"name": "queue", "namespace": ns},
                       "spec": {"clusterQueue": "training-stack"}})
        created = cluster.apply({
            "apiVersion": TRAINER_API, "kind": "TrainJob",
            "metadata": {"name": "queued", "namespace": ns,
                         "labels": {labels.KUEUE_QUEUE_NAME: "queue"}},
            "spec": {"runtimeRef": {"name": TORCH_RUNTIME}, "trainer": {
                "image": IMAGE, "command": ["python", "-c", SHOW_PET],
                "numNodes": 2, "numProcPerNode": 4,
                "resourcesPerNode": {"requests": {"cpu": "1"}}}}})
        assert created["spec"]["suspend"] is True  # Kueue's webhook held it

        wait_for(lambda: admitted(cluster, ns, "queued") or None, 60,
                 "Kueue to admit TrainJob queued's Workload")
        wait_for(lambda: (cluster.get(TRAINER_API, "TrainJob", "queued", ns) or {}).get(
            "spec", {}).get("suspend") is False or None, 60, "Kueue to start TrainJob queued")
        pods = pods_of(cluster, ns, "queued", 2)
        assert {env_of(p, "node")["PET_NNODES"] for p in pods} == {"2"}
    finally:
        cluster.delete(TRAINER_API, "TrainJob", "queued", ns)
        kueue.stop()
