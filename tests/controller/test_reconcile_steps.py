"""Each reconcile step on its own: one call, then the API objects it must have written.

The controller's caches run (its informers), its workers do not: the test calls the workload and
estimation reconcilers by hand, the process node on the real control plane runs the estimation pod for real (the probe on
the example GPT script), and every assertion reads the API.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Dict

import pytest

from tests.controller.support import (
    TINY_GPT,
    Harness,
    policy_spec,
    template_annotations,
    training_job,
    wait,
)
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import estimation_line, estimation_pods, records, workloads
from xmem_admission.cluster.controller.manager import Controller
from xmem_admission.cluster.kube.client import GME
from xmem_admission.contract.errors import KubeApiError


@pytest.fixture()
def caches(harness: Harness) -> Controller:
    """A controller whose informers run and whose queue nobody drains."""
    return _caches(harness)


def _caches(harness: Harness) -> Controller:
    controller = harness.controller(start=False)
    for informer in controller.informers():
        informer.start()
    for informer in controller.informers():
        assert informer.synced.wait(60), informer.error
    harness.controllers.append(controller)
    return controller


def _fresh(controller: Controller, namespace: str, kind: str, name: str,
           want: Any) -> Dict[str, Any]:
    """Wait until the cache shows what the API has (the watch delivers asynchronously)."""
    informer = controller.ctx.estimates if kind == "gme" else controller.ctx.pods if kind == "pod" \
        else controller.ctx.workloads["Job"].informer
    return wait(lambda: (lambda o: o if o is not None and want(o) else None)(
        informer.get(namespace, name)), 30, f"{kind} {name} in the cache")


def _reconcile_job(harness: Harness, controller: Controller, name: str) -> None:
    """One workload reconcile from a cache that has caught up with the API. On a real cluster
    the Job controller writes the Job too (its status while suspended), so a write from the
    cache can still meet a newer version: 409, and the worker starts over, as here."""
    for _ in range(20):
        current = harness.job(name)["metadata"]["resourceVersion"]
        _fresh(controller, harness.namespace, "job", name,
               lambda o, seen=int(current): int(o["metadata"]["resourceVersion"]) >= seen)
        try:
            workloads.reconcile(controller.ctx, "Job", harness.namespace, name)
            return
        except KubeApiError as exc:
            if not exc.conflict:
                raise
    raise AssertionError(f"job {name}: 20 conflicts in a row")


def test_a_held_workload_gets_an_estimate_object_no_workload_owns_and_is_marked_estimating(
        harness, caches):
    job = harness.submit(training_job("train"))
    _reconcile_job(harness, caches, "train")
    [gme] = harness.gmes()
    fp = job["metadata"]["annotations"][labels.FINGERPRINT]
    assert gme["metadata"]["name"] == records.name_for(fp)
    assert gme["spec"]["fingerprint"] == fp and gme["spec"]["gpus"] == ["A100-80GB", "H100-80GB"]
    assert "ownerReferences" not in gme["metadata"]  # it outlives the job (estimate_cache)
    assert gme["spec"]["workload"]["name"] == "train"
    held = harness.job("train")
    assert held["metadata"]["annotations"][labels.HELD_REASON] == "Estimating"
    assert held["spec"]["suspend"] is True


def _start_step(caches: Controller, namespace: str, name: str) -> None:
    """The estimate's turn (the line's dispatch grants it a slot), then its reconcile."""
    estimation_line.dispatch(caches.ctx)
    assert caches.ctx.line.granted((namespace, name))
    estimation_pods.reconcile(caches.ctx, namespace, name)


def test_an_estimate_waits_behind_an_earlier_workload_whose_reconcile_has_not_run_yet(harness):
    """First come, first served holds while a reconcile lags: the later workload's estimate
    exists first, and still waits for the earlier one's."""
    harness.use(policy_spec(estimation={"maxConcurrentPerNamespace": 1}))
    caches = _caches(harness)
    namespace = harness.namespace
    for index, name in enumerate(["first", "second"]):  # a positional argument each: two
        harness.submit(training_job(name, script="fails_before_step.py",  # trial families
                                    args=[f"shard-{index}"]))
    _fresh(caches, namespace, "job", "first", lambda o: True)
    _reconcile_job(harness, caches, "second")
    [later] = harness.gmes()
    second = later["metadata"]["name"]
    _fresh(caches, namespace, "gme", second, lambda o: True)
    estimation_line.dispatch(caches.ctx)
    assert not caches.ctx.line.granted((namespace, second))  # the first keeps its place

    _reconcile_job(harness, caches, "first")
    [first] = [g["metadata"]["name"] for g in harness.gmes()
               if g["spec"]["workload"]["name"] == "first"]
    _fresh(caches, namespace, "gme", first, lambda o: True)
    estimation_line.dispatch(caches.ctx)
    assert caches.ctx.line.granted((namespace, first))
    assert not caches.ctx.line.granted((namespace, second))  # one at a time in the namespace


def test_the_estimate_step_waits_its_turn_then_creates_one_pod_and_records_it_running(
        harness, caches):
    harness.submit(training_job("train"))
    _reconcile_job(harness, caches, "train")
    [gme] = harness.gmes()
    name = gme["metadata"]["name"]
    _fresh(caches, harness.namespace, "gme", name, lambda o: True)
    estimation_pods.reconcile(caches.ctx, harness.namespace, name)  # no slot granted yet
    assert harness.estimation_pods() == []
    queued = harness.gmes()[0]["status"]  # kubectl shows it queued, not a blank row
    assert queued["phase"] == "Pending"
    assert _condition(queued, "Estimating")[:2] == ("True", "Queued")
    assert _condition(queued, "Estimated")[:2] == ("False", "InProgress")
    _fresh(caches, harness.namespace, "gme", name, lambda o: "conditions" in o["status"])
    _start_step(caches, harness.namespace, name)
    estimation_pods.reconcile(caches.ctx, harness.namespace, name)  # again: no second pod
    [pod] = harness.estimation_pods()
    assert re.fullmatch(r"train-xmem-[0-9a-f]{8}", pod["metadata"]["name"])
    assert pod["metadata"]["ownerReferences"][0]["uid"] == gme["metadata"]["uid"]
    status = harness.gmes()[0]["status"]
    assert (status["phase"], status["podName"], status["attempt"]) == \
        ("Running", pod["metadata"]["name"], 1)
    running = _condition(status, "Estimating")
    assert running[:2] == ("True", "PodRunning") and pod["metadata"]["name"] in running[2]
    assert running[3] == _condition(queued, "Estimating")[3]  # still true: no transition


def _condition(status: Dict[str, Any], kind: str) -> Any:
    """A condition's status, reason, message and lastTransitionTime."""
    [found] = [c for c in status["conditions"] if c["type"] == kind]
    return found["status"], found["reason"], found["message"], found["lastTransitionTime"]


def test_an_estimate_an_older_release_recorded_gets_its_conditions_on_the_next_pass(
        harness, caches):
    name = records.name_for("e" * 32)
    kube = harness.kube()
    created = kube.create(GME, harness.namespace, records.new(
        training_job("train", harness.namespace), "e" * 32, ["A100-80GB"], "pytorch/pytorch"))
    estimate = {"gpu": "A100-80GB", "capacityBytes": 80 << 30, "peakReservedBytes": 3 << 30,
                "totalBytes": 4 << 30, "recommendedRequestBytes": 5 << 30, "fits": True}
    kube.replace_status(GME, dict(created, status={  # as written before conditions existed
        "phase": "Succeeded", "attempt": 1, "completionTime": "2026-01-31T12:00:00Z",
        "mode": "Fake", "estimates": [estimate], "gpu": "A100-80GB", "estimateBytes": 4 << 30,
        "estimate": "4.0Gi", "requestBytes": 5 << 30, "request": "5.0Gi"}))
    _fresh(caches, harness.namespace, "gme", name, lambda o: "phase" in (o.get("status") or {}))
    estimation_pods.reconcile(caches.ctx, harness.namespace, name)
    [gme] = harness.gmes()
    assert gme["status"]["observedGeneration"] == gme["metadata"]["generation"]
    assert _condition(gme["status"], "Estimated")[:3] == (
        "True", "Traced", "4.0Gi on A100-80GB, request 5.0Gi")
    assert [c["type"] for c in gme["status"]["conditions"] if c["status"] == "True"] == \
        ["Estimated"]
    written = gme["metadata"]["resourceVersion"]
    _fresh(caches, harness.namespace, "gme", name,
           lambda o: o["metadata"]["resourceVersion"] == written)
    estimation_pods.reconcile(caches.ctx, harness.namespace, name)  # nothing more to say
    assert harness.gmes()[0]["metadata"]["resourceVersion"] == written


def test_a_finished_pod_is_recorded_and_the_release_step_annotates_and_unsuspends(harness, caches):
    harness.submit(training_job("train"))
    _reconcile_job(harness, caches, "train")
    name = harness.gmes()[0]["metadata"]["name"]
    _fresh(caches, harness.namespace, "gme", name, lambda o: True)
    _start_step(caches, harness.namespace, name)
    pod = harness.gmes()[0]["status"]["podName"]
    _fresh(caches, harness.namespace, "pod", pod,
           lambda p: (p.get("status") or {}).get("phase") in ("Succeeded", "Failed"))
    estimation_pods.reconcile(caches.ctx, harness.namespace, name)
    status = harness.gmes()[0]["status"]
    assert status["phase"] == "Succeeded", status
    # the result is recorded: the pod is deleted (its estimate holds what it said)
    wait(lambda: harness.estimation_pods() == [], 30, "the succeeded pod to be deleted")
    assert [e["gpu"] for e in status["estimates"]] == ["A100-80GB", "H100-80GB"]
    assert status["gpu"] == "A100-80GB" and status["estimate"].endswith("Gi")
    assert status["requestBytes"] >= status["estimateBytes"] > 0
    _fresh(caches, harness.namespace, "gme", name, lambda o: records.phase(o) == "Succeeded")
    assert harness.job("train")["metadata"]["annotations"][labels.HELD_REASON] == "Estimating"
    _reconcile_job(harness, caches, "train")
    released = harness.job("train")
    assert released["spec"]["suspend"] is False
    assert not set(labels.HELD_ANNOTATIONS) & set(released["metadata"]["annotations"])
    sized = template_annotations(released)
    assert int(sized[labels.REQUEST_BYTES]) == status["requestBytes"]
    assert sized[labels.GPU_MODEL] == "A100-80GB"
    assert int(sized[labels.ESTIMATE_BYTES]) == status["estimateBytes"]
    [event] = harness.events("train")
    assert event["reason"] == "Estimated"
    assert "on A100-80GB; requesting nvidia.com/gpumem" in event["message"]
    # what holds the memory at the peak, from the pod's version-2 result
    peak = status["peak"]
    assert peak["gpu"] == "A100-80GB" and 1 <= len(peak["groups"]) <= 3
    assert peak["groups"][0]["bytes"] >= peak["groups"][-1]["bytes"] > 0
    assert peak["largest"] == records.largest_text(peak["groups"][0])
    assert f"largest at the peak: {peak['largest']}" in event["message"]
    assert status["reproduce"].startswith("xmem estimate --gpu A100-80GB,H100-80GB --steps ")
    assert status["reproduce"].endswith("-- python /app/train_gpt.py " + " ".join(TINY_GPT))
    kubectl = Path(__file__).resolve().parents[2] / ".tools" / "bin" / "kubectl"
    if not kubectl.exists() and shutil.which("kubectl") is None:
        pytest.skip("no kubectl for `kubectl describe gme`: scripts/install-tools.sh installs it")
    described = subprocess.run(
        # the control plane's own admin kubeconfig: the harness's goes through its plain-HTTP
        # fault proxy, over which kubectl sends no bearer token
        [str(kubectl) if kubectl.exists() else "kubectl", "--kubeconfig",
         str(harness.cluster.plane.admin_kubeconfig), "describe", "gme", name, "-n",
         harness.namespace],
        capture_output=True, text=True, timeout=60, check=True).stdout
    for group in peak["groups"]:
        assert group["module"] in described and group["op"] in described
    assert "Reproduce:" in described and "/app/train_gpt.py" in described


def test_a_second_workload_with_the_same_fingerprint_joins_the_estimate(harness, caches):
    first = harness.submit(training_job("first"))
    second = harness.submit(training_job("second"))
    _fresh(caches, harness.namespace, "job", "second", lambda o: True)
    _reconcile_job(harness, caches, "first")
    _fresh(caches, harness.namespace, "gme", harness.gmes()[0]["metadata"]["name"], lambda o: True)
    _reconcile_job(harness, caches, "second")
    [gme] = harness.gmes()
    assert "ownerReferences" not in gme["metadata"]  # joining writes no owner on it
    assert gme["status"]["lastUsedTime"]
    waiting = caches.ctx.waiters.of(harness.namespace, gme["metadata"]["name"])
    assert [uid for _kind, _name, uid in waiting] == [first["metadata"]["uid"],
                                                       second["metadata"]["uid"]]


def test_a_failure_older_than_the_hold_starts_a_new_attempt(harness, caches):
    job = harness.submit(training_job("train"))
    fp = job["metadata"]["annotations"][labels.FINGERPRINT]
    kube = harness.kube()
    from xmem_admission.cluster.kube.client import GME

    created = kube.create(GME, harness.namespace, records.new(job, fp, ["A100-80GB", "H100-80GB"], "x"))
    kube.replace_status(GME, dict(created, status={
        "phase": "Failed", "attempt": 1, "reason": "ImagePullFailed", "message": "was missing",
        "completionTime": "2020-01-01T00:00:00Z"}))
    _fresh(caches, harness.namespace, "gme", created["metadata"]["name"], lambda o: records.phase(o) == "Failed")
    _reconcile_job(harness, caches, "train")
    status = harness.gmes()[0]["status"]
    assert (status["phase"], status["attempt"]) == ("Pending", 2)
    assert harness.job("train")["spec"]["suspend"] is True
