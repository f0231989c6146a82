"""Malformed reviews, unknown kinds and unparsable objects get a proper AdmissionResponse.

Never an HTTP error, never a dropped connection: the API server turns those into failures of
the webhook call (failurePolicy), while a 400-class response tells the user what is wrong.
"""

from __future__ import annotations

import copy
import json
from typing import Any, Dict

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.builders import make_job, make_pod, review
from tests.support.harness import HttpsWebhook, LocalWebhook, make_policy

VALID = review(make_job("train").opt_in().gpus(1).obj(), uid="fuzz-uid")


def check_answer(raw: Dict[str, Any]) -> Dict[str, Any]:
    """Every answer is an AdmissionReview v1 response with a uid and a ranked verdict."""
    assert raw["apiVersion"] == "admission.k8s.io/v1" and raw["kind"] == "AdmissionReview"
    response = raw["response"]
    assert isinstance(response["uid"], str) and isinstance(response["allowed"], bool)
    if not response["allowed"]:
        assert 400 <= response["status"]["code"] < 500
        assert response["status"]["message"]
    return response


@pytest.mark.parametrize(
    "body, message",
    [
        (b"", "empty body"),
        (b"{not json", "not JSON"),
        (b"[]", "expected an AdmissionReview object"),
        (b'{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1beta1","request":{}}',
         "apiVersion must be admission.k8s.io/v1"),
        (b'{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1"}', "request is required"),
        (b'{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1","request":{"uid":"u"}}',
         "request.kind must be an object"),
    ],
)
def test_a_malformed_review_is_answered_with_a_400_and_the_reason(
    served: HttpsWebhook, body: bytes, message: str
) -> None:
    reply = served.post_raw("/mutate", body, {"Content-Type": "application/json"})
    assert reply.status_code == 200
    response = check_answer(reply.json())
    assert response["allowed"] is False
    assert response["status"]["code"] == 400 and response["status"]["reason"] == "BadRequest"
    assert message in response["status"]["message"]


def test_an_unknown_kind_is_refused_with_a_400_naming_the_kinds_handled(served: HttpsWebhook) -> None:
    obj = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"}, "spec": {}}
    request = review(obj, kind="Deployment", uid="dep-1")
    request["request"]["kind"]["group"] = "apps"
    answer = served.send(request)
    assert answer.response["uid"] == "dep-1"
    assert not answer.allowed and answer.status["code"] == 400
    assert "Deployment" in answer.status["message"] and "Job, Pod, PyTorchJob" in answer.status["message"]


UNREADABLE = [
    (("spec", "template"), "not-a-template", "spec.template"),
    (("spec", "template", "spec", "containers"), {"a": 1}, "spec.containers"),
    (("spec", "template", "spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"),
     "lots", "nvidia.com/gpu"),
    (("spec", "template", "spec", "containers", 0, "resources", "limits", "nvidia.com/gpu"),
     "1e8000000", "too large"),
    (("spec", "template", "spec", "initContainers"), "not-a-list", "spec.initContainers"),
]


def _broken(path: tuple, value: Any) -> Dict[str, Any]:
    job = make_job("bad").opt_in().gpus(1).obj()
    node: Any = job
    for part in path[:-1]:
        node = node.setdefault(part, {}) if isinstance(part, str) else node[part]
    node[path[-1]] = value
    return job


@pytest.mark.parametrize("path, value, where", UNREADABLE)
def test_an_unreadable_object_where_the_policy_enforces_fails_closed_with_a_422_naming_the_field(
    served: HttpsWebhook, path: tuple, value: Any, where: str
) -> None:
    served.use(make_policy(enforcement="Enforce"))
    answer = served.send(review(_broken(path, value), uid="bad-1"))
    assert answer.response["uid"] == "bad-1"
    assert not answer.allowed and answer.status["code"] == 422, answer.response
    assert answer.status["reason"] == "Invalid" and where in answer.status["message"]
    assert "fails closed" in answer.status["message"]


@pytest.mark.parametrize("path, value, where", UNREADABLE)
def test_an_unreadable_object_where_the_policy_warns_is_admitted_unchanged_saying_it_fails_open(
    served: HttpsWebhook, path: tuple, value: Any, where: str
) -> None:
    answer = served.send(review(_broken(path, value), uid="bad-2"))
    assert answer.allowed and not answer.ops, answer.response
    [warning] = answer.warnings
    assert where in warning and "fails open" in warning


@pytest.mark.parametrize("value", ["12 GiB", "\u00b2", "1" * 40, "-5", "0"])
def test_an_unreadable_request_annotation_on_a_released_pod_fails_closed_where_enforced(
    served: HttpsWebhook, value: str
) -> None:
    served.use(make_policy(enforcement="Enforce"))
    pod = (make_pod("train-x1").owned_by("Job", "train").opt_in().gpus(1)
           .template_annotation("xmem.io/request-bytes", value).obj())
    answer = served.send(review(pod))
    assert not answer.allowed and answer.status["code"] == 422, answer.response
    assert "xmem.io/request-bytes" in answer.status["message"]


def test_a_body_beyond_any_api_server_limit_is_refused_without_being_read(served: HttpsWebhook) -> None:
    reply = served.post_raw("/mutate", b" " * (9 * 1024 * 1024))
    assert reply.status_code == 200
    response = check_answer(reply.json())
    assert response["status"]["code"] == 413


def _mutations() -> st.SearchStrategy:
    """A valid review with one part replaced by something of the wrong shape."""
    paths = [
        ("request",), ("request", "uid"), ("request", "kind"), ("request", "kind", "kind"),
        ("request", "operation"), ("request", "object"), ("request", "object", "metadata"),
        ("request", "object", "metadata", "labels"), ("request", "object", "spec"),
        ("request", "object", "spec", "template", "spec"), ("request", "dryRun"),
        ("request", "namespace"), ("apiVersion",), ("kind",),
        ("request", "object", "spec", "template", "spec", "containers"),
    ]
    junk = st.none() | st.booleans() | st.integers() | st.text(max_size=5) | st.lists(
        st.integers(), max_size=2) | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
    return st.tuples(st.sampled_from(paths), junk)


@settings(max_examples=300, deadline=None)
@given(_mutations())
def test_any_review_with_a_part_of_the_wrong_shape_gets_a_ranked_answer(mutation: Any) -> None:
    path, junk = mutation
    document = copy.deepcopy(VALID)
    node: Any = document
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = junk
    webhook = LocalWebhook(make_policy(enforcement="Enforce"))
    body = json.dumps(document).encode()  # json: any integer is valid JSON, orjson caps at 64 bits
    check_answer(orjson.loads(webhook.webhook.review(body, _endpoint())))
    assert webhook.webhook.metrics.policy_errors.labels("internal")._value.get() == 0


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_arbitrary_bytes_get_a_ranked_answer(body: bytes) -> None:
    webhook = LocalWebhook(make_policy())
    check_answer(orjson.loads(webhook.webhook.review(body, _endpoint())))


def _endpoint() -> Any:
    from xmem_admission.cluster.admission.webhook import Endpoint

    return Endpoint.MUTATE


def test_a_fuzzed_sample_over_https_always_gets_http_200(served: HttpsWebhook) -> None:
    bodies = [b"\x00\xff", b"null", b'{"kind":"AdmissionReview"}', orjson.dumps(VALID)[:50],
              orjson.dumps(review(make_pod("p").opt_in().gpus(1).obj()))]
    for body in bodies:
        for path in ("/mutate", "/validate/namespace"):
            reply = served.post_raw(path, body)
            assert reply.status_code == 200
            check_answer(reply.json())
