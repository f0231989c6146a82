"""The fault proxy the controller tests put in front of the real API server: what the official
client sees of the faults it injects, and what its observers see."""

from __future__ import annotations

import json

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tests.controller.support import Harness, training_job, wait


def test_a_429_with_retry_after_is_retried_by_the_client_and_one_without_surfaces(
        harness: Harness):
    batch = client.BatchV1Api(harness.api_client())
    fault = harness.proxy.inject("GET", "/jobs$", 429, retry_after=1)
    assert batch.list_namespaced_job(harness.namespace).items == []  # urllib3 honoured it
    assert fault.hits == 1
    harness.proxy.inject("GET", "/jobs$", 429, retry_after=None)
    with pytest.raises(ApiException) as caught:
        batch.list_namespaced_job(harness.namespace)
    assert caught.value.status == 429
    assert json.loads(caught.value.body)["reason"] == "TooManyRequests"


def test_an_after_fault_lands_the_write_but_answers_an_error(harness: Harness):
    batch = client.BatchV1Api(harness.api_client())
    harness.proxy.inject("POST", "/jobs$", 503, when="after")
    body = training_job("train")
    body["metadata"]["namespace"] = harness.namespace
    with pytest.raises(ApiException) as caught:
        batch.create_namespaced_job(harness.namespace, body)
    assert caught.value.status == 503
    assert [j.metadata.name for j in batch.list_namespaced_job(harness.namespace).items] == \
        ["train"]


def test_observers_see_every_answered_request_with_its_code(harness: Harness):
    seen = []
    harness.proxy.on_request(lambda method, path, code: seen.append((method, path, code)))
    body = training_job("train")
    body["metadata"]["namespace"] = harness.namespace
    client.BatchV1Api(harness.api_client()).create_namespaced_job(harness.namespace, body)
    wait(lambda: ("POST", f"/apis/batch/v1/namespaces/{harness.namespace}/jobs", 201) in seen,
         5, "the observer to see the create")
