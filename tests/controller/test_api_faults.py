"""The API answering 409, 429 and 5xx never loses or doubles anything.

Faults are injected by the fault proxy in front of the real API server, on the exact requests the
controller makes; the outcome is read from the API: one estimate, one estimation pod, the Job
released once, one Event.
"""

from __future__ import annotations

from tests.controller.support import Harness, template_annotations, training_job, wait
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import workloads
from xmem_admission.contract.errors import KubeApiError


def _estimated(harness: Harness, name: str) -> list:
    return wait(lambda: [e for e in harness.events(name) if e["reason"] == "Estimated"], 15,
                "the Estimated event")


def _released_once(harness: Harness, name: str) -> dict:
    job = harness.wait_released(name)
    assert job["spec"]["suspend"] is False
    assert int(template_annotations(job)[labels.REQUEST_BYTES]) > 0
    [gme] = harness.gmes()
    # one estimation pod: one attempt, whose pod name is fixed (a second create is a 409),
    # deleted once its result was recorded
    assert gme["status"].get("attempt", 1) == 1  # unset: the first attempt
    wait(lambda: not harness.estimation_pods(), 30, "the succeeded estimation pod to be deleted")
    assert len(_estimated(harness, name)) == 1
    return job


def test_a_storm_of_409_429_and_5xx_answers_still_gives_one_estimate_one_pod_one_release(
        harness):
    proxy = harness.proxy
    injected = {
        "list jobs 500": proxy.inject("GET", "/jobs$", 500, times=3),
        "create estimate 429 + Retry-After": proxy.inject(
            "POST", "/gpumemoryestimates$", 429, times=2, retry_after=1),
        "create pod 429": proxy.inject("POST", "/pods$", 429, times=2),
        "create pod 500 after it landed": proxy.inject("POST", "/pods$", 500, when="after"),
        "status 503 beyond the client's retries": proxy.inject(
            "PUT", "/gpumemoryestimates/.*/status$", 503, times=8),
        "release 409": proxy.inject("PUT", "/jobs/train$", 409, times=2,
                                    message="the object has been modified"),
    }
    controller = harness.controller(sync_timeout=60)
    harness.submit(training_job("train"))
    _released_once(harness, "train")
    assert {name: f.hits for name, f in injected.items()} == {
        "list jobs 500": 3, "create estimate 429 + Retry-After": 2, "create pod 429": 2,
        "create pod 500 after it landed": 1, "status 503 beyond the client's retries": 8,
        "release 409": 2}
    assert controller.kube.retries >= 4 + 8 - 1
    # the status write that met the 503s beyond the client's retries was counted, whichever
    # reconcile made it first (the estimate's, or a waiting workload's lastUsedTime)
    assert sum(controller.metrics.errors.labels(key)._value.get()
               for key in ("estimate", "workload")) >= 1


def test_a_stale_cache_write_is_a_real_409_and_writes_nothing(harness):
    controller = harness.controller(start=False)
    for informer in controller.informers():
        informer.start()
        assert informer.synced.wait(60), informer.error
    harness.submit(training_job("train"))
    informer = controller.ctx.workloads["Job"].informer
    stale = wait(lambda: informer.get(harness.namespace, "train"), 10, "the job in the cache")
    informer.stop()  # the cache stops following: what it holds goes stale
    harness.kube().batch.patch_namespaced_job("train", harness.namespace,
                                              {"metadata": {"labels": {"team": "ml"}}})
    try:
        workloads.reconcile(controller.ctx, "Job", harness.namespace, "train")
        raise AssertionError("a write from a stale resourceVersion succeeded")
    except KubeApiError as exc:
        assert exc.conflict
    assert harness.job("train")["metadata"]["annotations"][labels.HELD_REASON] == \
        stale["metadata"]["annotations"][labels.HELD_REASON]
    controller.stop()
