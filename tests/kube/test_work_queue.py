"""The controller's work queue: a key waits once however often it is asked for, delayed keys
keep one timer (the earliest), and a key is never handed to two workers at once."""

from __future__ import annotations

import threading

from xmem_admission.cluster.kube.informer import WorkQueue


def drain(queue, timeout=0.05):
    keys = []
    while True:
        key = queue.get(timeout=timeout)
        if key is None:
            return keys
        keys.append(key)
        queue.done(key)


def test_a_key_asked_for_many_times_is_handed_out_once():
    queue = WorkQueue()
    for _ in range(10):
        queue.add("a")
    assert queue.pending("a") == 1 and len(queue) == 1
    assert drain(queue) == ["a"]


def test_a_delayed_key_asked_for_again_by_every_resync_keeps_one_timer():
    queue = WorkQueue()
    for _ in range(1000):  # a resync every 30 s over a long hold, each asking again
        queue.add("held", delay=30.0)
    assert queue.pending("held") == 1 and len(queue) == 1


def test_an_earlier_timer_replaces_a_later_one_and_the_later_never_fires():
    queue = WorkQueue()
    queue.add("k", delay=0.3)
    queue.add("k", delay=0.01)
    assert queue.pending("k") == 1
    # drained until well past the replaced timer's time: the key is handed out once
    assert drain(queue, timeout=0.8) == ["k"]
    assert queue.pending("k") == 0 and len(queue) == 0


def test_a_key_being_processed_is_handed_out_again_only_after_done():
    queue = WorkQueue()
    queue.add("k")
    first = queue.get(timeout=0.1)
    queue.add("k")
    other = []
    worker = threading.Thread(target=lambda: other.append(queue.get(timeout=0.2)))
    worker.start()
    worker.join()
    assert first == "k" and other == [None]
    queue.done("k")
    assert drain(queue) == ["k"]


def test_a_cluster_wide_item_goes_ahead_of_a_long_line_of_workloads():
    queue = WorkQueue()
    for index in range(2000):
        queue.add(("workload", "Job", "team", f"job-{index}"))
    queue.add(("dispatch",))
    first = queue.get(timeout=0.05)
    assert first == ("dispatch",)
    queue.done(first)
    assert queue.get(timeout=0.05) == ("workload", "Job", "team", "job-0")
