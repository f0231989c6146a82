"""Deletion on the real API server: finalizers, preconditions, propagation, the garbage collector."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from tests.kube.support import job, pod, raw


def _owned(name: str, owner: dict, controller: bool = True) -> dict:
    body = pod(name, ["true"])
    meta = owner["metadata"]
    body["metadata"]["ownerReferences"] = [{"apiVersion": owner["apiVersion"],
                                            "kind": owner["kind"], "name": meta["name"],
                                            "uid": meta["uid"], "controller": controller}]
    return body


def _names(core) -> list:
    return sorted(p.metadata.name for p in core.list_namespaced_pod("default").items)


def test_background_deletion_collects_dependents_whose_owners_are_all_gone(server, core, batch):
    owner = raw(batch.create_namespaced_job("default", job("train"), _preload_content=False))
    core.create_namespaced_pod("default", _owned("dependent", owner))
    batch.delete_namespaced_job("train", "default", propagation_policy="Background")
    server.wait_for(lambda: _names(core) == [], 5, "the dependent pod to be collected")


def test_a_dependent_with_another_live_owner_survives_and_loses_the_dangling_reference(
        server, core, batch):
    first = raw(batch.create_namespaced_job("default", job("a"), _preload_content=False))
    second = raw(batch.create_namespaced_job("default", job("b"), _preload_content=False))
    body = _owned("shared", first, controller=False)
    body["metadata"]["ownerReferences"].append(_owned("x", second, False)["metadata"]["ownerReferences"][0])
    core.create_namespaced_pod("default", body)
    batch.delete_namespaced_job("a", "default", propagation_policy="Background")
    server.wait_for(lambda: [r.name for r in core.read_namespaced_pod("shared", "default")
                             .metadata.owner_references] == ["b"], 5, "the dangling reference to go")


def test_jobs_orphan_their_pods_by_default_as_batch_v1_does(server, core, batch):
    owner = raw(batch.create_namespaced_job("default", job("train"), _preload_content=False))
    core.create_namespaced_pod("default", _owned("dependent", owner))
    batch.delete_namespaced_job("train", "default")
    survivor = server.wait_for(lambda: (lambda p: p if not p.metadata.owner_references else None)(
        core.read_namespaced_pod("dependent", "default")), 5, "the owner reference to go")
    assert survivor.metadata.name == "dependent"


def test_foreground_deletion_keeps_the_owner_until_its_dependents_are_gone(server, core, batch):
    owner = raw(batch.create_namespaced_job("default", job("train"), _preload_content=False))
    core.create_namespaced_pod("default", _owned("dependent", owner))
    batch.delete_namespaced_job("train", "default", propagation_policy="Foreground")
    server.wait_for(lambda: not batch.list_namespaced_job("default").items, 5, "the owner to go")
    assert _names(core) == []


def test_finalizers_hold_an_object_with_a_deletion_timestamp_until_removed(server, batch):
    body = job("train")
    body["metadata"]["finalizers"] = ["example.com/keep"]
    batch.create_namespaced_job("default", body)
    batch.delete_namespaced_job("train", "default")
    held = raw(batch.read_namespaced_job("train", "default", _preload_content=False))
    assert held["metadata"]["deletionTimestamp"]
    batch.patch_namespaced_job("train", "default", {"metadata": {"finalizers": None}})
    with pytest.raises(ApiException) as caught:
        batch.read_namespaced_job("train", "default")
    assert caught.value.status == 404


def test_a_delete_with_a_stale_uid_precondition_is_409(batch):
    batch.create_namespaced_job("default", job("train"))
    with pytest.raises(ApiException) as caught:
        batch.delete_namespaced_job("train", "default", body={"preconditions": {"uid": "other"}})
    assert caught.value.status == 409


def test_deleting_a_namespace_deletes_what_it_holds(server, core, batch):
    # Asynchronous on kube-apiserver (the namespace turns Terminating and the namespace
    # controller empties it), which a test may not rely on.
    core.create_namespace({"metadata": {"name": "ml"}})
    batch.create_namespaced_job("ml", job("train"))
    core.delete_namespace("ml")
    server.wait_for(lambda: batch.list_namespaced_job("ml").items == [], 30,
                    "the namespace's jobs to go")
    server.wait_for(lambda: "ml" not in [n.metadata.name for n in core.list_namespace().items],
                    30, "the namespace to go")
