"""The controller releases a held TrainJob through its own runtime patch, with the real JobSet and
Kubeflow Trainer controllers and Trainer's webhooks judging every write (the ``trainer`` fixture):

- the sizing annotations and the opt-in label go into one runtime patch the controller owns
  (manager ``xmem.io/controller``), in the update that unsuspends the TrainJob, which Trainer's
  validating webhook admits (runtime patches may change while it is suspended);
- Trainer copies them into the JobSet it makes, on the trainer step's pod template, so the
  Job controller's pods carry ``xmem.io/request-bytes`` for the Pod webhook to turn into the
  backend's request;
- a second sizing replaces the controller's entry and keeps everyone else's: never two.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import pytest

from tests.controller.support import Harness, wait
from tests.support.builders import review
from tests.support.estimates import record_dict
from tests.support.harness import LocalWebhook
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller.gme_store import KubeStore
from xmem_admission.cluster.integrations.trainjob import MANAGER, TrainJobIntegration
from xmem_admission.cluster.policy.store import EstimateRecord
from xmem_admission.contract.errors import KubeApiError

TRAINER_API = "trainer.kubeflow.org/v1alpha1"
TRAINJOB = TrainJobIntegration()


@pytest.fixture()
def stack(trainer: Any, harness: Harness) -> Harness:
    """The test's namespace on a control plane where JobSet and Trainer run."""
    return harness


def held_trainjob(harness: Harness, name: str, patches: Optional[list] = None) -> Dict[str, Any]:
    """A 2-node x 4-process TrainJob on Trainer's torch runtime, created as the xmem webhook
    leaves it (held), its runtime read through the harness's API."""
    obj: Dict[str, Any] = {
        "apiVersion": TRAINER_API, "kind": "TrainJob",
        "metadata": {"name": name, "namespace": harness.namespace,
                     "labels": {labels.OPT_IN: labels.OPT_IN_VALUE}},
        "spec": {"runtimeRef": {"name": "torch-distributed"},
                 "trainer": {"image": "python:3.11-slim", "command": ["torchrun", "train.py"],
                             "numNodes": 2, "numProcPerNode": 4,
                             "resourcesPerNode": {"limits": {"nvidia.com/gpu": "4"}}}},
    }
    if patches:
        obj["spec"]["runtimePatches"] = patches
    webhook = LocalWebhook(harness.policy)
    webhook.webhook.reader = harness.kube()
    answer = webhook.send(review(obj))
    assert answer.allowed, answer.status
    return harness.create(answer.patched())


def record_estimate(harness: Harness, held: Dict[str, Any]) -> None:
    """The estimate the held TrainJob's fingerprint names, recorded as a finished run leaves
    it (the estimation itself is the e2e tests')."""
    data = record_dict(held["metadata"]["annotations"][labels.FINGERPRINT],
                       {"A100-80GB": 11.7, "H100-80GB": 11.9})
    data["workload"] = {"namespace": harness.namespace, "kind": "TrainJob",
                        "name": held["metadata"]["name"]}
    KubeStore(harness.kube()).put(EstimateRecord.from_dict(data))


def trainjob(harness: Harness, name: str) -> Dict[str, Any]:
    found = harness.get(TRAINER_API, "TrainJob", name)
    assert found is not None
    return found


def released(harness: Harness, name: str) -> Dict[str, Any]:
    def done() -> Optional[Dict[str, Any]]:
        obj = trainjob(harness, name)
        return None if labels.HELD_REASON in (obj["metadata"].get("annotations") or {}) else obj
    return wait(done, 90, f"TrainJob {name} to be released")


def own_patches(obj: Dict[str, Any]) -> list:
    return [p for p in obj["spec"].get("runtimePatches") or [] if p.get("manager") == MANAGER]


def test_a_held_trainjob_is_released_with_its_sizing_in_the_controllers_runtime_patch(stack):
    held = held_trainjob(stack, "llm")
    assert held["spec"]["suspend"] is True and not own_patches(held)
    record_estimate(stack, held)
    stack.controller()
    obj = released(stack, "llm")
    assert obj["spec"]["suspend"] is False
    (patch,) = own_patches(obj)
    (job,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    assert job["name"] == "node"
    meta = job["template"]["spec"]["template"]["metadata"]
    assert int(meta["annotations"][labels.REQUEST_BYTES]) > int(11.7 * (1 << 30))
    assert meta["annotations"][labels.GPU_MODEL] == "A100-80GB"
    assert meta["labels"] == {labels.OPT_IN: labels.OPT_IN_VALUE}
    # the Event is written after the release: waited for, not read at once
    (event,) = wait(lambda: [e for e in stack.events("llm") if e["reason"] == "Estimated"], 30,
                    "the Estimated event")
    assert "requesting nvidia.com/gpumem" in event["message"]

    # Trainer makes the JobSet with the sizing on the trainer step's pods
    jobset = wait(lambda: stack.get("jobset.x-k8s.io/v1alpha2", "JobSet", "llm"), 60,
                  "Trainer's JobSet")
    (node,) = [j for j in jobset["spec"]["replicatedJobs"] if j["name"] == "node"]
    pod_meta = node["template"]["spec"]["template"]["metadata"]
    assert pod_meta["annotations"][labels.REQUEST_BYTES] == meta["annotations"][
        labels.REQUEST_BYTES]
    assert pod_meta["labels"][labels.OPT_IN] == labels.OPT_IN_VALUE
    assert node["template"]["spec"]["parallelism"] == 2
    owner = next(r for r in jobset["metadata"]["ownerReferences"] if r.get("controller"))
    assert (owner["kind"], owner["uid"]) == ("TrainJob", obj["metadata"]["uid"])


def hold_again(harness: Harness, name: str) -> None:
    """Suspend a released TrainJob with the hold annotations, as the webhook holds one (a fresh
    read per attempt: Trainer's controller writes it too)."""
    for _ in range(20):
        obj = trainjob(harness, name)
        obj["spec"]["suspend"] = True
        obj["metadata"]["annotations"][labels.HELD_REASON] = "AwaitingEstimate"
        try:
            harness.kube().replace(TRAINJOB.resource, obj)
            return
        except KubeApiError as exc:
            if not exc.conflict:
                raise
    raise AssertionError(f"TrainJob {name}: 20 conflicts in a row")


def test_sizing_again_replaces_the_controllers_entry_beside_the_others(stack):
    team = {"manager": "example.com/team", "trainingRuntimeSpec": {"template": {"spec": {
        "replicatedJobs": [{"name": "node", "template": {"spec": {"template": {
            "metadata": {"annotations": {"team": "nlp"}}}}}}]}}}}
    held = held_trainjob(stack, "twice", patches=[team])
    record_estimate(stack, held)
    stack.controller()
    first = released(stack, "twice")
    assert [p["manager"] for p in first["spec"]["runtimePatches"]] == ["example.com/team",
                                                                       MANAGER]
    # Held again and released again: the controller's entry is the one it wrote, not a second
    # one beside it; the team's entry is kept.
    hold_again(stack, "twice")
    second = released(stack, "twice")
    assert second["spec"]["suspend"] is False
    assert [p["manager"] for p in second["spec"]["runtimePatches"]] == ["example.com/team",
                                                                        MANAGER]
    assert own_patches(second) == own_patches(first)
