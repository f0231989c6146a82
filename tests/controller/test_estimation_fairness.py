"""Estimations wait in a fair line when estimation pods are capped: first come, first served in
a namespace, namespaces in turn when the cluster's cap is the limit, and a line that will keep a
workload past ``maxHoldSeconds`` is said at once (a Warning Event, a gauge), not at the deadline.

A full controller runs against the real control plane; the process node runs the estimation
pods. Which pod started when is read from the pods the controller creates, as they appear.
"""

from __future__ import annotations

import copy
import re
import threading
from typing import Iterator, List, Optional, Tuple

import pytest

from tests.controller.support import (
    Harness,
    code_map,
    hold,
    policy_spec,
    training_job,
    wait,
)
from xmem_admission.cluster import labels
from xmem_admission.cluster.controller.estimation_line import BACKLOG

SELECTOR = "app.kubernetes.io/component=estimation"
POD_CREATE = re.compile(r"/api/v1/namespaces/([^/]+)/pods")


class Starts:
    """The order in which estimation pods were created: (namespace, workload) as each pod
    appears, read right after the API server answered its create."""

    def __init__(self, harness: Harness, namespaces: List[str]) -> None:
        self.harness = harness
        self.namespaces = namespaces
        self.order: List[Tuple[str, str]] = []
        self.seen: set = set()
        self.lock = threading.Lock()
        harness.proxy.on_request(self.observe)

    def observe(self, method: str, path: str, code: int) -> None:
        found = POD_CREATE.fullmatch(path)
        if method != "POST" or code != 201 or not found or found.group(1) not in self.namespaces:
            return
        pods = self.harness.cluster.list("v1", "Pod", found.group(1), SELECTOR)
        with self.lock:
            for pod in sorted(pods, key=lambda p: p["metadata"]["creationTimestamp"]):
                if pod["metadata"]["uid"] in self.seen:
                    continue
                self.seen.add(pod["metadata"]["uid"])
                workload = pod["metadata"]["annotations"]["xmem.io/workload"].split("/", 1)[1]
                self.order.append((found.group(1), workload))


def _quick_failing_job(name: str, index: int) -> dict:
    """A Job whose estimation ends at once (the script fails before its first step): its own
    fingerprint and trial family by a positional argument, so it gets a pod of its own."""
    return training_job(name, script="fails_before_step.py", args=[f"shard-{index}"])


@pytest.fixture()
def other_namespace(harness: Harness) -> Iterator[str]:
    name = f"{harness.namespace}-b"
    harness.cluster.ensure_namespace(name)
    # its pods need it (the API server refuses a pod whose service account is not there yet)
    wait(lambda: harness.cluster.get("v1", "ServiceAccount", "default", name), 30,
         f"the default service account of {name}")
    harness.cluster.apply(code_map(name))
    try:
        yield name
    finally:
        harness.cluster.delete("v1", "Namespace", name)
        wait(lambda: harness.cluster.get("v1", "Namespace", name) is None, 120,
             f"namespace {name} to be deleted")


def _submit_in(harness: Harness, namespace: str, obj: dict) -> dict:
    obj = copy.deepcopy(obj)
    obj["metadata"]["namespace"] = namespace
    return harness.create(hold(obj, harness.policy))


def _released(harness: Harness, namespace: str, name: str) -> Optional[dict]:
    job = harness.get("batch/v1", "Job", name, namespace)
    assert job is not None, f"job {namespace}/{name} is gone"
    return None if labels.HELD_REASON in (job["metadata"].get("annotations") or {}) else job


def test_with_one_pod_a_namespace_estimations_start_in_the_order_jobs_were_submitted(harness):
    harness.use(policy_spec(estimation={"maxConcurrentPerNamespace": 1}))
    starts = Starts(harness, [harness.namespace])
    harness.controller()
    names = ["delta", "charlie", "bravo", "alpha"]  # submitted against name order
    for index, name in enumerate(names):
        harness.submit(_quick_failing_job(name, index))
    for name in names:
        harness.wait_released(name, 180)
    assert [workload for _, workload in starts.order] == names


def test_two_namespaces_take_turns_when_the_clusters_cap_is_the_limit(harness, other_namespace):
    harness.use(policy_spec(estimation={"maxConcurrent": 1}))
    starts = Starts(harness, [harness.namespace, other_namespace])
    # All six wait before the controller starts: each namespace has a line when slots free up.
    for index in range(3):
        harness.submit(_quick_failing_job(f"a{index}", index))
    for index in range(3):
        _submit_in(harness, other_namespace, _quick_failing_job(f"b{index}", index))
    harness.controller()
    for index in range(3):
        harness.wait_released(f"a{index}", 180)
        wait(lambda i=index: _released(harness, other_namespace, f"b{i}"), 180, f"b{index}")
    # The namespaces take turns (which goes first is a tie: all six were created within a
    # second or two), and each namespace's line is served in its own order.
    served = [ns for ns, _ in starts.order]
    assert len(served) == 6 and all(a != b for a, b in zip(served, served[1:])), starts.order
    assert [w for ns, w in starts.order if ns == harness.namespace] == ["a0", "a1", "a2"]
    assert [w for ns, w in starts.order if ns == other_namespace] == ["b0", "b1", "b2"]


def test_a_line_longer_than_max_hold_is_said_early_with_a_warning_event_and_a_gauge(harness):
    # Each estimation takes its deadline (8 s: the script waits forever); one at a time; a
    # workload may be held 45 s. The sixth in line cannot be estimated in time.
    harness.use(policy_spec(estimation={"maxConcurrentPerNamespace": 1,
                                        "activeDeadlineSeconds": 8, "maxHoldSeconds": 45}))
    controller = harness.controller()
    names = [f"job{index}" for index in range(6)]
    jobs = {name: harness.submit(training_job(name, script="hangs.py", args=["--part", name]))
            for name in names}

    def gauge(name: str) -> float:
        value = controller.metrics.registry.get_sample_value(
            name, {"namespace": harness.namespace})
        return value or 0.0

    wait(lambda: gauge("xmem_controller_estimations_waiting") >= 4, 60,
         "the waiting estimations on the gauge")
    wait(lambda: gauge("xmem_controller_estimation_oldest_wait_seconds") >= 1, 30,
         "the oldest wait on the gauge")

    def backlog(name: str) -> list:
        return [e for e in harness.events(name) if e["reason"] == BACKLOG]

    [event] = wait(lambda: backlog("job5"), 60, "the backlog Warning on the last job")
    assert event["type"] == "Warning"
    assert gauge("xmem_controller_estimations_expected_late") >= 1
    message = event["message"]
    assert re.search(r"is number \d of \d waiting in " + re.escape(harness.namespace), message), \
        message
    assert f"(1 estimation pod at a time in {harness.namespace})" in message
    assert re.search(r"expected in (about|at least) \d+", message), message
    assert "maxHoldSeconds (45)" in message and "onEstimationFailure (Release)" in message
    # said before its deadline, while it was still held
    from xmem_admission.cluster.controller import records

    created = records.parse_time(jobs["job5"]["metadata"]["creationTimestamp"])
    said = records.parse_time(event["firstTimestamp"])
    assert created is not None and said is not None
    assert (said - created).total_seconds() < 45 - 5, (created, said)
    # the first in line was never in danger
    assert backlog("job0") == []
    for name in names:  # nothing is left held
        harness.wait_released(name, 120)
    assert len(backlog("job5")) == 1  # said once
