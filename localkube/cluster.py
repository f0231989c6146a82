"""The real control plane with this project installed the way the chart installs it.

``Cluster(root).start()``: the control plane (``controlplane``), kwok for fake GPU nodes, the
project's process node for pods that must really run (estimation pods), then the chart as
``helm template`` renders it: its CRDs (plus Kubeflow's PyTorchJob CRD from the training
operator's module, and JobSet's and Trainer's CRDs from their build), its ServiceAccounts and RBAC, created as the objects they are. The webhook
and the controller then run here as ``xmem serve`` / ``xmem controller`` processes
(``serve()``/``controller()``), each with its own service account's token, so every call they
make goes through RBAC; the webhook configurations are the chart's, with ``clientConfig.url``
pointing at the loopback server and ``caBundle`` filled.

Shared by the e2e tests (one cluster per session) and the playground.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Protocol, Sequence

import yaml

from localkube import tools, training_stack
from localkube.controlplane import ControlPlane, stop_process, wait_for
from localkube.kwok import TEST_STAGES, Kwok
from localkube.node import ProcessNode

ROOT = tools.ROOT
CHART = ROOT / "helm" / "xmem-admission"
RELEASE = "xmem"
NAMESPACE = "xmem-system"
WEBHOOK_SA = f"{RELEASE}-xmem-admission-webhook"
CONTROLLER_SA = f"{RELEASE}-xmem-admission-controller"
LEASE = f"{RELEASE}-xmem-admission-controller"
PROBE_IMAGE = "registry.example/xmem-admission:test"
CHART_KINDS = ("CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
               "Role", "RoleBinding")


def helm() -> str:
    path = Path(os.environ.get("XMEM_TOOLS_DIR", ROOT / ".tools")) / "bin" / "helm"
    if not os.access(path, os.X_OK):
        raise tools.ToolsMissing(f"{path} is missing: run `make tools`")
    return str(path)


def render_chart(values: Optional[Dict[str, Any]] = None,
                 namespace: str = NAMESPACE) -> List[Dict[str, Any]]:
    """``helm template`` of the chart (CRDs included), as objects."""
    argv = [helm(), "template", RELEASE, str(CHART), "--namespace", namespace, "--include-crds",
            "--values", "-"]
    values = dict(values or {})  # the chart requires an image; nothing here pulls it
    values["image"] = {"repository": PROBE_IMAGE.rsplit(":", 1)[0], **(values.get("image") or {})}
    out = subprocess.run(argv, input=yaml.safe_dump(values), capture_output=True,
                         text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def training_stack_crds() -> List[Dict[str, Any]]:
    """JobSet's and Kubeflow Trainer's CRDs from their build (``localkube.training_stack``):
    the controller watches JobSets and TrainJobs by default, so a cluster the tests share serves
    them whether or not the test starts those controllers (``localkube.trainer``)."""
    entry = training_stack.home()
    paths = sorted((entry / "jobset" / "crds").glob("*.yaml")) + \
        sorted((entry / "trainer" / "crds").glob("*.yaml"))
    return [d for path in paths for d in yaml.safe_load_all(path.read_text()) if d]


class Node(Protocol):
    """Where the cluster's CPU pods run: the process node, or a real kubelet (``RealNode``)."""

    name: str

    def stop(self) -> None: ...


def plural(obj: Dict[str, Any]) -> str:
    return {"CustomResourceDefinition": "customresourcedefinitions"}.get(obj["kind"], "")


class Cluster:
    """See the module docstring."""

    def __init__(self, root: Path, kwok_stages: Iterable[str] = TEST_STAGES,
                 start_node: Optional[Callable[[ControlPlane], Node]] = None,
                 probe_image: str = PROBE_IMAGE) -> None:
        """``start_node`` starts the node for the cluster's CPU pods once the control plane
        runs (default: the process node); ``probe_image`` is the controller's
        ``--probe-image`` (the process node runs no image, so any reference does there)."""
        self.root = Path(root)
        self.plane = ControlPlane(self.root)
        self.kwok = Kwok(self.plane, kwok_stages)
        self.node: Optional[Node] = None
        self.start_node = start_node or self._process_node
        self.probe_image = probe_image
        self.processes: List[subprocess.Popen] = []
        self._dynamic: Any = None

    # --- lifecycle --------------------------------------------------------------------------

    def start(self) -> Cluster:
        self.plane.start()
        self.api = self.plane.api_client()
        self.kwok.start()
        self.node = self.start_node(self.plane)
        objects = [o for o in render_chart() if o["kind"] in CHART_KINDS
                   and not (o["metadata"].get("annotations") or {}).get("helm.sh/hook")]
        objects.append(yaml.safe_load(tools.crd("kubeflow.org_pytorchjobs.yaml").read_text()))
        objects.extend(training_stack_crds())
        self.ensure_namespace(NAMESPACE)
        for obj in objects:
            self.apply(obj)
        for obj in objects:
            if obj["kind"] == "CustomResourceDefinition":
                self.wait_established(obj["metadata"]["name"])
        self.webhook_kubeconfig = self.plane.service_account_kubeconfig(NAMESPACE, WEBHOOK_SA)
        self.controller_kubeconfig = self.plane.service_account_kubeconfig(NAMESPACE,
                                                                           CONTROLLER_SA)
        return self

    @staticmethod
    def _process_node(plane: ControlPlane) -> ProcessNode:
        return ProcessNode(plane, path_prefix=[os.path.dirname(sys.executable)]).start()

    def stop(self) -> None:
        for process in self.processes:
            stop_process(process, grace=5)
        self.processes.clear()
        self.kwok.stop()
        if self.node is not None:
            self.node.stop()
        if getattr(self, "api", None) is not None:
            self.api.close()
        self.plane.stop()

    # --- objects ----------------------------------------------------------------------------

    def dynamic(self) -> Any:
        from kubernetes import dynamic

        if self._dynamic is None:
            self._dynamic = dynamic.DynamicClient(self.api)
        return self._dynamic

    def resource(self, api_version: str, kind: str) -> Any:
        return self.dynamic().resources.get(api_version=api_version, kind=kind)

    def apply(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        """Server-side apply (field manager ``xmem-tests``), retried while a new CRD settles:
        a CRD reports Established a moment before its first object can be created."""
        from kubernetes.client import ApiException
        from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

        def attempt() -> Dict[str, Any]:
            resource = self.resource(obj["apiVersion"], obj["kind"])
            namespace = obj["metadata"].get("namespace") if resource.namespaced else None
            return dict(resource.server_side_apply(
                body=obj, name=obj["metadata"]["name"], namespace=namespace,
                field_manager="xmem-tests", force_conflicts=True).to_dict())

        deadline = time.monotonic() + 30
        while True:
            try:
                return attempt()
            except (ResourceNotFoundError, NotFoundError):
                if time.monotonic() > deadline:
                    raise
                self.invalidate_discovery()
                time.sleep(0.3)
            except ApiException as exc:
                if exc.status != 404 or time.monotonic() > deadline:
                    raise
                time.sleep(0.3)

    def invalidate_discovery(self) -> None:
        # The dynamic client caches discovery: a fresh one sees new CRDs at once.
        if self._dynamic is not None:
            self._dynamic.resources.invalidate_cache()
        self._dynamic = None

    def wait_established(self, name: str, timeout: float = 30) -> None:
        from kubernetes import client

        api = client.ApiextensionsV1Api(self.api)

        def established() -> bool:
            crd = api.read_custom_resource_definition(name)
            return any(c.type == "Established" and c.status == "True"
                       for c in (crd.status.conditions or []))

        wait_for(established, timeout, f"CRD {name} to be Established")
        self.invalidate_discovery()

    def ensure_namespace(self, name: str, labels: Optional[Dict[str, str]] = None) -> None:
        self.apply({"apiVersion": "v1", "kind": "Namespace",
                    "metadata": {"name": name, "labels": labels or {}}})

    def get(self, api_version: str, kind: str, name: str,
            namespace: Optional[str] = None) -> Optional[Dict[str, Any]]:
        from kubernetes.dynamic.exceptions import NotFoundError

        try:
            return dict(self.resource(api_version, kind).get(name=name,
                                                             namespace=namespace).to_dict())
        except NotFoundError:
            return None

    def list(self, api_version: str, kind: str, namespace: Optional[str] = None,
             label_selector: str = "") -> List[Dict[str, Any]]:
        answer = self.resource(api_version, kind).get(namespace=namespace,
                                                      label_selector=label_selector)
        return [dict(i) for i in answer.to_dict()["items"]]

    def delete(self, api_version: str, kind: str, name: str,
               namespace: Optional[str] = None) -> None:
        from kubernetes.dynamic.exceptions import NotFoundError

        try:
            self.resource(api_version, kind).delete(name=name, namespace=namespace,
                                                    propagation_policy="Background")
        except NotFoundError:
            pass

    # --- the project's processes ------------------------------------------------------------

    def _spawn(self, name: str, argv: List[str]) -> subprocess.Popen:
        log_path = self.plane.logs / f"{name}.log"
        log = open(log_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL,
                                       env=dict(os.environ, PYTHONUNBUFFERED="1"))
        finally:
            log.close()
        self.processes.append(process)
        return process

    def log(self, name: str) -> str:
        path = self.plane.logs / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def serve(self, name: str, policy_name: str, values: Optional[Dict[str, Any]] = None,
              extra: Sequence[str] = ()) -> Webhook:
        """``xmem serve`` with the webhook's service account, its certificate from the cluster
        CA, and the chart's webhook configurations pointing at it."""
        ca = self.plane._authority()
        pair = ca.issue(f"webhook-{name}", "xmem-admission-webhook", server=True,
                        ips=["127.0.0.1"], dns=["localhost"])
        (self.plane.logs / f"{name}.log").unlink(missing_ok=True)
        process = self._spawn(name, [
            sys.executable, "-m", "xmem_admission.cli", "serve", "--cert-file", str(pair.cert),
            "--key-file", str(pair.key), "--host", "127.0.0.1", "--port", "0",
            "--metrics-port", "0", "--kubeconfig", str(self.webhook_kubeconfig),
            "--policy-name", policy_name, "--log-level", "info",
            "--controller-user", f"system:serviceaccount:{NAMESPACE}:{CONTROLLER_SA}", *extra])
        port = int(wait_for(lambda: (lambda m: m.group(1) if m else None)(re.search(
            r"admission on https://127\.0\.0\.1:(\d+)", self.log(name))), 60,
            f"xmem serve to listen (log: {self.plane.logs / name}.log)"))
        webhook = Webhook(self, name, process, port)
        webhook.configure(values)
        return webhook

    def controller(self, name: str, policy_name: str, *extra: str,
                   kubeconfig: Optional[Path] = None) -> subprocess.Popen:
        """``xmem controller`` with the controller's service account (or another kubeconfig),
        leading through the chart's Lease in the chart's namespace."""
        return self._spawn(name, [
            sys.executable, "-m", "xmem_admission.cli", "controller",
            "--kubeconfig", str(kubeconfig or self.controller_kubeconfig),
            "--policy-name", policy_name,
            "--probe-image", self.probe_image, "--host", "127.0.0.1", "--metrics-port", "0",
            "--lease-name", LEASE, "--lease-namespace", NAMESPACE, "--identity", name,
            "--workloads", "Job,PyTorchJob", "--resync-seconds", "1", "--log-level", "info",
            *extra])

    def stop_process(self, process: subprocess.Popen, kill: bool = False) -> None:
        if kill:
            process.kill()
            process.wait(10)
        else:
            stop_process(process, grace=10)
        if process in self.processes:
            self.processes.remove(process)


class Webhook:
    """A running ``xmem serve`` and the chart's webhook configurations that call it."""

    def __init__(self, cluster: Cluster, name: str, process: subprocess.Popen, port: int) -> None:
        self.cluster = cluster
        self.name = name
        self.process = process
        self.port = port

    def configurations(self, values: Optional[Dict[str, Any]] = None) -> List[Dict[str, Any]]:
        ca = self.cluster.plane._authority().pem
        out = []
        for doc in render_chart(values):
            if not doc["kind"].endswith("WebhookConfiguration"):
                continue
            doc = copy.deepcopy(doc)
            for webhook in doc["webhooks"]:
                path = webhook["clientConfig"]["service"]["path"]
                webhook["clientConfig"] = {"url": f"https://127.0.0.1:{self.port}{path}",
                                           "caBundle": base64.b64encode(ca).decode()}
            out.append(doc)
        return out

    def configure(self, values: Optional[Dict[str, Any]] = None) -> None:
        for doc in self.configurations(values):
            self.cluster.apply(doc)

    def remove(self) -> None:
        for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
            self.cluster.delete("admissionregistration.k8s.io/v1", kind,
                                f"{RELEASE}-xmem-admission")

    def stop(self) -> None:
        self.cluster.stop_process(self.process)


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True, default=str)
