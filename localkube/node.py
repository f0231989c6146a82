"""A node of the project's, for the real control plane: it runs the pods bound to it as processes.

``ProcessNode(plane, name).start()`` does what a kubelet does, as far as the tests need, and as a
client of the real API server with a node's own credentials (``system:node:<name>`` in
``system:nodes``, so the Node authorizer and NodeRestriction apply to it as to a kubelet):

- registers its Node (capacity, ``Ready``, its address and the port of its log endpoint) and
  renews its Lease in ``kube-node-lease``, so the node-lifecycle controller keeps it;
- watches the pods the real kube-scheduler binds to it (``spec.nodeName``), prepares their
  volumes (``emptyDir``, ``configMap``, ``secret``, ``hostPath``), "pulls" each image (one from a
  registry under the reserved ``.invalid`` domain, RFC 6761, can never be reached: the container
  waits in ``ErrImagePull`` then ``ImagePullBackOff``, with the runtime's message and Events, as
  for a missing image), runs init containers in order
  and then the containers as local processes (``containers``: environment,
  command line, path translation, memory limit), and reports each step through ``pods/status``
  (phase, conditions, container states, the termination message, ``DeadlineExceeded``);
- stops a pod's processes when the pod is deleted, then deletes it for good (grace period 0), as
  a kubelet confirms a graceful deletion;
- serves ``/containerLogs/<namespace>/<pod>/<container>`` over HTTPS with a certificate from the
  cluster CA, to the API server only (client certificate required), so ``pods/log`` works.

The node advertises no GPU unless given one (``allocatable``): the scheduler places GPU pods
elsewhere (the kwok nodes). ``restartPolicy: Never`` and ``OnFailure`` are run as a kubelet runs
them: with ``OnFailure`` an app container that exits non-zero waits in ``CrashLoopBackOff``
(``RESTART_BACKOFF`` here, the kubelet's 10 s doubling there) with its termination in
``lastState`` and ``restartCount`` counted, then runs again in the same pod; ``Always`` is not.
"""

from __future__ import annotations

import base64
import datetime
import http.server
import os
import shutil
import ssl
import threading
import time
import urllib.parse
from typing import Any, Dict, List, Optional

from localkube import containers as ctr
from localkube.controlplane import LOOPBACK, ControlPlane, free_port, kubeconfig
from xmem_admission.cluster.kube import quantity

MAX_MESSAGE = 4096  # the kubelet's limit on a termination message (4 KiB)
# Image reference -> digest ("sha256:..."), shared by the process nodes of this process: an image
# listed here is reported as the runtime reports a pulled image, ``<repository>@<digest>`` in
# ``containerStatuses[].imageID``; a test changes the entry to push a new image behind a tag.
# Any other image is reported as ``process://<image>``.
DIGESTS: Dict[str, str] = {}
PULL_BACKOFF = 0.3  # seconds between pull attempts (the kubelet backs off from 10 s; tests wait)
RESTART_BACKOFF = 1.0  # seconds before a failed container runs again (the kubelet: 10 s, doubling)
START_ERROR_EXIT = 128  # the kubelet's exit code for a container whose process never started (StartError)


def unreachable(image: str) -> bool:
    """Whether ``image`` names a registry under ``.invalid``, which no resolver answers."""
    first = image.split("/", 1)[0]
    host = first.split(":", 1)[0] if "/" in image else ""
    return host == "invalid" or host.endswith(".invalid")
HEARTBEAT_SECONDS = 5.0


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _micro_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class ProcessNode:
    """See the module docstring."""

    def __init__(self, plane: ControlPlane, name: str = "xmem-process-node",
                 allocatable: Optional[Dict[str, str]] = None,
                 labels: Optional[Dict[str, str]] = None, root: Optional[str] = None,
                 path_prefix: Optional[List[str]] = None,
                 taints: Optional[List[Dict[str, str]]] = None) -> None:
        self.plane = plane
        self.name = name
        self.taints = list(taints or [])  # set when the node registers (--register-with-taints)
        self.allocatable = allocatable or {"cpu": "8", "memory": "32Gi", "pods": "110",
                                           "ephemeral-storage": "100Gi"}
        self.labels = dict(labels or {})
        self.root = root or str(plane.root / "nodes" / name)
        self.path_prefix = list(path_prefix or [])
        self._stop = threading.Event()
        self._pods: Dict[str, threading.Thread] = {}
        self._done: set = set()
        self._deleting: Dict[str, threading.Event] = {}
        self._logs: Dict[tuple, str] = {}
        self._last: Dict[tuple, Dict[str, Any]] = {}  # (pod uid, container): its termination
        self._lock = threading.Lock()
        self._threads: List[threading.Thread] = []
        self._watcher: Any = None
        self._http: Optional[http.server.ThreadingHTTPServer] = None
        self.log_port = 0

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> ProcessNode:
        from kubernetes import client

        os.makedirs(self.root, exist_ok=True)
        ca = self.plane._authority()
        pair = ca.issue(f"node-{self.name}", f"system:node:{self.name}", ["system:nodes"])
        self.kubeconfig = kubeconfig(self.plane.root / f"node-{self.name}.kubeconfig",
                                     self.plane.server, ca.cert_file, f"system:node:{self.name}",
                                     pair=pair)
        self.api_client = self.plane.api_client(self.kubeconfig)
        self.core = client.CoreV1Api(self.api_client)
        self.coordination = client.CoordinationV1Api(self.api_client)
        self._serve_logs()
        self._register()
        for target, name in ((self._heartbeat, "heartbeat"), (self._watch, "watch")):
            thread = threading.Thread(target=target, name=f"{self.name}-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.stop()
        for event in list(self._deleting.values()):
            event.set()
        for runner in list(self._pods.values()):
            runner.join(timeout=15)
        for thread in self._threads:
            thread.join(timeout=10)
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
        self.api_client.close()
        shutil.rmtree(self.root, ignore_errors=True)

    # --- the Node, its Lease, its log endpoint ----------------------------------------------

    def _node_status(self) -> Dict[str, Any]:
        stamp = now()
        ready = {"type": "Ready", "status": "True", "reason": "KubeletReady",
                 "message": "process node is posting ready status",
                 "lastHeartbeatTime": stamp, "lastTransitionTime": stamp}
        return {
            "capacity": self.allocatable, "allocatable": self.allocatable,
            "conditions": [ready],
            "addresses": [{"type": "InternalIP", "address": LOOPBACK},
                          {"type": "Hostname", "address": self.name}],
            "daemonEndpoints": {"kubeletEndpoint": {"Port": self.log_port}},
            "nodeInfo": {"machineID": "", "systemUUID": "", "bootID": "",
                         "kernelVersion": os.uname().release, "osImage": "xmem process node",
                         "containerRuntimeVersion": "process://1", "kubeletVersion": "v0.0.0",
                         "kubeProxyVersion": "", "operatingSystem": "linux",
                         "architecture": "amd64"},
        }

    def _register(self) -> None:
        from kubernetes import client

        labels = {"kubernetes.io/hostname": self.name, "kubernetes.io/os": "linux",
                  "kubernetes.io/arch": "amd64", **self.labels}
        body = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": self.name, "labels": labels},
                "spec": {"taints": self.taints}, "status": self._node_status()}
        try:
            self.core.create_node(body, _preload_content=False)
        except client.ApiException as exc:
            if exc.status != 409:
                raise
        self.core.patch_node_status(self.name, {"status": self._node_status()},
                                    _preload_content=False)

    def _heartbeat(self) -> None:
        from kubernetes import client

        namespace = "kube-node-lease"
        while not self._stop.is_set():
            try:
                lease = {"metadata": {"name": self.name, "namespace": namespace},
                         "spec": {"holderIdentity": self.name, "leaseDurationSeconds": 40,
                                  "renewTime": _micro_now()}}
                try:
                    self.coordination.patch_namespaced_lease(
                        self.name, namespace, {"spec": lease["spec"]}, _preload_content=False)
                except client.ApiException as exc:
                    if exc.status != 404:
                        raise
                    self.coordination.create_namespaced_lease(namespace, lease,
                                                              _preload_content=False)
                self.core.patch_node_status(self.name, {"status": {
                    "conditions": self._node_status()["conditions"]}}, _preload_content=False)
            except Exception:  # noqa: BLE001 - a node keeps beating through API restarts
                pass
            self._stop.wait(HEARTBEAT_SECONDS)

    def _serve_logs(self) -> None:
        ca = self.plane._authority()
        pair = ca.issue(f"node-{self.name}-serving", self.name, server=True, ips=[LOOPBACK],
                        dns=[self.name, "localhost"])
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(pair.cert), str(pair.key))
        context.load_verify_locations(str(ca.cert_file))
        context.verify_mode = ssl.CERT_REQUIRED  # only the API server's client certificate
        node = self

        class Logs(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server protocol
                url = urllib.parse.urlsplit(self.path)
                parts = url.path.strip("/").split("/")
                params = dict(urllib.parse.parse_qsl(url.query))
                body = None
                if len(parts) == 4 and parts[0] == "containerLogs":
                    body = node._log(parts[1], parts[2], parts[3], params)
                if body is None:
                    self.send_error(404, "no such container")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.log_port = free_port()
        self._http = http.server.ThreadingHTTPServer((LOOPBACK, self.log_port), Logs)
        self._http.socket = context.wrap_socket(self._http.socket, server_side=True)
        thread = threading.Thread(target=self._http.serve_forever, daemon=True,
                                  name=f"{self.name}-logs")
        thread.start()
        self._threads.append(thread)

    def _log(self, namespace: str, name: str, container: str,
             params: Dict[str, str]) -> Optional[bytes]:
        path = self._logs.get((namespace, name, container))
        if path is None:
            return None
        lines = int(params["tailLines"]) if params.get("tailLines") else None
        limit = int(params["limitBytes"]) if params.get("limitBytes") else None
        return ctr.tail(path, lines, limit)

    # --- pods -------------------------------------------------------------------------------

    def _watch(self) -> None:
        from kubernetes import watch

        selector = f"spec.nodeName={self.name}"
        while not self._stop.is_set():
            try:
                self._watcher = watch.Watch()
                for event in self._watcher.stream(self.core.list_pod_for_all_namespaces,
                                                  field_selector=selector, timeout_seconds=60,
                                                  deserialize=False):
                    if self._stop.is_set():
                        break
                    self._on_pod(event["type"], event["object"])
            except Exception:  # noqa: BLE001 - a node keeps going through API hiccups
                self._stop.wait(0.5)

    def _on_pod(self, kind: str, pod: Dict[str, Any]) -> None:
        m = pod["metadata"]
        uid = m["uid"]
        if kind == "DELETED":
            event = self._deleting.get(uid)
            if event is not None:
                event.set()
            return
        if "deletionTimestamp" in m:
            with self._lock:
                event = self._deleting.setdefault(uid, threading.Event())
                event.set()
                running = uid in self._pods
            if not running:
                self._delete_now(pod)
            return
        with self._lock:
            phase = (pod.get("status") or {}).get("phase")
            if uid in self._pods or uid in self._done or phase in ("Succeeded", "Failed"):
                return
            self._deleting.setdefault(uid, threading.Event())
            runner = threading.Thread(target=self._run_pod, args=(pod,), daemon=True,
                                      name=f"pod-{m['name']}")
            self._pods[uid] = runner
        runner.start()

    def _patch_status(self, pod: Dict[str, Any], status: Dict[str, Any]) -> bool:
        m = pod["metadata"]
        deadline = time.monotonic() + 120  # a kubelet keeps syncing status until it lands
        while True:
            try:
                self.core.patch_namespaced_pod_status(
                    m["name"], m["namespace"], {"metadata": {"uid": m["uid"]}, "status": status},
                    _preload_content=False)
                return True
            except Exception as exc:  # noqa: BLE001 - gone: nothing left to report to
                if getattr(exc, "status", None) in (404, 409, 422) or self._stop.is_set() \
                        or time.monotonic() > deadline:
                    return False
                time.sleep(0.5)  # the API server restarting: try again

    def _event(self, pod: Dict[str, Any], type_: str, reason: str, message: str) -> None:
        m = pod["metadata"]
        stamp = now()
        body = {
            "metadata": {"generateName": f"{m['name']}.", "namespace": m["namespace"]},
            "involvedObject": {"apiVersion": "v1", "kind": "Pod", "name": m["name"],
                               "namespace": m["namespace"], "uid": m["uid"]},
            "reason": reason, "message": message, "type": type_, "count": 1,
            "firstTimestamp": stamp, "lastTimestamp": stamp,
            "source": {"component": "kubelet", "host": self.name},
        }
        try:
            self.core.create_namespaced_event(m["namespace"], body, _preload_content=False)
        except Exception:  # noqa: BLE001 - events are best effort, as on a real node
            pass

    def _delete_now(self, pod: Dict[str, Any]) -> None:
        m = pod["metadata"]
        try:
            # With a body, the API server reads the options from it alone: a gracePeriodSeconds
            # query parameter beside it would be ignored and the pod would wait out its grace.
            self.core.delete_namespaced_pod(
                m["name"], m["namespace"],
                body={"gracePeriodSeconds": 0, "preconditions": {"uid": m["uid"]}},
                _preload_content=False)
        except Exception:  # noqa: BLE001 - already gone
            pass

    def _lookup(self, kind: str, namespace: str, name: str) -> Optional[Dict[str, str]]:
        """A ConfigMap's or Secret's data as text (for the environment); None only when the
        server says it is not there."""
        files = self._files(kind, namespace, name, binary=False)
        return None if files is None else {k: v.decode() for k, v in files.items()}

    def _files(self, kind: str, namespace: str, name: str,
               binary: bool = True) -> Optional[Dict[str, bytes]]:
        """The files a config map or secret volume holds, as the kubelet writes them: a config
        map's ``data`` (UTF-8) and, with ``binary``, its ``binaryData``; a secret's decoded
        ``data``. None only when the server says it is not there. A refusal right after binding
        (the Node authorizer lets a node read what its pods refer to once it has seen the
        binding) or an API server restarting is retried."""
        deadline = time.monotonic() + 60
        while True:
            try:
                if kind == "ConfigMap":
                    obj = self.core.read_namespaced_config_map(name, namespace)
                    files = {k: v.encode() for k, v in (obj.data or {}).items()}
                    if binary:
                        files.update({k: base64.b64decode(v)
                                      for k, v in (obj.binary_data or {}).items()})
                    return files
                obj = self.core.read_namespaced_secret(name, namespace)
                return {k: base64.b64decode(v) for k, v in (obj.data or {}).items()}
            except Exception as exc:  # noqa: BLE001 - 404: missing, the caller reports it
                if getattr(exc, "status", None) == 404 or time.monotonic() > deadline \
                        or self._stop.is_set():
                    return None
                time.sleep(0.25)

    def _volumes(self, pod: Dict[str, Any], pod_dir: str) -> Dict[str, str]:
        out = {}
        for volume in pod["spec"].get("volumes") or []:
            host = os.path.join(pod_dir, "volumes", volume["name"])
            if "hostPath" in volume:
                out[volume["name"]] = volume["hostPath"]["path"]
                continue
            os.makedirs(host, exist_ok=True)
            if "projected" in volume:  # the service-account token volume, among others
                for source in volume["projected"].get("sources") or []:
                    self._write_source(pod, source, host)
            elif any(k in volume for k in ("configMap", "secret", "downwardAPI")):
                self._write_source(pod, volume, host)
            elif "emptyDir" not in volume:
                raise ctr.ConfigError(f"volume {volume['name']!r}: type not supported here")
            out[volume["name"]] = host
        return out

    def _write_source(self, pod: Dict[str, Any], source: Dict[str, Any], host: str) -> None:
        """The files of one volume source (configMap, secret, downwardAPI, serviceAccountToken)."""
        m = pod["metadata"]
        files: Dict[str, bytes] = {}
        if "serviceAccountToken" in source:
            spec = source["serviceAccountToken"]
            request: Dict[str, Any] = {"spec": {
                "expirationSeconds": spec.get("expirationSeconds", 3607),
                "boundObjectRef": {"apiVersion": "v1", "kind": "Pod", "name": m["name"],
                                   "uid": m["uid"]}}}
            if spec.get("audience"):
                request["spec"]["audiences"] = [spec["audience"]]
            account = pod["spec"].get("serviceAccountName") or "default"
            from kubernetes.client import ApiException

            try:
                answer = self.core.create_namespaced_service_account_token(
                    account, m["namespace"], request)
            except ApiException as exc:
                if exc.status not in (403, 404):
                    raise
                # The account (or the pod) went while the pod started, as in a `helm uninstall`
                # racing its pods, or the node authorizer refuses the token (403: "bound to a
                # pod scheduled on a different node", seen when a pod is deleted as it starts):
                # the kubelet's token mount fails, the pod never starts.
                raise ctr.ConfigError(f'no token for serviceaccount "{account}" to mount in pod '
                                      f'"{m["name"]}": {exc.status} {exc.reason}') from None
            files[spec["path"]] = answer.status.token.encode()
        for kind, key in (("ConfigMap", "configMap"), ("Secret", "secret")):
            if key not in source:
                continue
            ref = source[key]
            ref_name = ref.get("name") or ref.get("secretName", "")
            data = self._files(kind, m["namespace"], ref_name)
            if data is None:
                if ref.get("optional"):
                    continue
                raise ctr.ConfigError(f'{kind.lower()} "{ref_name}" not found')
            for item in ref.get("items") or [{"key": k, "path": k} for k in data]:
                files[item["path"]] = data.get(item["key"], b"")
        if "downwardAPI" in source:
            for item in source["downwardAPI"].get("items") or []:
                if "fieldRef" in item:
                    files[item["path"]] = ctr.field_ref(
                        pod, item["fieldRef"]["fieldPath"]).encode()
        for path, content in files.items():
            target = os.path.join(host, path)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as handle:
                handle.write(content)

    def _run_pod(self, pod: Dict[str, Any]) -> None:
        m = pod["metadata"]
        uid = m["uid"]
        deleting = self._deleting[uid]
        pod_dir = os.path.join(self.root, f"{m['namespace']}_{m['name']}_{uid[:8]}")
        limit = pod["spec"].get("activeDeadlineSeconds")
        deadline = time.monotonic() + float(limit) if limit else None
        outcome: Optional[str] = None
        try:
            os.makedirs(pod_dir, exist_ok=True)
            self._patch_status(pod, {
                "phase": "Pending", "startTime": now(), "hostIP": LOOPBACK,
                "hostIPs": [{"ip": LOOPBACK}], "podIP": LOOPBACK, "podIPs": [{"ip": LOOPBACK}],
                "conditions": [{"type": "PodScheduled", "status": "True",
                                "lastTransitionTime": now()}],
                "containerStatuses": [_waiting(c, "ContainerCreating")
                                      for c in pod["spec"]["containers"]]})
            outcome = self._run_containers(pod, pod_dir, deleting, deadline)
        except ctr.ConfigError as exc:
            self._patch_status(pod, {"containerStatuses": [
                _waiting(c, "CreateContainerConfigError", str(exc))
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
            self._delete_now(pod)
        with self._lock:
            self._pods.pop(uid, None)
            self._done.add(uid)

    def _run_containers(self, pod: Dict[str, Any], pod_dir: str, deleting: threading.Event,
                        deadline: Optional[float]) -> Optional[str]:
        """Init containers one by one, then the containers; "done", "deadline" or None."""
        volumes = self._volumes(pod, pod_dir)
        grace = min(float(pod["spec"].get("terminationGracePeriodSeconds", 30)), 5.0)
        for field, group in (("initContainerStatuses", "initContainers"),
                             ("containerStatuses", "containers")):
            specs = pod["spec"].get(group) or []
            sequential = group == "initContainers"
            for batch in ([[c] for c in specs] if sequential else [specs] if specs else []):
                for c in batch:
                    if not self._pull(pod, c, field, deleting, deadline):
                        late = deadline is not None and time.monotonic() > deadline
                        return "deadline" if late else None
                results = self._run_batch(pod, pod_dir, batch, field, volumes, deleting,
                                          deadline, grace)
                if not sequential:
                    results = self._restart(pod, pod_dir, batch, results, volumes, deleting,
                                            deadline, grace)
                if results is None:
                    return "deadline"
                if sequential and any(code != 0 for code in results):
                    self._patch_status(pod, {"phase": "Failed"})
                    return "done"
                if not sequential:
                    phase = "Succeeded" if all(code == 0 for code in results) else "Failed"
                    self._patch_status(pod, {"phase": phase, "conditions": [
                        {"type": "Ready", "status": "False", "reason": "PodCompleted",
                         "lastTransitionTime": now()}]})
        return "done"

    def _pull(self, pod: Dict[str, Any], c: Dict[str, Any], field: str,
              deleting: threading.Event, deadline: Optional[float]) -> bool:
        """False when the image can never be pulled (the container waits until the pod is
        deleted or its deadline passes)."""
        if not unreachable(c["image"]):
            return True
        attempt = 0
        while not deleting.is_set() and not self._stop.is_set():
            if deadline is not None and time.monotonic() > deadline:
                return False
            reason = "ErrImagePull" if attempt == 0 else "ImagePullBackOff"
            message = (f'rpc error: code = Unknown desc = failed to pull and unpack image '
                       f'"{c["image"]}": dial tcp: lookup {c["image"].split("/", 1)[0]}: '
                       f'no such host' if attempt == 0
                       else f'Back-off pulling image "{c["image"]}"')
            self._patch_status(pod, {field: [_waiting(c, reason, message)]})
            if attempt < 2:
                self._event(pod, "Warning", "Failed", f"Error: {reason}")
            attempt += 1
            deleting.wait(PULL_BACKOFF)
        return False

    def _restart(self, pod: Dict[str, Any], pod_dir: str, batch: List[Dict[str, Any]],
                 results: Optional[List[int]], volumes: Dict[str, str],
                 deleting: threading.Event, deadline: Optional[float],
                 grace: float) -> Optional[List[int]]:
        """``restartPolicy: OnFailure``: the containers that exited non-zero wait in
        CrashLoopBackOff and run again in this pod, until they succeed or the pod goes."""
        if pod["spec"].get("restartPolicy") != "OnFailure":
            return results
        restarts = {c["name"]: 0 for c in batch}
        while results is not None and any(code != 0 for code in results):
            failed = [c for c, code in zip(batch, results) if code != 0]
            for c in failed:
                restarts[c["name"]] += 1
            self._patch_status(pod, {"containerStatuses": [_backing_off(
                c, restarts[c["name"]], self._last[(pod["metadata"]["uid"], c["name"])])
                for c in failed]})
            deleting.wait(RESTART_BACKOFF)
            if deleting.is_set() or self._stop.is_set():
                return results
            again = self._run_batch(pod, pod_dir, failed, "containerStatuses", volumes,
                                    deleting, deadline, grace, restarts)
            if again is None:
                return None
            codes = dict(zip([c["name"] for c in failed], again))
            results = [codes.get(c["name"], 0) for c in batch]
        return results

    def _run_batch(self, pod: Dict[str, Any], pod_dir: str, batch: List[Dict[str, Any]],
                   field: str, volumes: Dict[str, str], deleting: threading.Event,
                   deadline: Optional[float], grace: float,
                   restarts: Optional[Dict[str, int]] = None) -> Optional[List[int]]:
        m = pod["metadata"]
        restarts = restarts or {}
        last = {c["name"]: self._last.get((m["uid"], c["name"])) for c in batch}
        running: List[tuple] = []
        not_started: Dict[str, str] = {}  # name -> the runtime's error
        for c in batch:
            image = ctr.Image()
            paths = ctr.PathMap()
            for mount in c.get("volumeMounts") or []:
                paths.add(mount["mountPath"], os.path.join(volumes[mount["name"]],
                                                           mount.get("subPath", "")).rstrip("/"))
            message_file = os.path.join(pod_dir, f"{c['name']}.termination-log")
            open(message_file, "wb").close()
            paths.add(c.get("terminationMessagePath", "/dev/termination-log"), message_file)
            env = ctr.resolve_env(pod, c, image, self._lookup)
            env["PATH"] = os.pathsep.join(self.path_prefix +
                                          [env.get("PATH", "/usr/local/bin:/usr/bin:/bin")])
            env.setdefault("HOME", os.path.join(pod_dir, "home"))
            env.setdefault("TMPDIR", os.path.join(pod_dir, "tmp"))
            os.makedirs(env["HOME"], exist_ok=True)
            os.makedirs(env["TMPDIR"], exist_ok=True)
            env = {k: paths.translate(v) for k, v in env.items()}
            argv = [paths.translate(a) for a in ctr.command_line(c, image, env)]
            cwd = paths.translate(c.get("workingDir") or pod_dir)
            # One log per container instance, as the kubelet keeps <restartCount>.log: the log's
            # tail in a restarted container's termination message is that instance's.
            restart = restarts.get(c["name"], 0)
            log_path = os.path.join(pod_dir, f"{c['name']}.{restart}.log" if restart
                                    else f"{c['name']}.log")
            self._logs[(m["namespace"], m["name"], c["name"])] = log_path
            try:
                process = ctr.start(c["name"], argv, env, cwd, log_path, _memory_limit(c), now())
            except ctr.StartFailure as exc:
                not_started[c["name"]] = str(exc)
                self._event(pod, "Warning", "Failed", f"Error: {exc}")
                continue
            running.append((c, process, message_file))
        self._patch_status(pod, {"phase": "Running" if field == "containerStatuses" else "Pending",
                                 field: [_running(c, p, restarts.get(c["name"], 0),
                                                  last[c["name"]]) for c, p, _ in running]})
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
        statuses = [_terminated(c, p, codes[c["name"]], f, restarts.get(c["name"], 0),
                                last[c["name"]]) for c, p, f in running]
        for c in batch:
            if c["name"] in not_started:
                codes[c["name"]] = START_ERROR_EXIT
                statuses.append(_start_error(c, not_started[c["name"]],
                                             restarts.get(c["name"], 0), last[c["name"]]))
        for status in statuses:
            self._last[(m["uid"], status["name"])] = status["state"]["terminated"]
        self._patch_status(pod, {field: statuses})
        for c, p, _ in running:
            if p.oom_killed:
                self._event(pod, "Warning", "OOMKilling",
                            f"Memory cgroup out of memory: killed container {c['name']}")
        if timed_out:
            return None
        return [codes[c["name"]] for c in batch]


def image_id(image: str) -> str:
    """What the node reports as a container's ``imageID`` (see ``DIGESTS``)."""
    digest = DIGESTS.get(image)
    if digest is None:
        return f"process://{image}"
    name = image.split("@", 1)[0]
    repository = name.rsplit(":", 1)[0] if ":" in name.rsplit("/", 1)[-1] else name
    return f"{repository}@{digest}"


def _waiting(c: Dict[str, Any], reason: str, message: str = "") -> Dict[str, Any]:
    waiting = {"reason": reason}
    if message:
        waiting["message"] = message
    return {"name": c["name"], "image": c["image"], "imageID": "", "ready": False,
            "restartCount": 0, "started": False, "state": {"waiting": waiting}}


def _with_last(status: Dict[str, Any], restarts: int,
               last: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    status["restartCount"] = restarts
    if restarts and last is not None:
        status["lastState"] = {"terminated": last}
    return status


def _running(c: Dict[str, Any], p: ctr.Process, restarts: int = 0,
             last: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    return _with_last({"name": c["name"], "image": c["image"],
                       "imageID": image_id(c["image"]),
                       "containerID": f"process://{p.popen.pid}", "ready": True,
                       "started": True, "state": {"running": {"startedAt": p.started_at}}},
                      restarts, last)


def _backing_off(c: Dict[str, Any], restarts: int, last: Dict[str, Any]) -> Dict[str, Any]:
    """A failed container waiting to run again (the kubelet's CrashLoopBackOff)."""
    message = f"back-off {RESTART_BACKOFF:g}s restarting failed container={c['name']}"
    return _with_last(_waiting(c, "CrashLoopBackOff", message), restarts, last)


def _terminated(c: Dict[str, Any], p: ctr.Process, code: int, message_file: str,
                restarts: int = 0, last: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    exit_code = 137 if p.oom_killed or code == -9 else (128 - code if code < 0 else code)
    reason = "OOMKilled" if p.oom_killed else "Completed" if exit_code == 0 else "Error"
    with open(message_file, "rb") as handle:
        message = handle.read(MAX_MESSAGE).decode("utf-8", "replace")
    if not message and exit_code != 0 and \
            c.get("terminationMessagePolicy") == "FallbackToLogsOnError":
        message = ctr.tail(p.log_path, 80, None)[-2048:].decode("utf-8", "replace")
    terminated: Dict[str, Any] = {"exitCode": exit_code, "reason": reason,
                                  "startedAt": p.started_at, "finishedAt": now(),
                                  "containerID": f"process://{p.popen.pid}"}
    if message:
        terminated["message"] = message
    return _with_last({"name": c["name"], "image": c["image"],
                       "imageID": image_id(c["image"]),
                       "containerID": f"process://{p.popen.pid}", "ready": False,
                       "started": False, "state": {"terminated": terminated}}, restarts, last)


def _start_error(c: Dict[str, Any], message: str, restarts: int = 0,
                 last: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """A container whose process never started, as the kubelet reports it: terminated with
    reason StartError, exit code 128, started at the epoch (it never ran)."""
    terminated = {"exitCode": START_ERROR_EXIT, "reason": "StartError", "message": message,
                  "startedAt": "1970-01-01T00:00:00Z", "finishedAt": now()}
    return _with_last({"name": c["name"], "image": c["image"],
                       "imageID": image_id(c["image"]), "ready": False, "started": False,
                       "state": {"terminated": terminated}}, restarts, last)


def _memory_limit(container: Dict[str, Any]) -> Optional[int]:
    value = ((container.get("resources") or {}).get("limits") or {}).get("memory")
    return quantity.parse_bytes(value) if value is not None else None
