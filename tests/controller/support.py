"""The controller tests' cluster: the real control plane, the real webhook's mutation, workloads.

``Harness`` gives each test a namespace of its own on the session's real control plane
(kube-apiserver, controller-manager, the project's process node that runs estimation pods as
processes; the chart's CRDs), a ConfigMap holding the example and test training scripts (mounted
at /app in the workloads, as a user would ship code), and makes held workloads the way a cluster
does: the Job goes through the real webhook's mutation (``Webhook.review``, in-process) and is
then created through the API. Everything the test and its controllers send goes through a fault
proxy (``harness.proxy``: injected 409/429/5xx answers, request observers) with a cluster-admin
service account's token. Controllers run in-process (``controller()``) or as ``xmem controller``
processes (``spawn()``).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import jsonpatch

from localkube.cluster import PROBE_IMAGE
from localkube.cluster import Cluster as RealCluster
from localkube.controlplane import wait_for as wait  # noqa: F401 - tests poll with it
from localkube.faultproxy import FaultProxy
from xmem_admission.cluster import labels
from xmem_admission.cluster.admission.webhook import Endpoint, Webhook
from xmem_admission.cluster.controller.manager import Controller
from xmem_admission.cluster.kube.client import Kube
from xmem_admission.cluster.policy.model import Policy
from xmem_admission.cluster.policy.sources import StaticPolicySource
from xmem_admission.cluster.policy.store import MemoryStore

REPO = Path(__file__).resolve().parents[2]
CRDS = [str(REPO / "helm/xmem-admission/crds/gpumemoryestimates.xmem.io.yaml"),
        str(REPO / "helm/xmem-admission/crds/gpuadmissionpolicies.xmem.io.yaml"),
        str(REPO / "tests/data/crds/kubeflow.org_pytorchjobs.yaml")]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
IMAGE = "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
UNPULLABLE = "registry.invalid/team/train:does-not-exist"  # RFC 6761: never resolves
TINY_GPT = ["--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "100",
            "--seq-len", "32", "--batch-size", "2"]
GPUS = ("A100-80GB", "H100-80GB")


def policy_spec(**spec: Any) -> Dict[str, Any]:
    """A GPUAdmissionPolicy spec: HAMi on two GPU models, quick estimation settings."""
    estimation = {"resources": {"cpu": "1", "memory": "2Gi"}, "activeDeadlineSeconds": 120,
                  "maxHoldSeconds": 600}
    estimation.update(spec.pop("estimation", {}))
    body: Dict[str, Any] = {"targets": [{"gpu": g, "backend": "HAMi"} for g in GPUS],
                            "estimation": estimation}
    body.update(spec)
    return body


def make_policy(**spec: Any) -> Policy:
    return Policy.from_spec(policy_spec(**spec))


def code_map(namespace: str = "default") -> Dict[str, Any]:
    data = {"train_gpt.py": (REPO / "examples/train_gpt.py").read_text()}
    for script in SCRIPTS.glob("*.py"):
        data[script.name] = script.read_text()
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "code", "namespace": namespace}, "data": data}


def training_job(name: str, namespace: str = "default", script: str = "train_gpt.py",
                 args: Sequence[str] = tuple(TINY_GPT), image: str = IMAGE,
                 command: Optional[List[str]] = None) -> Dict[str, Any]:
    """An opted-in Job asking for one GPU, running a script from the ``code`` ConfigMap."""
    container = {
        "name": "train", "image": image,
        "command": command or ["python", f"/app/{script}"], "args": list(args),
        "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "4", "memory": "16Gi"}},
        "volumeMounts": [{"name": "code", "mountPath": "/app"}],
    }
    if command:
        container.pop("args")
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": namespace, "labels": {labels.OPT_IN: "true"}},
        "spec": {"backoffLimit": 0, "template": {
            "metadata": {"labels": {"app": name}},
            "spec": {"restartPolicy": "Never", "containers": [container],
                     "volumes": [{"name": "code", "configMap": {"name": "code"}}]}}},
    }


def training_pytorchjob(name: str, namespace: str = "default", script: str = "train_gpt.py",
                        args: Sequence[str] = tuple(TINY_GPT)) -> Dict[str, Any]:
    """An opted-in Kubeflow PyTorchJob with one master replica (single-process training)."""
    template = training_job(name, namespace, script, args)["spec"]["template"]
    template["spec"]["restartPolicy"] = "OnFailure"
    return {
        "apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": namespace, "labels": {labels.OPT_IN: "true"}},
        "spec": {"runPolicy": {"cleanPodPolicy": "None"}, "pytorchReplicaSpecs": {
            "Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}},
    }


def hold(obj: Dict[str, Any], policy: Policy,
         versions: Optional[Callable[[str], Any]] = None) -> Dict[str, Any]:
    """The object as the real webhook's mutation leaves it at CREATE (held, fingerprinted);
    ``versions``: the lookup of ConfigMap versions its fingerprint reads, by namespace."""
    group, version = (obj["apiVersion"].split("/") + [""])[:2] if "/" in obj["apiVersion"] \
        else ("", obj["apiVersion"])
    plural = {"Job": "jobs", "PyTorchJob": "pytorchjobs"}[obj["kind"]]
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "3c6a4b7e-0000-4000-8000-000000000001",
        "kind": {"group": group, "version": version, "kind": obj["kind"]},
        "resource": {"group": group, "version": version, "resource": plural},
        "name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"],
        "operation": "CREATE", "userInfo": {"username": "alice"}, "object": obj,
        "dryRun": False}}
    webhook = Webhook(StaticPolicySource(policy), MemoryStore(), versions=versions)
    answer = json.loads(webhook.review(json.dumps(review).encode(), Endpoint.MUTATE))["response"]
    assert answer["allowed"], answer
    ops = json.loads(base64.b64decode(answer["patch"])) if answer.get("patch") else []
    return jsonpatch.apply_patch(obj, ops)


HARNESS_NAMESPACE = "xmem-harness"  # where the tests' own admin service account lives


class Harness:
    """See the module docstring."""

    def __init__(self, cluster: RealCluster, namespace: str, root: Path,
                 spec: Optional[Dict[str, Any]] = None) -> None:
        self.cluster = cluster
        self.namespace = namespace
        self.root = root
        cluster.ensure_namespace(namespace)
        wait(lambda: cluster.get("v1", "ServiceAccount", "default", namespace), 30,
             f"the default service account of {namespace}")
        self.proxy = FaultProxy(cluster.plane.port,
                                str(cluster.plane._authority().cert_file)).start()
        self.kubeconfig = str(_admin_kubeconfig(cluster, self.proxy.url))
        self.use(spec or policy_spec())
        cluster.apply(code_map(namespace))
        self.controllers: List[Controller] = []
        self.processes: List[subprocess.Popen] = []

    # --- the API, as the tests' admin, through the fault proxy --------------------------------

    def api_client(self) -> Any:
        return self.cluster.plane.api_client(Path(self.kubeconfig))

    def kube(self) -> Kube:
        return Kube(self.api_client(), backoff=0.05)

    def get(self, api_version: str, kind: str, name: str,
            namespace: Optional[str] = "") -> Optional[Dict[str, Any]]:
        """The object, or None; namespaced kinds default to the test's namespace."""
        return self.cluster.get(api_version, kind, name,
                                self.namespace if namespace == "" else namespace)

    def create(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        resource = self.cluster.resource(obj["apiVersion"], obj["kind"])
        namespace = obj["metadata"].get("namespace") if resource.namespaced else None
        return dict(resource.create(body=obj, namespace=namespace).to_dict())

    # --- controllers ------------------------------------------------------------------------

    def controller(self, start: bool = True, **options: Any) -> Controller:
        settings = dict(resync_seconds=0.5, sync_timeout=60, deadline_slack=2.0,
                        identity=f"test-{len(self.controllers)}")
        settings.update(options)
        controller = Controller(self.kube(), StaticPolicySource(self.policy), PROBE_IMAGE,
                                **settings)
        self.controllers.append(controller)
        return controller.start() if start else controller

    def use(self, spec: Dict[str, Any]) -> None:
        """The policy in force for the webhook and for controllers started from now on."""
        self.spec = spec
        self.policy = Policy.from_spec(spec)

    def policy_file(self) -> str:
        import yaml

        path = self.root / "policy.yaml"
        path.write_text(yaml.safe_dump({"apiVersion": "xmem.io/v1alpha1",
                                        "kind": "GPUAdmissionPolicy",
                                        "metadata": {"name": self.namespace},
                                        "spec": self.spec}))
        return str(path)

    def spawn(self, *extra: str, identity: str = "replica",
              cluster_policy: bool = False) -> subprocess.Popen:
        """``xmem controller`` as its own process, against this cluster; its policy from a file,
        or (``cluster_policy``) from the cluster's GPUAdmissionPolicy named after the test's
        namespace. Its Lease is in the test's namespace unless ``extra`` says otherwise."""
        if cluster_policy:
            self.cluster.apply({"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
                                "metadata": {"name": self.namespace}, "spec": self.spec})
            source = ["--policy-name", self.namespace]
        else:
            source = ["--policy", self.policy_file()]
        argv = [sys.executable, "-m", "xmem_admission.cli", "controller",
                "--kubeconfig", self.kubeconfig, *source,
                "--probe-image", PROBE_IMAGE, "--metrics-port", "0", "--host", "127.0.0.1",
                "--identity", identity, "--resync-seconds", "0.5", "--workloads", "Job",
                "--lease-name", "xmem", "--lease-namespace", self.namespace, *extra]
        log = open(self.root / f"{identity}.log", "ab")  # noqa: SIM115 - owned by the child
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1"))
        log.close()
        self.processes.append(process)
        return process

    def log_of(self, identity: str) -> str:
        path = self.root / f"{identity}.log"
        return path.read_text() if path.exists() else ""

    # --- workloads --------------------------------------------------------------------------

    def submit(self, obj: Dict[str, Any]) -> Dict[str, Any]:
        """Create the workload as the webhook leaves it (held), in the test's namespace."""
        obj = copy.deepcopy(obj)
        obj["metadata"]["namespace"] = self.namespace
        return self.create(hold(obj, self.policy, self.versions))

    def versions(self, namespace: str) -> Any:
        """The ConfigMap versions the webhook's cache would give, read from the API now."""
        kube = self.kube()
        return lambda kind, name: kube.config_map_version(namespace, name) \
            if kind == "ConfigMap" else None

    def job(self, name: str) -> Dict[str, Any]:
        found = self.get("batch/v1", "Job", name)
        assert found is not None, f"job {self.namespace}/{name} is gone"
        return found

    def wait_released(self, name: str, timeout: float = 90.0) -> Dict[str, Any]:
        def released() -> Optional[Dict[str, Any]]:
            job = self.job(name)
            held = labels.HELD_REASON in (job["metadata"].get("annotations") or {})
            return None if held else job
        return wait(released, timeout, f"job {name} to be released")

    def gmes(self) -> List[Dict[str, Any]]:
        return self.cluster.list("xmem.io/v1alpha1", "GPUMemoryEstimate", self.namespace)

    def estimation_pods(self) -> List[Dict[str, Any]]:
        return self.cluster.list("v1", "Pod", self.namespace,
                                 "app.kubernetes.io/component=estimation")

    def events(self, name: str) -> List[Dict[str, Any]]:
        return [e for e in self.cluster.list("v1", "Event", self.namespace)
                if e["involvedObject"]["name"] == name
                and (e.get("source") or {}).get("component") == "xmem-controller"]

    def close(self) -> None:
        for controller in self.controllers:
            controller.stop()
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
        self.proxy.stop()
        self.cluster.delete("xmem.io/v1alpha1", "GPUAdmissionPolicy", self.namespace)
        # Gone before the next test: its controllers watch every namespace, and what is left of
        # this one (held workloads, estimates) would be theirs to reconcile.
        self.cluster.delete("v1", "Namespace", self.namespace)
        wait(lambda: self.cluster.get("v1", "Namespace", self.namespace) is None, 120,
             f"namespace {self.namespace} to be deleted")


def _admin_kubeconfig(cluster: RealCluster, server: str) -> Path:
    """A token kubeconfig (a token passes the plain-HTTP fault proxy; a client certificate
    would not) for a service account bound to cluster-admin."""
    cluster.ensure_namespace(HARNESS_NAMESPACE)
    cluster.apply({"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
                   "metadata": {"name": "xmem-harness-admin"},
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                               "name": "cluster-admin"},
                   "subjects": [{"kind": "ServiceAccount", "name": "admin",
                                 "namespace": HARNESS_NAMESPACE}]})
    return cluster.plane.service_account_kubeconfig(HARNESS_NAMESPACE, "admin", server=server)


def template_annotations(job: Dict[str, Any]) -> Dict[str, str]:
    return job["spec"]["template"]["metadata"].get("annotations") or {}
