"""The Kueue AdmissionCheck the controller serves (``admission_checks``), at the controller's
level: the real API server with Kueue's own CRDs, Kueue's controller not running. The test does
what Kueue does around a check (creates the Workload owned by the Job, with the check ``Pending``
in its status once quota is reserved) and reads back what the controller wrote; the estimation
pods run for real on the process node. The real Kueue around it is tests/e2e_real/test_kueue.py.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List

import pytest
import yaml

from localkube.kueue import home as kueue_home
from tests.controller.support import Harness, policy_spec, training_job, wait
from tests.support.estimates import record_dict
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import records
from xmem_admission.cluster.controller.admission_checks import (
    ADMISSION_CHECK,
    CONTROLLER_NAME,
    WORKLOAD,
)
from xmem_admission.cluster.controller.gme_store import KubeStore
from xmem_admission.cluster.controller.manager import Controller
from xmem_admission.cluster.policy import fingerprint
from xmem_admission.cluster.policy.store import EstimateRecord


@pytest.fixture()
def kueue(harness: Harness) -> Iterator[Harness]:
    """The harness (real control plane) with Kueue's own CRDs (from its build, ``make tools``)
    and an AdmissionCheck of ours named after the test; controllers in-process."""
    for path in sorted((kueue_home() / "crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        harness.cluster.apply(crd)
        harness.cluster.wait_established(crd["metadata"]["name"])
    harness.use(policy_spec(integration="Kueue"))
    harness.cluster.apply({"apiVersion": ADMISSION_CHECK.api_version, "kind": "AdmissionCheck",
                           "metadata": {"name": check(harness)},
                           "spec": {"controllerName": CONTROLLER_NAME}})
    try:
        yield harness
    finally:
        for name in (check(harness), f"provisioning-{harness.namespace}"[:63]):
            harness.cluster.delete(ADMISSION_CHECK.api_version, "AdmissionCheck", name)


def check(harness: Harness) -> str:
    """The test's AdmissionCheck (cluster-scoped: one name per test)."""
    return f"xmem-{harness.namespace}"[:63]


def controller(harness: Harness) -> Controller:
    return harness.controller(kueue_check=CONTROLLER_NAME)


def queued_job(harness: Harness, name: str, glass: str = "", **job: Any) -> Dict[str, Any]:
    """A Job submitted to a Kueue LocalQueue, through the webhook, suspended as Kueue's own
    webhook leaves it, and the Workload Kueue makes for it with our check Pending. ``glass``:
    as the webhook leaves an admin's break-glass instead (the annotation on the Job and in its
    template, where only the webhook writes it)."""
    obj = training_job(name, **job)
    obj["metadata"]["labels"][labels.KUEUE_QUEUE_NAME] = "gpu-queue"
    obj["spec"]["suspend"] = True
    if glass:
        for meta in (obj["metadata"], obj["spec"]["template"]["metadata"]):
            meta.setdefault("annotations", {})[labels.BREAK_GLASS] = glass
        created = harness.create(dict(obj, metadata=dict(obj["metadata"],
                                                         namespace=harness.namespace)))
    else:
        created = harness.submit(obj)
    m = created["metadata"]
    workload = harness.create({
        "apiVersion": WORKLOAD.api_version, "kind": "Workload",
        "metadata": {"name": f"job-{name}-1a2b3", "namespace": m["namespace"],
                     "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job",
                                          "name": name, "uid": m["uid"], "controller": True}]},
        "spec": {"queueName": "gpu-queue", "podSets": [
            {"name": "main", "count": 1, "template": created["spec"]["template"]}]}})
    harness.kube().replace_status(WORKLOAD, dict(workload, status={"admissionChecks": [
        {"name": check(harness), "state": "Pending", "message": "",
         "lastTransitionTime": records.stamp()}]}))
    return created


def check_state(harness: Harness, name: str, settled: bool = True) -> Dict[str, Any]:
    def state() -> Any:
        wl = harness.get(WORKLOAD.api_version, "Workload", f"job-{name}-1a2b3")
        found = ((wl.get("status") or {}).get("admissionChecks") or [{}])[0]
        return found if not settled or found.get("state") != "Pending" else None
    found: Dict[str, Any] = wait(state, 120, f"the check of {name} to settle")
    return found


def test_the_controller_marks_its_admission_check_active_and_leaves_others_alone(kueue):
    provisioning = f"provisioning-{kueue.namespace}"[:63]
    kueue.create({"apiVersion": ADMISSION_CHECK.api_version, "kind": "AdmissionCheck",
                  "metadata": {"name": provisioning},
                  "spec": {"controllerName": "kueue.x-k8s.io/provisioning-request"}})
    controller(kueue)

    def active() -> Any:
        ours = kueue.get(ADMISSION_CHECK.api_version, "AdmissionCheck", check(kueue), None)
        return [c for c in (ours.get("status") or {}).get("conditions") or []
                if c["type"] == "Active" and c["status"] == "True"]
    wait(active, 30, "the check to be Active")
    other = kueue.get(ADMISSION_CHECK.api_version, "AdmissionCheck", provisioning, None)
    assert not (other.get("status") or {}).get("conditions")


def test_a_queued_job_is_estimated_and_its_check_made_ready_with_the_sizing(kueue):
    controller(kueue)
    queued_job(kueue, "train")
    state = check_state(kueue, "train")
    assert state["state"] == "Ready", state
    assert "estimated" in state["message"] and "GiB" in state["message"]
    (update,) = state["podSetUpdates"]
    assert update["name"] == "main"
    # The webhook copied the opt-in label into the template at CREATE: no conflicting update.
    assert "labels" not in update
    request = int(update["annotations"][labels.REQUEST_BYTES])
    assert update["annotations"][labels.GPU_MODEL] in ("A100-80GB", "H100-80GB")
    assert 0 < int(update["annotations"][labels.ESTIMATE_BYTES]) <= request
    (gme,) = kueue.gmes()
    assert records.phase(gme) == records.SUCCEEDED
    job = kueue.job("train")
    assert job["spec"]["suspend"] is True  # only Kueue unsuspends it
    assert labels.HELD_REASON not in (job["metadata"].get("annotations") or {})


def test_a_repeat_job_is_ready_at_once_without_a_second_estimation(kueue):
    controller(kueue)
    queued_job(kueue, "first")
    assert check_state(kueue, "first")["state"] == "Ready"
    def pods_created() -> int:  # estimation pods are deleted once their result is in
        return sum(1 for method, path, code in kueue.proxy.seen
                   if method == "POST" and path.endswith(f"/namespaces/{kueue.namespace}/pods")
                   and code == 201)

    pods = pods_created()
    assert pods == 1
    queued_job(kueue, "second")
    state = check_state(kueue, "second")
    assert state["state"] == "Ready" and state["podSetUpdates"]
    assert pods_created() == pods


def test_a_job_an_admin_broke_the_glass_for_is_ready_at_once_unsized_and_not_estimated(kueue):
    kueue.use(policy_spec(integration="Kueue", enforcement="Enforce"))
    controller(kueue)
    queued_job(kueue, "urgent", glass="INC-4711: estimator down")
    state = check_state(kueue, "urgent")
    assert state["state"] == "Ready", state
    assert "break-glass" in state["message"] and not state.get("podSetUpdates")
    assert not kueue.gmes() and not kueue.estimation_pods()


def _recorded(harness: Harness, name: str, totals: Dict[str, float]) -> None:
    """An estimate already recorded for the Job ``name`` will be (as a finished run leaves it)."""
    obj = training_job(name)
    fp = fingerprint.of_templates([obj["spec"]["template"]], ("A100-80GB", "H100-80GB"),
                                  harness.versions(harness.namespace))
    data = record_dict(fp, totals)
    data["workload"] = {"namespace": harness.namespace, "kind": "Job", "name": name}
    KubeStore(harness.kube()).put(EstimateRecord.from_dict(data))


def test_an_estimate_that_fits_no_gpu_is_rejected_with_the_reason_where_the_policy_enforces(
        kueue):
    kueue.use(policy_spec(integration="Kueue", enforcement="Enforce"))
    _recorded(kueue, "huge", {"A100-80GB": 300.0, "H100-80GB": 300.0})
    controller(kueue)
    queued_job(kueue, "huge")
    state = check_state(kueue, "huge")
    assert state["state"] == "Rejected", state
    assert "fits no GPU" in state["message"] and "300" in state["message"]


@pytest.mark.parametrize("action, state, sized", [("Release", "Ready", False),
                                                  ("Hold", "Retry", False),
                                                  ("Default", "Ready", True)])
def test_a_failed_estimation_follows_the_policys_failure_action_with_the_reason(
        kueue, action: str, state: str, sized: bool):
    failure: Dict[str, Any] = {"action": action}
    if action == "Default":
        failure["defaultRequest"] = "20Gi"
    kueue.use(policy_spec(integration="Kueue", onEstimationFailure=failure))
    controller(kueue)
    queued_job(kueue, "broken", script="fails_before_step.py", args=())
    found = check_state(kueue, "broken")
    assert found["state"] == state, found
    assert "(ScriptFailed)" in found["message"]
    annotations: List[Dict[str, str]] = [u.get("annotations") or {}
                                         for u in found.get("podSetUpdates") or []]
    assert any(a.get(labels.REQUEST_BYTES) == str(20 << 30) for a in annotations) is sized
    if state == "Retry":
        assert found["requeueAfterSeconds"] > 0


def test_a_workload_of_a_kind_xmem_does_not_size_is_ready_at_once_saying_so(kueue):
    """Kueue's plain-pod integration: the Workload is owned by a Pod Kueue keeps gated."""
    controller(kueue)
    pod = kueue.create({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "solo",
                                                        "namespace": kueue.namespace},
        "spec": {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}],
                 "containers": [{"name": "main", "image": "busybox:1.36"}]}})
    workload = kueue.create({
        "apiVersion": WORKLOAD.api_version, "kind": "Workload",
        "metadata": {"name": "pod-solo-1a2b3", "namespace": kueue.namespace,
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "solo",
                                          "uid": pod["metadata"]["uid"], "controller": True}]},
        "spec": {"queueName": "gpu-queue", "podSets": [{"name": "main", "count": 1, "template": {
            "spec": {"containers": pod["spec"]["containers"]}}}]}})
    kueue.kube().replace_status(WORKLOAD, dict(workload, status={"admissionChecks": [
        {"name": check(kueue), "state": "Pending", "message": "",
         "lastTransitionTime": records.stamp()}]}))

    def state() -> Any:
        wl = kueue.get(WORKLOAD.api_version, "Workload", "pod-solo-1a2b3")
        found = wl["status"]["admissionChecks"][0]
        return found if found["state"] != "Pending" else None
    found = wait(state, 30, "the check to settle")
    assert found["state"] == "Ready" and "does not size Pod" in found["message"]
    assert "podSetUpdates" not in found
    assert kueue.estimation_pods() == []
