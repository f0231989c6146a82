"""A DRA kubelet plugin beside the real node's kubelet: the Kubernetes project's example
driver, ``sigs.k8s.io/dra-example-driver`` (cmd/dra-example-kubeletplugin), built by
``scripts/build-dra-driver.sh`` (version in ``scripts/dra-driver-versions.env``).

``ExampleDriver(node).start()`` runs it as a host process of the ``RealNode``
(``RealNode.run_beside``: as the kubelet itself runs, where the driver's Helm chart would run a
DaemonSet pod), configured as the chart's DaemonSet configures its container
(deployments/helm/dra-example-driver/templates/kubeletplugin.yaml at v0.4.0, environment
variables the plugin reads: cmd/dra-example-kubeletplugin/main.go):

- ``NODE_NAME`` the node; ``KUBELET_REGISTRAR_DIRECTORY_PATH`` and
  ``KUBELET_PLUGINS_DIRECTORY_PATH`` the kubelet's ``plugins_registry`` and ``plugins`` under the
  node's kubelet root directory (the chart's defaults are /var/lib/kubelet/...); ``CDI_ROOT`` the
  directory the node's containerd reads CDI specs from (``cdi_spec_dirs``; the chart mounts
  /var/run/cdi, one of containerd's defaults);
- ``DEVICE_PROFILE=gpu`` (driver name ``gpu.example.com``), ``NUM_DEVICES`` (chart default 8),
  ``GPU_ALLOW_MULTIPLE_ALLOCATIONS`` (the chart's ``gpuAllowMultipleAllocations``, default false);
  health check and metrics ports off (the chart's probes are not run here).

What the plugin does (internal/profiles/gpu/gpu.go, cmd/dra-example-kubeletplugin/cdi.go,
state.go, driver.go): it publishes one ResourceSlice for its node, pool = the node's name, with
``NUM_DEVICES`` simulated GPUs ``gpu-<i>`` (attributes ``index``, ``uuid``, ``model``
"LATEST-GPU-MODEL", ``driverVersion`` 1.0.0; capacities ``memory`` 80Gi and ``compute`` 100).
With ``GPU_ALLOW_MULTIPLE_ALLOCATIONS`` each device has ``allowMultipleAllocations: true`` and
each capacity a request policy: default = the whole capacity, validRange min 1Gi (memory) / 1
(compute), step the same, max the whole. At NodePrepareResources it writes a CDI spec per claim
(``k8s.gpu.example.com-gpu_<claim uid>.yaml``, removed at unprepare) whose only edits are environment
variables: ``GPU_DEVICE_<i>=gpu-<i>``, the sharing strategy (``TimeSlicing``, interval
``Default``), ``GPU_DEVICE_<i>_MEMORY`` and ``_COMPUTE`` = the allocation's consumedCapacity,
``GPU_DEVICE_GPU_<i>_RESOURCE_CLAIM=<claim uid>``, ``DRA_ADMIN_ACCESS``; and a common spec
(``k8s.gpu.example.com-gpu_common.yaml``: ``KUBERNETES_NODE_NAME``, ``DRA_RESOURCE_DRIVER_NAME``)
written at start, which every prepared container gets too. No device exists: the
container gets variables, not a GPU.

Its identity: a client certificate for the user ``dra-example-driver`` bound to a ClusterRole
with the rules of the chart's (templates/clusterrole.yaml): claims read, claim status update,
nodes get, ResourceSlices written. The DeviceClass is the one the chart makes
(templates/deviceclass.yaml): ``gpu.example.com`` selecting ``device.driver ==
'gpu.example.com'``. ``stop()`` stops the plugin and deletes its ResourceSlices, the DeviceClass
and the RBAC objects; the node's own ``stop()`` stops the plugin too (before the kubelet), and
its folder (CDI specs, sockets, checkpoint) goes with the node's.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Dict, List

import yaml

from localkube import tools
from localkube.controlplane import Exited, wait_for
from localkube.kubelet import RealNode, _tail

VERSIONS_FILE = tools.ROOT / "scripts" / "dra-driver-versions.env"
BINARY = "dra-example-kubeletplugin"
DRIVER = "gpu.example.com"  # DEVICE_PROFILE "gpu" + ".example.com" (main.go)
USER = "dra-example-driver"
RESOURCE = "/apis/resource.k8s.io/v1"
RBAC = "/apis/rbac.authorization.k8s.io/v1"
# Linux's sun_path holds 108 bytes, the last a NUL: a longer socket path cannot be bound.
SOCKET_PATH_MAX = 107
_BUILD = "`make node-tools` (scripts/build-dra-driver.sh)"


class DraDriverMissing(tools.ToolsMissing):
    """The plugin is not built: ``make node-tools`` builds it."""


def versions() -> Dict[str, str]:
    return tools.read_env(VERSIONS_FILE)


def cache_key() -> str:
    """The key scripts/build-dra-driver.sh builds into."""
    v = versions()
    return f"{v['DRA_DRIVER_VERSION']}_r{v['DRA_DRIVER_BUILD_RECIPE']}"


def binary() -> str:
    entry = tools.cache_entry("XMEM_DRA_DRIVER_CACHE", "dra-driver", cache_key(),
                              "the DRA example driver", _BUILD, DraDriverMissing)
    return tools.executable(entry, BINARY, _BUILD, DraDriverMissing)


def device_class() -> Dict[str, Any]:
    """The DeviceClass the driver's chart makes (templates/deviceclass.yaml, no
    extendedResourceName: the chart's default)."""
    return {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass",
            "metadata": {"name": DRIVER},
            "spec": {"selectors": [{"cel": {"expression": f"device.driver == '{DRIVER}'"}}]}}


def cluster_role() -> Dict[str, Any]:
    """What the chart's ClusterRole grants the plugin (templates/clusterrole.yaml)."""
    group = "resource.k8s.io"
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
            "metadata": {"name": f"{USER}-role"},
            "rules": [
                {"apiGroups": [group], "resources": ["resourceclaims"],
                 "verbs": ["get", "list", "watch"]},
                {"apiGroups": [group], "resources": ["resourceclaims/status"],
                 "verbs": ["update"]},
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]},
                {"apiGroups": [group], "resources": ["resourceslices"],
                 "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
            ]}


def cluster_role_binding() -> Dict[str, Any]:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": f"{USER}-role-binding"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": f"{USER}-role"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                          "name": USER}]}


class ExampleDriver:
    """See the module docstring."""

    def __init__(self, node: RealNode, devices: int = 8, shared: bool = False) -> None:
        self.node = node
        self.devices = devices
        self.shared = shared
        self.name = BINARY
        self.registry_dir = node.kubelet_dir / "plugins_registry"
        self.plugins_dir = node.kubelet_dir / "plugins"
        self.cdi_dir = node.containerd_dir / "cdi"  # containerd's cdi_spec_dirs (kubelet.py)
        self._marker = "--- xmem: plugin not started ---"

    @property
    def log(self) -> Path:
        return self.node.logs / f"{self.name}.log"

    def _sockets(self) -> List[Path]:
        return [self.registry_dir / f"{DRIVER}-reg.sock", self.plugins_dir / DRIVER / "dra.sock"]

    def _put(self, base: str, plural: str, body: Dict[str, Any]) -> None:
        """Create ``body`` (cluster-scoped) as the admin, replacing one of the same name."""
        plane = self.node.plane
        name = body["metadata"]["name"]
        plane.request("DELETE", f"{base}/{plural}/{name}")
        status, answer = plane.request("POST", f"{base}/{plural}", body)
        if status != 201:
            raise RuntimeError(f"creating {plural}/{name} answered {status}: {answer[:500]!r}")

    def start(self, timeout: float = 120) -> ExampleDriver:
        """Start the plugin and wait until its ResourceSlice for the node says what this
        configuration publishes and the kubelet has registered the plugin."""
        for socket_path in self._sockets():
            if len(str(socket_path).encode()) > SOCKET_PATH_MAX:
                raise ValueError(f"the node's folder is too deep for the plugin's socket "
                                 f"{socket_path} (at most {SOCKET_PATH_MAX} bytes)")
        plane = self.node.plane
        self._put(RESOURCE, "deviceclasses", device_class())
        self._put(RBAC, "clusterroles", cluster_role())
        self._put(RBAC, "clusterrolebindings", cluster_role_binding())
        config = plane.user_kubeconfig(USER)
        env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": str(self.node.root), "LANG": "C.UTF-8",
            "KUBECONFIG": str(config),
            "NODE_NAME": self.node.name,
            "DRIVER_NAME": DRIVER, "DEVICE_PROFILE": "gpu",
            "CDI_ROOT": str(self.cdi_dir),
            "KUBELET_REGISTRAR_DIRECTORY_PATH": str(self.registry_dir),
            "KUBELET_PLUGINS_DIRECTORY_PATH": str(self.plugins_dir),
            "NUM_DEVICES": str(self.devices),
            "GPU_DEVICE_STATUS": "false",
            "GPU_ALLOW_MULTIPLE_ALLOCATIONS": "true" if self.shared else "false",
            "GPU_PARTITIONS": "0",
            "BINDING_CONDITIONS": "false",
            "HEALTHCHECK_PORT": "-1", "METRICS_PORT": "-1",
        }
        self._marker = f"--- xmem: plugin started {time.time():.3f} ---"
        with open(self.log, "a") as log:
            log.write(self._marker + "\n")
        # -v 6: the kubeletplugin helper logs every gRPC call and its answer at 6
        # (k8s.io/dynamic-resource-allocation kubeletplugin, GRPCVerbosity), the kubelet's
        # registration and NodePrepareResources calls among them.
        process = self.node.run_beside(self.name, [binary(), "-v", "6"], env)

        def published() -> bool:
            if process.poll() is not None:
                raise Exited(f"the DRA plugin exited ({process.returncode}): "
                             f"{_tail(self.log, 40)}")
            devices = [d for s in self.slices() for d in s["spec"].get("devices") or []]
            return len(devices) == self.devices and all(
                bool(d.get("allowMultipleAllocations")) == self.shared for d in devices)

        wait_for(published, timeout, f"the ResourceSlice of {DRIVER} on {self.node.name} "
                 f"(plugin log: {self.log})", interval=0.5)
        wait_for(self.registered, timeout,
                 f"the kubelet to register {DRIVER} (log: {self.log})", interval=0.5)
        return self

    def registered(self) -> bool:
        """Whether the kubelet has told this run of the plugin that it registered it: the
        plugin answered the kubelet's NotifyRegistrationStatus (pluginregistration API), which
        the helper refuses when the status says not registered (kubeletplugin
        registrationserver.go); its log shows the answer at -v 6. Each start appends to the
        log after a line of its own."""
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        this_run = text.rsplit(self._marker, 1)[-1] if self._marker in text else ""
        return any("NotifyRegistrationStatus" in line and "handling request succeeded" in line
                   for line in this_run.splitlines())

    def slices(self) -> List[Dict[str, Any]]:
        """The ResourceSlices of this driver for the node (field selectors of the API)."""
        status, body = self.node.plane.request(
            "GET", f"{RESOURCE}/resourceslices?fieldSelector=spec.nodeName%3D{self.node.name}"
            f"%2Cspec.driver%3D{DRIVER}")
        if status != 200:
            raise RuntimeError(f"listing ResourceSlices answered {status}: {body[:300]!r}")
        return list(json.loads(body).get("items") or [])

    def cdi_specs(self) -> Dict[str, Dict[str, Any]]:
        """The CDI spec files the plugin has written now, by file name (the CDI library
        names a spec ``<vendor>-<class>_<id>`` and adds ``.yaml``: pkg/cdi/cache.go WriteSpec)."""
        if not self.cdi_dir.is_dir():
            return {}
        return {p.name: yaml.safe_load(p.read_text()) for p in sorted(self.cdi_dir.iterdir())
                if p.suffix in (".json", ".yaml") and p.is_file()}

    def stop(self) -> None:
        """Stop the plugin and remove what it and ``start`` put in the cluster (its slices
        would otherwise stay until the kubelet notices the plugin gone). Safe to call twice."""
        self.node.stop_beside(self.name)
        plane = self.node.plane
        if "kube-apiserver" not in plane.processes:  # the cluster went first
            return
        for item in self.slices():
            plane.request("DELETE", f"{RESOURCE}/resourceslices/{item['metadata']['name']}")
        for base, plural, name in ((RESOURCE, "deviceclasses", DRIVER),
                                   (RBAC, "clusterrolebindings", f"{USER}-role-binding"),
                                   (RBAC, "clusterroles", f"{USER}-role")):
            plane.request("DELETE", f"{base}/{plural}/{name}")
