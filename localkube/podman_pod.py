"""A pod's containers run from their images under podman (runc), the way a kubelet starts them.

Used by the image tests (``tests/images``) to run an estimation pod built by the controller's own
``podspec.build``: the init container from the project's image, the training container from a
training image. It is not a node (no API server, no status, no restarts): it takes a Pod
manifest and the ConfigMaps it refers to, and gives each container's exit code, logs and
termination message.

What the kubelet does that is done here too:

- init containers one after another, each to completion and stopping the pod when one fails,
  then the pod's containers (one after another: an estimation pod has one);
- ``command``/``args`` over the image's ENTRYPOINT/CMD (``command`` replaces both; ``args``
  alone replaces CMD), ``$(VAR)`` expanded; the image's ENV under the container's ``env`` and
  ``envFrom`` (resolved as ``localkube.containers.resolve_env`` does for the process node);
- volumes: ``emptyDir`` as a fresh directory of mode 0777 (the kubelet's empty_dir.go), a
  ConfigMap's keys as files of mode 0644 (``defaultMode``); ``readOnly`` mounts read-only;
- the security context: user and group (the container's over the pod's), ``fsGroup`` and
  ``supplementalGroups`` as supplementary groups, dropped capabilities, no privilege escalation
  (``no_new_privs``), a read-only root file system without the tmpfs podman would otherwise put
  on /tmp, /var/tmp and /run (the kubelet adds none), ``RuntimeDefault`` seccomp as the runtime's
  default profile;
- CPU and memory limits as the container's cgroup limits;
- ``terminationMessagePath``: a file made writable for any user (0666, as the kubelet's
  kuberuntime_container.go makes it) bind-mounted into the container; with
  ``FallbackToLogsOnError`` and an empty file after a failure, the last 80 lines of the logs, at
  most 2048 bytes (the kubelet's MaxContainerTerminationMessageLogLines and ...LogLength), and
  at most 4096 bytes of a message (MaxContainerTerminationMessageLength);
- ``activeDeadlineSeconds``: the pod's containers are stopped once it has passed.

No network: containers run with ``--network none`` (estimation pods need none, and nothing
leaves the host). Volume sources other than ``emptyDir`` and ``configMap``, and ``subPath``,
are refused with a ``ConfigError``.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from localkube.containers import ConfigError, Image, expand, resolve_env
from xmem_admission.cluster.kube import quantity

PODMAN = ["podman", "--runtime", "runc"]  # crun refuses cgroup v1 hosts (scripts/image-common.sh)
# podman's default open-file and process limits fail here ("setrlimit: operation not permitted").
ULIMITS = ["--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024"]
LOG_LINES = 80  # kubelet: MaxContainerTerminationMessageLogLines
LOG_BYTES = 2048  # kubelet: MaxContainerTerminationMessageLogLength
MESSAGE_BYTES = 4096  # kubelet: MaxContainerTerminationMessageLength


@dataclass
class ContainerRun:
    """What became of one container."""

    name: str
    exit_code: int
    logs: str
    message: str  # the termination message the kubelet would put into the pod's status
    deadline_exceeded: bool = False


def podman(*args: str, timeout: float = 600,
           check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(PODMAN + list(args), capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"podman {' '.join(args[:3])}... failed: {result.stderr.strip()}")
    return result


def _volumes(pod: Mapping[str, Any], workdir: Path,
             config_maps: Mapping[str, Mapping[str, str]]) -> Dict[str, Path]:
    out: Dict[str, Path] = {}
    for volume in pod["spec"].get("volumes") or []:
        path = workdir / "volumes" / volume["name"]
        path.mkdir(parents=True)
        if "emptyDir" in volume:
            path.chmod(0o777)
        elif "configMap" in volume:
            source = volume["configMap"]
            data = config_maps.get(source["name"])
            if data is None:
                raise ConfigError(f'configmap "{source["name"]}" not found')
            mode = int(source.get("defaultMode", 0o644))
            path.chmod(0o755)
            for key, value in data.items():
                (path / key).write_text(value)
                (path / key).chmod(mode)
        else:
            raise ConfigError(f"volume {volume['name']!r}: only emptyDir and configMap here")
        out[volume["name"]] = path
    return out


def _security(pod: Mapping[str, Any], container: Mapping[str, Any]) -> List[str]:
    pod_context = pod["spec"].get("securityContext") or {}
    context = container.get("securityContext") or {}
    args: List[str] = []
    user = context.get("runAsUser", pod_context.get("runAsUser"))
    group = context.get("runAsGroup", pod_context.get("runAsGroup"))
    if user is not None:
        args += ["--user", f"{user}:{group}" if group is not None else str(user)]
    groups = list(pod_context.get("supplementalGroups") or [])
    if pod_context.get("fsGroup") is not None:
        groups.append(pod_context["fsGroup"])
    for extra in groups:
        args += ["--group-add", str(extra)]
    for cap in (context.get("capabilities") or {}).get("drop") or []:
        args += ["--cap-drop", cap]
    for cap in (context.get("capabilities") or {}).get("add") or []:
        args += ["--cap-add", cap]
    if context.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    if context.get("readOnlyRootFilesystem"):
        args += ["--read-only", "--read-only-tmpfs=false"]
    seccomp = context.get("seccompProfile") or pod_context.get("seccompProfile") or {}
    if seccomp.get("type") not in (None, "RuntimeDefault"):
        raise ConfigError(f"seccomp profile {seccomp.get('type')!r}: only RuntimeDefault here")
    return args


def _limits(container: Mapping[str, Any]) -> List[str]:
    limits = (container.get("resources") or {}).get("limits") or {}
    args: List[str] = []
    if "memory" in limits:
        args += ["--memory", str(quantity.parse_bytes(limits["memory"]))]
    if "cpu" in limits:
        args += ["--cpus", str(float(quantity.parse(limits["cpu"])))]
    return args


def _message(container: Mapping[str, Any], path: Path, exit_code: int, logs: str) -> str:
    message = path.read_bytes()[:MESSAGE_BYTES].decode("utf-8", "replace")
    if (not message.strip() and exit_code != 0
            and container.get("terminationMessagePolicy") == "FallbackToLogsOnError"):
        tail = "\n".join(logs.splitlines()[-LOG_LINES:])
        message = tail.encode("utf-8")[-LOG_BYTES:].decode("utf-8", "ignore")
    return message


def _run_container(pod: Mapping[str, Any], container: Mapping[str, Any],
                   volumes: Mapping[str, Path], workdir: Path, env: Dict[str, str],
                   timeout: float) -> ContainerRun:
    name = f"xmem-{pod['metadata']['name']}-{container['name']}-{uuid.uuid4().hex[:8]}"
    message_path = workdir / "termination" / container["name"]
    message_path.parent.mkdir(parents=True, exist_ok=True)
    message_path.touch()
    message_path.chmod(0o666)
    args = ["run", "--name", name, "--network", "none", "--hostname",
            pod["metadata"]["name"], *ULIMITS, *_security(pod, container), *_limits(container)]
    for mount in container.get("volumeMounts") or []:
        if mount.get("subPath"):
            raise ConfigError(f"volume mount {mount['name']!r}: subPath is not supported here")
        if mount["name"] not in volumes:
            raise ConfigError(f'volume mount "{mount["name"]}" refers to no volume')
        suffix = ":ro" if mount.get("readOnly") else ""
        args += ["-v", f"{volumes[mount['name']]}:{mount['mountPath']}{suffix}"]
    args += ["-v", f"{message_path}:{container.get('terminationMessagePath', '/dev/termination-log')}"]
    for key, value in env.items():
        args += ["--env", f"{key}={value}"]
    if container.get("workingDir"):
        args += ["--workdir", container["workingDir"]]
    command = [expand(a, env) for a in container.get("command") or []]
    rest = [expand(a, env) for a in container.get("args") or []]
    if command:
        args += ["--entrypoint", json.dumps(command)]
    args.append(container["image"])
    args += rest
    try:
        result = subprocess.run(PODMAN + args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, timeout=max(timeout, 1))
        exit_code, logs, exceeded = result.returncode, result.stdout, False
    except subprocess.TimeoutExpired as expired:
        podman("rm", "--force", "--time", "0", name, check=False)
        out = expired.stdout
        logs = out.decode("utf-8", "replace") if isinstance(out, bytes) else (out or "")
        exit_code, exceeded = 137, True
    podman("rm", "--force", "--ignore", name, check=False)
    return ContainerRun(container["name"], exit_code, logs,
                        _message(container, message_path, exit_code, logs), exceeded)


def run_pod(pod: Mapping[str, Any], workdir: Path,
            config_maps: Optional[Mapping[str, Mapping[str, str]]] = None) -> List[ContainerRun]:
    """Run the pod's init containers, then its containers; stop at the first failure."""
    maps = config_maps or {}
    volumes = _volumes(pod, workdir, maps)
    namespace = pod["metadata"].get("namespace", "default")

    def lookup(kind: str, ns: str, name: str) -> Optional[Dict[str, str]]:
        return dict(maps[name]) if kind == "ConfigMap" and ns == namespace and name in maps \
            else None

    deadline = time.monotonic() + float(pod["spec"].get("activeDeadlineSeconds") or 3600)
    runs: List[ContainerRun] = []
    for container in list(pod["spec"].get("initContainers") or []) + \
            list(pod["spec"]["containers"]):
        env = resolve_env(dict(pod), dict(container), Image(), lookup)
        run = _run_container(pod, container, volumes, workdir, env, deadline - time.monotonic())
        runs.append(run)
        if run.exit_code != 0:
            break
    return runs


def image_size(reference: str) -> int:
    """The image's size in bytes, as podman reports it."""
    return int(podman("image", "inspect", "--format", "{{.Size}}", reference).stdout.strip())


def podman_ready() -> Optional[str]:
    """Why podman cannot run containers here, or None when it can."""
    if not any((Path(p) / "podman").is_file() for p in os.environ.get("PATH", "").split(":")):
        return "podman is not installed (scripts/install-image-tools.sh)"
    return None
