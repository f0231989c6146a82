"""An estimation pod as a user and an admin meet it: named after its workload, gone once its
result is recorded, kept after a failure for ``kubectl logs``, placed where the policy says, and a
ResourceQuota that refuses it said on the workload, then started once the quota has room.

A full controller runs against the real control plane (with its ResourceQuota and Priority
admission); the process node runs the estimation pods.
"""

from __future__ import annotations

import re
from typing import Iterator

import pytest
from kubernetes import client

from tests.controller.support import Harness, policy_spec, training_job, wait
from tests.helm.chart import run, tool
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller.estimation_line import QUOTA_REFUSED


def _pod(harness: Harness, name: str) -> dict:
    pod = harness.get("v1", "Pod", name)
    assert pod is not None, f"estimation pod {name} is gone"
    return pod


def test_an_estimation_pod_is_named_after_its_workload_and_deleted_once_its_result_is_in(harness):
    harness.controller()
    harness.submit(training_job("train-gpt"))
    running = wait(lambda: next(iter(harness.estimation_pods()), None), 60,
                   "the estimation pod")
    name = running["metadata"]["name"]
    assert re.fullmatch(r"train-gpt-xmem-[0-9a-f]{8}", name), name
    released = harness.wait_released("train-gpt", 180)
    assert labels.REQUEST_BYTES in released["spec"]["template"]["metadata"]["annotations"]
    [gme] = harness.gmes()
    assert (gme["status"]["phase"], gme["status"]["podName"]) == ("Succeeded", name)
    wait(lambda: not harness.estimation_pods(), 30, "the succeeded estimation pod to be deleted")


def _kubectl(harness: Harness, *args: str, timeout: float = 60) -> str:
    return run([tool("kubectl"), "--kubeconfig", str(harness.cluster.plane.admin_kubeconfig),
                "-n", harness.namespace, *args], timeout=timeout).stdout


def _condition(gme: dict, kind: str) -> dict:
    [found] = [c for c in gme["status"]["conditions"] if c["type"] == kind]
    return found


def test_kubectl_waits_on_an_estimates_conditions_and_a_failed_pod_is_kept_for_kubectl_logs(
        harness):
    harness.controller()
    harness.submit(training_job("broken", script="fails_before_step.py", args=()))
    [gme] = wait(harness.gmes, 60, "the estimate of broken")
    failed = f"gme/{gme['metadata']['name']}"
    _kubectl(harness, "wait", "--for=condition=Failed", failed, "--timeout=120s", timeout=130)
    harness.wait_released("broken", 120)
    [gme] = harness.gmes()
    assert (gme["status"]["phase"], gme["status"]["reason"]) == ("Failed", "ScriptFailed")
    assert gme["status"]["observedGeneration"] == gme["metadata"]["generation"]
    why = _condition(gme, "Failed")
    assert (why["status"], why["reason"]) == ("True", "ScriptFailed")
    assert "fails_before_step.py" in why["message"]  # the script's last lines, as the status
    assert (_condition(gme, "Estimated")["status"], _condition(gme, "Estimating")["status"]) \
        == ("False", "False")
    name = gme["status"]["podName"]
    assert re.fullmatch(r"broken-xmem-[0-9a-f]{8}", name), name
    # Another estimation starts, finishes and is cleaned up meanwhile: the failed pod stays.
    harness.submit(training_job("fine"))
    fine = wait(lambda: [g for g in harness.gmes() if g["spec"]["workload"]["name"] == "fine"],
                60, "the estimate of fine")[0]
    _kubectl(harness, "wait", "--for=condition=Estimated", f"gme/{fine['metadata']['name']}",
             "--timeout=180s", timeout=190)
    fine = harness.get("xmem.io/v1alpha1", "GPUMemoryEstimate", fine["metadata"]["name"])
    estimated = _condition(fine, "Estimated")
    assert (estimated["status"], estimated["reason"]) == ("True", "Traced")
    assert estimated["message"].startswith(
        f"{fine['status']['estimate']} on {fine['status']['gpu']}, request ")
    harness.wait_released("fine", 180)
    # `kubectl get gme`: six columns, the phase and the first true condition's reason in them.
    header, *rows = _kubectl(harness, "get", "gme").splitlines()
    assert header.split() == ["NAME", "WORKLOAD", "GPU", "ESTIMATE", "PHASE", "REASON", "AGE"]
    shown = {row.split()[1]: row.split() for row in rows}
    assert shown["broken"][2:4] == ["Failed", "ScriptFailed"]
    assert shown["fine"][2:6] == [fine["status"]["gpu"], fine["status"]["estimate"], "Succeeded",
                                  "Traced"]
    wait(lambda: [p["metadata"]["name"] for p in harness.estimation_pods()] == [name], 30,
         "only the failed pod left")
    pod = _pod(harness, name)
    assert pod["status"]["phase"] == "Failed" and "deletionTimestamp" not in pod["metadata"]
    log = client.CoreV1Api(harness.api_client()).read_namespaced_pod_log(
        name, harness.namespace, container="train")
    assert "giving up: the dataset is empty" in log


@pytest.fixture()
def priority_class(harness: Harness) -> Iterator[str]:
    name = f"{harness.namespace}-estimation"
    harness.cluster.apply({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                           "metadata": {"name": name}, "value": 1000,
                           "description": "xmem estimation pods (test)"})
    try:
        yield name
    finally:
        harness.cluster.delete("scheduling.k8s.io/v1", "PriorityClass", name)


def test_estimation_pods_run_where_the_policy_places_them(harness, priority_class):
    node = harness.cluster.node.name
    toleration = {"key": "xmem.io/estimation", "operator": "Exists", "effect": "NoSchedule"}
    harness.use(policy_spec(estimation={"placement": {
        "nodeSelector": {"kubernetes.io/hostname": node}, "tolerations": [toleration],
        "priorityClassName": priority_class}}))
    harness.controller()
    job = training_job("placed", script="fails_before_step.py", args=())
    job["spec"]["template"]["spec"].update(  # the workload's own GPU placement is not copied
        nodeSelector={"nvidia.com/gpu.product": "A100"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
    harness.submit(job)
    harness.wait_released("placed", 120)
    [gme] = harness.gmes()
    pod = _pod(harness, gme["status"]["podName"])  # kept: its estimation failed
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"kubernetes.io/hostname": node}
    assert toleration in spec["tolerations"]
    assert not any(t.get("key") == "nvidia.com/gpu" for t in spec["tolerations"])
    assert spec["priorityClassName"] == priority_class
    assert spec["priority"] == 1000  # resolved by the API server's Priority admission
    assert spec["nodeName"] == node  # the real scheduler's choice
    assert pod["status"]["phase"] == "Failed"  # it ran there


@pytest.fixture()
def full_quota(harness: Harness) -> Iterator[dict]:
    quota = harness.cluster.apply({"apiVersion": "v1", "kind": "ResourceQuota",
                                   "metadata": {"name": "no-room", "namespace": harness.namespace},
                                   "spec": {"hard": {"pods": "0"}}})
    wait(lambda: (harness.get("v1", "ResourceQuota", "no-room") or {}).get("status", {})
         .get("hard"), 30, "the quota controller to count the namespace")
    yield quota


def _warnings(harness: Harness, name: str, reason: str) -> list:
    return [e for e in harness.events(name) if e["reason"] == reason and e["type"] == "Warning"]


def test_a_quota_refusal_is_a_warning_on_the_workload_then_it_starts_once_there_is_room(
        harness, full_quota):
    controller = harness.controller()
    harness.submit(training_job("train"))
    [event] = wait(lambda: _warnings(harness, "train", QUOTA_REFUSED), 60,
                   "the quota refusal on the workload")
    assert "exceeded quota: no-room" in event["message"], event["message"]
    assert "tried again with back-off" in event["message"]
    assert "an estimation pod asks for 1 CPU and 2Gi" in event["message"]
    assert harness.job("train")["spec"]["suspend"] is True  # still held, not failed
    wait(lambda: (controller.metrics.registry.get_sample_value(
        "xmem_controller_estimation_pods_refused_total", {"reason": QUOTA_REFUSED}) or 0) >= 2,
        60, "a second refused try (back-off)")
    harness.cluster.apply({"apiVersion": "v1", "kind": "ResourceQuota",
                           "metadata": {"name": "no-room", "namespace": harness.namespace},
                           "spec": {"hard": {"pods": "10"}}})
    released = harness.wait_released("train", 240)
    assert labels.REQUEST_BYTES in released["spec"]["template"]["metadata"]["annotations"]
    wait(lambda: [e for e in harness.events("train") if e["reason"] == "Estimated"], 30,
         "the Estimated event")
    assert len(_warnings(harness, "train", QUOTA_REFUSED)) == 1  # said once, not per retry
