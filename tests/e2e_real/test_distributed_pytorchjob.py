"""End to end on the real control plane: a PyTorchJob of two replicas (Master and Worker) with 4
GPUs each and ``nprocPerNode: 4`` runs ``torchrun`` over a DDP script. The controller's estimation
pod gets the master's world (8 ranks) and the process node runs it: the probe traces rank 0 of
8 in one process with no GPU. The job is released with every replica template sized, and the
pods the training operator creates for each replica (created here with the operator's service
account, as it would) get the per-GPU request on each of their 4 GPUs."""

from __future__ import annotations

import json

from kubernetes import client

from localkube.controlplane import wait_for
from tests.distributed.conftest import script
from xmem_admission.cluster import labels
from xmem_admission.cluster.kube.quantity import MiB, ceil_div

OPERATOR = ("kubeflow", "training-operator")  # trust.DEFAULT_WORKLOAD_CONTROLLERS names it


def _pytorchjob(name, namespace):
    def template():
        return {"metadata": {"labels": {"app": name}}, "spec": {
            "restartPolicy": "OnFailure",
            "containers": [{
                "name": "pytorch", "image": "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime",
                "command": ["torchrun", "/ddp/ddp_train.py", "--layers", "2", "--width", "128"],
                "resources": {"limits": {"nvidia.com/gpu": "4", "cpu": "4", "memory": "16Gi"}},
                "volumeMounts": [{"name": "ddp", "mountPath": "/ddp"}]}],
            "volumes": [{"name": "ddp", "configMap": {"name": "ddp"}}]}}

    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": name, "namespace": namespace, "labels": {labels.OPT_IN: "true"}},
            "spec": {"nprocPerNode": "4", "runPolicy": {"cleanPodPolicy": "None"},
                     "pytorchReplicaSpecs": {
                         "Master": {"replicas": 1, "restartPolicy": "OnFailure",
                                    "template": template()},
                         "Worker": {"replicas": 1, "restartPolicy": "OnFailure",
                                    "template": template()}}}}


def _operator_client(cluster, namespace):
    """The training operator's service account, allowed to create pods in the namespace."""
    kubeconfig = cluster.plane.service_account_kubeconfig(*OPERATOR)
    cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
                   "metadata": {"name": "operator-pods", "namespace": namespace},
                   "rules": [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["create", "get", "list"]}]})
    cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                   "metadata": {"name": "operator-pods", "namespace": namespace},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                               "name": "operator-pods"},
                   "subjects": [{"kind": "ServiceAccount", "name": OPERATOR[1],
                                 "namespace": OPERATOR[0]}]})
    return client.CoreV1Api(cluster.plane.api_client(kubeconfig))


def test_a_two_replica_pytorchjob_is_estimated_as_rank_0_of_8_and_every_gpu_sized(xmem):
    cluster = xmem.cluster
    with open(script("ddp_train.py"), encoding="utf-8") as handle:
        cluster.apply({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": "ddp", "namespace": xmem.namespace},
                       "data": {"ddp_train.py": handle.read()}})
    xmem.serve()
    xmem.controller()
    probes = xmem.record_estimation_pods()  # a succeeded one is deleted once recorded
    custom = client.CustomObjectsApi(cluster.api)
    created = custom.create_namespaced_custom_object(
        "kubeflow.org", "v1", xmem.namespace, "pytorchjobs", _pytorchjob("ddp", xmem.namespace))
    assert created["spec"]["runPolicy"]["suspend"] is True

    def released():
        obj = custom.get_namespaced_custom_object("kubeflow.org", "v1", xmem.namespace,
                                                  "pytorchjobs", "ddp")
        return obj if labels.HELD_REASON not in (obj["metadata"].get("annotations") or {}) \
            else None

    obj = wait_for(released, 240, "the PyTorchJob to be released", interval=0.3)
    assert obj["spec"]["runPolicy"]["suspend"] is False
    [probe] = probes.seen()
    probes.stop()
    env = {e["name"]: e.get("value") for e in probe["spec"]["containers"][0]["env"]}
    assert (env["WORLD_SIZE"], env["RANK"], env["PET_NNODES"], env["PET_NPROC_PER_NODE"]) == (
        "8", "0", "2", "4")
    [main] = probe["status"]["containerStatuses"]
    assert main["state"]["terminated"]["reason"] == "Completed", main
    [gme] = xmem.gmes()
    request = int(gme["status"]["requestBytes"])
    replicas = obj["spec"]["pytorchReplicaSpecs"]
    for role in ("Master", "Worker"):
        annotations = replicas[role]["template"]["metadata"]["annotations"]
        assert int(annotations[labels.REQUEST_BYTES]) == request, role

    operator = _operator_client(cluster, xmem.namespace)
    owner = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "name": "ddp",
             "uid": obj["metadata"]["uid"], "controller": True}
    for role in ("Master", "Worker"):
        template = replicas[role]["template"]
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": f"ddp-{role.lower()}-0", "namespace": xmem.namespace,
                            "labels": dict(template["metadata"].get("labels") or {},
                                           **{"training.kubeflow.org/replica-type":
                                              role.lower()}),
                            "annotations": template["metadata"]["annotations"],
                            "ownerReferences": [owner]},
               "spec": template["spec"]}
        made = json.loads(operator.create_namespaced_pod(xmem.namespace, pod,
                                                         _preload_content=False).data)
        limits = made["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "4", role
        assert limits["nvidia.com/gpumem"] == str(ceil_div(request, MiB)), role  # per GPU
        assert made["metadata"]["annotations"][labels.REQUEST_BYTES] == str(request)
