"""Kill ``xmem controller`` right after each write it makes; its successor finishes the job.

All the controller's state lives in API objects, so a process SIGKILLed at any point leaves
something a fresh process continues from: never a second estimate, a second estimation pod or a
second release. The stand-in API server kills the process from inside the request handler,
just after answering the write, the most awkward moment there is.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from tests.controller.support import template_annotations, training_job, wait
from xmem_admission.cluster import labels

# (method, path pattern, which occurrence): every write of one estimation, in order.
KILL_POINTS = {
    "estimate created": ("POST", r"/gpumemoryestimates$", 1),
    "workload marked estimating": ("PUT", r"/jobs/train$", 1),
    "estimation pod created": ("POST", r"/namespaces/default/pods$", 1),
    "estimate recorded running": ("PUT", r"/gpumemoryestimates/[^/]+/status$", 1),
    "estimate recorded succeeded": ("PUT", r"/gpumemoryestimates/[^/]+/status$", 2),
    "workload released": ("PUT", r"/jobs/train$", 2),
}


@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_a_controller_killed_after_a_write_is_finished_by_a_new_process(harness, point):
    method, pattern, nth = KILL_POINTS[point]
    harness.submit(training_job("train"))
    first = harness.spawn("--no-leader-election", identity="first")
    seen = []
    killed = threading.Event()

    def kill_after_write(verb: str, path: str, code: int) -> None:
        if verb == method and code < 300 and re.search(pattern, path) and not killed.is_set():
            seen.append(path)
            if len(seen) == nth:
                os.kill(first.pid, signal.SIGKILL)
                killed.set()

    harness.server.on_request(kill_after_write)
    wait(killed.is_set, 90, f"the write '{point}'")
    assert first.wait(timeout=10) == -signal.SIGKILL
    harness.spawn("--no-leader-election", identity="second")
    released = harness.wait_released("train", timeout=120)
    assert released["spec"]["suspend"] is False
    assert int(template_annotations(released)[labels.REQUEST_BYTES]) > 0
    [gme] = harness.gmes()
    assert gme["status"]["phase"] == "Succeeded"
    assert len(harness.estimation_pods()) == 1
    def estimated() -> list:
        return [e for e in harness.events("train") if e["reason"] == "Estimated"]

    if point == "workload released":  # killed between the release and its Event: no Event,
        time.sleep(1.0)               # and the successor does not release a second time
        assert estimated() == []
    else:
        wait(estimated, 10, "the Estimated event")
        time.sleep(0.5)
        assert len(estimated()) == 1
