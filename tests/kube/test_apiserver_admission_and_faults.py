"""kube-apiserver calls admission webhooks as the product expects.

The webhook here is the project's own, served over HTTPS by ``xmem serve``'s server (the
admission tests' harness): the API server POSTs real AdmissionReviews to it and applies its
JSONPatch, so a Job created with the official client comes back held.
"""

from __future__ import annotations

import base64
from typing import Iterator

import pytest
from kubernetes.client.exceptions import ApiException

from tests.kube.support import job, pod, raw, status_of
from tests.support.harness import Certificates, HttpsWebhook, make_policy
from xmem_admission.cluster import labels


@pytest.fixture(scope="module")
def webhook(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpsWebhook]:
    served = HttpsWebhook(make_policy(), Certificates(tmp_path_factory.mktemp("tls")))
    try:
        yield served
    finally:
        served.close()


def _configuration(webhook: HttpsWebhook, kind: str = "Mutating", url: str = "",
                   failure: str = "Fail") -> dict:
    ca = base64.b64encode(webhook.certs.ca_file.read_bytes()).decode()
    path = "mutate" if kind == "Mutating" else "validate"
    return {
        "apiVersion": "admissionregistration.k8s.io/v1", "kind": f"{kind}WebhookConfiguration",
        "metadata": {"name": f"xmem-{path}"},
        "webhooks": [{
            "name": f"{path}.xmem.io", "admissionReviewVersions": ["v1"],
            "sideEffects": "None", "failurePolicy": failure, "timeoutSeconds": 5,
            "clientConfig": {"url": url or f"https://127.0.0.1:{webhook.port}/{path}",
                             "caBundle": ca},
            "objectSelector": {"matchLabels": {labels.OPT_IN: "true"}},
            "rules": [{"operations": ["CREATE"], "apiGroups": ["batch", ""],
                       "apiVersions": ["v1"], "resources": ["jobs", "pods"]}],
        }],
    }


def _gpu_job(name: str) -> dict:
    body = job(name, labels={labels.OPT_IN: "true"})
    body["spec"]["template"]["spec"]["containers"][0]["resources"] = {
        "limits": {"nvidia.com/gpu": "1"}}
    return body


def test_a_mutating_webhook_holds_an_opted_in_gpu_job_created_with_the_client(
        server, batch, webhook):
    webhook.use(make_policy())
    server.create(_configuration(webhook))
    created = raw(batch.create_namespaced_job("default", _gpu_job("train"), _preload_content=False))
    assert created["spec"]["suspend"] is True
    assert created["metadata"]["annotations"][labels.HELD_REASON] == "AwaitingEstimate"
    template_labels = created["spec"]["template"]["metadata"]["labels"]
    assert template_labels[labels.OPT_IN] == "true"


def test_objects_outside_the_object_selector_never_reach_the_webhook(server, batch, webhook):
    server.create(_configuration(webhook, url="https://127.0.0.1:1/unreachable"))
    created = raw(batch.create_namespaced_job("default", job("plain"), _preload_content=False))
    assert created["spec"]["suspend"] is False


def test_a_validating_webhook_denial_is_the_real_error_with_its_message(server, core, webhook):
    webhook.use(make_policy(enforcement="Enforce"))
    server.create(_configuration(webhook))  # the mutation denies bare pods when enforcing
    body = pod("bare", ["true"], labels={labels.OPT_IN: "true"},
               container={"resources": {"limits": {"nvidia.com/gpu": "1"}}})
    with pytest.raises(ApiException) as caught:
        core.create_namespaced_pod("default", body)
    message = status_of(caught.value)["message"]
    assert message.startswith('admission webhook "mutate.xmem.io" denied the request:')
    assert "bare Pod" in message
    webhook.use(make_policy())


def test_an_unreachable_webhook_fails_closed_or_open_as_its_failure_policy_says(server, batch, webhook):
    server.create(_configuration(webhook, url="https://127.0.0.1:1/mutate"))
    with pytest.raises(ApiException) as caught:
        batch.create_namespaced_job("default", _gpu_job("closed"))
    assert caught.value.status == 500
    assert "failed calling webhook" in status_of(caught.value)["message"]
    from kubernetes import client as k8s

    k8s.AdmissionregistrationV1Api(server.api_client()).delete_mutating_webhook_configuration(
        "xmem-mutate")
    server.create(_configuration(webhook, url="https://127.0.0.1:1/mutate", failure="Ignore"))
    created = raw(batch.create_namespaced_job("default", _gpu_job("open"), _preload_content=False))
    assert created["spec"]["suspend"] is False
