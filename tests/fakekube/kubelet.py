"""A stand-in node: scheduler and kubelet in one, running pods as local processes.

It is a client of the API server like a real kubelet (the official ``kubernetes`` client, over
HTTPS): it watches pods, binds the ones it can take (``pods/binding``), prepares their volumes
(``emptyDir``, ``configMap``, ``secret``, ``hostPath``), pulls images (an image named in
``unpullable`` fails with ``ErrImagePull`` then ``ImagePullBackOff``, as a missing image does),
runs init containers in order and then the containers (see ``containers`` for how a container
becomes a process), and reports each step through ``pods/status``: phase, conditions,
``containerStatuses`` with ``waiting``/``running``/``terminated`` (``Completed``, ``Error``,
``OOMKilled`` with exit code 137), the termination message read from the file at
``terminationMessagePath`` (at most 4096 bytes; ``FallbackToLogsOnError`` falls back to the last
log lines), and ``DeadlineExceeded`` when ``activeDeadlineSeconds`` runs out (counted from
``status.startTime``, pulls included). Logs are served to ``pods/log`` through the API server.

Pods asking for resources the node does not have (any GPU, here) stay Pending with
``PodScheduled=False``/``Unschedulable``, as with a real scheduler. Only ``restartPolicy:
Never`` is run faithfully; a failed container of a pod with another policy is not restarted.
"""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Dict, Iterable, List, Optional

from tests.fakekube.apiserver import ApiServer
from tests.fakekube.objects import now
from tests.fakekube.rbac import User
from tests.fakekube.selectors import LabelSelector
from tests.realkube import containers as ctr
from xmem_admission.cluster.kube import quantity
from xmem_admission.cluster.kube.informer import interrupt_watch

MAX_MESSAGE = 4096  # kubelet: maxTerminationMessageLength... per container (4 KiB)


class Kubelet:
    """Runs the pods bound to its node; see the module docstring."""

    def __init__(self, server: ApiServer, node_name: str = "standin-node",
                 images: Optional[Dict[str, ctr.Image]] = None, unpullable: Iterable[str] = (),
                 path_prefix: Iterable[str] = (), allocatable: Optional[Dict[str, str]] = None,
                 selector: str = "", root: Optional[str] = None, pull_backoff: float = 0.3) -> None:
        self.server = server
        self.node_name = node_name
        self.images = dict(images or {})
        self.unpullable = set(unpullable)
        self.path_prefix = list(path_prefix)
        self.allocatable = allocatable or {"cpu": "16", "memory": "64Gi", "pods": "110",
                                           "ephemeral-storage": "100Gi"}
        self.selector = LabelSelector.parse(selector)
        self.root = root or tempfile.mkdtemp(prefix="standin-kubelet-")
        self.pull_backoff = pull_backoff
        self._stop = threading.Event()
        self._pods: Dict[str, threading.Thread] = {}  # uid -> runner
        self._done: set = set()  # uids whose containers have run: never run twice
        self._deleting: Dict[str, threading.Event] = {}
        self._logs: Dict[tuple, str] = {}
        self._lock = threading.Lock()
        self._client: Any = None
        self._watcher: Any = None
        self._thread: Optional[threading.Thread] = None

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> Kubelet:
        from kubernetes import client

        node = User(f"system:node:{self.node_name}", ("system:nodes", "system:authenticated"),
                    superuser=True)
        self._client = client.CoreV1Api(self.server.api_client(self.server.add_user(node)))
        self.server.api.log_source = self._log
        self.server.storage.kubelet_present = lambda: not self._stop.is_set()
        self._thread = threading.Thread(target=self._watch, name="standin-kubelet", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        deadline = time.monotonic() + 5
        while self._thread is not None and self._thread.is_alive() and time.monotonic() < deadline:
            if self._watcher is not None:  # unblock the watch now rather than at its timeout
                interrupt_watch(self._watcher)
            self._thread.join(0.05)
        for event in list(self._deleting.values()):
            event.set()
        for runner in list(self._pods.values()):
            runner.join(timeout=10)
        if self._thread is not None:
            self._thread.join(timeout=5)
        shutil.rmtree(self.root, ignore_errors=True)

    def _watch(self) -> None:
        from kubernetes import watch

        while not self._stop.is_set():
            try:
                self._watcher = watch.Watch()
                stream = self._watcher.stream(self._client.list_pod_for_all_namespaces,
                                              timeout_seconds=30, deserialize=False)
                for event in stream:
                    if self._stop.is_set():
                        break
                    self._on_pod(event["type"], event["object"])
            except Exception:  # noqa: BLE001 - a node keeps going through API hiccups
                time.sleep(0.2)

    def _on_pod(self, kind: str, pod: Dict[str, Any]) -> None:
        m = pod["metadata"]
        uid = m["uid"]
        node = pod["spec"].get("nodeName")
        if kind == "DELETED":
            event = self._deleting.get(uid)
            if event is not None:
                event.set()
            return
        if "deletionTimestamp" in m:
            if node == self.node_name:
                with self._lock:
                    event = self._deleting.setdefault(uid, threading.Event())
                    event.set()
                    running = uid in self._pods
                if not running:
                    self._force_delete(pod)
            return
        if node is None and self.selector.matches(m.get("labels")) and \
                (pod.get("status") or {}).get("phase", "Pending") == "Pending":
            self._schedule(pod)
        elif node == self.node_name:
            with self._lock:
                if uid in self._pods or uid in self._done or \
                        (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                    return
                self._deleting.setdefault(uid, threading.Event())
                runner = threading.Thread(target=self._run_pod, args=(pod,), daemon=True,
                                          name=f"pod-{m['name']}")
                self._pods[uid] = runner
            runner.start()

    # --- scheduling -------------------------------------------------------------------------

    def _schedule(self, pod: Dict[str, Any]) -> None:
        missing = []
        for c in pod["spec"].get("containers") or []:
            resources = c.get("resources") or {}
            for name in set(resources.get("limits") or {}) | set(resources.get("requests") or {}):
                if name not in self.allocatable:
                    missing.append(name)
        m = pod["metadata"]
        if missing:
            message = f"0/1 nodes are available: 1 Insufficient {sorted(set(missing))[0]}."
            for condition in (pod.get("status") or {}).get("conditions") or []:
                if condition.get("type") == "PodScheduled" and condition.get("message") == message:
                    return  # already reported; a real scheduler retries quietly
            self._patch_status(pod, {"conditions": [
                {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                 "message": message, "lastTransitionTime": now()}]})
            return
        body = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": m["name"]},
                "target": {"apiVersion": "v1", "kind": "Node", "name": self.node_name}}
        try:
            self._client.create_namespaced_pod_binding(m["name"], m["namespace"], body,
                                                       _preload_content=False)
        except Exception:  # noqa: BLE001 - deleted or bound meanwhile: the watch will tell
            return
        self._event(pod, "Normal", "Scheduled",
                    f"Successfully assigned {m['namespace']}/{m['name']} to {self.node_name}")

    # --- API helpers ------------------------------------------------------------------------

    def _patch_status(self, pod: Dict[str, Any], status: Dict[str, Any]) -> bool:
        m = pod["metadata"]
        try:
            self._client.patch_namespaced_pod_status(
                m["name"], m["namespace"], {"metadata": {"uid": m["uid"]}, "status": status},
                _preload_content=False)
            return True
        except Exception:  # noqa: BLE001 - the pod is gone: nothing left to report to
            return False

    def _event(self, pod: Dict[str, Any], type_: str, reason: str, message: str) -> None:
        m = pod["metadata"]
        stamp = now()
        body = {
            "metadata": {"generateName": f"{m['name']}.", "namespace": m["namespace"]},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": m["name"],
                               "namespace": m["namespace"], "uid": m["uid"]},
            "reason": reason, "message": message, "type": type_, "count": 1,
            "firstTimestamp": stamp, "lastTimestamp": stamp,
            "source": {"component": "kubelet", "host": self.node_name},
        }
        try:
            self._client.create_namespaced_event(m["namespace"], body, _preload_content=False)
        except Exception:  # noqa: BLE001 - events are best effort, as on a real node
            pass

    def _force_delete(self, pod: Dict[str, Any]) -> None:
        m = pod["metadata"]
        try:
            self._client.delete_namespaced_pod(m["name"], m["namespace"], grace_period_seconds=0,
                                               _preload_content=False)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def _lookup(self, kind: str, namespace: str, name: str) -> Optional[Dict[str, str]]:
        try:
            if kind == "ConfigMap":
                obj = self._client.read_namespaced_config_map(name, namespace)
                return dict(obj.data or {})
            obj = self._client.read_namespaced_secret(name, namespace)
            return {k: base64.b64decode(v).decode() for k, v in (obj.data or {}).items()}
        except Exception:  # noqa: BLE001 - missing: the caller reports it
            return None

    def _log(self, namespace: str, name: str, container: str, params: Dict[str, str]) -> Optional[bytes]:
        path = self._logs.get((namespace, name, container))
        if path is None:
            return None
        lines = int(params["tailLines"]) if params.get("tailLines") else None
        limit = int(params["limitBytes"]) if params.get("limitBytes") else None
        return ctr.tail(path, lines, limit)

    # --- running a pod ----------------------------------------------------------------------

    def _volumes(self, pod: Dict[str, Any], pod_dir: str) -> Dict[str, str]:
        out = {}
        namespace = pod["metadata"]["namespace"]
        for volume in pod["spec"].get("volumes") or []:
            host = os.path.join(pod_dir, "volumes", volume["name"])
            if "hostPath" in volume:
                out[volume["name"]] = volume["hostPath"]["path"]
                continue
            os.makedirs(host, exist_ok=True)
            for kind, key in (("ConfigMap", "configMap"), ("Secret", "secret")):
                if key not in volume:
                    continue
                ref = volume[key]
                data = self._lookup(kind, namespace, ref.get("name") or ref.get("secretName", ""))
                if data is None:
                    raise ctr.ConfigError(f'{kind.lower()} "{ref.get("name") or ref.get("secretName")}" not found')
                items = ref.get("items") or [{"key": k, "path": k} for k in data]
                for item in items:
                    target = os.path.join(host, item["path"])
                    os.makedirs(os.path.dirname(target), exist_ok=True)
                    with open(target, "w", encoding="utf-8") as handle:
                        handle.write(data.get(item["key"], ""))
            if not any(k in volume for k in ("emptyDir", "configMap", "secret")):
                raise ctr.ConfigError(f"volume {volume['name']!r}: type not supported by the stand-in")
            out[volume["name"]] = host
        return out

    def _container_env(self, pod: Dict[str, Any], c: Dict[str, Any], image: ctr.Image,
                       paths: ctr.PathMap, pod_dir: str) -> Dict[str, str]:
        env = ctr.resolve_env(pod, c, image, self._lookup)
        base_path = env.get("PATH", "/usr/local/bin:/usr/bin:/bin")
        env["PATH"] = os.pathsep.join(self.path_prefix + [base_path])
        env.setdefault("HOME", os.path.join(pod_dir, "home"))
        env.setdefault("TMPDIR", os.path.join(pod_dir, "tmp"))
        os.makedirs(env["HOME"], exist_ok=True)
        os.makedirs(env["TMPDIR"], exist_ok=True)
        return {k: paths.translate(v) for k, v in env.items()}

    def _pull(self, pod: Dict[str, Any], c: Dict[str, Any], field: str, deleting: threading.Event,
              deadline: Optional[float]) -> bool:
        """False when the image can never be pulled (the pod stays waiting until stopped)."""
        if c["image"] not in self.unpullable:
            return True
        reasons = ("ErrImagePull", "ImagePullBackOff")
        attempt = 0
        while not deleting.is_set() and not self._stop.is_set():
            if deadline is not None and time.monotonic() > deadline:
                return False
            reason = reasons[min(attempt, 1)]
            message = (f'rpc error: code = NotFound desc = failed to pull and unpack image '
                       f'"{c["image"]}": not found' if attempt == 0
                       else f'Back-off pulling image "{c["image"]}"')
            self._patch_status(pod, {field: [{"name": c["name"], "image": c["image"],
                                              "imageID": "", "ready": False, "restartCount": 0,
                                              "state": {"waiting": {"reason": reason,
                                                                    "message": message}}}]})
            if attempt < 2:
                self._event(pod, "Warning", "Failed", f"Error: {reason}")
            attempt += 1
            deleting.wait(self.pull_backoff)
        return False

    def _run_pod(self, pod: Dict[str, Any]) -> None:
        m = pod["metadata"]
        uid = m["uid"]
        deleting = self._deleting[uid]
        pod_dir = os.path.join(self.root, f"{m['namespace']}_{m['name']}_{uid[:8]}")
        started = time.monotonic()
        limit = pod["spec"].get("activeDeadlineSeconds")
        deadline = started + float(limit) if limit else None
        try:
            os.makedirs(pod_dir, exist_ok=True)
            self._patch_status(pod, {
                "phase": "Pending", "startTime": now(), "hostIP": "127.0.0.1",
                "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
                "conditions": [{"type": "PodScheduled", "status": "True",
                                "lastTransitionTime": now()}],
                "containerStatuses": [self._waiting(c, "ContainerCreating")
                                      for c in pod["spec"]["containers"]]})
            outcome = self._run_containers(pod, pod_dir, deleting, deadline)
        except ctr.ConfigError as exc:
            outcome = None
            self._patch_status(pod, {"containerStatuses": [
                self._waiting(c, "CreateContainerConfigError", str(exc))
                for c in pod["spec"]["containers"]]})
            self._event(pod, "Warning", "Failed", f"Error: {exc}")
            while not deleting.is_set() and not self._stop.is_set():
                if deadline is not None and time.monotonic() > deadline:
                    outcome = "deadline"
                    break
                deleting.wait(0.1)
        if outcome == "deadline":
            self._patch_status(pod, {"phase": "Failed", "reason": "DeadlineExceeded",
                                     "message": "Pod was active on the node longer than the "
                                     "specified deadline"})
            self._event(pod, "Normal", "DeadlineExceeded",
                        "Pod was active on the node longer than the specified deadline")
        if deleting.is_set() and not self._stop.is_set():
            self._force_delete(pod)
        with self._lock:
            self._pods.pop(uid, None)
            self._done.add(uid)

    @staticmethod
    def _waiting(c: Dict[str, Any], reason: str, message: str = "") -> Dict[str, Any]:
        waiting = {"reason": reason}
        if message:
            waiting["message"] = message
        return {"name": c["name"], "image": c["image"], "imageID": "", "ready": False,
                "restartCount": 0, "started": False,
                "state": {"waiting": waiting, "running": None, "terminated": None}}

    def _run_containers(self, pod: Dict[str, Any], pod_dir: str, deleting: threading.Event,
                        deadline: Optional[float]) -> Optional[str]:
        """Run init containers then containers; the outcome: "done", "deadline" or None."""
        volumes = self._volumes(pod, pod_dir)
        grace = min(float(pod["spec"].get("terminationGracePeriodSeconds", 30)), 5.0)
        for field, group in (("initContainerStatuses", "initContainers"),
                             ("containerStatuses", "containers")):
            specs = pod["spec"].get(group) or []
            if not specs:
                continue
            for c in specs:
                if not self._pull(pod, c, field, deleting, deadline):
                    return "deadline" if deadline is not None and time.monotonic() > deadline else None
            sequential = group == "initContainers"
            batches = [[c] for c in specs] if sequential else [specs]
            for batch in batches:
                results = self._run_batch(pod, pod_dir, batch, field, volumes, deleting,
                                          deadline, grace)
                if results is None:
                    return "deadline"
                if any(code != 0 for code in results) and sequential:
                    self._patch_status(pod, {"phase": "Failed"})
                    return "done"
                if not sequential:
                    phase = "Succeeded" if all(code == 0 for code in results) else "Failed"
                    self._patch_status(pod, {"phase": phase, "conditions": [
                        {"type": "Ready", "status": "False", "reason": "PodCompleted",
                         "lastTransitionTime": now()}]})
        return "done"

    def _run_batch(self, pod: Dict[str, Any], pod_dir: str, batch: List[Dict[str, Any]],
                   field: str, volumes: Dict[str, str], deleting: threading.Event,
                   deadline: Optional[float], grace: float) -> Optional[List[int]]:
        m = pod["metadata"]
        running: List[tuple] = []
        for c in batch:
            image = self.images.get(c["image"], ctr.Image())
            paths = ctr.PathMap()
            for mount in c.get("volumeMounts") or []:
                paths.add(mount["mountPath"], os.path.join(volumes[mount["name"]],
                                                           mount.get("subPath", "")).rstrip("/"))
            message_file = os.path.join(pod_dir, f"{c['name']}.termination-log")
            open(message_file, "wb").close()
            paths.add(c.get("terminationMessagePath", "/dev/termination-log"), message_file)
            env = self._container_env(pod, c, image, paths, pod_dir)
            argv = [paths.translate(a) for a in ctr.command_line(c, image, env)]
            cwd = paths.translate(c.get("workingDir") or image.working_dir or pod_dir)
            log_path = os.path.join(pod_dir, f"{c['name']}.log")
            self._logs[(m["namespace"], m["name"], c["name"])] = log_path
            process = ctr.start(c["name"], argv, env, cwd, log_path,
                                _memory_limit(c), now())
            running.append((c, process, message_file))
        self._patch_status(pod, {"phase": "Running" if field == "containerStatuses" else "Pending",
                                 field: [self._running(c, p) for c, p, _ in running]})
        codes: Dict[str, int] = {}
        timed_out = False
        while len(codes) < len(running):
            if deleting.is_set() or self._stop.is_set() or (
                    deadline is not None and time.monotonic() > deadline):
                timed_out = not deleting.is_set() and not self._stop.is_set()
                for c, process, _ in running:
                    if c["name"] not in codes:
                        codes[c["name"]] = process.stop(grace)
                break
            for c, process, _ in running:
                if c["name"] not in codes:
                    code = process.poll()
                    if code is not None:
                        codes[c["name"]] = code
            time.sleep(0.05)
        statuses = [self._terminated(c, p, codes[c["name"]], f) for c, p, f in running]
        self._patch_status(pod, {field: statuses})
        for c, p, _ in running:
            if p.oom_killed:
                self._event(pod, "Warning", "OOMKilling",
                            f"Memory cgroup out of memory: killed container {c['name']}")
        if timed_out:
            return None
        return [codes[c["name"]] for c, _, _ in running]

    @staticmethod
    def _running(c: Dict[str, Any], p: ctr.Process) -> Dict[str, Any]:
        return {"name": c["name"], "image": c["image"], "imageID": f"standin://{c['image']}",
                "containerID": f"standin://{p.popen.pid}", "ready": True, "restartCount": 0,
                "started": True,
                "state": {"running": {"startedAt": p.started_at}, "waiting": None,
                          "terminated": None}}

    def _terminated(self, c: Dict[str, Any], p: ctr.Process, code: int,
                    message_file: str) -> Dict[str, Any]:
        exit_code = 137 if p.oom_killed or code == -9 else (128 - code if code < 0 else code)
        if p.oom_killed:
            reason = "OOMKilled"
        else:
            reason = "Completed" if exit_code == 0 else "Error"
        with open(message_file, "rb") as handle:
            message = handle.read(MAX_MESSAGE).decode("utf-8", "replace")
        if not message and exit_code != 0 and c.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = ctr.tail(p.log_path, 80, None)[-2048:].decode("utf-8", "replace")
        terminated: Dict[str, Any] = {"exitCode": exit_code, "reason": reason,
                                      "startedAt": p.started_at, "finishedAt": now(),
                                      "containerID": f"standin://{p.popen.pid}"}
        if message:
            terminated["message"] = message
        return {"name": c["name"], "image": c["image"], "imageID": f"standin://{c['image']}",
                "containerID": f"standin://{p.popen.pid}", "ready": False, "restartCount": 0,
                "started": False,
                "state": {"terminated": terminated, "running": None, "waiting": None}}


def _memory_limit(container: Dict[str, Any]) -> Optional[int]:
    value = ((container.get("resources") or {}).get("limits") or {}).get("memory")
    return quantity.parse_bytes(value) if value is not None else None
