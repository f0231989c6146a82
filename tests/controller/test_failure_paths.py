"""Every way an estimation can go wrong ends with the workload released or held by policy.

A full controller runs (workers, resync) against the real control plane; the process node runs
the estimation pods for real, with the probe, on scripts that fail the way users' scripts fail
(and an image from an unreachable registry fails to pull).
"""

from __future__ import annotations

from tests.controller.support import (
    TINY_GPT,
    UNPULLABLE,
    Harness,
    policy_spec,
    template_annotations,
    training_job,
    training_pytorchjob,
    wait,
)
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import records
from xmem_admission.cluster.kube.client import GME


def _warning(harness: Harness, name: str) -> dict:
    events = wait(lambda: [e for e in harness.events(name) if e["type"] == "Warning"], 30,
                  f"a Warning event on {name}")
    return events[0]


def test_a_script_failing_before_its_first_step_releases_the_job_with_its_last_lines(harness):
    harness.controller()
    harness.submit(training_job("train", script="fails_before_step.py", args=()))
    released = harness.wait_released("train")
    assert released["spec"]["suspend"] is False
    assert labels.REQUEST_BYTES not in template_annotations(released)  # released unchanged
    event = _warning(harness, "train")
    assert event["reason"] == "EstimationFailed"
    assert "(ScriptFailed)" in event["message"]
    assert "FileNotFoundError: no training shards under /data" in event["message"]
    assert "released unchanged" in event["message"]
    status = harness.gmes()[0]["status"]
    assert (status["phase"], status["reason"]) == ("Failed", "ScriptFailed")
    assert "fails_before_step.py" in status["message"]  # the traceback names the user's file


def test_an_estimation_pod_over_its_memory_limit_is_reported_oom_killed(harness):
    harness.use(policy_spec(estimation={"resources": {"cpu": "1", "memory": "300Mi"}}))
    harness.controller()
    harness.submit(training_job("train", script="hogs_memory.py", args=()))
    harness.wait_released("train")
    event = _warning(harness, "train")
    assert "(OOMKilled)" in event["message"]
    assert "memory limit (300Mi)" in event["message"]


def test_an_estimation_past_its_deadline_releases_the_job(harness):
    harness.use(policy_spec(estimation={"activeDeadlineSeconds": 2}))
    harness.controller()
    harness.submit(training_job("train", script="hangs.py", args=()))
    harness.wait_released("train")
    event = _warning(harness, "train")
    assert "(DeadlineExceeded)" in event["message"]
    assert "activeDeadlineSeconds=2" in event["message"]


def test_an_image_that_cannot_be_pulled_fails_the_estimation_and_frees_the_pod(harness):
    harness.controller()
    harness.submit(training_job("train", image=UNPULLABLE))
    harness.wait_released("train")
    event = _warning(harness, "train")
    assert "(ImagePullFailed)" in event["message"]
    assert UNPULLABLE in event["message"]
    wait(lambda: not harness.estimation_pods(), 15, "the stuck pod to be deleted")


def test_the_default_action_releases_with_the_policys_default_request(harness):
    harness.use(policy_spec(onEstimationFailure={"action": "Default", "defaultRequest": "20Gi"}))
    harness.controller()
    harness.submit(training_job("train", image=UNPULLABLE))
    released = harness.wait_released("train")
    sized = template_annotations(released)
    assert sized[labels.REQUEST_BYTES] == str(20 << 30)
    assert sized[labels.GPU_MODEL] == "A100-80GB"
    assert "default request 20.0 GiB" in _warning(harness, "train")["message"]


def test_the_hold_action_keeps_the_job_until_max_hold_then_releases_it(harness):
    harness.use(policy_spec(onEstimationFailure={"action": "Hold"},
                            estimation={"maxHoldSeconds": 4}))
    harness.controller()
    harness.submit(training_job("train", image=UNPULLABLE))
    held = wait(lambda: (lambda j: j if j["metadata"]["annotations"].get(labels.HELD_REASON)
                         == "EstimationFailed" else None)(harness.job("train")), 30,
                "the hold after the failure")
    assert held["spec"]["suspend"] is True
    released = harness.wait_released("train", timeout=30)
    assert released["spec"]["suspend"] is False
    messages = wait(lambda: (lambda ms: ms if len(ms) == 2 else None)(
        [e["message"] for e in harness.events("train")]), 10, "both Warning events")
    assert any("kept held until" in m for m in messages)
    assert any("released unchanged" in m for m in messages)


def test_a_workload_deleted_while_estimating_leaves_its_estimate_for_the_next_submission(
        harness):
    # estimates belong to the cache, not to a workload: deleting the only one waiting does not
    # take the estimate with it (the cache's TTL does, once unused)
    harness.use(policy_spec(estimation={"activeDeadlineSeconds": 60}))
    harness.controller()
    harness.submit(training_job("train", script="hangs.py", args=()))
    wait(lambda: [p for p in harness.estimation_pods()
                  if (p.get("status") or {}).get("phase") == "Running"], 30, "the pod to run")
    from kubernetes import client

    batch = client.BatchV1Api(harness.api_client())
    batch.delete_namespaced_job("train", harness.namespace, propagation_policy="Background")

    def gone() -> bool:
        return not [j for j in batch.list_namespaced_job(harness.namespace).items
                    if j.metadata.name == "train"]

    wait(gone, 30, "the job to be deleted")
    [gme] = harness.gmes()
    assert not (gme["metadata"].get("ownerReferences") or [])


def test_a_workload_edited_while_held_is_estimated_again_as_edited(harness):
    harness.use(policy_spec(estimation={"activeDeadlineSeconds": 60}))
    harness.controller()
    job = harness.submit(training_pytorchjob("ddp", script="hangs.py", args=()))
    old = job["metadata"]["annotations"][labels.FINGERPRINT]
    wait(harness.estimation_pods, 30, "the first estimation pod")
    from kubernetes import client

    container = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    container["command"] = ["python", "/app/train_gpt.py"]
    container["args"] = list(TINY_GPT)
    client.CustomObjectsApi(harness.api_client()).patch_namespaced_custom_object(
        "kubeflow.org", "v1", harness.namespace, "pytorchjobs", "ddp",
        {"spec": {"pytorchReplicaSpecs": {"Master": {"template": {"spec": {
            "containers": [container]}}}}}})

    def released() -> dict:
        obj = harness.get("kubeflow.org/v1", "PyTorchJob", "ddp")
        return obj if labels.HELD_REASON not in obj["metadata"]["annotations"] else None

    obj = wait(released, 90, "the edited PyTorchJob to be released")
    assert obj["spec"]["runPolicy"]["suspend"] is False
    assert obj["metadata"]["annotations"][labels.FINGERPRINT] != old
    master = obj["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["annotations"]
    assert int(master[labels.REQUEST_BYTES]) > 0
    wait(lambda: any(e["reason"] == "WorkloadChanged" for e in harness.events("ddp")), 10,
         "the WorkloadChanged event")


def test_a_job_unsuspended_by_someone_else_is_let_go_with_an_event(harness):
    harness.use(policy_spec(estimation={"activeDeadlineSeconds": 60}))
    harness.controller()
    harness.submit(training_job("train", script="hangs.py", args=()))
    wait(harness.estimation_pods, 30, "the estimation pod")
    from kubernetes import client

    client.BatchV1Api(harness.api_client()).patch_namespaced_job(
        "train", harness.namespace, {"spec": {"suspend": False}})
    harness.wait_released("train")
    wait(lambda: any(e["reason"] == "ReleasedElsewhere" for e in harness.events("train")), 10,
         "the ReleasedElsewhere event")


def test_an_estimate_that_fits_no_gpu_of_the_policy_is_a_failure_with_the_misfit(harness):
    job = harness.submit(training_job("train"))
    fp = job["metadata"]["annotations"][labels.FINGERPRINT]
    kube = harness.kube()
    created = kube.create(GME, harness.namespace, records.new(job, fp, ["A100-80GB", "H100-80GB"], "x"))
    huge = 200 << 30
    kube.replace_status(GME, dict(created, status={
        "phase": "Succeeded", "attempt": 1, "completionTime": records.stamp(),
        "estimates": [{"gpu": g, "capacityBytes": c, "peakReservedBytes": huge,
                       "totalBytes": huge, "recommendedRequestBytes": huge, "fits": False,
                       "migProfile": None}
                      for g, c in (("A100-80GB", 84970559242), ("H100-80GB", 84938346987))]}))
    harness.controller()
    harness.wait_released("train")
    message = _warning(harness, "train")["message"]
    assert "(FitsNoGPU)" in message and "fits no GPU of the policy" in message
