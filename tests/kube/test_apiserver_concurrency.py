"""The API server keeps resource versions and optimistic concurrency as the client relies on.

Every test drives it with the official ``kubernetes`` client over HTTPS, so what is checked is
what a controller sees: status codes, Status reasons, resourceVersions and server-set fields.
"""

from __future__ import annotations

import threading

import pytest
from kubernetes.client.exceptions import ApiException

from tests.kube.real import ApiStatusError
from tests.kube.support import job, raw, status_of


def test_create_stamps_uid_version_generation_and_the_job_selector(batch):
    created = raw(batch.create_namespaced_job("default", job("train"), _preload_content=False))
    meta = created["metadata"]
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert int(meta["resourceVersion"]) > 0
    assert meta["generation"] == 1
    uid_label = created["spec"]["selector"]["matchLabels"]["batch.kubernetes.io/controller-uid"]
    assert uid_label == meta["uid"]
    assert created["spec"]["template"]["metadata"]["labels"]["job-name"] == "train"
    assert created["spec"]["backoffLimit"] == 6  # scheme defaulting


def test_a_second_create_with_the_same_name_is_409_already_exists(batch):
    batch.create_namespaced_job("default", job("train"))
    with pytest.raises(ApiException) as caught:
        batch.create_namespaced_job("default", job("train"))
    assert caught.value.status == 409
    assert status_of(caught.value)["reason"] == "AlreadyExists"


def test_an_update_from_a_stale_resource_version_is_409_conflict(batch):
    first = raw(batch.create_namespaced_job("default", job("train"), _preload_content=False))
    batch.patch_namespaced_job("train", "default", {"metadata": {"labels": {"a": "1"}}})
    stale = dict(first, metadata=dict(first["metadata"], labels={"b": "2"}))
    with pytest.raises(ApiException) as caught:
        batch.replace_namespaced_job("train", "default", stale)
    assert caught.value.status == 409
    body = status_of(caught.value)
    assert body["reason"] == "Conflict"
    assert "the object has been modified" in body["message"]


def test_an_update_with_the_current_version_succeeds_and_bumps_it(batch):
    first = raw(batch.create_namespaced_job("default", job("train"), _preload_content=False))
    first["metadata"]["labels"] = {"b": "2"}
    second = raw(batch.replace_namespaced_job("train", "default", first, _preload_content=False))
    assert int(second["metadata"]["resourceVersion"]) > int(first["metadata"]["resourceVersion"])
    assert second["metadata"]["labels"] == {"b": "2"}
    assert second["metadata"]["generation"] == 1  # metadata changes leave generation alone


def test_a_spec_change_bumps_generation_and_a_no_op_update_leaves_it(batch):
    first = raw(batch.create_namespaced_job("default", job("train", suspend=True),
                                            _preload_content=False))
    same = raw(batch.replace_namespaced_job("train", "default", first, _preload_content=False))
    # kube-apiserver v1.36.3 was seen to bump the resourceVersion of an unchanged Job here;
    # Only the generation is promised.
    assert same["metadata"]["generation"] == 1
    same["spec"]["suspend"] = False
    changed = raw(batch.replace_namespaced_job("train", "default", same, _preload_content=False))
    assert changed["metadata"]["generation"] == 2


def test_concurrent_writers_with_versions_exactly_one_wins_each_round(batch):
    base = raw(batch.create_namespaced_job("default", job("train"), _preload_content=False))
    outcomes = []

    def writer(value: str) -> None:
        body = dict(base, metadata=dict(base["metadata"], labels={"writer": value}))
        try:
            batch.replace_namespaced_job("train", "default", body)
            outcomes.append("ok")
        except ApiException as exc:
            outcomes.append(exc.status)

    threads = [threading.Thread(target=writer, args=(str(i),)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes, key=str) == [409] * 5 + ["ok"]


def test_a_suspended_job_that_never_ran_may_change_only_template_scheduling_fields(batch):
    created = raw(batch.create_namespaced_job("default", job("train", suspend=True),
                                              _preload_content=False))
    template = created["spec"]["template"]
    template["metadata"].setdefault("annotations", {})["xmem.io/request-bytes"] = "1073741824"
    template["spec"]["nodeSelector"] = {"gpu": "a100"}
    created["spec"]["suspend"] = False
    released = raw(batch.replace_namespaced_job("train", "default", created, _preload_content=False))
    assert released["spec"]["template"]["metadata"]["annotations"]["xmem.io/request-bytes"]
    released["spec"]["template"]["spec"]["containers"][0]["image"] = "busybox:1.37"
    with pytest.raises(ApiException) as caught:
        batch.replace_namespaced_job("train", "default", released)
    assert caught.value.status == 422
    assert "spec.template" in status_of(caught.value)["message"]


def test_an_unknown_field_is_dropped_by_default_not_refused(server):
    # The client refuses unknown fields itself, so send the body as any HTTP client could.
    body = job("train")
    body["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    created = server.create(dict(body, metadata=dict(body["metadata"], namespace="default")))
    assert "resourcez" not in created["spec"]["template"]["spec"]["containers"][0]


def test_an_object_that_fails_the_official_schema_is_422_with_the_field(server):
    body = job("train")
    body["spec"]["template"]["spec"]["containers"][0]["name"] = "Not_A_DNS_Label"
    with pytest.raises(ApiStatusError) as caught:
        server.create(dict(body, metadata=dict(body["metadata"], namespace="default")))
    assert caught.value.code == 422
    assert "spec.template.spec.containers[0].name" in caught.value.message


def test_objects_in_a_namespace_that_does_not_exist_are_404(batch):
    with pytest.raises(ApiException) as caught:
        batch.create_namespaced_job("nowhere", job("train"))
    assert caught.value.status == 404
    assert 'namespaces "nowhere" not found' in status_of(caught.value)["message"]


def test_requests_without_credentials_are_anonymous_and_forbidden(server, tmp_path):
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = server.url
    ca = tmp_path / "ca.crt"
    ca.write_bytes(server.ca_pem)
    configuration.ssl_ca_cert = str(ca)
    with client.ApiClient(configuration) as api_client:
        with pytest.raises(ApiException) as caught:
            client.CoreV1Api(api_client).list_namespace()
    assert caught.value.status == 403
    assert 'User "system:anonymous" cannot list' in status_of(caught.value)["message"]
