"""/validate: what an enforcing policy denies, and what a warning policy only reports."""

from __future__ import annotations

from tests.support.builders import make_job, make_pod, make_pytorchjob, review
from tests.support.estimates import record_for
from tests.support.harness import HttpsWebhook, make_policy
from xmem_admission.cluster import labels

GPUS = ("A100-80GB", "H100-80GB")
TOO_BIG = {"A100-80GB": 95.0, "H100-80GB": 95.3}


def test_an_estimate_that_fits_no_gpu_is_denied_with_the_shortfall_and_what_would_fit(
    served: HttpsWebhook,
) -> None:
    served.use(make_policy(enforcement="Enforce"))
    job = make_job("huge").opt_in().gpus(1).obj()
    served.record(record_for(job, TOO_BIG, GPUS))
    answer = served.send(review(job), endpoint="validate")
    assert not answer.allowed and answer.status["code"] == 403
    message = answer.status["message"]
    assert "estimated 95.0 GiB per GPU fits no GPU of the policy" in message
    # A100-80GB's catalogue capacity is 79.1 GiB: 95.0 - 79.1 = 15.9 GiB short
    assert "A100-80GB (79.1 GiB) short by 15.9 GiB" in message
    assert "H200" in message and "B200" in message
    assert "cut per-GPU memory by at least 17%" in message


def test_the_mutation_leaves_an_unfitting_workload_unheld_and_warns(served: HttpsWebhook) -> None:
    job = make_job("huge").opt_in().gpus(1).obj()
    served.record(record_for(job, TOO_BIG, GPUS))
    answer = served.send(review(job))
    patched = answer.patched()
    assert "suspend" not in patched["spec"]
    assert labels.REQUEST_BYTES not in patched["spec"]["template"]["metadata"].get("annotations", {})
    assert any("fits no policy GPU" in w for w in answer.warnings)
    assert all(len(w) <= 256 and "\n" not in w for w in answer.warnings)


def test_a_warning_policy_admits_violations_with_one_line_warnings_that_keep_their_figures(
        served: HttpsWebhook) -> None:
    job = make_job("huge").opt_in().gpus(1).obj()
    served.record(record_for(job, TOO_BIG, GPUS))
    answer = served.send(review(job), endpoint="validate")
    assert answer.allowed and "status" not in answer.response
    # The API server passes warnings of up to 256 characters on unchanged.
    assert answer.warnings and all(len(w) <= 256 for w in answer.warnings)
    [warning] = answer.warnings
    assert warning.startswith("xmem: spec: estimated 95.0 GiB per GPU fits no GPU of the policy: "
                              "A100-80GB (79.1 GiB) short by 15.9 GiB")


def test_a_request_set_by_hand_below_the_estimate_is_denied_with_its_field(served: HttpsWebhook) -> None:
    served.use(make_policy(enforcement="Enforce"))
    job = make_job("low").opt_in().gpus(1).limit("nvidia.com/gpumem", "8000").obj()
    served.record(record_for(job, {"A100-80GB": 11.7, "H100-80GB": 11.9}, GPUS))
    mutated = served.send(review(job)).patched()
    # the mutation never overrides a request set by hand
    assert mutated["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "nvidia.com/gpumem"] == "8000"
    answer = served.send(review(mutated), endpoint="validate")
    assert not answer.allowed
    message = answer.status["message"]
    assert "spec.template.spec.containers[0].resources.limits[nvidia.com/gpumem]" in message
    assert "asks nvidia.com/gpumem: 8000 (7.8 GiB per GPU)" in message
    assert "below the A100-80GB estimate of 11.7 GiB less the 0% overcommit allowance" in message


def test_the_overcommit_allowance_lets_a_request_go_that_far_below_the_estimate(
    served: HttpsWebhook,
) -> None:
    served.use(make_policy(enforcement="Enforce", overcommitPercent=10))
    estimate = {"A100-80GB": 10.0, "H100-80GB": 10.0}
    # 10 GiB less 10 % is 9216 MiB: 9300 MiB passes, 9000 MiB does not
    for mib, allowed in ((9300, True), (9000, False)):
        job = make_job(f"oc{mib}").opt_in().gpus(1).limit("nvidia.com/gpumem", str(mib)).obj()
        served.record(record_for(job, estimate, GPUS))
        answer = served.send(review(job), endpoint="validate")
        assert answer.allowed is allowed, (mib, answer.response)


def test_a_hand_set_request_bytes_annotation_below_the_estimate_is_denied(served: HttpsWebhook) -> None:
    served.use(make_policy("Annotation", enforcement="Enforce"))
    job = (make_pytorchjob("ddp").opt_in().gpus(2)
           .template_annotation(labels.REQUEST_BYTES, str(4 << 30)).obj())
    served.record(record_for(job, {"A100-80GB": 30.0, "H100-80GB": 30.0}, GPUS))
    answer = served.send(review(job), endpoint="validate")
    assert not answer.allowed
    message = answer.status["message"]
    assert "spec.pytorchReplicaSpecs.Master.template.metadata.annotations[xmem.io/request-bytes]" in message
    assert "spec.pytorchReplicaSpecs.Worker.template" in message


def test_a_bare_pod_without_estimate_is_denied_by_validate_when_enforcing(served: HttpsWebhook) -> None:
    served.use(make_policy(enforcement="Enforce"))
    answer = served.send(review(make_pod("bare").opt_in().gpus(1).obj()), endpoint="validate")
    assert not answer.allowed and "bare Pod" in answer.status["message"]
    owned = served.send(
        review(make_pod("owned").owned_by("Job", "j").opt_in().gpus(1).obj()), endpoint="validate"
    )
    assert owned.allowed


def test_the_first_policy_gpu_that_holds_the_estimate_is_chosen(served: HttpsWebhook) -> None:
    served.use(make_policy("HAMi", ("A100-40GB", "A100-80GB")))
    job = make_job("mid").opt_in().gpus(1).obj()
    served.record(record_for(job, {"A100-40GB": 50.0, "A100-80GB": 50.0}, ("A100-40GB", "A100-80GB")))
    annotations = served.send(review(job)).patched()["spec"]["template"]["metadata"]["annotations"]
    assert annotations[labels.GPU_MODEL] == "A100-80GB"


def test_a_template_may_pin_its_gpu_model(served: HttpsWebhook) -> None:
    job = make_job("pinned").opt_in().gpus(1).template_annotation(labels.GPU_MODEL, "H100-80GB").obj()
    served.record(record_for(job, {"A100-80GB": 11.7, "H100-80GB": 11.9}, GPUS))
    annotations = served.send(review(job)).patched()["spec"]["template"]["metadata"]["annotations"]
    assert annotations[labels.GPU_MODEL] == "H100-80GB"
    assert annotations[labels.ESTIMATE_BYTES] == str(int(11.9 * (1 << 30)))


def test_namespace_overrides_apply_their_own_enforcement(served: HttpsWebhook) -> None:
    served.use(make_policy(overrides=[{"namespaces": ["prod-*"], "enforcement": "Enforce"}]))
    for namespace, allowed in (("prod-eu", False), ("dev", True)):
        job = make_job("huge", namespace).opt_in().gpus(1).obj()
        served.record(record_for(job, TOO_BIG, GPUS))
        assert served.send(review(job), endpoint="validate").allowed is allowed


def test_a_disabled_namespace_passes_everything_unchanged(served: HttpsWebhook) -> None:
    served.use(make_policy(overrides=[{"namespaces": ["kube-*"], "enabled": False}]))
    answer = served.send(review(make_job("sys", "kube-system").opt_in().gpus(1).obj()))
    assert answer.ops == [] and answer.warnings == []
