"""End to end on the real control plane: a Job is held at CREATE by the webhook the API server
calls, the controller runs an estimation pod that the scheduler puts on the process node, where
the probe traces the example GPT script; the Job is released, the real Job controller creates its
pod, the webhook gives the pod the backend's resources and the scheduler puts it on a kwok GPU
node. A second Job with the same fingerprint is sized at CREATE."""

from __future__ import annotations

import json

from kubernetes import client

from localkube.controlplane import wait_for
from localkube.kwok import gpu_node
from tests.e2e_real.support import job, names, pytorchjob, template_annotations
from xmem_admission.cluster import labels
from xmem_admission.cluster.kube.quantity import MiB, ceil_div


def _create(cluster, obj, dry_run=None):
    """Create through the typed client, as kubectl would; returns (object, warning header)."""
    batch = client.BatchV1Api(cluster.api)
    kwargs = {"dry_run": dry_run} if dry_run else {}
    answer = batch.create_namespaced_job(obj["metadata"]["namespace"], obj,
                                         _preload_content=False, **kwargs)
    return json.loads(answer.data), answer.headers.get("Warning", "")


def _gpu_pool(cluster, pool, count=1, **node):
    for i in range(count):
        cluster.apply(gpu_node(f"{pool}-{i}", labels={"pool": pool}, **node))
    return {"pool": pool}


def test_a_job_is_held_estimated_on_the_process_node_released_and_its_pod_sized(xmem):
    cluster = xmem.cluster
    selector = _gpu_pool(cluster, "e2e-hami")
    xmem.serve()
    xmem.controller()

    created, warning = _create(cluster, job("train", xmem.namespace, opt_in=False,
                                            node_selector=selector))
    assert created["spec"]["suspend"] is True, created  # opted in through its namespace
    assert created["metadata"]["annotations"][labels.HELD_REASON] == "AwaitingEstimate"
    assert "held until its GPU memory is estimated" in warning

    released = xmem.wait_released("train")
    assert released["spec"]["suspend"] is False
    sized = template_annotations(released)
    request = int(sized[labels.REQUEST_BYTES])
    assert sized[labels.GPU_MODEL] == "A100-80GB"

    # The estimation pod, named after the Job, ran on the process node (the real scheduler's
    # choice, in its Scheduled Event) and was deleted once its result was recorded.
    [estimate] = xmem.gmes()
    probe = estimate["status"]["podName"]
    assert probe.startswith("train-xmem-")
    scheduled = wait_for(lambda: [e for e in cluster.list("v1", "Event", xmem.namespace)
                                  if e["involvedObject"]["name"] == probe
                                  and e["reason"] == "Scheduled"], 30, "the Scheduled event")
    assert scheduled[0]["message"].endswith(f"to {cluster.node.name}"), scheduled[0]["message"]
    wait_for(lambda: not xmem.estimation_pods(), 30, "the estimation pod to be deleted")
    assert [e["gpu"] for e in estimate["status"]["estimates"]][0] == "A100-80GB"  # its result

    def training_pod():
        pods = xmem.pods("job-name=train")
        return pods[0] if pods and pods[0]["spec"].get("nodeName") else None

    pod = wait_for(training_pod, 60, "the Job controller's pod to be scheduled")
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpumem"] == str(ceil_div(request, MiB))  # HAMi: MiB per GPU
    assert limits["nvidia.com/gpu"] == "1"
    assert pod["metadata"]["annotations"][labels.REQUEST_BYTES] == str(request)
    assert pod["spec"]["nodeName"] == "e2e-hami-0"

    event = wait_for(lambda: [e for e in xmem.events("train") if e["reason"] == "Estimated"],
                     30, "the Estimated event")[0]
    assert f"requesting nvidia.com/gpumem {ceil_div(request, MiB)} MiB" in event["message"]
    assert event["source"]["component"] == "xmem-controller"
    [gme] = xmem.gmes()
    assert (gme["status"]["gpu"], gme["status"]["requestBytes"]) == ("A100-80GB", request)

    # `kubectl get gme`: the API server renders the CRD's printer columns as a Table.
    code, data = cluster.plane.request(
        "GET", f"/apis/xmem.io/v1alpha1/namespaces/{xmem.namespace}/gpumemoryestimates",
        accept="application/json;as=Table;g=meta.k8s.io;v=v1")
    assert code == 200, data
    table = json.loads(data)
    columns = [c["name"] for c in table["columnDefinitions"]]
    assert columns[:7] == ["Name", "Workload", "GPU", "Estimate", "Phase", "Reason", "Age"]
    row = dict(zip(columns, table["rows"][0]["cells"]))
    assert row["Workload"].endswith("train") and row["GPU"] == "A100-80GB"
    assert (row["Phase"], row["Reason"]) == ("Succeeded", "Traced")

    # The same training again: the recorded estimate sizes it at CREATE, nothing is held.
    again, warning = _create(cluster, job("train-again", xmem.namespace, node_selector=selector))
    assert not again["spec"].get("suspend")
    assert template_annotations(again)[labels.REQUEST_BYTES] == str(request)
    assert labels.HELD_REASON not in (again["metadata"].get("annotations") or {})
    assert xmem.webhook.process.poll() is None


def test_a_labelled_job_in_a_namespace_without_the_label_is_held_and_others_pass(xmem):
    cluster = xmem.cluster
    plain = f"{xmem.namespace}-plain"
    cluster.ensure_namespace(plain)  # not opted in
    try:
        xmem.serve()
        labelled, _ = _create(cluster, job("labelled", plain))
        unlabelled, warning = _create(cluster, job("unlabelled", plain, opt_in=False))
        assert labelled["spec"]["suspend"] is True
        assert not unlabelled["spec"].get("suspend")
        assert labels.HELD_REASON not in (unlabelled["metadata"].get("annotations") or {})
        assert warning == ""
        # A Job asking for no GPU passes unchanged even where everything is opted in.
        cpu_only = job("cpu-only", xmem.namespace)
        del cpu_only["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
            "nvidia.com/gpu"]
        passed, _ = _create(cluster, cpu_only)
        assert not passed["spec"].get("suspend")
    finally:
        cluster.delete("v1", "Namespace", plain)


def test_a_pytorchjob_is_held_and_released_with_its_replica_templates_sized(xmem):
    cluster = xmem.cluster
    xmem.serve()
    xmem.controller()
    custom = client.CustomObjectsApi(cluster.api)
    created = custom.create_namespaced_custom_object("kubeflow.org", "v1", xmem.namespace,
                                                     "pytorchjobs", pytorchjob("ddp", xmem.namespace))
    assert created["spec"]["runPolicy"]["suspend"] is True

    def released():
        obj = custom.get_namespaced_custom_object("kubeflow.org", "v1", xmem.namespace,
                                                  "pytorchjobs", "ddp")
        annotations = obj["metadata"].get("annotations") or {}
        return obj if labels.HELD_REASON not in annotations else None

    obj = wait_for(released, 180, "the PyTorchJob to be released", interval=0.3)
    assert obj["spec"]["runPolicy"]["suspend"] is False
    master = obj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    assert int(master["metadata"]["annotations"][labels.REQUEST_BYTES]) > 0
    assert names(xmem.gmes()) and xmem.gmes()[0]["status"]["gpu"] == "A100-80GB"
