"""The controller's caches in a big cluster: it holds the workloads it may act on, without
``managedFields``, lists in pages, picks up a namespace opted in while it runs, and keeps its
log short while hundreds of workloads wait (``controller.scope``, ``kube.informer``).

A full controller runs against the real control plane, through the tests' fault proxy (which
records every request and can answer one with an expired continue token).
"""

from __future__ import annotations

import logging
import time
from typing import Iterator, Optional
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.controller.support import Harness, policy_spec, training_job, wait
from xmem_admission.cluster import labels
from xmem_admission.cluster.integrations.job import JobIntegration
from xmem_admission.cluster.kube.informer import Informer

JOBS = JobIntegration().resource


def _plain_job(name: str, namespace: str, **meta: dict) -> dict:
    """A suspended CPU Job nobody opted in: no pod is ever made for it."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": namespace, **meta},
            "spec": {"suspend": True, "template": {"spec": {
                "restartPolicy": "Never",
                "containers": [{"name": "main", "image": "busybox", "command": ["true"]}]}}}}


@pytest.fixture()
def plain_namespace(harness: Harness) -> Iterator[str]:
    """A namespace of another team's, not opted in (no pod ever runs there)."""
    name = f"{harness.namespace}-plain"
    harness.cluster.ensure_namespace(name)
    yield name
    harness.cluster.delete("v1", "Namespace", name)
    wait(lambda: harness.cluster.get("v1", "Namespace", name) is None, 120, f"{name} deleted")


def _cached(harness: Harness, controller, namespace: str, name: str) -> Optional[dict]:
    return controller.ctx.workloads["Job"].informer.get(namespace, name)


def test_the_caches_keep_no_managed_fields_and_the_server_still_has_them_after_a_release(harness):
    controller = harness.controller()
    harness.submit(training_job("managed"))
    cached = wait(lambda: _cached(harness, controller, harness.namespace, "managed"), 60,
                  "the held Job in the controller's cache")
    assert "managedFields" not in cached["metadata"]
    released = harness.wait_released("managed", 120)
    # The controller wrote the Job back without its managedFields: the server kept them.
    managers = {f["manager"] for f in released["metadata"].get("managedFields") or []}
    assert managers, released["metadata"]
    for gme in controller.ctx.estimates.items():
        assert "managedFields" not in gme["metadata"]
    for pod in controller.ctx.pods.items():
        assert "managedFields" not in pod["metadata"]


def test_workloads_elsewhere_are_not_cached_until_their_namespace_opts_in(harness,
                                                                          plain_namespace):
    controller = harness.controller()
    harness.create(_plain_job("bystander", plain_namespace))
    marked = _plain_job("marked", plain_namespace)  # as a JobSet's Job: its template is
    marked["spec"]["template"]["metadata"] = {"labels": {labels.OPT_IN: labels.OPT_IN_VALUE}}
    harness.create(marked)  # created after the bystander: seen after it on the same watch
    wait(lambda: _cached(harness, controller, plain_namespace, "marked"), 60,
         "the Job whose template carries the opt-in label, in the cache")
    assert _cached(harness, controller, plain_namespace, "bystander") is None

    def cached_jobs() -> Optional[float]:
        return controller.metrics.registry.get_sample_value(
            "xmem_controller_cached_objects", {"resource": "jobs"})
    wait(lambda: cached_jobs() is not None, 30, "the cached objects gauge")
    listed = len(harness.cluster.list("batch/v1", "Job"))
    wait(lambda: (cached_jobs() or 0) < listed, 30, "fewer Jobs cached than the cluster has")

    # Opted in while the controller runs: its workloads are listed and cached, no restart.
    harness.cluster.ensure_namespace(plain_namespace, {labels.OPT_IN: labels.OPT_IN_VALUE})
    wait(lambda: _cached(harness, controller, plain_namespace, "bystander"), 60,
         "the bystander Job cached once its namespace opted in")
    # Opted out again: what carries no mark leaves the cache.
    harness.cluster.ensure_namespace(plain_namespace, {labels.OPT_IN: "false"})
    wait(lambda: _cached(harness, controller, plain_namespace, "bystander") is None, 60,
         "the bystander dropped once its namespace opted out")
    assert _cached(harness, controller, plain_namespace, "marked") is not None


def test_a_listing_walks_its_pages_and_starts_over_when_its_continue_token_expired(harness):
    selector = f"xmem-test-run={harness.namespace}"
    for index in range(7):
        harness.create(_plain_job(f"page-{index}", harness.namespace,
                                  labels={"xmem-test-run": harness.namespace}))
    path = r"^/apis/batch/v1/jobs$"
    harness.proxy.inject("GET", path, 410, times=1, query="continue=",
                         message="The provided continue parameter is too old to display a "
                                 "consistent list result.")
    informer = Informer(harness.kube(), JOBS, label_selector=selector, page_size=2).start()
    try:
        assert informer.synced.wait(60), informer.error
        assert sorted(o["metadata"]["name"] for o in informer.items()) == \
            [f"page-{i}" for i in range(7)]
        assert informer.listed == 7
    finally:
        informer.stop()
    lists = []
    for method, full, status in list(harness.proxy.seen):
        parts = urlsplit(full)
        query = parse_qs(parts.query)
        if method == "GET" and parts.path == "/apis/batch/v1/jobs" and "watch" not in query:
            lists.append((query.get("limit"), "continue" in query, status))
    # first page, its continue answered 410, then the whole walk again: 4 pages of 2
    assert lists[:2] == [(["2"], False, 200), (["2"], True, 410)], lists
    assert lists[2:] == [(["2"], False, 200)] + [(["2"], True, 200)] * 3, lists


def test_two_hundred_held_jobs_keep_the_log_short(harness, caplog):
    # One estimation pod at a time, each stuck until its 12 s deadline: 199 Jobs wait.
    harness.use(policy_spec(estimation={"maxConcurrent": 1, "activeDeadlineSeconds": 12,
                                        "maxHoldSeconds": 3600}))
    caplog.set_level(logging.INFO, logger="xmem_admission")
    for index in range(200):
        harness.submit(training_job(f"wait-{index:03d}", script="hangs.py",
                                    args=["--part", str(index)]))
    controller = harness.controller()
    start = time.monotonic()

    def held() -> Optional[float]:
        return controller.metrics.registry.get_sample_value(
            "xmem_controller_held_workloads", {"kind": "Job"})
    wait(lambda: (held() or 0) >= 200, 120, "200 held Jobs on the gauge")

    def second_pod() -> bool:
        return len(harness.estimation_pods()) >= 2
    # The first estimation runs to its deadline, then the next starts: over 12 s and more of waiting,
    # with the resync (every 0.5 s) going over all 200.
    wait(second_pod, 120, "the second estimation pod")
    minutes = (time.monotonic() - start) / 60
    ours = [r for r in caplog.records if r.name.startswith("xmem_admission")]
    per_minute = len(ours) / minutes
    assert per_minute < 300, (per_minute, [r.getMessage() for r in ours[:40]])
    named = [r for r in ours if "wait-1" in r.getMessage()]  # 100 of the 200 by name
    assert len(named) <= 10, [r.getMessage() for r in named]
