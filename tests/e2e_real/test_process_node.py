"""The project's process node, on the real control plane: the real scheduler binds pods to it, it
runs them as processes and reports them as a kubelet does, and the API server serves their logs
from it. Containers run ``python`` (this interpreter, first on the node's PATH)."""

from __future__ import annotations

import re
import time
from typing import Any, Iterator

import pytest
from kubernetes import client

from localkube.controlplane import wait_for


def _pod(name: str, command: list, **spec: Any) -> dict:
    container = {"name": "main", "image": "busybox:1.36", "command": command}
    container.update(spec.pop("container", {}))
    body = {"restartPolicy": "Never", "containers": [container]}
    body.update(spec)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": body}


@pytest.fixture()
def ns(cluster, request) -> Iterator[str]:
    name = "node-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[5:40].strip("-")
    cluster.ensure_namespace(name)
    wait_for(lambda: cluster.get("v1", "ServiceAccount", "default", name), 30,
             "the namespace's default service account")
    yield name
    cluster.delete("v1", "Namespace", name)


@pytest.fixture()
def core(cluster) -> Any:
    return client.CoreV1Api(cluster.api)


def _finished(core, ns: str, name: str) -> Any:
    return wait_for(lambda: (lambda p: p if p.status.phase in ("Succeeded", "Failed") else None)(
        core.read_namespaced_pod(name, ns)), 180, f"pod {name} to finish")


def _terminated(p: Any) -> Any:
    return p.status.container_statuses[0].state.terminated


def test_a_container_that_exits_0_completes_with_its_termination_message(cluster, core, ns):
    program = "open('/dev/termination-log', 'w').write('all good'); print('done')"
    core.create_namespaced_pod(ns, _pod("ok", ["python", "-c", program]))
    finished = _finished(core, ns, "ok")
    assert finished.spec.node_name == cluster.node.name
    assert finished.status.phase == "Succeeded"
    assert (_terminated(finished).reason, _terminated(finished).exit_code) == ("Completed", 0)
    assert _terminated(finished).message == "all good"
    assert core.read_namespaced_pod_log("ok", ns) == "done\n"  # through the API server


def test_a_failing_container_is_error_with_its_exit_code(core, ns):
    core.create_namespaced_pod(ns, _pod("fail", ["python", "-c", "raise SystemExit(3)"]))
    finished = _finished(core, ns, "fail")
    assert finished.status.phase == "Failed"
    assert (_terminated(finished).reason, _terminated(finished).exit_code) == ("Error", 3)


def test_a_command_the_image_lacks_ends_the_container_with_start_error_as_the_kubelet_does(
        core, ns):
    """kubelet 1.36 with containerd 2.4 and runc (tests/realnode): terminated, StartError, exit
    code 128, the runtime's error as the message, the pod Failed."""
    core.create_namespaced_pod(ns, _pod("missing", ["no-such-program", "--flag"]))
    finished = _finished(core, ns, "missing")
    assert finished.status.phase == "Failed"
    ended = _terminated(finished)
    assert (ended.reason, ended.exit_code) == ("StartError", 128)
    assert 'exec: "no-such-program": executable file not found in $PATH' in ended.message


def test_fallback_to_logs_on_error_puts_the_last_lines_in_the_message(core, ns):
    body = _pod("fallback", ["python", "-c", "print('boom'); raise SystemExit(1)"],
                container={"terminationMessagePolicy": "FallbackToLogsOnError"})
    core.create_namespaced_pod(ns, body)
    assert _terminated(_finished(core, ns, "fallback")).message.strip() == "boom"


def test_a_container_over_its_memory_limit_is_oom_killed(core, ns):
    program = "x = bytearray(400 << 20); import time; time.sleep(30)"
    body = _pod("hog", ["python", "-c", program],
                container={"resources": {"limits": {"memory": "128Mi", "cpu": "1"}}})
    core.create_namespaced_pod(ns, body)
    finished = _finished(core, ns, "hog")
    assert (_terminated(finished).reason, _terminated(finished).exit_code) == ("OOMKilled", 137)


def test_a_pod_past_its_active_deadline_fails_with_deadline_exceeded(core, ns):
    core.create_namespaced_pod(ns, _pod("slow", ["python", "-c", "import time; time.sleep(60)"],
                                        activeDeadlineSeconds=2))
    started = time.monotonic()
    finished = _finished(core, ns, "slow")
    assert finished.status.reason == "DeadlineExceeded"
    assert time.monotonic() - started < 20


def test_env_volumes_and_paths_are_those_of_the_pod_spec(core, ns):
    core.create_namespaced_config_map(ns, {"metadata": {"name": "code"},
                                           "data": {"greet.py": "print('from config map')"}})
    program = ("import os; print(os.environ['WHO'], os.environ['GREETING'], "
               "os.environ['POD']); exec(open('/app/greet.py').read())")
    body = _pod("env", ["python", "-c", program], volumes=[
        {"name": "code", "configMap": {"name": "code"}}], container={
        "env": [{"name": "WHO", "value": "world"},
                {"name": "GREETING", "value": "hello $(WHO)"},
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "volumeMounts": [{"name": "code", "mountPath": "/app"}]})
    core.create_namespaced_pod(ns, body)
    assert _finished(core, ns, "env").status.phase == "Succeeded"
    assert core.read_namespaced_pod_log("env", ns).split("\n")[:2] == [
        "world hello world env", "from config map"]


def test_a_pod_asking_for_a_gpu_stays_pending_unschedulable_on_a_node_without_one(
        cluster, core, ns):
    # Held to this node by name: the session may also hold a GPU process node (the OOM-retry,
    # right-sizing and Kueue tests start one), which would otherwise take the pod.
    core.create_namespaced_pod(ns, _pod("gpu", ["true"], container={
        "resources": {"limits": {"nvidia.com/gpu": "1"}}},
        nodeSelector={"kubernetes.io/hostname": cluster.node.name}))

    def unschedulable() -> bool:
        conditions = core.read_namespaced_pod("gpu", ns).status.conditions or []
        return any(c.reason == "Unschedulable" for c in conditions)

    wait_for(unschedulable, 60, "the scheduler's Unschedulable condition")
    assert core.read_namespaced_pod("gpu", ns).spec.node_name is None


def test_deleting_a_running_pod_stops_its_process_and_removes_it(core, ns):
    core.create_namespaced_pod(ns, _pod("busy", ["python", "-c", "import time; time.sleep(60)"]))
    wait_for(lambda: core.read_namespaced_pod("busy", ns).status.phase == "Running", 30,
             "the pod to run")
    started = time.monotonic()
    core.delete_namespaced_pod("busy", ns)
    wait_for(lambda: not core.list_namespaced_pod(ns).items, 30, "the pod to go")
    assert time.monotonic() - started < 20  # stopped at SIGTERM, not at the grace period's end


def test_an_image_from_an_unreachable_registry_waits_in_image_pull_backoff(core, ns):
    body = _pod("unpullable", ["python", "-c", "pass"])
    body["spec"]["containers"][0]["image"] = "registry.invalid/team/train:1"
    core.create_namespaced_pod(ns, body)

    def reason(wanted: str) -> Any:
        statuses = core.read_namespaced_pod("unpullable", ns).status.container_statuses or []
        waiting = statuses[0].state.waiting if statuses else None
        return waiting if waiting is not None and waiting.reason == wanted else None

    first = wait_for(lambda: reason("ErrImagePull"), 60, "ErrImagePull")
    assert "registry.invalid" in first.message and "no such host" in first.message
    wait_for(lambda: reason("ImagePullBackOff"), 30, "ImagePullBackOff")
    pod = core.read_namespaced_pod("unpullable", ns)
    assert pod.status.phase == "Pending"
    events = core.list_namespaced_event(ns, field_selector="involvedObject.name=unpullable")
    assert "Error: ErrImagePull" in {e.message for e in events.items}


def test_fallback_to_logs_keeps_the_last_80_lines_and_2048_bytes_as_the_kubelet_does(core, ns):
    """The kubelet reads the last 80 lines of the log into a 2048-byte ring (kubelet
    kuberuntime readLastStringFromContainerLogs; kubecontainer
    MaxContainerTerminationMessageLogLines and MaxContainerTerminationMessageLogLength), stdout
    and stderr together, only for a failed container that wrote no message."""
    short = "import sys\nfor i in range(100): print(f'l{i:03d}', file=sys.stderr if i % 2 else " \
            "sys.stdout, flush=True)\nraise SystemExit(1)"
    wide = "for i in range(100): print(f'line {i:03d} ' + 'x' * 40, flush=True)\nraise SystemExit(2)"
    written = "open('/dev/termination-log', 'w').write('mine'); print('noise'); raise SystemExit(1)"
    for name, program in (("short", short), ("wide", wide), ("written", written)):
        core.create_namespaced_pod(ns, _pod(name, ["python", "-c", program], container={
            "terminationMessagePolicy": "FallbackToLogsOnError"}))
    assert _terminated(_finished(core, ns, "short")).message == "".join(
        f"l{i:03d}\n" for i in range(20, 100))
    lines = "".join(f"line {i:03d} " + "x" * 40 + "\n" for i in range(20, 100))
    assert _terminated(_finished(core, ns, "wide")).message == lines[-2048:]
    assert _terminated(_finished(core, ns, "written")).message == "mine"


def test_on_failure_a_failed_container_runs_again_in_the_same_pod_as_the_kubelet_runs_it(
        core, ns):
    """restartPolicy OnFailure: the container that exited non-zero backs off, with its
    termination (and message) in lastState and restartCount counted, then runs again."""
    program = ("import pathlib; f = pathlib.Path('/scratch/runs'); n = int(f.read_text()) if "
               "f.exists() else 0; f.write_text(str(n + 1)); print(f'run {n}'); "
               "raise SystemExit(0 if n >= 2 else 1)")
    body = _pod("again", ["python", "-c", program], restartPolicy="OnFailure",
                volumes=[{"name": "work", "emptyDir": {}}],
                container={"terminationMessagePolicy": "FallbackToLogsOnError",
                           "volumeMounts": [{"name": "work", "mountPath": "/scratch"}]})
    core.create_namespaced_pod(ns, body)
    def backing_off_pod() -> Any:
        pod = core.read_namespaced_pod("again", ns)
        waiting = pod.status.container_statuses and pod.status.container_statuses[0].state.waiting
        return pod if waiting and waiting.reason == "CrashLoopBackOff" else None

    # A condition, not a pause: generous because the node starts the container's Python on a
    # loaded machine (it timed out at 60 s in a full run beside a benchmark)
    backing_off = wait_for(backing_off_pod, 180, "the container to back off")
    status = backing_off.status.container_statuses[0]
    assert status.restart_count >= 1 and status.last_state.terminated.exit_code == 1
    assert backing_off.status.phase == "Running"
    finished = _finished(core, ns, "again")
    status = finished.status.container_statuses[0]
    assert finished.status.phase == "Succeeded" and status.restart_count == 2
    assert status.state.terminated.exit_code == 0
    assert (status.last_state.terminated.exit_code, status.last_state.terminated.message) == (
        1, "run 1\n")
