"""Patch types and the status subresource on the API server, as the official client sends them."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from tests.kube.support import job, pod, raw

GME_CRD = "helm/xmem-admission/crds/gpumemoryestimates.xmem.io.yaml"


def _gme(name: str = "gme-1") -> dict:
    return {"apiVersion": "xmem.io/v1alpha1", "kind": "GPUMemoryEstimate",
            "metadata": {"name": name},
            "spec": {"fingerprint": "0" * 32, "workload": {"kind": "Job", "name": "train"},
                     "gpus": ["A100-80GB"]}}


def test_a_strategic_merge_patch_merges_containers_by_name_and_env_by_name(core):
    body = pod("p", ["true"], container={"env": [{"name": "A", "value": "1"}]})
    body["spec"]["containers"].append({"name": "side", "image": "busybox:1.36"})
    core.create_namespaced_pod("default", body)
    patched = raw(core.patch_namespaced_pod("p", "default", {"spec": {"containers": [
        {"name": "main", "image": "busybox:1.37"}]}}, _preload_content=False))
    names = [c["name"] for c in patched["spec"]["containers"]]
    assert names == ["main", "side"]
    assert patched["spec"]["containers"][0]["image"] == "busybox:1.37"
    assert patched["spec"]["containers"][0]["env"] == [{"name": "A", "value": "1"}]


def test_a_json_merge_patch_replaces_lists_and_null_deletes(custom, server):
    server.apply_file(GME_CRD)
    custom.create_namespaced_custom_object("xmem.io", "v1alpha1", "default", "gpumemoryestimates",
                                           _gme())
    patched = custom.patch_namespaced_custom_object(
        "xmem.io", "v1alpha1", "default", "gpumemoryestimates", "gme-1",
        {"spec": {"gpus": ["H100-80GB"], "image": None}, "metadata": {"labels": {"a": "b"}}})
    assert patched["spec"]["gpus"] == ["H100-80GB"]
    assert patched["metadata"]["labels"] == {"a": "b"}


def test_a_json_patch_applies_operations_and_a_failed_test_is_422(batch):
    batch.create_namespaced_job("default", job("train"))
    patched = raw(batch.patch_namespaced_job("train", "default", [
        {"op": "add", "path": "/metadata/annotations", "value": {"k": "v"}}],
        _preload_content=False))
    assert patched["metadata"]["annotations"] == {"k": "v"}
    with pytest.raises(ApiException) as caught:
        batch.patch_namespaced_job("train", "default", [
            {"op": "test", "path": "/metadata/annotations/k", "value": "other"}])
    assert caught.value.status == 422


def test_a_patch_carrying_a_stale_resource_version_is_409(batch):
    first = raw(batch.create_namespaced_job("default", job("train"), _preload_content=False))
    batch.patch_namespaced_job("train", "default", {"metadata": {"labels": {"a": "1"}}})
    with pytest.raises(ApiException) as caught:
        batch.patch_namespaced_job("train", "default", {"metadata": {
            "resourceVersion": first["metadata"]["resourceVersion"], "labels": {"a": "2"}}})
    assert caught.value.status == 409


def test_strategic_merge_on_a_custom_resource_is_415(custom, server, client):
    server.apply_file(GME_CRD)
    custom.create_namespaced_custom_object("xmem.io", "v1alpha1", "default", "gpumemoryestimates",
                                           _gme())
    with pytest.raises(ApiException) as caught:
        custom.patch_namespaced_custom_object(
            "xmem.io", "v1alpha1", "default", "gpumemoryestimates", "gme-1", {"spec": {}},
            _content_type="application/strategic-merge-patch+json")
    assert caught.value.status == 415


def test_status_writes_go_only_through_the_status_subresource(custom, server):
    server.apply_file(GME_CRD)
    created = custom.create_namespaced_custom_object(
        "xmem.io", "v1alpha1", "default", "gpumemoryestimates",
        dict(_gme(), status={"phase": "Succeeded"}))
    assert "status" not in created  # create ignores status when it is a subresource
    with_status = custom.replace_namespaced_custom_object_status(
        "xmem.io", "v1alpha1", "default", "gpumemoryestimates", "gme-1",
        dict(created, status={"phase": "Running"}, spec=dict(created["spec"], gpus=["L40S"])))
    assert with_status["status"] == {"phase": "Running"}
    assert with_status["spec"]["gpus"] == ["A100-80GB"]  # the status write ignored the spec
    main = custom.replace_namespaced_custom_object(
        "xmem.io", "v1alpha1", "default", "gpumemoryestimates", "gme-1",
        dict(with_status, status={"phase": "Failed"}))
    assert main["status"] == {"phase": "Running"}  # and the main write ignored the status


def test_custom_resources_are_validated_and_pruned_by_their_crd_schema(custom, server):
    server.apply_file(GME_CRD)
    bad = _gme()
    bad["spec"]["fingerprint"] = "not hex"
    with pytest.raises(ApiException) as caught:
        custom.create_namespaced_custom_object("xmem.io", "v1alpha1", "default",
                                               "gpumemoryestimates", bad)
    assert caught.value.status == 422
    extra = _gme("gme-2")
    extra["spec"]["unknownField"] = 1
    created = custom.create_namespaced_custom_object("xmem.io", "v1alpha1", "default",
                                                     "gpumemoryestimates", extra)
    assert "unknownField" not in created["spec"]  # pruned, as a structural schema does
    extra["metadata"]["name"] = "gme-3"
    with pytest.raises(ApiException) as strict:
        custom.create_namespaced_custom_object("xmem.io", "v1alpha1", "default",
                                               "gpumemoryestimates", extra,
                                               field_validation="Strict")
    assert strict.value.status == 400


def test_discovery_lists_custom_resources_once_their_crd_exists(server, client):
    from kubernetes import client as k8s

    server.apply_file(GME_CRD)
    listing = raw(k8s.ApisApi(client).get_api_versions(_preload_content=False))
    assert "xmem.io" in [g["name"] for g in listing["groups"]]
