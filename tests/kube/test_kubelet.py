"""The stand-in node runs pods as processes and reports them as a kubelet does.

Containers run ``python`` (this interpreter, first on the node's PATH) with tiny programs; the
assertions read the pod back through the API with the official client, as a controller would.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Iterator

import pytest

from tests.fakekube.kubelet import Kubelet
from tests.kube.support import pod

pytestmark = pytest.mark.imitation_only  # the stand-in's node


@pytest.fixture()
def node(server) -> Iterator[Kubelet]:
    kubelet = Kubelet(server, unpullable={"registry.example/missing:1"},
                      path_prefix=[os.path.dirname(sys.executable)], pull_backoff=0.1).start()
    try:
        yield kubelet
    finally:
        kubelet.stop()


def _finished(server, core, name: str) -> Any:
    return server.wait_for(
        lambda: (lambda p: p if p.status.phase in ("Succeeded", "Failed") else None)(
            core.read_namespaced_pod(name, "default")), 30, f"pod {name} to finish")


def _terminated(p: Any) -> Any:
    return p.status.container_statuses[0].state.terminated


def test_a_container_that_exits_0_completes_with_its_termination_message(server, core, node):
    program = "open('/dev/termination-log', 'w').write('result!'); print('hello')"
    core.create_namespaced_pod("default", pod("ok", ["python", "-c", program]))
    finished = _finished(server, core, "ok")
    assert finished.status.phase == "Succeeded"
    assert (_terminated(finished).reason, _terminated(finished).exit_code) == ("Completed", 0)
    assert _terminated(finished).message == "result!"
    assert core.read_namespaced_pod_log("ok", "default").strip() == "hello"


def test_a_failing_container_is_error_with_its_exit_code_and_log_tail(server, core, node):
    program = "import sys; print('one'); print('two'); print('three'); sys.exit(3)"
    core.create_namespaced_pod("default", pod("fail", ["python", "-c", program]))
    finished = _finished(server, core, "fail")
    assert finished.status.phase == "Failed"
    assert (_terminated(finished).reason, _terminated(finished).exit_code) == ("Error", 3)
    assert core.read_namespaced_pod_log("fail", "default", tail_lines=2).split() == ["two", "three"]


def test_fallback_to_logs_on_error_puts_the_last_lines_in_the_message(server, core, node):
    body = pod("fallback", ["python", "-c", "print('boom'); raise SystemExit(1)"],
               container={"terminationMessagePolicy": "FallbackToLogsOnError"})
    core.create_namespaced_pod("default", body)
    assert _terminated(_finished(server, core, "fallback")).message.strip() == "boom"


def test_a_container_over_its_memory_limit_is_oom_killed(server, core, node):
    program = "x = bytearray(400 << 20); import time; time.sleep(30)"
    body = pod("hog", ["python", "-c", program],
               container={"resources": {"limits": {"memory": "128Mi", "cpu": "1"}}})
    core.create_namespaced_pod("default", body)
    finished = _finished(server, core, "hog")
    assert (_terminated(finished).reason, _terminated(finished).exit_code) == ("OOMKilled", 137)


def test_a_pod_past_its_active_deadline_fails_with_deadline_exceeded(server, core, node):
    body = pod("slow", ["python", "-c", "import time; time.sleep(60)"], activeDeadlineSeconds=1)
    core.create_namespaced_pod("default", body)
    started = time.monotonic()
    finished = _finished(server, core, "slow")
    assert finished.status.reason == "DeadlineExceeded"
    assert time.monotonic() - started < 15


def test_an_unpullable_image_waits_in_err_image_pull_then_image_pull_back_off(server, core, node):
    core.create_namespaced_pod("default", pod("pull", ["true"], container={
        "image": "registry.example/missing:1"}))
    reasons = set()

    def seen_back_off() -> bool:
        statuses = core.read_namespaced_pod("pull", "default").status.container_statuses or []
        for status in statuses:
            if status.state.waiting is not None:
                reasons.add(status.state.waiting.reason)
        return "ImagePullBackOff" in reasons

    server.wait_for(seen_back_off, 10, "ImagePullBackOff")
    assert "ErrImagePull" in reasons
    assert core.read_namespaced_pod("pull", "default").status.phase == "Pending"


def test_env_volumes_and_paths_are_those_of_the_pod_spec(server, core, node):
    core.create_namespaced_config_map("default", {"metadata": {"name": "code"},
                                                  "data": {"greet.py": "print('from config map')"}})
    program = ("import os; print(os.environ['WHO'], os.environ['GREETING'], "
               "os.environ['POD']); exec(open('/app/greet.py').read())")
    body = pod("env", ["python", "-c", program], volumes=[
        {"name": "code", "configMap": {"name": "code"}}], container={
        "env": [{"name": "WHO", "value": "world"},
                {"name": "GREETING", "value": "hello $(WHO)"},
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "volumeMounts": [{"name": "code", "mountPath": "/app"}]})
    core.create_namespaced_pod("default", body)
    assert _finished(server, core, "env").status.phase == "Succeeded"
    assert core.read_namespaced_pod_log("env", "default").split("\n")[:2] == [
        "world hello world env", "from config map"]


def test_pods_asking_for_gpus_stay_pending_unschedulable(server, core, node):
    core.create_namespaced_pod("default", pod("gpu", ["true"], container={
        "resources": {"limits": {"nvidia.com/gpu": "1"}}}))

    def unschedulable() -> bool:
        conditions = core.read_namespaced_pod("gpu", "default").status.conditions or []
        return any(c.reason == "Unschedulable" for c in conditions)

    server.wait_for(unschedulable, 10, "the Unschedulable condition")
    assert core.read_namespaced_pod("gpu", "default").spec.node_name is None


def test_deleting_a_running_pod_stops_its_process_and_removes_it(server, core, node):
    core.create_namespaced_pod("default", pod("busy", ["python", "-c",
                                                      "import time; time.sleep(60)"]))
    server.wait_for(lambda: core.read_namespaced_pod("busy", "default").status.phase == "Running",
                    15, "the pod to run")
    core.delete_namespaced_pod("busy", "default")
    server.wait_for(lambda: not core.list_namespaced_pod("default").items, 15, "the pod to go")
