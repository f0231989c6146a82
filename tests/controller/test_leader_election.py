"""Leader election with a coordination.k8s.io Lease: one replica reconciles, a standby takes over.

The electors talk to the real API server through the official client; the Lease object is read
back from the API after each step.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

from tests.controller.support import training_job, wait
from xmem_admission.cluster.kube.leader import LeaderElector

FAST = dict(lease_duration=1.5, renew_deadline=1.0, retry_period=0.2)


def _lease(harness) -> dict:
    return harness.get("coordination.k8s.io/v1", "Lease", "xmem")


def _elector(harness, identity: str) -> LeaderElector:
    return LeaderElector(harness.kube(), harness.namespace, "xmem", identity, **FAST)


def test_the_first_candidate_takes_the_lease_and_the_second_stands_by(harness):
    a, b = _elector(harness, "a"), _elector(harness, "b")
    assert a.try_acquire_or_renew() and a.leading
    assert not b.try_acquire_or_renew() and not b.leading
    spec = _lease(harness)["spec"]
    assert (spec["holderIdentity"], spec["leaseDurationSeconds"], spec["leaseTransitions"]) == \
        ("a", 1, 0)
    assert a.try_acquire_or_renew()  # renewal
    assert _lease(harness)["spec"]["renewTime"] >= spec["renewTime"]


def test_a_standby_takes_over_once_the_leader_stops_renewing(harness):
    a, b = _elector(harness, "a"), _elector(harness, "b")
    assert a.try_acquire_or_renew()
    assert not b.try_acquire_or_renew()
    time.sleep(FAST["lease_duration"] + 0.2)  # the leader is gone: no renewals
    assert b.try_acquire_or_renew()
    spec = _lease(harness)["spec"]
    assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("b", 1)
    assert not a.try_acquire_or_renew() and not a.leading


def test_candidates_racing_for_a_free_lease_elect_exactly_one(harness):
    electors = [_elector(harness, f"c{i}") for i in range(6)]
    wins = []
    barrier = threading.Barrier(len(electors))

    def race(elector: LeaderElector) -> None:
        barrier.wait()
        if elector.try_acquire_or_renew():
            wins.append(elector.identity)

    threads = [threading.Thread(target=race, args=(e,)) for e in electors]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(wins) == 1
    assert _lease(harness)["spec"]["holderIdentity"] == wins[0]


def test_a_leader_that_shuts_down_cleanly_hands_over_at_once(harness):
    a, b = _elector(harness, "a"), _elector(harness, "b")
    stop = threading.Event()
    started = threading.Event()
    thread = threading.Thread(target=a.run, args=(stop, started.set, lambda: None))
    thread.start()
    assert started.wait(5)
    stop.set()
    thread.join(5)
    assert _lease(harness)["spec"]["holderIdentity"] == ""
    assert b.try_acquire_or_renew()


def test_two_replicas_one_killed_mid_estimation_the_other_finishes(harness):
    timing = ["--lease-name", "xmem", "--lease-namespace", harness.namespace,
              "--lease-duration", "2", "--renew-deadline", "1.5", "--retry-period", "0.3"]
    replicas = {name: harness.spawn(*timing, identity=name) for name in ("one", "two")}
    leader = wait(lambda: _holder(harness), 30, "a leader")
    killed = threading.Event()

    def kill_leader_after_pod(verb: str, path: str, code: int) -> None:
        if verb == "POST" and code < 300 and re.search(rf"/namespaces/{harness.namespace}/pods$", path) \
                and not killed.is_set():
            os.kill(replicas[leader].pid, signal.SIGKILL)
            killed.set()

    harness.proxy.on_request(kill_leader_after_pod)
    harness.submit(training_job("train"))
    wait(killed.is_set, 60, "the leader to create the estimation pod")
    standby = "two" if leader == "one" else "one"
    released = harness.wait_released("train", timeout=120)
    assert released["spec"]["suspend"] is False
    assert _holder(harness) == standby
    assert _lease(harness)["spec"]["leaseTransitions"] >= 1
    [gme] = harness.gmes()
    assert gme["status"].get("attempt", 1) == 1  # one pod a name per attempt
    wait(lambda: not harness.estimation_pods(), 30, "the succeeded estimation pod to be deleted")
    assert f"{standby} leads" in harness.log_of(standby)


def _holder(harness) -> str:
    try:
        return _lease(harness)["spec"].get("holderIdentity") or ""
    except Exception:  # noqa: BLE001 - not created yet
        return ""
