"""xmem installed on a cluster the way the chart installs it, for end-to-end and security tests.

The objects come from the chart rendered with its defaults (``deploy/xmem-admission-self-signed
.yaml``): its ClusterRoles, Roles and bindings (so ``xmem serve`` and ``xmem controller`` run
with exactly the chart's permissions, as its ServiceAccounts), its webhook configurations (the
Service reference becomes a loopback URL; the CEL ``matchConditions``, which the stand-in does
not evaluate, are dropped) and its policy. ``xmem serve`` and ``xmem controller`` run as their
own processes with kubeconfigs holding their ServiceAccounts' tokens.

The cluster is anything with the stand-in's interface (``tests.fakekube.apiserver.ApiServer``):
``create``, ``add_user``, ``kubeconfig``, ``api_client``; a real control plane with the same
small interface can take its place.
"""

from __future__ import annotations

import base64
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

import yaml

from tests.fakekube.apiserver import wait_for
from tests.fakekube.rbac import User, service_account
from tests.support.harness import Certificates

REPO = Path(__file__).resolve().parents[2]
MANIFESTS = REPO / "deploy/xmem-admission-self-signed.yaml"
NAMESPACE = "xmem-system"
RELEASE_NAME = "xmem-xmem-admission"
WEBHOOK_SA = f"{RELEASE_NAME}-webhook"
CONTROLLER_SA = f"{RELEASE_NAME}-controller"
LEASE = f"{RELEASE_NAME}-controller"
RBAC_KINDS = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def manifests(kinds: Iterable[str]) -> List[Dict[str, Any]]:
    """The chart's rendered objects of the given kinds."""
    wanted = set(kinds)
    return [d for d in yaml.safe_load_all(MANIFESTS.read_text()) if d and d["kind"] in wanted]


def webhook_configurations(port: int, ca: bytes) -> List[Dict[str, Any]]:
    """The chart's two webhook configurations, calling ``xmem serve`` on loopback."""
    out = []
    for doc in manifests(("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")):
        for webhook in doc["webhooks"]:
            path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}",
                                       "caBundle": base64.b64encode(ca).decode()}
            webhook.pop("matchConditions", None)
        out.append(doc)
    return out


class Installed:
    """xmem's RBAC, webhook and controller on a cluster, run as the chart's ServiceAccounts."""

    def __init__(self, server: Any, root: Path) -> None:
        self.server = server
        self.root = root
        self.processes: List[subprocess.Popen] = []
        if not _exists(server, "Namespace", NAMESPACE):
            server.create({"apiVersion": "v1", "kind": "Namespace",
                           "metadata": {"name": NAMESPACE}})
        for obj in manifests(RBAC_KINDS):
            server.create(obj)
        self.webhook_user = service_account(NAMESPACE, WEBHOOK_SA)
        self.controller_user = service_account(NAMESPACE, CONTROLLER_SA)

    def kubeconfig(self, user: User, name: str) -> str:
        """A kubeconfig file holding a token for ``user``."""
        return self.server.kubeconfig(str(self.root / f"{name}.kubeconfig"),
                                      token=self.server.add_user(user))

    def _spawn(self, argv: List[str], name: str) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - owned by the child
        process = subprocess.Popen([sys.executable, "-m", "xmem_admission.cli", *argv],
                                   stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.processes.append(process)
        return process

    def log_of(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def serve(self, certs: Certificates, *extra: str, policy_file: Optional[str] = None,
              name: str = "serve") -> int:
        """``xmem serve`` as the webhook's ServiceAccount (the cluster's policy and estimates
        unless ``policy_file``), trusting the controller's ServiceAccount; the webhook
        configurations then point at it. Returns its admission port."""
        source = ["--policy", policy_file] if policy_file else \
            ["--kubeconfig", self.kubeconfig(self.webhook_user, "webhook")]
        self._spawn(["serve", "--cert-file", str(certs.cert_file), "--key-file",
                     str(certs.key_file), "--host", "127.0.0.1", "--port", "0",
                     "--metrics-port", "0", "--log-level", "warning",
                     "--controller-user", self.controller_user.username, *source, *extra], name)
        port = int(wait_for(lambda: (lambda m: m.group(1) if m else None)(re.search(
            r"admission on https://127\.0\.0\.1:(\d+)", self.log_of(name))), 30,
            "xmem serve to listen"))
        for configuration in webhook_configurations(port, certs.ca_file.read_bytes()):
            self.server.create(configuration)
        return port

    def controller(self, probe_image: str, *extra: str, name: str = "controller") -> None:
        """``xmem controller`` as the controller's ServiceAccount, leading through the Lease
        the chart's Role allows."""
        self._spawn(["controller", "--kubeconfig", self.kubeconfig(self.controller_user, name),
                     "--probe-image", probe_image, "--metrics-port", "0", "--host", "127.0.0.1",
                     "--identity", name, "--lease-name", LEASE, "--lease-namespace", NAMESPACE,
                     "--resync-seconds", "0.5", *extra], name)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)


def _exists(server: Any, kind: str, name: str) -> bool:
    try:
        server.get("v1", kind, name)
    except Exception as exc:  # the stand-in's 404
        if getattr(exc, "code", None) == 404:
            return False
        raise
    return True
