"""A real node for the real control plane: kubelet, containerd and runc, CNI bridge networking and a
local image registry, each started and stopped by PID.

``RealNode(plane, root).start()`` starts, all as processes of this one and all under ``root``:

- ``Registry``: distribution's registry on a loopback port, its blobs in ``root/registry`` (and,
  with ``registry_auth=(user, password)``, htpasswd authentication: pods then pull with their
  ``imagePullSecrets``, and the sandbox image comes from a second registry without it).
  ``push(local, repository)`` copies an image from podman's store into it (``podman push
  --tls-verify=false``), so pods pull it by reference (``127.0.0.1:PORT/repository``) as they do
  from any registry;
- containerd 2.x with its own root, state, socket, runc state, CNI configuration and registry
  hosts (``certs.d/127.0.0.1:PORT/hosts.toml``: plain http), the runc v2 shim with Debian's runc and
  the cgroupfs driver, the pod sandbox image pinned to a local one (no registry beyond the local
  one is reachable here), and nothing that its defaults would put elsewhere on the machine
  (``/opt/containerd``, ``/etc/cni``, NRI's socket, CDI's directories, network namespaces in
  ``/var/run/netns``): each is moved under ``root`` or turned off;
- the kubelet of the pinned release, registered with the API server as ``system:node:<name>``
  (a client certificate from the control plane's CA, so the Node authorizer and NodeRestriction
  apply), serving its API on the host's address with a certificate from the same CA (the API
  server verifies it: ``pods/log``, ``exec``), cgroupfs under a cgroup root of its own
  (``/xmem-node-<tag>`` in every hierarchy, made here, since the kubelet requires its cgroup root
  to exist), cgroup v1 allowed (``failCgroupV1: false``), no swap check, eviction thresholds and
  image garbage collection in absolute terms of this machine's disk, and a ``resolv.conf`` of its
  own;
- CNI: a bridge network of its own (``xmem-br-<tag>``, a private /24 under 10.244.0.0/16 that no
  route on the host uses, host-local addresses kept under ``root``). The bridge is the pods'
  gateway so the host reaches them, but pods get no default route: nothing leaves the host.

``run_beside(name, argv, env)`` starts a host process that serves the node as a DaemonSet's pod
would (a DRA kubelet plugin: ``localkube/dra_plugin.py``); ``stop()`` stops those first.

``stop()`` stops the kubelet, containerd and the registry by PID, then undoes what they made, found
by what this node created and never by a broad pattern: the processes in its cgroup tree (the
containers), the runc shims started with its containerd's socket as their address, every mount
under ``root`` (the kubelet's bind mount of its root directory, volumes, containers' root file
systems, sandboxes' ``/dev/shm``, network namespaces), the cgroup tree (leaf first), the bridge it
named, iptables rules that carry its CNI network's name and the chains the kubelet makes
(``KUBE-FIREWALL``, ``KUBE-IPTABLES-HINT``, ``KUBE-KUBELET-CANARY``) when they were not there
before it, its log links in ``/var/log/containers``, the shim sockets of its tasks in
``/run/containerd/s``, and the kernel settings the kubelet and the bridge plugin change
(``setupKernelTunables``: vm.overcommit_memory, vm.panic_on_oom, kernel.panic,
kernel.panic_on_oops, kernel.keys.root_max*; the bridge plugin: net.ipv4.ip_forward), restored to
what they were. ``footprint()`` lists what the node has made
at the moment, for the tests to check that ``stop()`` leaves nothing.

Built by ``make node-tools`` (``scripts/build-node.sh``, versions in ``scripts/node-versions.env``);
runc, the CNI plugins, iptables and podman come from Debian's packages (``make image-tools``).
Root only: a kubelet manages cgroups, mounts and network namespaces.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import hashlib
import ipaddress
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import yaml

from localkube import tools
from localkube.controlplane import (
    LOOPBACK,
    SERVICE_CIDR,
    ControlPlane,
    Exited,
    free_port,
    kubeconfig,
    stop_process,
    wait_for,
)

NODE_VERSIONS_FILE = tools.ROOT / "scripts" / "node-versions.env"
CNI_BIN_DIR = Path("/usr/lib/cni")  # Debian's containernetworking-plugins installs them here
CGROUP_FS = Path("/sys/fs/cgroup")
# containerd's namespace for everything the CRI plugin makes (internal/cri/constants).
CRI_NAMESPACE = "k8s.io"
# Where containerd 2.x's runc shim puts its sockets when it runs as root: defaults.DefaultStateDir
# + "/s" (pkg/shim/util_unix.go and cmd/containerd-shim-runc-v2/manager/manager_linux.go); no
# setting moves it, so the fixture removes the sockets of its own tasks there.
SHIM_SOCKET_DIR = Path("/run/containerd/s")
# The kubelet links every container's log here whatever podLogsDir says
# (pkg/kubelet/kubelet.go, DefaultContainerLogsDir).
CONTAINER_LOG_LINKS = Path("/var/log/containers")
# The CNI library's default cache directory (libcni's CacheDir), where containerd's CNI calls keep
# each attachment's result as <network>-<container id>-<interface>.
CNI_CACHE = Path("/var/lib/cni")
# What the kubelet sets at start (pkg/kubelet/cm/container_manager_linux.go, setupKernelTunables)
# and the bridge plugin sets when it is the gateway (ip forwarding); restored by stop().
SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
           "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes", "net/ipv4/ip_forward")
# The chains the kubelet makes in the host's iptables (pkg/kubelet/kubelet_network_linux.go:
# the hint chain, the martian-packet firewall with jumps from INPUT and OUTPUT, and the canary it
# watches to find its rules flushed), per table.
KUBELET_CHAINS = {"mangle": ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"),
                  "filter": ("KUBE-FIREWALL", "KUBE-KUBELET-CANARY"),
                  "nat": ("KUBE-KUBELET-CANARY",)}
GIB = 1 << 30
MNT_DETACH = 2  # <sys/mount.h>
CAP_SYS_RESOURCE = 24  # <linux/capability.h>
# containerd refuses a socket path longer than this ("unix socket path too long (> 104)": its
# limit for every platform it serves; Linux's sun_path holds 108 bytes).
SOCKET_PATH_MAX = 104


class NodeToolsMissing(tools.ToolsMissing):
    """The node's binaries are not built: ``make node-tools`` builds them."""


def versions() -> Dict[str, str]:
    """scripts/kube-versions.env and scripts/node-versions.env together."""
    return {**tools.versions(), **tools.read_env(NODE_VERSIONS_FILE)}


def cache_key() -> str:
    """The key scripts/build-node.sh builds into."""
    v = versions()
    return (f"k8s-{v['KUBERNETES_VERSION']}_containerd-{v['CONTAINERD_VERSION']}"
            f"_registry-{v['DISTRIBUTION_VERSION']}_r{v['NODE_BUILD_RECIPE']}")


_BUILD = "`make node-tools` (scripts/build-node.sh)"


def home() -> Path:
    return tools.cache_entry("XMEM_NODE_CACHE", "node", cache_key(), "the real node", _BUILD,
                             NodeToolsMissing)


def proxy_home() -> Path:
    """kube-proxy's cache entry (scripts/build-node.sh builds it apart from the node's others)."""
    v = versions()
    return tools.cache_entry("XMEM_NODE_CACHE", "node",
                             f"k8s-{v['KUBERNETES_VERSION']}_kube-proxy_r{v['PROXY_BUILD_RECIPE']}",
                             "kube-proxy", _BUILD, NodeToolsMissing)


def binary(name: str) -> str:
    entry = proxy_home() if name == "kube-proxy" else home()
    return tools.executable(entry, name, _BUILD, NodeToolsMissing)


def host_tool(name: str) -> str:
    """runc, iptables, ip, podman: Debian's (``make image-tools``)."""
    found = shutil.which(name, path="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    if not found:
        raise tools.ToolsMissing(f"{name} is not installed: run `make image-tools` "
                                 f"(scripts/install-image-tools.sh)")
    return found


def missing() -> Optional[str]:
    """Why a real node cannot run here, or None."""
    if os.geteuid() != 0:
        return "a real node needs root (cgroups, mounts, network namespaces)"
    try:
        home()
        for name in ("runc", "iptables", "ip", "podman"):
            host_tool(name)
    except tools.ToolsMissing as err:
        return str(err)
    if not (CNI_BIN_DIR / "bridge").exists():
        return f"{CNI_BIN_DIR}/bridge is missing: run `make image-tools`"
    return None


def _run(*argv: str, check: bool = True, timeout: float = 60,
         input_text: Optional[str] = None) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                            input=input_text)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({result.returncode}): "
                           f"{(result.stderr or result.stdout).strip()[-2000:]}")
    return result


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie has exited: only its parent's wait is left.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1] != "Z"
    except (OSError, IndexError):
        return False


def _kill(pid: int, sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _unescape(path: str) -> str:
    """A path as /proc/self/mountinfo writes it (octal escapes for space, tab, newline, \\)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), path)


def mounts() -> List[Tuple[str, str]]:
    """(mount point, file system type) of every mount, from /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            out.append((_unescape(fields[4]), fields[fields.index("-") + 1]))
    return out


def mount_points() -> List[str]:
    return [point for point, _ in mounts()]


def cgroup_mounts() -> List[Path]:
    """Every cgroup hierarchy's mount point (v1 controllers, named ones, and v2's in hybrid mode)."""
    return [Path(point) for point, fstype in mounts() if fstype in ("cgroup", "cgroup2")]


def _under(path: str, root: Path) -> bool:
    return path == str(root) or path.startswith(str(root).rstrip("/") + "/")


def _ns_inode(path: Path) -> Optional[int]:
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


def net_namespaces_in_use() -> Set[int]:
    """The network namespaces of every process on the machine, by inode."""
    out: Set[int] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                link = os.readlink(entry / "ns" / "net")  # "net:[4026531840]"
                out.add(int(link[link.index("[") + 1:-1]))
    return out


def _disk_bytes(top: Path) -> int:
    """What ``du`` counts under ``top``: allocated blocks, each inode once, no symlink followed."""
    seen: Set[Tuple[int, int]] = set()
    total = 0
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except FileNotFoundError:  # a container's layer removed meanwhile
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _has_capability(bit: int) -> bool:
    """Whether this process's bounding set holds capability ``bit`` (linux/capability.h)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapBnd:"):
            return bool(int(line.split()[1], 16) >> bit & 1)
    return False


def _read_sysctl(name: str) -> Optional[str]:
    try:
        return (Path("/proc/sys") / name).read_text().strip()
    except OSError:
        return None


def _host_address() -> str:
    """The IPv4 address of the interface of the default route (the kubelet refuses loopback
    as a node address: kubelet_node_status.go, validateNodeIP)."""
    ip = host_tool("ip")
    routes = json.loads(_run(ip, "-j", "-4", "route", "show", "default").stdout or "[]")
    devices = [r["dev"] for r in routes if r.get("dev")]
    addresses = json.loads(_run(ip, "-j", "-4", "addr", "show", "scope", "global").stdout or "[]")
    ordered = sorted(addresses, key=lambda a: a.get("ifname") not in devices)
    for link in ordered:
        for info in link.get("addr_info", []):
            if info.get("family") == "inet":
                return str(info["local"])
    raise RuntimeError("no global IPv4 address on this machine for the kubelet to advertise")


def _free_subnet() -> str:
    """A 10.244.X.0/24 (the range kubeadm's and flannel's docs use for pods) that no address
    or route of the host overlaps."""
    ip = host_tool("ip")
    used = []
    for kind in ("addr", "route"):
        for line in _run(ip, "-4", "-o", kind).stdout.splitlines():
            for word in line.split():
                with contextlib.suppress(ValueError):
                    used.append(ipaddress.ip_network(word, strict=False))
    candidates = list(range(100, 250))
    secrets.SystemRandom().shuffle(candidates)
    for third in candidates:
        net = ipaddress.ip_network(f"10.244.{third}.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return str(net)
    raise RuntimeError("no free 10.244.X.0/24 for the pod network")


def _spawn(name: str, argv: List[str], logs: Path, run_dir: Path,
           env: Optional[Dict[str, str]] = None) -> subprocess.Popen[bytes]:
    log = open(logs / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True, env=env)
    finally:
        log.close()
    (run_dir / f"{name}.pid").write_text(str(process.pid))
    return process


def _tail(path: Path, lines: int = 30) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


# --- the registry -------------------------------------------------------------------------------


def htpasswd_line(user: str, password: str) -> str:
    """``user:bcrypt-hash``, the only hash distribution's htpasswd accepts (registry/auth/
    htpasswd: bcrypt.CompareHashAndPassword). glibc's crypt(3) on Debian (libxcrypt) makes
    bcrypt; Python's crypt module is deprecated (removed in 3.13), hence the warning filter."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt  # noqa: PLC0415

        hashed = crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))
    if not hashed or not hashed.startswith("$2"):
        raise RuntimeError("this Python's crypt makes no bcrypt hash for the registry's htpasswd")
    return f"{user}:{hashed}"


class Registry:
    """distribution's registry on ``127.0.0.1:<free port>``, plain http, blobs under ``root``."""

    def __init__(self, root: Path, auth: Optional[Tuple[str, str]] = None,
                 name: str = "registry") -> None:
        self.root = Path(root)
        self.auth = auth
        self.name = name  # of its log and PID files
        self.port = 0
        self.process: Optional[subprocess.Popen[bytes]] = None

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def start(self, logs: Path, run_dir: Path, timeout: float = 60) -> Registry:
        self.root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        config: Dict[str, Any] = {
            "version": 0.1,
            "log": {"level": "info", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(self.root / "data")},
                        "delete": {"enabled": True}},
            "http": {"addr": self.address, "secret": secrets.token_hex(16)},
        }
        if self.auth is not None:
            htpasswd = self.root / "htpasswd"
            htpasswd.write_text(htpasswd_line(*self.auth) + "\n")
            config["auth"] = {"htpasswd": {"realm": "xmem-test", "path": str(htpasswd)}}
        path = self.root / "config.yml"
        path.write_text(yaml.safe_dump(config))
        self.process = _spawn(self.name, [binary("registry"), "serve", str(path)], logs, run_dir)
        process = self.process

        def answers() -> bool:
            if process.poll() is not None:
                raise Exited(f"the registry exited ({process.returncode}): "
                             f"{_tail(logs / f'{self.name}.log')}")
            try:
                with urllib.request.urlopen(f"http://{self.address}/v2/", timeout=5) as answer:
                    return bool(answer.status == 200)
            except urllib.error.HTTPError as exc:
                return exc.code == 401 and self.auth is not None
            except (urllib.error.URLError, OSError):
                return False

        wait_for(answers, timeout, f"the registry on {self.address}", interval=0.1)
        return self

    def push(self, local: str, repository: str) -> str:
        """Copy ``local`` (an image in podman's store) to ``repository`` here; its reference."""
        reference = f"{self.address}/{repository}"
        argv = [host_tool("podman"), "--runtime", "runc", "push", "--tls-verify=false",
                "--quiet"]
        if self.auth is not None:
            argv += ["--creds", f"{self.auth[0]}:{self.auth[1]}"]
        _run(*argv, local, f"docker://{reference}", timeout=900)
        return reference

    def pull_secret(self, name: str) -> Dict[str, Any]:
        """An image pull Secret (``kubernetes.io/dockerconfigjson``) named ``name`` with this
        registry's credentials, for a namespace's pods to name in ``imagePullSecrets``."""
        assert self.auth is not None, "the registry was started without authentication"
        token = base64.b64encode(f"{self.auth[0]}:{self.auth[1]}".encode()).decode()
        config = {"auths": {self.address: {"auth": token}}}
        return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/dockerconfigjson",
                "metadata": {"name": name},
                "stringData": {".dockerconfigjson": json.dumps(config)}}

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self.process = None


def pause_image(base: str) -> str:
    """A pod sandbox image made from ``base`` (any image with coreutils' ``sleep``), tagged in
    podman's store: the sandbox's process only holds the pod's namespaces, and no registry with
    registry.k8s.io/pause is reachable here. containerd stops a sandbox with SIGKILL, which a PID
    1 ``sleep`` cannot ignore. No layer of its own: only the configuration differs from base."""
    tag = "localhost/xmem-pause:" + hashlib.sha256(base.encode()).hexdigest()[:12]
    podman = [host_tool("podman"), "--runtime", "runc"]
    if _run(*podman, "image", "exists", tag, check=False).returncode == 0:
        return tag
    containerfile = f'FROM {base}\nCMD ["sleep", "infinity"]\n'
    with contextlib.ExitStack() as stack:
        import tempfile

        context = stack.enter_context(tempfile.TemporaryDirectory())
        (Path(context) / "Containerfile").write_text(containerfile)
        _run(*podman, "build", "--pull=never", "--quiet", "-t", tag, context, timeout=300)
    return tag


# --- what a node leaves behind -------------------------------------------------------------------


@dataclass
class Footprint:
    """What a node has made on the machine at one moment (``RealNode.footprint()``)."""

    processes: Dict[int, str] = field(default_factory=dict)  # pid -> what it is
    mounts: List[str] = field(default_factory=list)  # mount points under the node's root
    netns: Dict[str, int] = field(default_factory=dict)  # namespace file -> its inode
    cgroups: List[str] = field(default_factory=list)  # directories under the node's cgroup root
    links: List[str] = field(default_factory=list)  # the bridge and the veths on it
    iptables: List[str] = field(default_factory=list)  # rules naming the node's CNI network
    kubelet_chains: List[str] = field(default_factory=list)  # the kubelet's, made by this node
    files: List[str] = field(default_factory=list)  # outside root: log links, shim sockets, cache

    def empty(self) -> bool:
        return not any((self.processes, self.mounts, self.netns, self.cgroups, self.links,
                        self.iptables, self.kubelet_chains, self.files))


# --- the node ------------------------------------------------------------------------------------


def too_deep(root: Path) -> Optional[str]:
    """Why a node in ``root`` cannot start because of the folder's depth, or None: containerd
    makes its sockets there (the longest is ``containerd/containerd.sock.ttrpc``)."""
    longest = Path(root).resolve() / "containerd" / "containerd.sock.ttrpc"
    if len(str(longest).encode()) <= SOCKET_PATH_MAX:
        return None
    return (f"the node's folder {root} is too deep: containerd's socket there ({longest}) would "
            f"be longer than the {SOCKET_PATH_MAX} bytes containerd allows; choose a shorter "
            f"folder")


class RealNode:
    """See the module docstring."""

    def __init__(self, plane: ControlPlane, root: Path, name: str = "",
                 registry_auth: Optional[Tuple[str, str]] = None,
                 taints: Sequence[Dict[str, str]] = (),
                 labels: Optional[Dict[str, str]] = None, services: bool = False) -> None:
        self.plane = plane
        # Services for the pods: kube-proxy (iptables mode) and a route to the
        # Service range through the bridge, so a pod reaches the API server through the
        # `kubernetes` Service (the control plane must then serve on the host's address).
        self.services = services
        self.proxy_config: Optional[Path] = None
        self.tag = secrets.token_hex(3)
        self.name = name or f"xmem-real-node-{self.tag}"
        self.root = Path(root)
        self.logs = self.root / "logs"
        self.run_dir = self.root / "run"
        self.registry = Registry(self.root / "registry", registry_auth)
        # The sandbox image is pulled by containerd itself, with no pod's pull secret: with
        # authentication on, it comes from a second registry without it (containerd's
        # registry-wide credentials would serve every pull and hide the pods' secrets).
        self.sandbox_registry = (Registry(self.root / "registry-sandbox", name="registry-sandbox")
                                 if registry_auth is not None else self.registry)
        self.taints = list(taints)
        self.labels = dict(labels or {})
        # Names of its own, so that teardown touches nothing else on the machine.
        self.cgroup_root = f"/xmem-node-{self.tag}"
        self.bridge = f"xmem-br-{self.tag}"  # 14 characters: Linux allows 15 (IFNAMSIZ - 1)
        self.network = f"xmem-pods-{self.tag}"
        self.subnet = ""
        self.node_ip = ""
        self.kubelet_port = 0
        self.healthz_port = 0
        self.containerd_dir = self.root / "containerd"
        self.socket = self.containerd_dir / "containerd.sock"
        self.state = self.containerd_dir / "state"
        self.kubelet_dir = self.root / "kubelet"
        self.pod_logs = self.root / "pod-logs"
        self.sandbox_image = ""
        self.processes: Dict[str, subprocess.Popen[bytes]] = {}
        self._beside: List[str] = []  # host processes of the node's own (run_beside)
        self._before: Dict[str, Any] = {}
        self._started = False

    # --- lifecycle --------------------------------------------------------------------------

    def start(self, sandbox_image: str, timeout: float = 180) -> RealNode:
        """Start the registry, push ``sandbox_image`` (a local podman image, see
        ``pause_image``) into it for containerd's pod sandboxes, start containerd and the
        kubelet, and wait until the API server shows the Node ``Ready``."""
        reason = missing()
        if reason:
            raise NodeToolsMissing(reason)
        deep = too_deep(self.root)
        if deep:
            raise ValueError(deep)
        for d in (self.logs, self.run_dir, self.containerd_dir, self.kubelet_dir, self.pod_logs):
            d.mkdir(parents=True, exist_ok=True)
        self._remember()
        self._started = True
        for registry in {id(r): r for r in (self.registry, self.sandbox_registry)}.values():
            registry.start(self.logs, self.run_dir)
            self.processes[registry.name] = registry.process  # type: ignore[assignment]
        self.sandbox_image = self.sandbox_registry.push(sandbox_image, "xmem/pause:node")
        self.subnet = _free_subnet()
        self.node_ip = _host_address()
        self._make_cgroup_root()
        self._write_cni()
        self._start_containerd()
        self._start_kubelet()
        if self.services:
            self._start_kube_proxy()
        wait_for(self._ready, timeout, f"Node {self.name} Ready (kubelet log: "
                 f"{self.logs / 'kubelet.log'})", interval=0.5)
        return self

    def _remember(self) -> None:
        """What is on the machine before the node starts: stop() removes only what was not."""
        chains: Dict[str, Set[str]] = {}
        for command in ("iptables", "ip6tables"):
            for table in KUBELET_CHAINS:
                chains[f"{command}:{table}"] = set(self._chains(command, table))
        self._before = {
            "sysctls": {name: _read_sysctl(name) for name in SYSCTLS},
            "chains": chains,
            "paths": {str(p): p.exists() for p in (CONTAINER_LOG_LINKS, SHIM_SOCKET_DIR,
                                                   SHIM_SOCKET_DIR.parent, CNI_CACHE,
                                                   CNI_CACHE / "results")},
        }

    def _make_cgroup_root(self) -> None:
        """The kubelet's cgroup root must exist in every hierarchy before it starts
        (cm/container_manager_linux.go: "cgroup-root ... doesn't exist"). A new cpuset cgroup
        has no CPUs and memory nodes until given its parent's."""
        for mount in cgroup_mounts():
            path = mount / self.cgroup_root.lstrip("/")
            path.mkdir(exist_ok=True)
            for name in ("cpuset.cpus", "cpuset.mems"):
                if (mount / name).exists() and not (path / name).read_text().strip():
                    (path / name).write_text((mount / name).read_text())

    def _write_cni(self) -> None:
        net_d = self.root / "cni" / "net.d"
        net_d.mkdir(parents=True, exist_ok=True)
        gateway = str(next(ipaddress.ip_network(self.subnet).hosts()))
        conf = {
            "cniVersion": "1.0.0",  # the newest the Debian plugins (1.1.1) speak
            "name": self.network,
            "plugins": [
                {"type": "bridge", "bridge": self.bridge, "isGateway": True, "ipMasq": False,
                 "hairpinMode": True,
                 # No "routes": pods reach the subnet (the bridge, each other, the host through
                 # the gateway) and nothing else.
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": self.subnet,
                                                             "gateway": gateway}]],
                          "dataDir": str(self.root / "cni" / "ipam"),
                          # With Services: their range too, through the host (kube-proxy's
                          # rules turn it into an endpoint, all on this host).
                          "routes": [{"dst": SERVICE_CIDR}] if self.services else []}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        (net_d / f"10-{self.network}.conflist").write_text(json.dumps(conf, indent=2))

    def _containerd_config(self) -> str:
        d = self.containerd_dir
        for registry in {self.registry.address, self.sandbox_registry.address}:
            hosts = d / "certs.d" / registry
            hosts.mkdir(parents=True, exist_ok=True)
            (hosts / "hosts.toml").write_text(
                f'server = "http://{registry}"\n\n[host."http://{registry}"]\n'
                f'  capabilities = ["pull", "resolve"]\n  skip_verify = true\n')
        # The kubelet asks for a negative OOM score for sandboxes (-998) and Guaranteed pods;
        # lowering a score needs CAP_SYS_RESOURCE, which this machine kind's bounding set lacks
        # (runc: "failed to update /proc/self/oom_score_adj: Permission denied"). Then containerd
        # raises every container's score to at least its own (restrict_oom_score_adj).
        restrict_oom = not _has_capability(CAP_SYS_RESOURCE)
        return f"""version = 3
root = "{d / 'root'}"
state = "{self.state}"
temp = "{d / 'tmp'}"

[grpc]
  address = "{self.socket}"

[plugins.'io.containerd.internal.v1.opt']
  path = "{d / 'opt'}"

[plugins.'io.containerd.image-verifier.v1.bindir']
  bin_dir = "{d / 'image-verifiers'}"

[plugins.'io.containerd.nri.v1.nri']
  disable = true

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  # A pulled image's compressed layers are dropped once unpacked (a torch image
  # otherwise lives in containerd twice, about 3 GB compressed beside 5-6 GB unpacked); the
  # transfer service ignores the setting, so CRI pulls locally (containerd-config.toml(5),
  # containerd discussion 12522).
  discard_unpacked_layers = true
  use_local_image_pull = true

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{self.sandbox_image}"

[plugins.'io.containerd.cri.v1.images'.registry]
  config_path = "{d / 'certs.d'}"

[plugins.'io.containerd.cri.v1.runtime']
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = {'true' if restrict_oom else 'false'}
  cdi_spec_dirs = ["{d / 'cdi'}"]

[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ["{CNI_BIN_DIR}"]
  conf_dir = "{self.root / 'cni' / 'net.d'}"

[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = "runc"

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = "{host_tool('runc')}"
  Root = "{d / 'runc'}"
  SystemdCgroup = false

[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "{LOOPBACK}"
"""

    def _env(self) -> Dict[str, str]:
        path = f"{home() / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        return {"PATH": path, "HOME": str(self.root), "LANG": "C.UTF-8"}

    def _start_containerd(self, timeout: float = 60) -> None:
        config = self.containerd_dir / "config.toml"
        config.write_text(self._containerd_config())
        process = _spawn("containerd", [binary("containerd"), "--config", str(config),
                                        "--log-level", "info"], self.logs, self.run_dir,
                         env=self._env())
        self.processes["containerd"] = process

        def serving() -> bool:
            if process.poll() is not None:
                raise Exited(f"containerd exited ({process.returncode}): "
                             f"{_tail(self.logs / 'containerd.log')}")
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(self.socket))
            return True

        wait_for(serving, timeout, f"containerd on {self.socket}", interval=0.1)

    def _kubelet_config(self, ca: Path, serving: Any) -> Dict[str, Any]:
        disk = os.statvfs(self.root)
        capacity = disk.f_blocks * disk.f_frsize

        def used_percent_at(free: int) -> int:
            return max(1, min(99, 100 - -(-free * 100 // capacity)))

        resolv = self.root / "resolv.conf"
        # The host's nameservers, in a file of the node's own (a later change of the host's
        # file does not reach pods mid-test); pods get no route to them anyway.
        host = Path("/etc/resolv.conf").read_text() if Path("/etc/resolv.conf").exists() else ""
        resolv.write_text("".join(line + "\n" for line in host.splitlines()
                                  if line.startswith(("nameserver", "search", "options"))))
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": self.node_ip, "port": self.kubelet_port, "readOnlyPort": 0,
            "healthzBindAddress": LOOPBACK, "healthzPort": self.healthz_port,
            "tlsCertFile": str(serving.cert), "tlsPrivateKeyFile": str(serving.key),
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": str(ca)}},
            "authorization": {"mode": "Webhook"},
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "cgroupDriver": "cgroupfs", "cgroupRoot": self.cgroup_root,
            # Kubernetes 1.35 made cgroup v1 an error unless allowed; this machine kind has it.
            "failCgroupV1": False, "failSwapOn": False,
            "podLogsDir": str(self.pod_logs), "resolvConf": str(resolv),
            "volumePluginDir": str(self.kubelet_dir / "volume-plugins"),
            "rotateCertificates": False, "serverTLSBootstrap": False,
            # The defaults (KubeletConfiguration v1beta1: nodefs 10 %, imagefs 15 %) are shares
            # of the disk's size: on this machine kind's 252 GB disk with 50-80 GB free they
            # would evict at 25-38 GB free. Absolute floors instead, what a filled disk needs:
            "evictionHard": {"memory.available": "100Mi",  # the default
                             "nodefs.available": "5Gi", "imagefs.available": "5Gi",
                             "nodefs.inodesFree": "5%", "imagefs.inodesFree": "5%"},
            # Image garbage collection by usage percent of the same disk: start when under
            # 10 GiB are free, free images until 20 GiB are (defaults 85 % / 80 %, i.e. at 38 GB
            # free on that disk), and never an image younger than the default 2 minutes.
            "imageGCHighThresholdPercent": used_percent_at(10 * GIB),
            "imageGCLowThresholdPercent": used_percent_at(20 * GIB),
            "registerNode": True,
            "registerWithTaints": self.taints,
            # The Node's status every 4 s (default 10 s): Ready shows sooner after a start.
            "nodeStatusUpdateFrequency": "4s",
        }

    def _start_kubelet(self) -> None:
        ca = self.plane._authority()
        pair = ca.issue(f"kubelet-{self.name}", f"system:node:{self.name}", ["system:nodes"])
        config_path = self.kubelet_dir.parent / "kubelet-kubeconfig.yaml"
        kubeconfig(config_path, self.plane.server, ca.cert_file, f"system:node:{self.name}",
                   pair=pair)
        serving = ca.issue(f"kubelet-{self.name}-serving", self.name, server=True,
                           ips=[self.node_ip], dns=[self.name])
        self.kubelet_port, self.healthz_port = free_port(), free_port()
        settings = self.root / "kubelet-config.yaml"
        settings.write_text(yaml.safe_dump(self._kubelet_config(ca.cert_file, serving)))
        argv = [binary("kubelet"), "--config", str(settings), "--kubeconfig", str(config_path),
                "--root-dir", str(self.kubelet_dir), "--cert-dir", str(self.root / "kubelet-pki"),
                "--hostname-override", self.name, "--node-ip", self.node_ip, "--v", "2"]
        if self.labels:
            argv += ["--node-labels", ",".join(f"{k}={v}" for k, v in self.labels.items())]
        self.processes["kubelet"] = _spawn("kubelet", argv, self.logs, self.run_dir,
                                           env=self._env())

    def _start_kube_proxy(self) -> None:
        """kube-proxy in iptables mode as ``system:kube-proxy`` (the default ClusterRoleBinding
        system:node-proxier), changing no kernel setting: conntrack limits and timeouts left as
        they are, no localhost NodePorts (which need route_localnet)."""
        ca = self.plane._authority()
        pair = ca.issue(f"kube-proxy-{self.name}", "system:kube-proxy")
        config_path = self.root / "kube-proxy-kubeconfig.yaml"
        kubeconfig(config_path, self.plane.server, ca.cert_file, "system:kube-proxy", pair=pair)
        settings = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(config_path)},
            "hostnameOverride": self.name, "mode": "iptables",
            "clusterCIDR": self.subnet, "detectLocalMode": "ClusterCIDR",
            "bindAddress": self.node_ip,
            "healthzBindAddress": f"{LOOPBACK}:{free_port()}",
            "metricsBindAddress": f"{LOOPBACK}:{free_port()}",
            "conntrack": {"maxPerCore": 0, "min": 0, "tcpEstablishedTimeout": "0s",
                          "tcpCloseWaitTimeout": "0s"},
            "iptables": {"localhostNodePorts": False, "masqueradeAll": False},
            "nodePortAddresses": [f"{self.node_ip}/32"],
        }
        self.proxy_config = self.root / "kube-proxy-config.yaml"
        self.proxy_config.write_text(yaml.safe_dump(settings))
        self.processes["kube-proxy"] = _spawn(
            "kube-proxy", [binary("kube-proxy"), "--config", str(self.proxy_config), "--v", "2"],
            self.logs, self.run_dir, env=self._env())

    def run_beside(self, name: str, argv: List[str],
                   env: Dict[str, str]) -> subprocess.Popen[bytes]:
        """Start a host process that serves this node as a DaemonSet's pod would (a DRA kubelet
        plugin: ``localkube/dra_plugin.py``), logged in ``logs/<name>.log`` with a PID file like
        the node's own; ``stop_beside`` stops it, and ``stop()`` stops it first, before the
        kubelet."""
        assert self._started and name not in self.processes, name
        process = _spawn(name, argv, self.logs, self.run_dir, env=env)
        self.processes[name] = process
        self._beside.append(name)
        return process

    def stop_beside(self, name: str) -> None:
        """Stop one process of ``run_beside`` (SIGTERM, then SIGKILL after 15 s)."""
        process = self.processes.pop(name, None)
        if process is not None:
            stop_process(process)
        (self.run_dir / f"{name}.pid").unlink(missing_ok=True)
        if name in self._beside:
            self._beside.remove(name)

    def _ready(self) -> bool:
        process = self.processes["kubelet"]
        if process.poll() is not None:
            raise Exited(f"the kubelet exited ({process.returncode}): "
                         f"{_tail(self.logs / 'kubelet.log')}")
        status, body = self.plane.request("GET", f"/api/v1/nodes/{self.name}")
        if status != 200:
            return False
        conditions = json.loads(body).get("status", {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    def versions(self) -> Dict[str, str]:
        """What the binaries say they are."""
        out = {}
        for name, flag in (("kubelet", "--version"), ("containerd", "--version"),
                           ("registry", "--version")):
            out[name] = _run(binary(name), flag).stdout.strip()
        out["runc"] = _run(host_tool("runc"), "--version").stdout.splitlines()[0]
        return out

    def image_bytes(self) -> Dict[str, int]:
        """Bytes on disk of containerd's content store (compressed blobs: manifests, configs
        and, unless discarded after unpacking, layers) and of its overlayfs snapshots
        (unpacked layers and containers' writable layers)."""
        root = self.containerd_dir / "root"
        return {"content": _disk_bytes(root / "io.containerd.content.v1.content"),
                "snapshots": _disk_bytes(root / "io.containerd.snapshotter.v1.overlayfs")}

    # --- what the node has made -------------------------------------------------------------

    def _cgroup_dirs(self) -> List[Path]:
        out = []
        for mount in cgroup_mounts():
            top = mount / self.cgroup_root.lstrip("/")
            if top.is_dir():
                out += [Path(d) for d, _, _ in os.walk(top)]
        return out

    def _cgroup_pids(self) -> Set[int]:
        pids: Set[int] = set()
        for d in self._cgroup_dirs():
            with contextlib.suppress(OSError):
                pids.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        return pids

    def _task_dirs(self) -> List[Path]:
        tasks = self.state / "io.containerd.runtime.v2.task"
        return sorted(p for p in tasks.glob("*/*") if p.is_dir()) if tasks.is_dir() else []

    def _shim_pids(self) -> Dict[int, str]:
        """The runc shims serving this node's containerd (found by the address they were started
        with, ``-address <this node's socket>``: containerd 2.x writes no shim.pid), and the
        containers' first processes (``init.pid`` in each task's bundle)."""
        out = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = [a.decode(errors="replace")
                        for a in (entry / "cmdline").read_bytes().split(b"\0") if a]
            except OSError:
                continue
            if (argv and os.path.basename(argv[0]) == "containerd-shim-runc-v2"
                    and "-address" in argv[:-1]
                    and argv[argv.index("-address") + 1] == str(self.socket)):
                task = argv[argv.index("-id") + 1] if "-id" in argv[:-1] else "?"
                out[int(entry.name)] = f"shim of {task[:12]}"
        for task_dir in self._task_dirs():
            with contextlib.suppress(OSError, ValueError):
                pid = int((task_dir / "init.pid").read_text().strip())
                out.setdefault(pid, f"init of {task_dir.name[:12]}")
        return out

    def _shim_sockets(self) -> List[Path]:
        """The sockets containerd's runc shim makes for this node's tasks: sha256 of
        containerd's address, the namespace and the task (pkg/shim/util_unix.go,
        CreateSocketAddress), plus the debug one."""
        out = []
        for task in self._task_dirs():
            base = os.path.join(str(self.socket), task.parent.name, task.name)
            for path in (base, os.path.join(base, "debug")):
                out.append(SHIM_SOCKET_DIR / hashlib.sha256(path.encode()).hexdigest())
        return out

    def _netns_files(self) -> Dict[str, int]:
        """The network namespaces containerd pinned for pods (bind mounts of type nsfs under
        its state directory, io.containerd.grpc.v1.cri/netns/cni-<uuid>), by inode."""
        out = {}
        for point, fstype in mounts():
            if fstype == "nsfs" and _under(point, self.state):
                inode = _ns_inode(Path(point))
                if inode is not None:
                    out[point] = inode
        return out

    def _links(self) -> List[str]:
        ip = host_tool("ip")
        found = _run(ip, "-o", "link", "show", "dev", self.bridge, check=False)
        if found.returncode != 0:
            return []
        ports = _run(ip, "-o", "link", "show", "master", self.bridge, check=False).stdout
        return [self.bridge] + [line.split(":")[1].strip().split("@")[0]
                                for line in ports.splitlines() if ":" in line]

    @staticmethod
    def _chains(command: str, table: str) -> List[str]:
        result = _run(host_tool(command), "-w", "5", "-t", table, "-S", check=False)
        return [line.split()[1] for line in result.stdout.splitlines()
                if line.startswith("-N ")]

    def _tagged_rules(self) -> List[Tuple[str, str, str]]:
        """(command, table, rule) for every rule whose comment names this node's network (the
        CNI plugins tag theirs ``name: "<network>" id: "<container>"``)."""
        out = []
        needle = f'name: \\"{self.network}\\"'
        for command in ("iptables", "ip6tables"):
            for table in ("filter", "nat", "mangle", "raw"):
                result = _run(host_tool(command), "-w", "5", "-t", table, "-S", check=False)
                out += [(command, table, line) for line in result.stdout.splitlines()
                        if line.startswith("-A ") and needle in line]
        return out

    def _made_kubelet_chains(self) -> List[Tuple[str, str, str]]:
        out = []
        for command in ("iptables", "ip6tables"):
            for table, names in KUBELET_CHAINS.items():
                before = self._before.get("chains", {}).get(f"{command}:{table}", set())
                present = set(self._chains(command, table))
                out += [(command, table, n) for n in names if n in present and n not in before]
        return out

    def _files_outside(self) -> List[str]:
        out = []
        if CONTAINER_LOG_LINKS.is_dir():
            for link in CONTAINER_LOG_LINKS.iterdir():
                with contextlib.suppress(OSError):
                    if link.is_symlink() and _under(os.readlink(link), self.pod_logs):
                        out.append(str(link))
        out += [str(s) for s in self._shim_sockets() if s.exists()]
        results = CNI_CACHE / "results"
        if results.is_dir():
            # <network>-<sandbox id>-<interface>, for the node's bridge network and for
            # containerd's own loopback network ("cni-loopback"); left behind by sandboxes
            # killed without a CNI DEL.
            sandboxes = self._sandbox_ids()
            for entry in results.iterdir():
                loopback = entry.name.startswith("cni-loopback-") and (
                    entry.name[len("cni-loopback-"):].rsplit("-", 1)[0] in sandboxes)
                if entry.name.startswith(self.network + "-") or loopback:
                    out.append(str(entry))
        return out

    def _sandbox_ids(self) -> Set[str]:
        """The pod sandboxes containerd made for this node (their directories under its root
        and state, and the tasks' bundles)."""
        ids = {task.name for task in self._task_dirs()}
        for base in (self.containerd_dir / "root", self.state):
            sandboxes = base / "io.containerd.grpc.v1.cri" / "sandboxes"
            if sandboxes.is_dir():
                ids.update(entry.name for entry in sandboxes.iterdir())
        return ids

    def footprint(self) -> Footprint:
        """What this node has made on the machine, now."""
        processes = {p.pid: name for name, p in self.processes.items() if p.poll() is None}
        processes.update({pid: what for pid, what in self._shim_pids().items() if _alive(pid)})
        processes.update({pid: "in the node's cgroups" for pid in self._cgroup_pids()
                          if pid not in processes})
        return Footprint(
            processes=processes,
            mounts=[m for m in mount_points() if _under(m, self.root)],
            netns=self._netns_files(),
            cgroups=[str(d) for d in self._cgroup_dirs()],
            links=self._links(),
            iptables=[f"{c} -t {t} {rule}" for c, t, rule in self._tagged_rules()],
            kubelet_chains=[f"{c} -t {t} {n}" for c, t, n in self._made_kubelet_chains()],
            files=self._files_outside(),
        )

    # --- teardown ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop everything by PID and undo what it made (module docstring). Safe to call twice
        and after a failed start."""
        if not self._started:
            return
        shims = self._shim_pids()
        for name in list(self._beside):
            self.stop_beside(name)
        for name in ("kube-proxy", "kubelet", "containerd", "registry", "registry-sandbox"):
            process = self.processes.get(name)
            if process is not None:
                stop_process(process)
            (self.run_dir / f"{name}.pid").unlink(missing_ok=True)
        if self.proxy_config is not None:
            # kube-proxy's own cleanup: the chains and rules it made, in every mode it knows.
            _run(binary("kube-proxy"), "--cleanup", "--config", str(self.proxy_config),
                 check=False, timeout=120)
        self.registry.process = self.sandbox_registry.process = None
        shims.update(self._shim_pids())
        self._kill_containers(shims)
        self._unmount()
        self._remove_cgroups()
        self._remove_network()
        self._restore_sysctls()
        self._remove_outside_files()
        # The images and containers' layers are several GB on a full run: the disk is shared.
        for d in (self.containerd_dir, self.registry.root / "data",
                  self.sandbox_registry.root / "data", self.kubelet_dir):
            if not any(_under(m, d) for m in mount_points()):
                shutil.rmtree(d, ignore_errors=True)
        self._started = False

    def _kill_containers(self, shims: Dict[int, str], timeout: float = 30) -> None:
        """SIGKILL to the containers' processes (everything in the node's cgroup tree) and then
        to the shims named in its state directory, until none is left."""
        deadline = time.monotonic() + timeout
        while True:
            inside = self._cgroup_pids()
            for pid in inside:
                _kill(pid)
            alive_shims = [pid for pid in shims if _alive(pid)]
            for pid in alive_shims:
                _kill(pid)
            if not inside and not alive_shims:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes of node {self.name} survive SIGKILL: "
                                   f"{sorted(inside)} {alive_shims}")
            time.sleep(0.1)

    def _unmount(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        for _ in range(5):  # a mount can reappear under a parent unmounted lazily; rarely
            mine = sorted((m for m in mount_points() if _under(m, self.root)),
                          key=lambda m: m.count("/"), reverse=True)
            if not mine:
                return
            for point in mine:
                if libc.umount2(point.encode(), 0) != 0:
                    err = ctypes.get_errno()
                    if err in (errno.EINVAL, errno.ENOENT):  # not a mount point any more
                        continue
                    if libc.umount2(point.encode(), MNT_DETACH) != 0:
                        raise OSError(ctypes.get_errno(), f"umount {point}")
        left = [m for m in mount_points() if _under(m, self.root)]
        if left:
            raise RuntimeError(f"mounts of node {self.name} remain: {left}")

    def _remove_cgroups(self, timeout: float = 15) -> None:
        """rmdir leaf first, only under the node's own cgroup root (a cgroup with a process
        that is still exiting says EBUSY for a moment)."""
        deadline = time.monotonic() + timeout
        while True:
            busy = []
            for mount in cgroup_mounts():
                top = mount / self.cgroup_root.lstrip("/")
                if not top.is_dir():
                    continue
                for d, _, _ in sorted(os.walk(top), key=lambda w: w[0].count("/"),
                                      reverse=True):
                    try:
                        os.rmdir(d)
                    except FileNotFoundError:
                        pass
                    except OSError:
                        busy.append(d)
            if not busy:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cgroups of node {self.name} cannot be removed: {busy}")
            time.sleep(0.1)

    def _remove_network(self) -> None:
        ip = host_tool("ip")
        if _run(ip, "-o", "link", "show", "dev", self.bridge, check=False).returncode == 0:
            _run(ip, "link", "delete", "dev", self.bridge)
        targets: Set[Tuple[str, str, str]] = set()
        for command, table, rule in self._tagged_rules():
            words = shlex.split(rule)
            if "-j" in words:
                targets.add((command, table, words[words.index("-j") + 1]))
            _run(host_tool(command), "-w", "5", "-t", table, "-D", *words[1:], check=False)
        # Chains that only those rules used, made while the node ran (CNI-DN-..., CNI-...).
        for command, table, chain in sorted(targets):
            before = self._before.get("chains", {}).get(f"{command}:{table}", set())
            if chain in before or chain not in self._chains(command, table):
                continue
            listing = _run(host_tool(command), "-w", "5", "-t", table, "-S", check=False).stdout
            if any(f"-j {chain}" in line for line in listing.splitlines()):
                continue
            _run(host_tool(command), "-w", "5", "-t", table, "-F", chain, check=False)
            _run(host_tool(command), "-w", "5", "-t", table, "-X", chain, check=False)
        for command, table, chain in self._made_kubelet_chains():
            listing = _run(host_tool(command), "-w", "5", "-t", table, "-S").stdout
            for line in listing.splitlines():
                words = shlex.split(line)
                if words[:1] == ["-A"] and words[-2:] == ["-j", chain]:
                    _run(host_tool(command), "-w", "5", "-t", table, "-D", *words[1:])
            _run(host_tool(command), "-w", "5", "-t", table, "-F", chain)
            _run(host_tool(command), "-w", "5", "-t", table, "-X", chain)

    def _restore_sysctls(self) -> None:
        for name, value in self._before.get("sysctls", {}).items():
            if value is not None and _read_sysctl(name) != value:
                with contextlib.suppress(OSError):
                    (Path("/proc/sys") / name).write_text(value + "\n")

    def _remove_outside_files(self) -> None:
        for name in self._files_outside():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
        # Directories the node's processes made (they were not there before), when empty.
        for directory in (CONTAINER_LOG_LINKS, CNI_CACHE / "results", CNI_CACHE,
                          SHIM_SOCKET_DIR, SHIM_SOCKET_DIR.parent):
            if not self._before.get("paths", {}).get(str(directory), True):
                with contextlib.suppress(OSError):
                    directory.rmdir()
