"""At Job CREATE the webhook sizes a repeat job (same fingerprint, same namespace) from its
estimate corrected by what earlier runs used, as the controller recorded them on the
GPUMemoryEstimate (``status.runs``), within the policy's spec.rightSizing; the
request, the warning line and the metrics say so, and runs never cross namespaces."""

from __future__ import annotations

import dataclasses

from tests.support.builders import make_job, review
from tests.support.estimates import record_for
from tests.support.harness import LocalWebhook, make_policy
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import records
from xmem_admission.cluster.policy.sizing import size_request
from xmem_admission.cluster.policy.store import Run, WorkloadRef

GiB = 1 << 30
GPUS = ("A100-80GB",)


def _sized(webhook: LocalWebhook, namespace: str = "ml"):
    answer = webhook.send(review(make_job("train", namespace).opt_in().gpus(1).obj()))
    assert answer.allowed
    annotations = answer.patched()["spec"]["template"]["metadata"]["annotations"]
    return int(annotations[labels.REQUEST_BYTES]), int(annotations[labels.ESTIMATE_BYTES]), \
        answer.warnings


def _webhook(runs, namespace: str = "ml", **right_sizing) -> LocalWebhook:
    spec = {"rightSizing": right_sizing} if right_sizing else {}
    webhook = LocalWebhook(make_policy(gpus=GPUS, **spec))
    record = record_for(make_job("train", namespace).opt_in().gpus(1).obj(), {GPUS[0]: 20}, GPUS)
    webhook.record(dataclasses.replace(record, runs=tuple(runs),
                                       workload=WorkloadRef(namespace, "Job", "train")))
    return webhook


def _run(peak_gib: float, completed: bool = True) -> Run:
    return Run(GPUS[0], 20 * GiB, int(peak_gib * GiB), completed, 1.0e9)


def _counter(webhook: LocalWebhook, name: str, **labels_: str) -> float:
    value = webhook.webhook.metrics.registry.get_sample_value(name, labels_)
    return value or 0.0


def test_a_run_that_used_more_than_estimated_raises_the_next_request():
    webhook = _webhook([_run(25)])
    settings = make_policy(gpus=GPUS).defaults

    request, estimate, warnings = _sized(webhook)

    assert estimate == 20 * GiB  # the estimator's figure stays the estimate
    assert request == size_request(25 * GiB, settings, settings.targets[0].gpu.capacity_bytes)
    assert any("right-sized by earlier runs" in w and "raised" in w for w in warnings), warnings
    assert _counter(webhook, "xmem_right_sized_requests_total", gpu_model=GPUS[0],
                    direction="raised") == 1
    assert _counter(webhook, "xmem_right_sizing_given_back_bytes_total", gpu_model=GPUS[0]) == 0


def test_runs_that_used_less_lower_the_request_only_where_the_policy_allows_it():
    settings = make_policy(gpus=GPUS).defaults
    capacity = settings.targets[0].gpu.capacity_bytes
    kept = _webhook([_run(14)])
    lowered = _webhook([_run(14)], lowerRequests=True)

    kept_request, _, kept_warnings = _sized(kept)
    lowered_request, _, _ = _sized(lowered)

    assert kept_request == size_request(20 * GiB, settings, capacity)
    assert not any("right-sized" in w for w in kept_warnings)
    assert lowered_request == size_request(14 * GiB, settings, capacity)
    given_back = _counter(lowered, "xmem_right_sizing_given_back_bytes_total", gpu_model=GPUS[0])
    assert given_back == kept_request - lowered_request > 5 * GiB


def test_a_run_cut_short_never_lowers_the_request():
    settings = make_policy(gpus=GPUS).defaults
    webhook = _webhook([_run(14, completed=False)], lowerRequests=True)

    request, _, _ = _sized(webhook)

    assert request == size_request(20 * GiB, settings, settings.targets[0].gpu.capacity_bytes)


def test_another_namespaces_runs_never_size_a_workload_through_estimate_sharing():
    policy = make_policy(gpus=GPUS, estimateSharing=[{"namespaces": ["ml", "research"]}])
    webhook = LocalWebhook(policy)
    record = record_for(make_job("train", "ml").opt_in().gpus(1).obj(), {GPUS[0]: 20}, GPUS)
    webhook.record(dataclasses.replace(record, runs=(_run(30),),
                                       workload=WorkloadRef("ml", "Job", "train")))
    settings = policy.defaults
    capacity = settings.targets[0].gpu.capacity_bytes

    own, _, _ = _sized(webhook, "ml")
    shared, _, warnings = _sized(webhook, "research")

    assert own == size_request(30 * GiB, settings, capacity)
    assert shared == size_request(20 * GiB, settings, capacity)
    assert not any("right-sized" in w for w in warnings)


def test_the_runs_the_controller_recorded_on_the_estimate_reach_the_record():
    job = make_job("train", "ml").opt_in().gpus(1).obj()
    record = record_for(job, {GPUS[0]: 20}, GPUS)
    gme = records.from_record(record, "ml")
    uid = {"kind": "Job", "name": "train-1", "uid": "u-1"}
    entry = {"workload": uid, "gpu": GPUS[0], "estimateBytes": 20 * GiB, "completed": True,
             "finished": "2026-01-31T12:00:00Z", "pods": 1, "observedPeakBytes": 23 * GiB,
             "source": "HAMi", "series": 1}
    no_peak = dict(entry, workload=dict(uid, uid="u-2"))
    no_peak.pop("observedPeakBytes")
    gme["status"] = records.with_run(records.with_run(gme["status"], entry), no_peak)

    found = records.record(gme)

    assert found is not None
    assert found.runs == (Run(GPUS[0], 20 * GiB, 23 * GiB, True, 1769860800.0),)
    assert gme["status"]["observedPeak"] == "23.0Gi" and gme["status"]["observedPercent"] == 115
    assert [e["workload"]["uid"] for e in gme["status"]["runs"]] == ["u-1", "u-2"]


def test_a_request_right_sizing_lowered_passes_an_enforcing_validation_job_and_pod():
    webhook = _webhook([_run(8)], lowerRequests=True)
    webhook.use(make_policy(gpus=GPUS, enforcement="Enforce",
                            rightSizing={"lowerRequests": True}))
    job = make_job("train", "ml").opt_in().gpus(1).obj()

    sized = webhook.send(review(job))
    template = sized.patched()["spec"]["template"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": dict(
        template["metadata"], name="train-x1", namespace="ml", ownerReferences=[{
            "apiVersion": "batch/v1", "kind": "Job", "name": "train", "uid": "u-1",
            "controller": True}]), "spec": template["spec"]}

    assert int(template["metadata"]["annotations"][labels.REQUEST_BYTES]) < 20 * GiB
    assert webhook.send(review(sized.patched()), "validate").allowed
    assert webhook.send(review(webhook.send(review(pod)).patched()), "validate").allowed
