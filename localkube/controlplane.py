"""etcd, kube-apiserver, kube-controller-manager and kube-scheduler on loopback, as processes.

``ControlPlane(root).start()`` makes the certificates (``pki``), starts etcd, the API server
(RBAC and the Node authorizer, NodeRestriction and OwnerReferencesPermissionEnforcement,
service-account tokens signed with the project's key), waits for ``/readyz``, then starts the
controller-manager (each controller with its own service-account credentials) and the scheduler
(a bin-packing profile: ``NodeResourcesFit`` with ``MostAllocated`` on the GPU resources, as a
cluster that shares GPUs configures it). Every process binds to 127.0.0.1 only, logs to
``<root>/logs/<name>.log`` and has its PID in ``<root>/run/<name>.pid``; ``stop()`` ends them in
the order that lets each exit cleanly (scheduler, controller-manager, API server, etcd: an API
server whose etcd died first hangs on SIGTERM).

Command line, for scripts and the playground (the processes outlive it)::

    python -m localkube.controlplane up DIR     # prints DIR/admin.kubeconfig
    python -m localkube.controlplane down DIR   # stops what DIR/run/*.pid names
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, TypeVar

import yaml

from localkube import tools
from localkube.pki import Authority, Pair, service_account_keys

T = TypeVar("T")
LOOPBACK = "127.0.0.1"
SERVICE_CIDR = "10.0.0.0/24"
# Stop order: whatever depends on the API server first, etcd last.
STOP_ORDER = ("kwok", "node", "kube-scheduler", "kube-controller-manager", "kube-apiserver",
              "etcd")
GPU_RESOURCES = ("nvidia.com/gpumem", "nvidia.com/gpu")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here


def free_port() -> int:
    """A loopback port nobody listens on, below the kernel's ephemeral range: a port from that
    range can become any outgoing connection's source port between this check and the server's
    bind (kube-apiserver, started right after etcd, once failed with "bind: address already in
    use" on such a port)."""
    import random

    low = _ephemeral_low()
    for _ in range(100):
        port = random.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # that span is full: any free port
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class Exited(RuntimeError):
    """A process the wait depends on has exited: waiting longer is pointless."""


def wait_for(check: Callable[[], Optional[T]], timeout: float, what: str,
             interval: float = 0.1) -> T:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = check()
            if value:
                return value
        except Exited:
            raise
        except Exception as exc:  # noqa: BLE001 - remembered for the failure message
            last = exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}"
                               + (f" (last error: {last!r})" if last else ""))
        time.sleep(interval)


def wait_while_running(check: Callable[[], Optional[T]], what: str,
                       process: subprocess.Popen[Any], timeout: float = 60,
                       interval: float = 0.2) -> T:
    """``wait_for`` on a process the wait depends on: its exit ends the wait at once, with its
    exit code and output in the failure."""
    def alive() -> Optional[T]:
        if process.poll() is not None:
            output = process.stdout.read() if process.stdout else ""
            raise Exited(f"{what}: {process.args[0]} exited ({process.returncode}):\n{output}")
        return check()

    return wait_for(alive, timeout, what, interval)


def kubeconfig(path: Path, server: str, ca: Path, user: str, pair: Optional[Pair] = None,
               token: Optional[str] = None) -> Path:
    """A kubeconfig with one cluster, one user (client certificate or token), one context."""
    credentials: Dict[str, Any] = {}
    if pair is not None:
        credentials = {"client-certificate": str(pair.cert), "client-key": str(pair.key)}
    if token is not None:
        credentials = {"token": token}
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": user,
        "clusters": [{"name": "xmem-test", "cluster": {
            "server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": user, "context": {"cluster": "xmem-test", "user": user}}],
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


class ControlPlane:
    """See the module docstring."""

    def __init__(self, root: Path, controllers: str = "*", scheduler: bool = True,
                 address: str = LOOPBACK) -> None:
        """``controllers``: the controller-manager's ``--controllers`` (all by default);
        ``scheduler``: whether to run kube-scheduler; ``address``: where the API server serves
        (loopback by default; the host's address when pods on a real node must reach it through
        the ``kubernetes`` Service, whose endpoint it then advertises itself)."""
        self.root = Path(root)
        self.address = address
        self.controllers = controllers
        self.scheduler = scheduler
        self.logs = self.root / "logs"
        self.run_dir = self.root / "run"
        self.pki_dir = self.root / "pki"
        self.processes: Dict[str, subprocess.Popen] = {}
        self.etcd_port = 0
        self.peer_port = 0
        self.port = 0
        self.ca: Optional[Authority] = None
        self.admin_kubeconfig = self.root / "admin.kubeconfig"

    # --- addresses and credentials ----------------------------------------------------------

    @property
    def server(self) -> str:
        return f"https://{self.address}:{self.port}"

    def _authority(self) -> Authority:
        assert self.ca is not None, "start() first"
        return self.ca

    def user_kubeconfig(self, user: str, groups: Sequence[str] = (),
                        server: Optional[str] = None) -> Path:
        """A client-certificate kubeconfig for ``user`` in ``groups`` (RBAC sees exactly that)."""
        stem = "user-" + "".join(c if c.isalnum() else "-" for c in user)
        pair = self._authority().issue(stem, user, groups)
        return kubeconfig(self.root / f"{stem}.kubeconfig", server or self.server,
                          self._authority().cert_file, user, pair=pair)

    def service_account_kubeconfig(self, namespace: str, name: str,
                                   server: Optional[str] = None) -> Path:
        """The service account's token (TokenRequest, one day) in a kubeconfig; the account
        and its namespace are created when missing."""
        from kubernetes import client

        api = client.CoreV1Api(self.api_client())
        try:
            api.create_namespace({"metadata": {"name": namespace}})
        except client.ApiException as exc:
            if exc.status != 409:
                raise
        try:
            api.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
        except client.ApiException as exc:
            if exc.status != 409:
                raise
        request = {"spec": {"audiences": [], "expirationSeconds": 86400}}
        answer = json.loads(api.create_namespaced_service_account_token(
            name, namespace, request, _preload_content=False).data)
        user = f"system:serviceaccount:{namespace}:{name}"
        return kubeconfig(self.root / f"sa-{namespace}-{name}.kubeconfig", server or self.server,
                          self._authority().cert_file, user, token=answer["status"]["token"])

    def api_client(self, kubeconfig_path: Optional[Path] = None) -> Any:
        """An official-client ``ApiClient`` (admin unless another kubeconfig is given)."""
        from kubernetes import client, config

        configuration = client.Configuration()
        config.load_kube_config(config_file=str(kubeconfig_path or self.admin_kubeconfig),
                                client_configuration=configuration)
        return client.ApiClient(configuration)

    # --- lifecycle --------------------------------------------------------------------------

    def start(self, timeout: float = 120) -> ControlPlane:
        for d in (self.logs, self.run_dir, self.pki_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.ca = Authority(self.pki_dir)
        ca = self.ca
        self.serving = ca.issue("apiserver", "kube-apiserver", server=True,
                                dns=["localhost", "kubernetes", "kubernetes.default",
                                     "kubernetes.default.svc",
                                     "kubernetes.default.svc.cluster.local"],
                                ips=sorted({LOOPBACK, self.address, "10.0.0.1"}))
        self.kubelet_client = ca.issue("apiserver-kubelet-client",
                                       "kube-apiserver-kubelet-client", ["system:masters"])
        self.sa_key, self.sa_pub = service_account_keys(self.pki_dir)
        self.etcd_port, self.peer_port, self.port = free_port(), free_port(), free_port()
        kubeconfig(self.admin_kubeconfig, self.server, ca.cert_file, "xmem-test-admin",
                   pair=ca.issue("admin", "xmem-test-admin", ["system:masters"]))
        self._start_etcd()
        self._start_apiserver(timeout)
        self._start_controller_manager()
        if self.scheduler:
            self._start_scheduler()
        self._write_state()
        # The service-account controller is the sign that the controller-manager works.
        wait_for(self._default_service_account, timeout,
                 "the controller-manager to create the default service account")
        return self

    def _write_state(self) -> None:
        state = {"server": self.server, "etcd_port": self.etcd_port, "port": self.port,
                 "peer_port": self.peer_port}
        (self.root / "state.json").write_text(json.dumps(state))

    def _spawn(self, name: str, argv: List[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
        try:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        self.processes[name] = process
        (self.run_dir / f"{name}.pid").write_text(str(process.pid))
        return process

    def _start_etcd(self) -> None:
        data = self.root / "etcd"
        peer = f"http://{LOOPBACK}:{self.peer_port}"
        client_url = f"http://{LOOPBACK}:{self.etcd_port}"
        self._spawn("etcd", [
            tools.binary("etcd"), "--name", "xmem-test", "--data-dir", str(data),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"xmem-test={peer}", "--log-level", "warn",
            # Tests own the data: no fsync (much less disk I/O on a shared machine).
            "--unsafe-no-fsync", "--quota-backend-bytes", str(2 << 30)])

    def apiserver_argv(self) -> List[str]:
        ca = self._authority()
        return [
            tools.binary("kube-apiserver"),
            "--etcd-servers", f"http://{LOOPBACK}:{self.etcd_port}",
            "--bind-address", self.address, "--advertise-address", self.address,
            "--secure-port", str(self.port), "--cert-dir", str(self.root / "apiserver"),
            "--tls-cert-file", str(self.serving.cert),
            "--tls-private-key-file", str(self.serving.key),
            "--client-ca-file", str(ca.cert_file),
            "--authorization-mode", "Node,RBAC",
            # OwnerReferencesPermissionEnforcement: OpenShift's default, where setting
            # blockOwnerDeletion needs update on the owner's finalizers.
            "--enable-admission-plugins", "NodeRestriction,OwnerReferencesPermissionEnforcement",
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", str(self.sa_pub),
            "--service-account-signing-key-file", str(self.sa_key),
            "--service-cluster-ip-range", SERVICE_CIDR,
            # A loopback address may not be an Endpoints address: nothing to reconcile there;
            # on the host's address the `kubernetes` Service gets it as its endpoint.
            "--endpoint-reconciler-type", "none" if self.address == LOOPBACK else "lease",
            "--kubelet-client-certificate", str(self.kubelet_client.cert),
            "--kubelet-client-key", str(self.kubelet_client.key),
            "--kubelet-certificate-authority", str(ca.cert_file),
            "--kubelet-preferred-address-types", "InternalIP",
            "--allow-privileged=true", "--profiling=false", "--v", "1",
        ]

    def _start_apiserver(self, timeout: float = 120) -> None:
        process = self._spawn("kube-apiserver", self.apiserver_argv())

        def ready() -> bool:
            if process.poll() is not None:
                raise Exited(f"kube-apiserver exited with {process.returncode}: "
                                   f"{self.tail('kube-apiserver')}")
            return self._ready()

        wait_for(ready, timeout, f"kube-apiserver /readyz on {self.server} "
                 f"(log: {self.logs / 'kube-apiserver.log'})", interval=0.2)

    def tail(self, name: str, lines: int = 20) -> str:
        path = self.logs / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def _component_kubeconfig(self, name: str) -> Path:
        pair = self._authority().issue(name, f"system:{name}")
        return kubeconfig(self.root / f"{name}.kubeconfig", self.server,
                          self._authority().cert_file, f"system:{name}", pair=pair)

    def _start_controller_manager(self) -> None:
        config = self._component_kubeconfig("kube-controller-manager")
        self._spawn("kube-controller-manager", [
            tools.binary("kube-controller-manager"), "--kubeconfig", str(config),
            "--bind-address", LOOPBACK, "--secure-port", "0", "--leader-elect=false",
            "--use-service-account-credentials=true",
            "--service-account-private-key-file", str(self.sa_key),
            "--root-ca-file", str(self._authority().cert_file),
            "--cluster-name", "xmem-test", "--controllers", self.controllers, "--v", "1"])

    def _start_scheduler(self) -> None:
        config = self._component_kubeconfig("kube-scheduler")
        fit = {"scoringStrategy": {"type": "MostAllocated", "resources": [
            {"name": "nvidia.com/gpumem", "weight": 5}, {"name": "nvidia.com/gpu", "weight": 1},
            {"name": "cpu", "weight": 1}, {"name": "memory", "weight": 1}]}}
        settings = {
            "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": str(config)},
            "leaderElection": {"leaderElect": False},
            "profiles": [{"schedulerName": "default-scheduler", "pluginConfig": [
                {"name": "NodeResourcesFit", "args": fit}]}],
        }
        path = self.root / "kube-scheduler.yaml"
        path.write_text(yaml.safe_dump(settings))
        self._spawn("kube-scheduler", [
            tools.binary("kube-scheduler"), "--config", str(path), "--bind-address", LOOPBACK,
            "--secure-port", "0", "--v", "1"])

    def request(self, method: str, path: str, body: Any = None,
                accept: str = "application/json") -> tuple[int, bytes]:
        """One request as the admin, any HTTP client's way (no client-side checks): the
        status and the body, errors included."""
        context = ssl.create_default_context(cafile=str(self._authority().cert_file))
        admin = self._authority().directory
        context.load_cert_chain(str(admin / "admin.crt"), str(admin / "admin.key"))
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"{self.server}{path}", data=data, method=method,
                                         headers={"Accept": accept,
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, context=context, timeout=30) as answer:
                return int(answer.status), bytes(answer.read())
        except urllib.error.HTTPError as exc:
            return int(exc.code), bytes(exc.read())

    def _ready(self) -> bool:
        try:
            return self.request("GET", "/readyz")[0] == 200
        except (urllib.error.URLError, OSError):
            return False

    def _default_service_account(self) -> bool:
        from kubernetes import client

        api = client.CoreV1Api(self.api_client())
        try:
            api.read_namespaced_service_account("default", "default")
            return True
        finally:
            api.api_client.close()

    def restart_apiserver(self, timeout: float = 120) -> None:
        """Stop the API server (SIGTERM) and start it again on the same port and etcd."""
        stop_process(self.processes.pop("kube-apiserver"))
        self._start_apiserver(timeout)

    def stop(self) -> None:
        for name in STOP_ORDER:
            process = self.processes.pop(name, None)
            if process is not None:
                stop_process(process)
            (self.run_dir / f"{name}.pid").unlink(missing_ok=True)

    def version(self) -> str:
        """``kube-apiserver --version``, as the binary prints it."""
        return subprocess.run([tools.binary("kube-apiserver"), "--version"], check=True,
                              capture_output=True, text=True).stdout.strip()


def stop_process(process: subprocess.Popen, grace: float = 15) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def stop_pid(pid: int, grace: float = 15) -> None:
    """The same for a process this one did not start (the command line's ``down``)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def down(root: Path) -> List[str]:
    """Stop every process ``root/run/*.pid`` names, in ``STOP_ORDER``; the names stopped."""
    run = root / "run"
    pids = {p.stem: p for p in run.glob("*.pid")} if run.is_dir() else {}
    order = sorted(pids, key=lambda n: next((i for i, s in enumerate(STOP_ORDER)
                                             if n == s or n.startswith(s + "-")), -1))
    for name in order:
        try:
            stop_pid(int(pids[name].read_text()))
        except ValueError:
            pass
        pids[name].unlink(missing_ok=True)
    return order


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localkube.controlplane")
    parser.add_argument("action", choices=["up", "down", "version"])
    parser.add_argument("dir", nargs="?", default="")
    args = parser.parse_args(argv)
    if args.action == "version":
        print(ControlPlane(Path(".")).version())
        return 0
    if not args.dir:
        parser.error("DIR is required")
    root = Path(args.dir).resolve()
    if args.action == "down":
        stopped = down(root)
        print("stopped: " + (", ".join(stopped) or "nothing"))
        return 0
    plane = ControlPlane(root)
    try:
        plane.start()
    except Exception:
        plane.stop()
        raise
    print(plane.version(), file=sys.stderr)
    print(plane.admin_kubeconfig)
    return 0


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


if __name__ == "__main__":
    sys.exit(main())
