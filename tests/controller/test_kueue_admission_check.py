"""The Kueue AdmissionCheck the controller serves (``admission_checks``), on the stand-in cluster.

Kueue itself is not in the stand-in: the test does what Kueue does around a check (creates the
Workload owned by the Job, with the check ``Pending`` in its status once quota is reserved) and
reads back what the controller wrote. The estimation pods run for real on the stand-in node. The
real Kueue, on the real control plane, is in tests/e2e_real/test_kueue.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from tests.controller.support import CRDS, code_map, hold, policy_spec, training_job
from tests.fakekube.apiserver import wait_for as wait
from tests.fakekube.cluster import PROBE_IMAGE, Cluster
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
from xmem_admission.cluster.kube.client import Kube
from xmem_admission.cluster.policy import fingerprint
from xmem_admission.cluster.policy.model import Policy
from xmem_admission.cluster.policy.sources import StaticPolicySource
from xmem_admission.cluster.policy.store import EstimateRecord

REPO = Path(__file__).resolve().parents[2]
KUEUE_CRDS = [str(REPO / "tests/data/crds/kueue.x-k8s.io_admissionchecks.yaml"),
              str(REPO / "tests/data/crds/kueue.x-k8s.io_workloads.yaml")]
CHECK = "xmem-gpu-memory"


class StandIn:
    """The stand-in cluster with Kueue's CRDs and our AdmissionCheck; controllers in-process."""

    def __init__(self, root: Path) -> None:
        self.cluster = Cluster(str(root), crds=CRDS + KUEUE_CRDS).start()
        self.server = self.cluster.server
        self.use(policy_spec(integration="kueue"))
        self.server.create(code_map())
        self.server.create({"apiVersion": ADMISSION_CHECK.api_version, "kind": "AdmissionCheck",
                            "metadata": {"name": CHECK},
                            "spec": {"controllerName": CONTROLLER_NAME}})
        self.controllers: List[Controller] = []

    def use(self, spec: Dict[str, Any]) -> None:
        self.policy = Policy.from_spec(spec)

    def kube(self) -> Kube:
        return Kube(self.server.api_client(), backoff=0.05)

    def controller(self) -> Controller:
        controller = Controller(self.kube(), StaticPolicySource(self.policy), PROBE_IMAGE,
                                resync_seconds=0.5, sync_timeout=10, deadline_slack=2.0,
                                identity=f"test-{len(self.controllers)}",
                                kueue_check=CONTROLLER_NAME)
        self.controllers.append(controller)
        return controller.start()

    def submit(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        """Through the real webhook's mutation (in-process), then the API."""
        return self.server.create(hold(obj, self.policy))

    def estimation_pods(self) -> List[Dict[str, Any]]:
        return self.server.list("v1", "Pod", "default", "app.kubernetes.io/component=estimation")

    def close(self) -> None:
        for controller in self.controllers:
            controller.stop()
        self.cluster.stop()


@pytest.fixture()
def kueue(tmp_path: Path) -> Iterator[StandIn]:
    running = StandIn(tmp_path)
    try:
        yield running
    finally:
        running.close()


def queued_job(harness: StandIn, name: str, **job: Any) -> Dict[str, Any]:
    """A Job submitted to a Kueue LocalQueue, through the webhook, suspended as Kueue's own
    webhook leaves it, and the Workload Kueue makes for it with our check Pending."""
    obj = training_job(name, **job)
    obj["metadata"]["labels"][labels.KUEUE_QUEUE_NAME] = "gpu-queue"
    obj["spec"]["suspend"] = True
    created = harness.submit(obj)
    m = created["metadata"]
    workload = harness.server.create({
        "apiVersion": WORKLOAD.api_version, "kind": "Workload",
        "metadata": {"name": f"job-{name}-1a2b3", "namespace": m["namespace"],
                     "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job",
                                          "name": name, "uid": m["uid"], "controller": True}]},
        "spec": {"queueName": "gpu-queue", "podSets": [
            {"name": "main", "count": 1, "template": created["spec"]["template"]}]}})
    harness.kube().replace_status(WORKLOAD, dict(workload, status={"admissionChecks": [
        {"name": CHECK, "state": "Pending", "message": "",
         "lastTransitionTime": records.stamp()}]}))
    return created


def check_state(harness: StandIn, name: str, settled: bool = True) -> Dict[str, Any]:
    def state() -> Any:
        wl = harness.server.get(WORKLOAD.api_version, "Workload", f"job-{name}-1a2b3", "default")
        found = ((wl.get("status") or {}).get("admissionChecks") or [{}])[0]
        return found if not settled or found.get("state") != "Pending" else None
    found: Dict[str, Any] = wait(state, 120, f"the check of {name} to settle")
    return found


def test_the_controller_marks_its_admission_check_active_and_leaves_others_alone(kueue):
    kueue.server.create({"apiVersion": ADMISSION_CHECK.api_version, "kind": "AdmissionCheck",
                         "metadata": {"name": "provisioning"},
                         "spec": {"controllerName": "kueue.x-k8s.io/provisioning-request"}})
    kueue.controller()

    def active() -> Any:
        check = kueue.server.get(ADMISSION_CHECK.api_version, "AdmissionCheck", CHECK)
        return [c for c in (check.get("status") or {}).get("conditions") or []
                if c["type"] == "Active" and c["status"] == "True"]
    wait(active, 30, "the check to be Active")
    other = kueue.server.get(ADMISSION_CHECK.api_version, "AdmissionCheck", "provisioning")
    assert not (other.get("status") or {}).get("conditions")


def test_a_queued_job_is_estimated_and_its_check_made_ready_with_the_sizing(kueue):
    kueue.controller()
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
    (gme,) = kueue.server.list("xmem.io/v1alpha1", "GPUMemoryEstimate", "default")
    assert records.phase(gme) == records.SUCCEEDED
    job = kueue.server.get("batch/v1", "Job", "train", "default")
    assert job["spec"]["suspend"] is True  # only Kueue unsuspends it
    assert labels.HELD_REASON not in (job["metadata"].get("annotations") or {})


def test_a_repeat_job_is_ready_at_once_without_a_second_estimation(kueue):
    kueue.controller()
    queued_job(kueue, "first")
    assert check_state(kueue, "first")["state"] == "Ready"
    pods = len(kueue.estimation_pods())
    queued_job(kueue, "second")
    state = check_state(kueue, "second")
    assert state["state"] == "Ready" and state["podSetUpdates"]
    assert len(kueue.estimation_pods()) == pods


def _recorded(harness: StandIn, name: str, totals: Dict[str, float]) -> None:
    """An estimate already recorded for the Job ``name`` will be (as a finished run leaves it)."""
    obj = training_job(name)
    fp = fingerprint.of_templates([obj["spec"]["template"]], ("A100-80GB", "H100-80GB"))
    data = record_dict(fp, totals)
    data["workload"] = {"namespace": "default", "kind": "Job", "name": name}
    KubeStore(harness.kube()).put(EstimateRecord.from_dict(data))


def test_an_estimate_that_fits_no_gpu_is_rejected_with_the_reason_where_the_policy_enforces(
        kueue):
    kueue.use(policy_spec(integration="kueue", enforcement="Enforce"))
    _recorded(kueue, "huge", {"A100-80GB": 300.0, "H100-80GB": 300.0})
    kueue.controller()
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
    kueue.use(policy_spec(integration="kueue", onEstimationFailure=failure))
    kueue.controller()
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
    kueue.controller()
    pod = kueue.server.create({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "solo", "namespace": "default"},
        "spec": {"schedulingGates": [{"name": "kueue.x-k8s.io/admission"}],
                 "containers": [{"name": "main", "image": "busybox:1.36"}]}})
    workload = kueue.server.create({
        "apiVersion": WORKLOAD.api_version, "kind": "Workload",
        "metadata": {"name": "pod-solo-1a2b3", "namespace": "default",
                     "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "solo",
                                          "uid": pod["metadata"]["uid"], "controller": True}]},
        "spec": {"queueName": "gpu-queue", "podSets": [{"name": "main", "count": 1,
                                                        "template": {"spec": {}}}]}})
    kueue.kube().replace_status(WORKLOAD, dict(workload, status={"admissionChecks": [
        {"name": CHECK, "state": "Pending", "message": "",
         "lastTransitionTime": records.stamp()}]}))

    def state() -> Any:
        wl = kueue.server.get(WORKLOAD.api_version, "Workload", "pod-solo-1a2b3", "default")
        found = wl["status"]["admissionChecks"][0]
        return found if found["state"] != "Pending" else None
    found = wait(state, 30, "the check to settle")
    assert found["state"] == "Ready" and "does not size Pod" in found["message"]
    assert "podSetUpdates" not in found
    assert kueue.estimation_pods() == []
