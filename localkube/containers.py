"""How a process node turns a container spec into a local process, and watches it.

Used by the project's process node (``localkube.node``).

A container here is a process group on the host, started with the environment Kubernetes would
give it (the image's env, then ``envFrom``, then ``env`` with ``$(VAR)`` expansion and
``valueFrom`` references resolved, plus ``HOSTNAME``), the command it would run (``command`` or
the image's entrypoint, ``args`` or the image's cmd, with ``$(VAR)`` expansion), and its volumes.

There is no mount namespace, so paths are translated instead: every volume's ``mountPath`` and
the container's ``terminationMessagePath`` map to directories and files under the pod's
directory, and occurrences of those paths in the command, the arguments, env values and the
working directory are rewritten (at path boundaries). A program that builds such a path from
pieces at run time would escape the translation; none of the project's do.

Supervision is what a container runtime and the kernel's cgroup would do: the resident memory of
the whole process group is sampled and the group is SIGKILLed when it exceeds the memory limit
(reported as ``OOMKilled``, exit code 137). CPU limits are not enforced.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

PAGE = os.sysconf("SC_PAGE_SIZE")
_VAR = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


class ConfigError(Exception):
    """A container cannot be created (reported as CreateContainerConfigError)."""


class StartFailure(Exception):
    """A container was created but its process could not start (its command is not in the
    image): the kubelet reports it terminated, reason ``StartError``, exit code 128, with the
    runtime's error as its message (seen on kubelet 1.36 with containerd 2.4 and runc)."""


@dataclass(frozen=True)
class Image:
    """What the process node knows of an image: ENTRYPOINT, CMD, ENV and WORKDIR."""

    entrypoint: Tuple[str, ...] = ()
    cmd: Tuple[str, ...] = ()
    env: Tuple[Tuple[str, str], ...] = ()
    working_dir: str = ""


def expand(text: str, env: Dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined names expand, ``$$`` escapes, others stay."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _VAR.sub(sub, text)


def field_ref(pod: Dict[str, Any], path: str) -> str:
    m = pod.get("metadata") or {}
    simple = {
        "metadata.name": m.get("name"), "metadata.namespace": m.get("namespace"),
        "metadata.uid": m.get("uid"), "spec.nodeName": pod["spec"].get("nodeName"),
        "spec.serviceAccountName": pod["spec"].get("serviceAccountName"),
        "status.hostIP": "127.0.0.1", "status.podIP": "127.0.0.1",
    }
    if path in simple:
        return str(simple[path] or "")
    match = re.match(r"^metadata\.(labels|annotations)\['(.+)'\]$", path)
    if match:
        return str((m.get(match.group(1)) or {}).get(match.group(2), ""))
    raise ConfigError(f"unsupported fieldRef {path!r}")


def resolve_env(pod: Dict[str, Any], container: Dict[str, Any], image: Image,
                lookup: Callable[[str, str, str], Optional[Dict[str, str]]]) -> Dict[str, str]:
    """The container's environment; ``lookup(kind, namespace, name)`` reads config maps/secrets."""
    namespace = pod["metadata"].get("namespace", "default")
    out: Dict[str, str] = dict(image.env)
    out["HOSTNAME"] = pod["metadata"]["name"]
    declared: Dict[str, str] = {}
    for source in container.get("envFrom") or []:
        kind = "ConfigMap" if "configMapRef" in source else "Secret"
        ref = source.get("configMapRef") or source.get("secretRef") or {}
        data = lookup(kind, namespace, ref.get("name", ""))
        if data is None:
            if ref.get("optional"):
                continue
            raise ConfigError(f'{kind.lower()} "{ref.get("name")}" not found')
        for key, value in data.items():
            declared[source.get("prefix", "") + key] = value
    for item in container.get("env") or []:
        name = item["name"]
        if "valueFrom" not in item:
            declared[name] = expand(str(item.get("value", "")), declared)
            continue
        source = item["valueFrom"]
        if "fieldRef" in source:
            declared[name] = field_ref(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            resource = source["resourceFieldRef"]["resource"]
            kind, _, key = resource.partition(".")
            value = ((container.get("resources") or {}).get(kind) or {}).get(key, "")
            declared[name] = str(value)
        else:
            kind = "ConfigMap" if "configMapKeyRef" in source else "Secret"
            ref = source.get("configMapKeyRef") or source.get("secretKeyRef") or {}
            data = lookup(kind, namespace, ref.get("name", ""))
            if data is None or ref.get("key") not in data:
                if ref.get("optional"):
                    continue
                raise ConfigError(f'couldn\'t find key {ref.get("key")} in {kind} '
                                  f'{namespace}/{ref.get("name")}')
            declared[name] = data[ref["key"]]
    out.update(declared)
    return out


@dataclass
class PathMap:
    """Container paths (mount points, termination message file) to host paths."""

    pairs: List[Tuple[str, str]] = field(default_factory=list)

    def add(self, inside: str, outside: str) -> None:
        self.pairs.append((inside.rstrip("/") or "/", outside))
        self.pairs.sort(key=lambda p: -len(p[0]))

    def translate(self, text: str) -> str:
        for inside, outside in self.pairs:
            pattern = r"(?<![\w.\-/])" + re.escape(inside) + r"(?=/|$|[:\s\"';,)])"
            text = re.sub(pattern, lambda _m, o=outside: o, text)
        return text


def command_line(container: Dict[str, Any], image: Image, env: Dict[str, str]) -> List[str]:
    """``command``/``args`` over the image's ENTRYPOINT/CMD, as the runtime combines them."""
    command = container.get("command")
    args = container.get("args")
    if command:
        argv = list(command) + list(args or [])
    else:
        argv = list(image.entrypoint) + list(args if args is not None else image.cmd)
    if not argv:
        raise ConfigError("no command specified")
    return [expand(a, env) for a in argv]


def which(program: str, env: Dict[str, str]) -> Optional[str]:
    if "/" in program:
        return program if os.access(program, os.X_OK) else None
    return shutil.which(program, path=env.get("PATH", ""))


def group_rss(session: int) -> int:
    """Resident bytes of every process in a session (the container's process group)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                stat = handle.read()
            fields = stat[stat.rindex(b")") + 2:].split()
            if int(fields[3]) != session:  # field 6: session id
                continue
            with open(f"/proc/{entry}/statm", "rb") as handle:
                total += int(handle.read().split()[1]) * PAGE
        except (OSError, ValueError, IndexError):
            continue
    return total


@dataclass
class Process:
    """One running container."""

    name: str
    popen: subprocess.Popen
    log_path: str
    memory_limit: Optional[int]
    started_at: str
    oom_killed: bool = False
    killed: bool = False

    def poll(self) -> Optional[int]:
        code = self.popen.poll()
        if code is None and self.memory_limit and group_rss(self.popen.pid) > self.memory_limit:
            self.oom_killed = True
            self.signal(signal.SIGKILL)
            code = self.popen.wait()
        return code

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace: float) -> int:
        """SIGTERM the group, SIGKILL it after ``grace`` seconds."""
        self.killed = True
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                break
            time.sleep(0.05)
        self.signal(signal.SIGKILL)
        return self.popen.wait()


def start(name: str, argv: List[str], env: Dict[str, str], cwd: str, log_path: str,
          memory_limit: Optional[int], started_at: str) -> Process:
    program = which(argv[0], env)
    if program is None:
        raise StartFailure(
            "failed to create containerd task: failed to create shim task: OCI runtime create "
            "failed: runc create failed: unable to start container process: exec: "
            f'"{argv[0]}": executable file not found in $PATH: unknown')
    os.makedirs(cwd, exist_ok=True)
    log = open(log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
    try:
        popen = subprocess.Popen([program] + argv[1:], env=env, cwd=cwd, stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
    finally:
        log.close()
    return Process(name, popen, log_path, memory_limit, started_at)


def tail(path: str, lines: Optional[int], limit_bytes: Optional[int]) -> bytes:
    """The end of a log file, as ``tailLines`` and ``limitBytes`` cut it."""
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except OSError:
        return b""
    if lines is not None:
        parts = data.splitlines(keepends=True)
        data = b"".join(parts[-lines:]) if lines > 0 else b""
    if limit_bytes is not None:
        data = data[:limit_bytes]
    return data
