"""End to end: a Job is held by the real webhook, estimated by the controller, released, and its
Pod gets the backend's resources, all over the real protocols.

Everything runs here and is started by the test: the stand-in API server (HTTPS, official
client, RBAC), which calls ``xmem serve`` over HTTPS through the chart's own webhook
configurations (``tests.support.installed``: the chart's RBAC too, so ``xmem serve`` and ``xmem
controller`` run as their own processes with exactly the chart's permissions, as its
ServiceAccounts); the stand-in node running the estimation pod with the real probe on the
example GPT script; and the stand-in Job controller that turns the released Job into its Pod.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator

import pytest
from kubernetes import client

from tests.controller.support import Harness, code_map, template_annotations, training_job, wait
from tests.fakekube.cluster import PROBE_IMAGE
from tests.support.harness import Certificates
from tests.support.installed import Installed
from xmem_admission.cluster import labels
from xmem_admission.cluster.kube.quantity import MiB, ceil_div


@pytest.fixture()
def cluster(tmp_path: Path) -> Iterator[Harness]:
    running = Harness(tmp_path, jobs=True)
    try:
        yield running
    finally:
        running.close()


@pytest.fixture()
def installed(cluster: Harness, tmp_path: Path) -> Iterator[Installed]:
    running = Installed(cluster.server, tmp_path)
    try:
        yield running
    finally:
        running.close()


def _certs(tmp_path: Path) -> Certificates:
    (tmp_path / "tls").mkdir()
    return Certificates(tmp_path / "tls")


def test_a_job_goes_from_held_to_estimated_to_a_pod_with_the_backends_resources(
        cluster, installed, tmp_path):
    installed.serve(_certs(tmp_path), policy_file=cluster.policy_file())
    core = client.CoreV1Api(cluster.server.api_client())
    batch = client.BatchV1Api(cluster.server.api_client())
    core.create_namespace({"metadata": {"name": "ml", "labels": {labels.OPT_IN: "true"}}})
    cluster.server.create(code_map("ml"))
    cluster.server.create({"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
                           "metadata": {"name": "default"}, "spec": cluster.spec})
    installed.controller(PROBE_IMAGE, "--workloads", "Job")  # reads the GPUAdmissionPolicy

    job = training_job("train", namespace="ml")
    del job["metadata"]["labels"][labels.OPT_IN]  # opted in through its namespace
    answer = batch.create_namespaced_job("ml", job, _preload_content=False)
    created = json.loads(answer.data)
    assert created["spec"]["suspend"] is True, created
    assert created["metadata"]["annotations"][labels.HELD_REASON] == "AwaitingEstimate"
    assert "held until its GPU memory is estimated" in answer.headers.get("Warning", "")

    def released() -> Dict[str, Any]:
        obj = json.loads(batch.read_namespaced_job("train", "ml", _preload_content=False).data)
        return obj if labels.HELD_REASON not in obj["metadata"]["annotations"] else None

    job = wait(released, 120, "the controller to release the Job")
    assert job["spec"]["suspend"] is False
    sized = template_annotations(job)
    request = int(sized[labels.REQUEST_BYTES])
    assert sized[labels.GPU_MODEL] == "A100-80GB"

    def training_pod() -> Dict[str, Any]:
        pods = json.loads(core.list_namespaced_pod("ml", label_selector="job-name=train",
                                                   _preload_content=False).data)["items"]
        return pods[0] if pods else None

    pod = wait(training_pod, 30, "the Job controller to create the Pod")
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpumem"] == str(ceil_div(request, MiB))  # HAMi, MiB per GPU
    assert limits["nvidia.com/gpu"] == "1"
    assert pod["metadata"]["annotations"][labels.REQUEST_BYTES] == str(request)
    event = wait(lambda: [e for e in cluster.events("train", "ml") if e["reason"] == "Estimated"],
                 10, "the Estimated event")[0]
    assert f"requesting nvidia.com/gpumem {ceil_div(request, MiB)} MiB" in event["message"]
    [gme] = cluster.gmes("ml")
    assert (gme["status"]["gpu"], gme["status"]["requestBytes"]) == ("A100-80GB", request)
    assert all(p.poll() is None for p in installed.processes)  # served and led throughout


def test_in_a_cluster_the_webhook_sizes_a_repeat_job_at_once_from_the_recorded_estimate(
        cluster, installed, tmp_path):
    """`xmem serve` with cluster credentials and no policy file reads the GPUAdmissionPolicy and
    the controller's GPUMemoryEstimates: a second Job with the same fingerprint is not held."""
    cluster.server.create({"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
                           "metadata": {"name": "default"}, "spec": cluster.spec})
    installed.controller(PROBE_IMAGE, "--workloads", "Job")
    installed.serve(_certs(tmp_path))
    assert "policy GPUAdmissionPolicy/default" in installed.log_of("serve")
    core = client.CoreV1Api(cluster.server.api_client())
    batch = client.BatchV1Api(cluster.server.api_client())
    core.create_namespace({"metadata": {"name": "ml", "labels": {labels.OPT_IN: "true"}}})
    cluster.server.create(code_map("ml"))

    first = training_job("first", namespace="ml")
    created = json.loads(batch.create_namespaced_job("ml", first, _preload_content=False).data)
    assert created["spec"]["suspend"] is True

    def released() -> Dict[str, Any]:
        obj = json.loads(batch.read_namespaced_job("first", "ml", _preload_content=False).data)
        return obj if labels.HELD_REASON not in obj["metadata"]["annotations"] else None

    request = template_annotations(wait(released, 120, "the first Job's release"))[
        labels.REQUEST_BYTES]

    def sized_at_once() -> Dict[str, Any]:
        # dryRun: no side effects, so the answer can be asked for until the watch has caught up
        answer = json.loads(batch.create_namespaced_job(
            "ml", training_job("second", namespace="ml"), dry_run="All",
            _preload_content=False).data)
        return answer if not answer["spec"].get("suspend") else None

    second = wait(sized_at_once, 30, "the webhook's store to see the recorded estimate")
    assert template_annotations(second)[labels.REQUEST_BYTES] == request
    assert labels.HELD_REASON not in second["metadata"].get("annotations", {})
    assert all(p.poll() is None for p in installed.processes)
