"""The controller tests' cluster: stand-in API server and node, the real webhook, workloads.

``Harness`` starts a stand-in cluster with the project's CRDs, a ConfigMap holding the example
and test training scripts (mounted at /app in the workloads, as a user would ship code), and
makes held workloads the way a cluster does: the Job goes through the real webhook's mutation
(``Webhook.review``, in-process) and is then created through the API. Controllers run
in-process (``controller()``) or as ``xmem controller`` processes (``spawn()``).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import jsonpatch

from tests.fakekube.apiserver import wait_for as wait  # noqa: F401 - tests poll with it
from tests.fakekube.cluster import PROBE_IMAGE, Cluster
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
UNPULLABLE = "registry.example/team/train:does-not-exist"
TINY_GPT = ["--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "100",
            "--seq-len", "32", "--batch-size", "2"]
GPUS = ("A100-80GB", "H100-80GB")


def policy_spec(**spec: Any) -> Dict[str, Any]:
    """A GPUAdmissionPolicy spec: HAMi on two GPU models, quick estimation settings."""
    estimation = {"resources": {"cpu": "1", "memory": "2Gi"}, "activeDeadlineSeconds": 120,
                  "maxHoldSeconds": 600}
    estimation.update(spec.pop("estimation", {}))
    body: Dict[str, Any] = {"targets": [{"gpu": g, "backend": "hami"} for g in GPUS],
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


def hold(obj: Dict[str, Any], policy: Policy) -> Dict[str, Any]:
    """The object as the real webhook's mutation leaves it at CREATE (held, fingerprinted)."""
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
    webhook = Webhook(StaticPolicySource(policy), MemoryStore())
    answer = json.loads(webhook.review(json.dumps(review).encode(), Endpoint.MUTATE))["response"]
    assert answer["allowed"], answer
    ops = json.loads(base64.b64decode(answer["patch"])) if answer.get("patch") else []
    return jsonpatch.apply_patch(obj, ops)


class Harness:
    """See the module docstring."""

    def __init__(self, root: Path, spec: Optional[Dict[str, Any]] = None, **cluster: Any) -> None:
        self.root = root
        self.cluster = Cluster(str(root), crds=CRDS, unpullable=[UNPULLABLE], **cluster).start()
        self.server = self.cluster.server
        self.use(spec or policy_spec())
        self.server.create(code_map())
        self.controllers: List[Controller] = []
        self.processes: List[subprocess.Popen] = []

    # --- controllers ------------------------------------------------------------------------

    def kube(self) -> Kube:
        return Kube(self.server.api_client(), backoff=0.05)

    def controller(self, start: bool = True, **options: Any) -> Controller:
        settings = dict(resync_seconds=0.5, sync_timeout=10, deadline_slack=2.0,
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
                                        "metadata": {"name": "default"}, "spec": self.spec}))
        return str(path)

    def spawn(self, *extra: str, identity: str = "replica",
              cluster_policy: bool = False) -> subprocess.Popen:
        """``xmem controller`` as its own process, against this cluster; its policy from a file,
        or (``cluster_policy``) from the cluster's GPUAdmissionPolicy ``default``."""
        if cluster_policy:
            self.server.create({"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
                                "metadata": {"name": "default"}, "spec": self.spec})
            source = ["--policy-name", "default"]
        else:
            source = ["--policy", self.policy_file()]
        argv = [sys.executable, "-m", "xmem_admission.cli", "controller",
                "--kubeconfig", self.cluster.kubeconfig, *source,
                "--probe-image", PROBE_IMAGE, "--metrics-port", "0", "--host", "127.0.0.1",
                "--identity", identity, "--resync-seconds", "0.5", "--workloads", "Job",
                *extra]
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
        return self.server.create(hold(obj, self.policy))

    def job(self, name: str, namespace: str = "default") -> Dict[str, Any]:
        return self.server.get("batch/v1", "Job", name, namespace)

    def wait_released(self, name: str, timeout: float = 90.0) -> Dict[str, Any]:
        def released() -> Optional[Dict[str, Any]]:
            job = self.job(name)
            held = labels.HELD_REASON in (job["metadata"].get("annotations") or {})
            return None if held else job
        return self.server.wait_for(released, timeout, f"job {name} to be released")

    def gmes(self, namespace: str = "default") -> List[Dict[str, Any]]:
        return self.server.list("xmem.io/v1alpha1", "GPUMemoryEstimate", namespace)

    def estimation_pods(self, namespace: str = "default") -> List[Dict[str, Any]]:
        return self.server.list("v1", "Pod", namespace,
                                "app.kubernetes.io/component=estimation")

    def events(self, name: str, namespace: str = "default") -> List[Dict[str, Any]]:
        return [e for e in self.server.list("v1", "Event", namespace)
                if e["involvedObject"]["name"] == name
                and e.get("source", {}).get("component") == "xmem-controller"]

    def close(self) -> None:
        for controller in self.controllers:
            controller.stop()
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
        self.cluster.stop()


def template_annotations(job: Dict[str, Any]) -> Dict[str, str]:
    return job["spec"]["template"]["metadata"].get("annotations") or {}
