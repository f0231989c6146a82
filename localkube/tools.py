"""Where ``make tools`` put the control plane: the cache entry keyed by the pinned versions."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parents[1]
VERSIONS_FILE = ROOT / "scripts" / "kube-versions.env"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


class ToolsMissing(RuntimeError):
    """The control plane is not built: ``make tools`` builds it."""


def versions() -> Dict[str, str]:
    """scripts/kube-versions.env as a dict."""
    return read_env(VERSIONS_FILE)


def read_env(path: Path) -> Dict[str, str]:
    """A versions file as a dict (KEY=VALUE lines, comments ignored)."""
    out: Dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def cache_key() -> str:
    """The same key scripts/build-kube.sh builds into."""
    v = versions()
    return (f"k8s-{v['KUBERNETES_VERSION']}_etcd-{v['ETCD_VERSION']}_kwok-{v['KWOK_VERSION']}"
            f"_to-{v['TRAINING_OPERATOR_VERSION']}_po-{v['PROMETHEUS_OPERATOR_VERSION']}"
            f"_cm-{v['CERT_MANAGER_VERSION']}_r{v['KUBE_BUILD_RECIPE']}")


def cache_entry(variable: str, folder: str, key: str, what: str, build: str,
                missing: type = ToolsMissing) -> Path:
    """A build script's finished cache entry (``$variable``, else ~/.cache/xmem-admission/
    ``folder``, then ``key``); raises ``missing`` naming ``what`` and the ``build`` command."""
    cache = os.environ.get(variable) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "xmem-admission",
        folder)
    entry = Path(cache) / key
    if not (entry / ".complete").is_file():
        raise missing(f"{what} is not built ({entry} is missing): run {build}")
    return entry


def executable(entry: Path, name: str, build: str, missing: type = ToolsMissing) -> str:
    """``entry``/bin/``name``, or ``missing`` naming the ``build`` command."""
    path = entry / "bin" / name
    if not os.access(path, os.X_OK):
        raise missing(f"{path} is missing: run {build}")
    return str(path)


_BUILD = "`make tools` (scripts/build-kube.sh)"


def home() -> Path:
    """The built cache entry; raises ``ToolsMissing`` naming the command that builds it."""
    return cache_entry("XMEM_KUBE_CACHE", "kube", cache_key(),
                       "the Kubernetes control plane", _BUILD)


def binary(name: str) -> str:
    return executable(home(), name, _BUILD)


def kwok_stages() -> Path:
    return home() / "kwok-stages"


def crd(name: str) -> Path:
    """A third-party CRD manifest copied from its project's Go module by the build."""
    return home() / "crds" / name
