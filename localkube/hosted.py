"""What a third-party controller manager needs to run as a host process beside the real control
plane, shared by ``jobset`` and ``trainer`` (controller-runtime managers whose release manifests
run them in a Deployment with a webhook Service):

- ``install_crds``: apply CRD manifests and wait until each is Established;
- ``HostedController``: the controller's identity (the service account its release manifests
  give it, bound to ``cluster-admin`` here: their RBAC is not what the tests are about, and a
  token kubeconfig), a serving certificate for its webhook server from the test CA, the process
  itself with its log in the control plane's ``logs/``, its ``/readyz`` polled until ready, and
  its webhook configurations rewritten so every ``clientConfig`` is
  ``url: https://127.0.0.1:PORT/...`` with the test CA's bundle (as ``cluster.Webhook`` does for
  xmem's); ``stop()`` removes the webhook configurations before it stops the process, so no
  ``failurePolicy: Fail`` webhook is left pointing at nothing.
- ``json_patch``: the release's kustomize JSON6902 patches (``add``/``replace``/``remove``),
  applied to the webhook configurations the module ships, as ``kustomize build`` would.
"""

from __future__ import annotations

import base64
import copy
import os
import subprocess
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, TypeVar

import yaml

from localkube.cluster import Cluster
from localkube.controlplane import Exited, free_port, stop_process, wait_for

Self = TypeVar("Self", bound="HostedController")


def load_all(path: Path) -> List[Dict[str, Any]]:
    """Every non-empty YAML document of ``path``."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def install_crds(cluster: Cluster, paths: Iterable[Path]) -> List[str]:
    """Apply the CRDs in ``paths`` and wait until each is Established; returns their names."""
    crds = [doc for path in sorted(paths) for doc in load_all(path)]
    for crd in crds:
        cluster.apply(crd)
    for crd in crds:
        cluster.wait_established(crd["metadata"]["name"])
    return [crd["metadata"]["name"] for crd in crds]


def json_patch(doc: Dict[str, Any], operations: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
    """``doc`` with the JSON patch (RFC 6902) ``operations`` applied (``add``, ``replace`` and
    ``remove``: what kustomize patch files in these releases use)."""
    out = copy.deepcopy(doc)
    for op in operations:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent: Any = out
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        if op["op"] not in ("add", "replace", "remove"):
            raise ValueError(f"unsupported JSON patch operation {op['op']!r}")
        if isinstance(parent, list):
            index = len(parent) if last == "-" else int(last)
            if op["op"] == "add":
                parent.insert(index, copy.deepcopy(op["value"]))
            elif op["op"] == "replace":
                parent[index] = copy.deepcopy(op["value"])
            else:
                del parent[index]
        elif op["op"] == "remove":
            del parent[last]
        else:
            if op["op"] == "replace" and last not in parent:
                raise KeyError(f"JSON patch replaces {op['path']}, which is not there")
            parent[last] = copy.deepcopy(op["value"])
    return out


def ready(cluster: Cluster, name: str, process: subprocess.Popen, health_port: int) -> bool:
    """Whether the controller ``name`` answers 200 on ``/readyz`` at ``health_port``; raises
    ``Exited`` with its log's tail when the process is gone."""
    if process.poll() is not None:
        raise Exited(f"{name} exited with {process.returncode}: {cluster.log(name)[-3000:]}")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{health_port}/readyz",
                                    timeout=2) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


class HostedController:
    """One controller manager as a host process (see the module docstring). Subclasses set
    ``NAME`` (the log's name), ``NAMESPACE`` and ``ACCOUNT`` (the release's service account)
    and implement ``_start``."""

    NAME = ""
    NAMESPACE = ""
    ACCOUNT = ""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.root = cluster.root / self.NAME
        self.process: Optional[subprocess.Popen] = None
        self.webhook_port = 0
        self.health_port = 0
        self.webhooks: List[Dict[str, Any]] = []

    def start(self: Self, timeout: float = 120) -> Self:
        """Install and run the controller (``_start``); what was started is stopped again
        when a step fails."""
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        raise NotImplementedError

    @property
    def user(self) -> str:
        """The identity the controller's API calls carry."""
        return f"system:serviceaccount:{self.NAMESPACE}:{self.ACCOUNT}"

    @property
    def log_path(self) -> Path:
        return self.cluster.plane.logs / f"{self.NAME}.log"

    def identity(self) -> Path:
        """The release's service account, bound to ``cluster-admin``; its token kubeconfig."""
        self.cluster.ensure_namespace(self.NAMESPACE)
        self.cluster.apply({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": f"{self.NAME}-tests-cluster-admin"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": self.ACCOUNT,
                          "namespace": self.NAMESPACE}]})
        return Path(self.cluster.plane.service_account_kubeconfig(self.NAMESPACE, self.ACCOUNT))

    def serving_certificate(self, folder: Path) -> Path:
        """``folder``/tls.crt and tls.key (controller-runtime's default names): a serving
        certificate from the test CA for 127.0.0.1 and localhost."""
        folder.mkdir(parents=True, exist_ok=True)
        pair = self.cluster.plane._authority().issue(
            f"{self.NAME}-webhook", f"{self.NAME}-webhook-service", server=True,
            ips=["127.0.0.1"], dns=["localhost"])
        (folder / "tls.crt").write_bytes(Path(pair.cert).read_bytes())
        (folder / "tls.key").write_bytes(Path(pair.key).read_bytes())
        return folder

    def launch(self, argv: List[str], kubeconfig: Path, timeout: float,
               env: Optional[Dict[str, str]] = None) -> None:
        """Run ``argv`` (its API client configured by ``KUBECONFIG``, which controller-runtime
        reads when no ``--kubeconfig`` is given) and wait for its ``/readyz`` on
        ``health_port``: both managers report ready only once their webhook server listens."""
        log = open(self.log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            self.process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(os.environ, KUBECONFIG=str(kubeconfig), **(env or {})))
        finally:
            log.close()
        wait_for(self._ready, timeout, f"{self.NAME} to be ready (log: {self.log_path})",
                 interval=0.5)

    def ports(self) -> None:
        self.webhook_port, self.health_port = free_port(), free_port()

    def _ready(self) -> bool:
        assert self.process is not None
        return ready(self.cluster, self.NAME, self.process, self.health_port)

    def manager_settings(self) -> Dict[str, Any]:
        """What both managers' Configuration files say alike, for a host process: metrics off
        (``bindAddress: "0"``, controller-runtime's "no server"), health on the loopback port,
        no leader election (one replica)."""
        return {"metrics": {"bindAddress": "0"},
                "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
                "leaderElection": {"leaderElect": False}}

    def release_webhooks(self, manifest: Path, patches: Mapping[str, Path]) -> List[Dict[str, Any]]:
        """The webhook configurations of ``manifest`` with the release's kustomize patch for
        each kind (``patches``: kind to patch file) applied, pointed at this process."""
        docs = [json_patch(doc, yaml.safe_load(patches[doc["kind"]].read_text()))
                for doc in load_all(manifest)]
        return self.point_webhooks(docs)

    def point_webhooks(self, docs: Iterable[Dict[str, Any]],
                       keep: Callable[[str], bool] = lambda path: True) -> List[Dict[str, Any]]:
        """``docs`` (webhook configurations) with each kept webhook's ``clientConfig`` turned
        into the host process's URL and the test CA's bundle; webhooks whose path ``keep``
        refuses are dropped."""
        ca = base64.b64encode(self.cluster.plane._authority().pem).decode()
        out = []
        for doc in docs:
            doc = copy.deepcopy(doc)
            kept = []
            for webhook in doc["webhooks"]:
                path = webhook["clientConfig"]["service"]["path"]
                if not keep(path):
                    continue
                webhook["clientConfig"] = {"url": f"https://127.0.0.1:{self.webhook_port}{path}",
                                           "caBundle": ca}
                kept.append(webhook)
            doc["webhooks"] = kept
            out.append(doc)
        return out

    def apply_webhooks(self, docs: List[Dict[str, Any]]) -> None:
        self.webhooks = docs
        for doc in docs:
            self.cluster.apply(doc)

    def stop(self) -> None:
        for doc in self.webhooks:
            self.cluster.delete(doc["apiVersion"], doc["kind"], doc["metadata"]["name"])
        self.webhooks = []
        if self.process is not None:
            stop_process(self.process, grace=10)
            self.process = None
