"""The line estimations wait in, as arithmetic: who is granted a slot, and the expected wait
(``controller.estimation_line``; the cluster behaviour is in test_estimation_fairness.py)."""

from __future__ import annotations

import datetime
import time

from xmem_admission.cluster.controller import line_state
from xmem_admission.cluster.controller.estimation_line import expected_end, human, plan, slots
from xmem_admission.cluster.controller.waiters import Waiters

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)


def _line(namespace: str, count: int) -> list:
    return [(namespace, f"{namespace}-{i}") for i in range(count)]


def test_a_namespace_gets_its_free_slots_in_line_order() -> None:
    started, cursor = plan({"a": _line("a", 5)}, {"a": 2}, 32, None)
    assert started == [("a", "a-0"), ("a", "a-1")]
    assert cursor == "a"


def test_when_the_cluster_cap_is_the_limit_namespaces_take_turns() -> None:
    queues = {"a": _line("a", 3), "b": _line("b", 3)}
    served = []
    cursor = None
    for _ in range(6):  # one slot at a time, as a cap of 1 in the cluster gives them
        started, cursor = plan(queues, {"a": 1, "b": 1}, 1, cursor, first="a")
        [key] = started
        served.append(key)
        queues[key[0]].remove(key)
    assert served == [("a", "a-0"), ("b", "b-0"), ("a", "a-1"), ("b", "b-1"), ("a", "a-2"),
                      ("b", "b-2")]


def test_the_round_robin_begins_with_the_namespace_that_waited_longest() -> None:
    started, cursor = plan({"a": _line("a", 2), "z": _line("z", 2)}, {"a": 4, "z": 4}, 1, None,
                           first="z")
    assert (started, cursor) == ([("z", "z-0")], "z")


def test_free_cluster_slots_are_dealt_one_per_namespace_per_round() -> None:
    queues = {"a": _line("a", 4), "b": _line("b", 1), "c": _line("c", 4)}
    started, cursor = plan(queues, {"a": 4, "b": 4, "c": 1}, 5, "a")
    assert started == [("b", "b-0"), ("c", "c-0"), ("a", "a-0"), ("a", "a-1"), ("a", "a-2")]
    assert cursor == "a"


def test_nothing_starts_without_room() -> None:
    assert plan({"a": _line("a", 2)}, {"a": 0}, 5, None) == ([], None)
    assert plan({"a": _line("a", 2)}, {"a": 3}, 0, "a") == ([], "a")


def test_the_expected_end_counts_the_rounds_before_a_slot_and_the_estimation_itself() -> None:
    assert expected_end(0, 1.0, 10.0) == 20.0  # the running one ends, then its own
    assert expected_end(4, 1.0, 10.0) == 60.0
    assert expected_end(4, 4.0, 10.0) == 30.0
    shares = slots({"a": 4, "b": 4}, 2, ["a", "b"])
    assert shares == {"a": 1.0, "b": 1.0}  # two namespaces share a cluster cap of two


def test_a_refused_pod_backs_off_doubling_and_is_said_once() -> None:
    line = line_state.Line()
    key = ("a", "gme-1")
    delays = []
    for _ in range(6):
        delay, first = line.refused(key, NOW, quota=True)
        delays.append((delay, first))
    assert delays == [(5.0, True), (10.0, False), (20.0, False), (40.0, False), (60.0, False),
                      (60.0, False)]
    assert line.backing_off(key, NOW) is not None
    line.started(key)
    assert line.backing_off(key, NOW) is None
    assert line.refused(key, NOW, quota=True) == (5.0, True)


def test_durations_read_in_words() -> None:
    assert [human(s) for s in (42, 425, 7800)] == ["42 s", "7m05s", "2h10m"]


def test_a_workload_keeps_its_place_for_a_while_after_it_was_first_seen() -> None:
    line = line_state.Line()
    line.saw({"metadata": {"uid": "u1", "name": "first"}})
    now = time.monotonic()
    assert line.keeps_place("u1", now)
    assert not line.keeps_place("u1", now + line_state.KEEP_PLACE_SECONDS)
    assert not line.keeps_place("never-seen", now)
    line.forget({"metadata": {"uid": "u1"}})
    assert not line.keeps_place("u1", now)


def test_a_workload_waits_on_an_estimate_until_it_is_dropped_from_every_one() -> None:
    waiters = Waiters()
    assert not waiters.waits("u1")
    waiters.add("ns", "est-a", "Job", "first", "u1")
    waiters.add("ns", "est-b", "Job", "first", "u1")  # one per GPU template
    waiters.add("ns", "est-a", "Job", "first", "u1")  # again: still two estimates
    waiters.drop("ns", "est-a", "u1")
    assert waiters.waits("u1")
    waiters.forget("ns", "est-b")
    assert not waiters.waits("u1")
