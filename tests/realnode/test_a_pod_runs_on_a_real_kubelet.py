"""A pod runs on a real kubelet: the real node of ``localkube/kubelet.py``
registers with the real control plane, pulls an image by reference from the local registry, runs
it with containerd and runc in a network namespace on the node's bridge, reports the result through
the API server (phase, termination message, logs), and leaves nothing behind when it stops, also
with a pod still running.

Run here (2026-12-03, Debian bookworm, kernel 6.18, cgroup v1, 2 cores): kubelet v1.36.3 (built
from k8s.io/kubernetes v1.36.3), containerd v2.4.2 (its CRI reports "containerd://2.4.2"), runc
1.1.5+ds1 (Debian), distribution registry v3.1.2, Debian's CNI plugins 1.1.1; node Ready about
11 s after start, the pod's container running 8 s after it was scheduled (sandbox, and the
225 MB image pulled from the local registry), the whole test 36 s warm.

What the real kubelet and runtime did differently from the process node
(``localkube/node.py``), each a place where that node is wrong or simpler than a cluster:

- The kubelet refuses a loopback node address (kubelet_node_status.go, validateNodeIP): the
  Node's InternalIP and the pods' ``hostIP`` are the host's address (its API is served there),
  and ``podIP`` comes from the bridge's subnet; the process node says 127.0.0.1 for all three.
- The pod's conditions: the kubelet writes ``PodReadyToStartContainers``, ``Initialized``,
  ``Ready`` and ``ContainersReady`` (reason ``PodCompleted`` once done, ``observedGeneration`` on
  each); the process node leaves ``PodScheduled`` alone.
- Container statuses: ``containerID`` ``containerd://<64 hex>`` and ``imageID``
  ``<registry>/<repository>@sha256:<digest>`` (process node: ``process://<pid>``,
  ``process://<image>``), plus ``user.linux`` (uid, gid, supplemental groups) and
  ``volumeMounts`` (the service account token's projected volume, which the kubelet mounts).
- ``status.resources.limits.memory`` of a BestEffort pod is 9007199254740988Ki: the "no limit"
  of a cgroup v1 memory controller, reported as if it were a limit. Whatever reads a pod's
  status for its memory must not take that field as the pod's limit.
- The sandbox needs an image (``pause_image``: no registry.k8s.io here), and on this machine kind
  every container's OOM score must be clamped (containerd's ``restrict_oom_score_adj``): the
  kubelet asks -998 for sandboxes, and without CAP_SYS_RESOURCE in the bounding set runc fails
  with "failed to update /proc/self/oom_score_adj: Permission denied", which the pod's events
  show only as "can't get final child's PID from pipe: EOF".
- A real node changes the host, which the fixture must undo: kernel settings
  (vm.overcommit_memory, kernel.panic, kernel.panic_on_oops), iptables and ip6tables chains
  (KUBE-FIREWALL, KUBE-IPTABLES-HINT, KUBE-KUBELET-CANARY), links in /var/log/containers, CNI
  result files in /var/lib/cni, shim sockets in /run/containerd/s, cgroups, mounts; containerd
  2.x writes no shim.pid, so shims are found by the address they were started with.
- Node info: kubeletVersion v1.36.3, osImage "Debian GNU/Linux 12 (bookworm)", machine and boot
  IDs; the process node reports v0.0.0 and ``process://1``.
- A command the image lacks (``sh -c ...`` in an image without a shell): the kubelet reports the
  container terminated, reason ``StartError``, exit code 128, the runtime's error ("failed to
  create containerd task: ... exec: \"sh\": executable file not found in $PATH") as its
  message, and the pod ``Failed``; the process node reported it waiting in
  ``CreateContainerConfigError`` and left the pod pending until its deadline (fixed:
  ``tests/e2e_real/test_process_node.py``; seen in
  ``tests/realnode/test_estimation_on_a_real_node.py``).
- Pods of the chart reach the API server through the ``kubernetes`` Service (kube-proxy's rules;
  ``tests/realnode/test_the_chart_on_a_real_node.py``), and a pod with ``dnsPolicy:
  ClusterFirst`` on a kubelet without cluster DNS gets a ``MissingClusterDNS`` event and the
  node's resolv.conf; the process node's pods call the API server on loopback and get neither.
- By hand (not in this test): with ``registry_auth``, a pod without the pull secret ends in
  ``ErrImagePull`` then ``ImagePullBackOff`` ("pull access denied"), one with it runs.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.realnode.conftest import SKIP_REASON

if os.environ.get("XMEM_REAL_NODE_TESTS") != "1":
    pytest.skip(SKIP_REASON, allow_module_level=True)

from kubernetes import client  # noqa: E402

from localkube import kubelet  # noqa: E402
from localkube.controlplane import ControlPlane, Exited, wait_for  # noqa: E402

# Cold: the conftest's builds (15 min for the node, 24 for the control plane) run inside the
# first test's setup; warm the test takes about a minute.
pytestmark = pytest.mark.timeout(3600)

NAMESPACE = "real-node"
MESSAGE = "the termination message, from a real container"
SCRIPT = (
    "import pathlib, socket\n"
    f"pathlib.Path('/dev/termination-log').write_text({MESSAGE!r} + ' on ' + socket.gethostname())\n"
    "print('hello from a container on a real kubelet', flush=True)\n"
)


def _pod(name: str, node: str, image: str, script: str) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "restartPolicy": "Never",
            # No cluster DNS here: the node's own resolv.conf, without the kubelet's
            # "MissingClusterDNS" fallback event.
            "dnsPolicy": "Default",
            "nodeSelector": {"kubernetes.io/hostname": node},
            "terminationGracePeriodSeconds": 0,
            "containers": [{"name": "main", "image": image,
                            "command": ["python3", "-c", script]}],
        },
    }


def _phase(core: client.CoreV1Api, name: str, wanted: str) -> bool:
    pod = core.read_namespaced_pod(name, NAMESPACE)
    phase = pod.status.phase
    if phase == "Failed" and wanted != "Failed":
        raise Exited(f"pod {name} failed: {pod.status}")
    return bool(phase == wanted)


def _events(core: client.CoreV1Api) -> str:
    return "\n".join(f"{e.involved_object.name}: {e.reason}: {e.message}"
                     for e in core.list_namespaced_event(NAMESPACE).items)


def test_a_pod_runs_on_a_real_kubelet(plane: ControlPlane, real_node: kubelet.RealNode,
                                      base_image: str) -> None:
    versions = real_node.versions()
    print(f"\nreal node versions: {json.dumps(versions)}")
    core = client.CoreV1Api(plane.api_client())
    node = core.read_node(real_node.name)
    assert node.status.node_info.kubelet_version == kubelet.versions()["KUBERNETES_VERSION"]
    runtime = kubelet.versions()["CONTAINERD_VERSION"].lstrip("v")  # CRI reports it without "v"
    assert node.status.node_info.container_runtime_version == f"containerd://{runtime}"
    print(f"node info: {node.status.node_info.to_dict()}")

    image = real_node.registry.push(base_image, "xmem/debian:bookworm")
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    wait_for(lambda: core.read_namespaced_service_account("default", NAMESPACE), 60,
             "the default service account in the test namespace")

    core.create_namespaced_pod(NAMESPACE, _pod("hello", real_node.name, image, SCRIPT))
    try:
        wait_for(lambda: _phase(core, "hello", "Succeeded"), 300, "pod hello Succeeded",
                 interval=0.5)
    except (TimeoutError, Exited) as err:
        raise AssertionError(f"{err}\nevents:\n{_events(core)}\nkubelet log:\n"
                             f"{kubelet._tail(real_node.logs / 'kubelet.log', 40)}") from err
    pod = core.read_namespaced_pod("hello", NAMESPACE)
    print(f"pod hello: {pod.status.to_dict()}")
    (state,) = [s.state.terminated for s in pod.status.container_statuses]
    assert state.exit_code == 0 and state.reason == "Completed"
    assert state.message == f"{MESSAGE} on hello"
    logs = core.read_namespaced_pod_log("hello", NAMESPACE, container="main")
    assert logs == "hello from a container on a real kubelet\n"
    assert pod.status.pod_ip, pod.status
    assert ipaddress.ip_address(pod.status.pod_ip) in ipaddress.ip_network(real_node.subnet)
    assert pod.status.host_ip == real_node.node_ip

    # A pod still running when the node stops: its container, shim, mounts, network namespace,
    # cgroups and veth must go with stop() as well as the node's own.
    core.create_namespaced_pod(NAMESPACE, _pod("sleeper", real_node.name, image,
                                               "import signal; signal.pause()"))
    wait_for(lambda: _phase(core, "sleeper", "Running"), 120, "pod sleeper Running",
             interval=0.5)
    before = real_node.footprint()
    print(f"footprint while running: {before}")
    kinds = set(before.processes.values())
    assert {"kubelet", "containerd", "registry"} <= kinds, before.processes
    assert any(k.startswith("shim of") for k in kinds), before.processes
    assert "in the node's cgroups" in kinds or any(k.startswith("init of") for k in kinds)
    assert before.netns, "the running pod's network namespace"
    assert any(m == str(real_node.kubelet_dir) for m in before.mounts), before.mounts
    assert any(m.endswith("/rootfs") for m in before.mounts), before.mounts
    assert any(c.endswith("/kubepods") for c in before.cgroups), before.cgroups
    assert real_node.bridge in before.links and len(before.links) >= 2, before.links
    assert any(f.startswith(str(kubelet.CONTAINER_LOG_LINKS)) for f in before.files)
    assert any(f.startswith(str(kubelet.CNI_CACHE)) for f in before.files)
    sysctls = dict(real_node._before["sysctls"])

    real_node.stop()

    after = real_node.footprint()
    assert after.empty(), after
    assert not [pid for pid in before.processes if kubelet._alive(pid)]
    assert not set(before.netns.values()) & kubelet.net_namespaces_in_use()
    assert not [m for m in kubelet.mount_points() if kubelet._under(m, real_node.root)]
    assert not [c for c in before.cgroups if Path(c).exists()]
    for mount in kubelet.cgroup_mounts():
        assert not (mount / real_node.cgroup_root.lstrip("/")).exists()
    for link in before.links:
        shown = subprocess.run(["ip", "link", "show", "dev", link], capture_output=True)
        assert shown.returncode != 0, f"{link} remains"
    assert {name: kubelet._read_sysctl(name) for name in sysctls} == sysctls
    assert not real_node._made_kubelet_chains()
