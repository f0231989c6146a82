"""The webhook over real HTTPS: envelope, hold, patch, warnings, dryRun, health and metrics."""

from __future__ import annotations

import re
import socket
import ssl
import time

import httpx
import pytest

from tests.support.builders import make_job, make_pod, review
from tests.support.estimates import record_for
from tests.support.harness import FIXED_NOW, HttpsWebhook, make_policy, metric
from tests.support.schemas import validate_object
from xmem_admission.cluster import labels

GPUS = ("A100-80GB", "H100-80GB")


def test_a_job_without_estimate_is_held_with_annotations_and_a_warning(served: HttpsWebhook) -> None:
    job = make_job("train").opt_in().gpus(1).obj()
    request = review(job, uid="b5e8c1a0-0000-4000-8000-000000000001")
    answer = served.send(request)
    assert answer.review["apiVersion"] == "admission.k8s.io/v1"
    assert answer.review["kind"] == "AdmissionReview"
    assert answer.response["uid"] == "b5e8c1a0-0000-4000-8000-000000000001"
    assert answer.allowed
    held = answer.patched()
    assert held["spec"]["suspend"] is True
    annotations = held["metadata"]["annotations"]
    assert annotations[labels.HELD_REASON] == "AwaitingEstimate"
    assert annotations[labels.HELD_SINCE] == FIXED_NOW
    assert re.fullmatch(r"[0-9a-f]{32}", annotations[labels.FINGERPRINT])
    assert held["spec"]["template"]["metadata"]["labels"][labels.OPT_IN] == "true"
    assert any("held until its GPU memory is estimated" in w for w in answer.warnings)
    assert all(len(w) < 120 for w in answer.warnings)
    validate_object(held)


def test_reinvoking_the_webhook_on_its_own_output_gives_an_empty_patch(served: HttpsWebhook) -> None:
    job = make_job("train").opt_in().gpus(1).obj()
    held = served.send(review(job)).patched()
    again = served.send(review(held))
    assert again.allowed and again.ops == []
    assert "patch" not in again.response and "patchType" not in again.response


def test_a_job_with_a_recorded_estimate_is_patched_at_create(served: HttpsWebhook) -> None:
    job = make_job("train").opt_in().gpus(1).obj()
    served.record(record_for(job, {"A100-80GB": 11.7, "H100-80GB": 11.9}, GPUS))
    answer = served.send(review(job))
    patched = answer.patched()
    template = patched["spec"]["template"]
    assert "suspend" not in patched["spec"]
    # 11.7 GiB * 1.05 = 12.285 GiB, rounded up to 256 MiB: 12.5 GiB = 12800 MiB
    assert template["metadata"]["annotations"][labels.REQUEST_BYTES] == str(12800 << 20)
    assert template["metadata"]["annotations"][labels.GPU_MODEL] == "A100-80GB"
    assert template["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] == "12800"
    assert template["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert any("A100-80GB estimate 11.7 GiB" in w for w in answer.warnings)
    assert all(len(w) < 120 for w in answer.warnings)
    validate_object(patched)
    text = served.health.get("/metrics").text
    applied = metric(text, "xmem_estimates_applied_total", backend="HAMi", gpu_model="A100-80GB")
    assert applied == 1.0
    given = metric(text, "xmem_estimate_request_bytes", workload="train", namespace="ml")
    assert given == 12800 << 20


def test_a_released_jobs_pod_records_its_request_under_the_job(served: HttpsWebhook) -> None:
    pod = (make_pod("train-x7k2p").opt_in().gpus(1).owned_by("Job", "train")
           .template_annotation(labels.REQUEST_BYTES, str(12 << 30))
           .template_annotation(labels.GPU_MODEL, "A100-80GB").obj())
    patched = served.send(review(pod)).patched()
    assert patched["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem"] == "12288"
    text = served.health.get("/metrics").text
    given = metric(text, "xmem_estimate_request_bytes", workload="train", namespace="ml",
                   kind="Job")
    assert given == 12 << 30


def test_workloads_without_the_opt_in_or_without_gpus_pass_unchanged(served: HttpsWebhook) -> None:
    plain = served.send(review(make_job("a").gpus(1).obj()))
    cpu_only = served.send(review(make_job("b").opt_in().obj()))
    for answer in (plain, cpu_only):
        assert answer.allowed and answer.ops == [] and answer.warnings == []


def test_the_namespace_path_treats_every_object_as_opted_in(served: HttpsWebhook) -> None:
    job = make_job("unlabelled").gpus(1).obj()
    object_entry = served.send(review(job), scope="object")
    namespace_entry = served.send(review(job), scope="namespace")
    assert object_entry.ops == []
    assert namespace_entry.patched()["spec"]["suspend"] is True


def test_dry_run_gives_the_same_patch_without_side_effects(certs) -> None:
    holds = []
    served = HttpsWebhook(make_policy(), certs, on_hold=lambda ref, fp: holds.append((ref, fp)))
    try:
        job = make_job("train").opt_in().gpus(1).obj()
        dry = served.send(review(job, dry_run=True))
        assert dry.patched()["spec"]["suspend"] is True
        assert holds == []
        assert _held(served) == 0
        real = served.send(review(job))
        assert real.ops == dry.ops
        assert [ref.name for ref, _ in holds] == ["train"]
        assert _held(served) == 1.0
    finally:
        served.close()


def _held(served: HttpsWebhook) -> float:
    return metric(served.health.get("/metrics").text, "xmem_workloads_held_total", kind="Job") or 0


def test_updates_and_deletes_pass_unchanged(served: HttpsWebhook) -> None:
    job = make_job("train").opt_in().gpus(1).obj()
    update = served.send(review(job, operation="UPDATE", old=job))
    delete = served.send(review(None, operation="DELETE", old=job, kind="Job"))
    assert update.allowed and update.ops == []
    assert delete.allowed and delete.ops == []


def test_health_readiness_and_metrics_are_served_on_the_plain_port(served: HttpsWebhook) -> None:
    served.send(review(make_job("m").opt_in().gpus(1).obj()))
    assert served.health.get("/healthz").text == "ok\n"
    ready = served.health.get("/readyz")
    assert ready.status_code == 200 and ready.text == "ready\n"
    metrics = served.health.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    held = metric(text, "xmem_admission_requests_total", decision="held", kind="Job",
                  operation="CREATE", endpoint="mutate")
    assert held is not None and held >= 1
    assert metric(text, "xmem_admission_duration_seconds_count", endpoint="mutate") >= 1
    assert metric(text, "xmem_estimate_cache_requests_total", result="miss") >= 1


def test_the_admission_port_speaks_only_tls_and_presents_the_service_names(served: HttpsWebhook) -> None:
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"http://127.0.0.1:{served.port}/mutate", content=b"{}", timeout=5)
    context = served.certs.client_context()
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="xmem-admission.xmem-system.svc") as tls:
            names = [v for k, v in tls.getpeercert()["subjectAltName"] if k == "DNS"]
            assert "xmem-admission.xmem-system.svc" in names
            assert tls.version() in ("TLSv1.2", "TLSv1.3")


def test_a_rotated_certificate_is_served_without_a_restart(certs, tmp_path) -> None:
    from tests.support.harness import Certificates

    own = Certificates(tmp_path)
    served = HttpsWebhook(make_policy(), own, reload_seconds=0.1)
    try:
        before = _serial(served)
        own.rotate()
        deadline = time.monotonic() + 5
        while _serial(served) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _serial(served) != before
        assert served.send(review(make_job("after").opt_in().gpus(1).obj())).allowed
    finally:
        served.close()


def _serial(served: HttpsWebhook) -> int:
    context = served.certs.client_context()
    with socket.create_connection(("127.0.0.1", served.port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
    from cryptography import x509

    return x509.load_der_x509_certificate(der).serial_number


def test_a_bare_pod_without_estimate_is_admitted_with_a_warning(served: HttpsWebhook) -> None:
    pod = make_pod("p").opt_in().gpus(1).obj()
    answer = served.send(review(pod))
    assert answer.allowed and answer.ops == []
    assert any("bare Pod" in w for w in answer.warnings)


def test_a_bare_pod_without_estimate_is_denied_when_the_policy_enforces(served: HttpsWebhook) -> None:
    served.use(make_policy(enforcement="Enforce"))
    answer = served.send(review(make_pod("p").opt_in().gpus(1).obj()))
    assert not answer.allowed
    assert answer.status["code"] == 403
    assert "no recorded GPU memory estimate for this bare Pod" in answer.status["message"]


def test_the_ssl_module_rejects_an_untrusted_server(served: HttpsWebhook) -> None:
    # The client side of the tests really verifies: a default context does not trust our CA.
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"https://localhost:{served.port}/healthz", verify=ssl.create_default_context())
