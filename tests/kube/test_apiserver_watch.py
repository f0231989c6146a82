"""Watches on the API server behave as the official client's ``Watch`` expects."""

from __future__ import annotations

import threading
import time
from typing import Any, List, Tuple

import pytest
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from localkube.controlplane import wait_for
from tests.kube.support import job, raw


def _collect(fn: Any, seconds: int, ready: int = 0,
             **kwargs: Any) -> Tuple[threading.Thread, List[Tuple[str, str]]]:
    """Watch in a thread; returns once the first ``ready`` events (those of the objects that
    already exist) have arrived, so the watch is open before the caller changes anything."""
    events: List[Tuple[str, str]] = []

    def run() -> None:
        for event in watch.Watch().stream(fn, timeout_seconds=seconds, deserialize=False, **kwargs):
            events.append((event["type"], event["object"]["metadata"]["name"]))

    thread = threading.Thread(target=run)
    thread.start()
    wait_for(lambda: len(events) >= ready, 10, f"the watch's first {ready} events")
    return thread, events


def test_a_watch_from_a_version_streams_every_later_change_in_order(batch):
    first = raw(batch.create_namespaced_job("default", job("a"), _preload_content=False))
    version = first["metadata"]["resourceVersion"]
    batch.create_namespaced_job("default", job("b"))
    batch.patch_namespaced_job("a", "default", {"metadata": {"labels": {"x": "1"}}})
    batch.delete_namespaced_job("b", "default")
    thread, events = _collect(batch.list_namespaced_job, 1, namespace="default",
                              resource_version=version)
    thread.join()
    assert events == [("ADDED", "b"), ("MODIFIED", "a"), ("MODIFIED", "b"), ("DELETED", "b")]


def test_a_watch_without_a_version_starts_with_the_current_objects(batch):
    batch.create_namespaced_job("default", job("a"))
    thread, events = _collect(batch.list_namespaced_job, 1, ready=1, namespace="default")
    batch.create_namespaced_job("default", job("b"))
    thread.join()
    assert events == [("ADDED", "a"), ("ADDED", "b")]


def test_objects_leaving_a_label_selector_arrive_as_deleted_and_entering_as_added(batch):
    batch.create_namespaced_job("default", job("a", labels={"team": "ml"}))
    thread, events = _collect(batch.list_namespaced_job, 1, ready=1, namespace="default",
                              label_selector="team=ml")
    batch.patch_namespaced_job("a", "default", {"metadata": {"labels": {"team": "web"}}})
    batch.patch_namespaced_job("a", "default", {"metadata": {"labels": {"team": "ml"}}})
    batch.create_namespaced_job("default", job("other", labels={"team": "web"}))
    thread.join()
    assert events == [("ADDED", "a"), ("DELETED", "a"), ("ADDED", "a")]


def test_after_etcd_compaction_the_api_servers_cache_still_serves_the_old_version(
        server, batch):
    """etcd has forgotten the first version, yet kube-apiserver 1.36 still replays a watch from
    it and lists exactly at it, from its watch cache (its snapshots outlive etcd's history): no
    410 Gone, which the project's stand-in answered. A 410 comes only once the cache has moved
    on; the informer relists then (not provoked here)."""
    first = raw(batch.create_namespaced_job("default", job("a"), _preload_content=False))
    batch.create_namespaced_job("default", job("b"))
    server.compact()
    version = first["metadata"]["resourceVersion"]
    seen = [(e["type"], e["object"].metadata.name) for e in watch.Watch().stream(
        batch.list_namespaced_job, "default", timeout_seconds=1, resource_version=version)]
    assert ("ADDED", "b") in seen
    exact = batch.list_namespaced_job("default", resource_version=version,
                                      resource_version_match="Exact")
    assert [j.metadata.name for j in exact.items] == ["a"]


def test_a_watch_ends_when_its_timeout_passes(batch):
    started = time.monotonic()
    events = list(watch.Watch().stream(batch.list_namespaced_job, "default", timeout_seconds=1))
    assert events == []
    assert 0.8 < time.monotonic() - started < 5


def test_list_selectors_limit_and_continue_page_through_matching_objects(batch, core):
    for index in range(5):
        batch.create_namespaced_job("default", job(f"j{index}", labels={"i": str(index % 2)}))
    page = raw(batch.list_namespaced_job("default", label_selector="i in (0)", limit=2,
                                         _preload_content=False))
    assert [o["metadata"]["name"] for o in page["items"]] == ["j0", "j2"]
    rest = raw(batch.list_namespaced_job("default", label_selector="i in (0)", limit=2,
                                         _continue=page["metadata"]["continue"],
                                         _preload_content=False))
    assert [o["metadata"]["name"] for o in rest["items"]] == ["j4"]
    assert "continue" not in rest["metadata"]
    named = raw(batch.list_namespaced_job("default", field_selector="metadata.name=j3",
                                          _preload_content=False))
    assert [o["metadata"]["name"] for o in named["items"]] == ["j3"]
    with pytest.raises(ApiException) as caught:
        core.list_namespaced_pod("default", field_selector="spec.containers=x")
    assert caught.value.status == 400
