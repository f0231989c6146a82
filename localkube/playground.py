"""The playground (``make playground``): the project on a real node of this machine, as root,
no Docker needed: the real control plane, a real kubelet with containerd and a registry of its
own (``localkube.kubelet``), kwok GPU nodes of two models, the webhook, the controller and the
example policy, with a handful of example jobs in a training image.

    python -m localkube.playground up [DIR] [--torch 2.15.0:3.13]   # `make playground`
    python -m localkube.playground down [DIR]                       # `make playground-stop`

``up`` builds what is missing (the project's image, a training image with that torch and Python,
a Debian base image for the pod sandbox: minutes the first time, reused after), then starts a
background process that hosts the cluster until ``down``: it pushes the images into the node's
registry, which requires authentication (the namespace gets a pull secret), and the controller
starts every estimation pod there, with the project's image as its init container and the
training image as its main container. Then ``up`` submits the example jobs and prints what
happened to each: held at CREATE or not, the estimate, the request, the GPU model and the node
the scheduler chose. The kubeconfig it prints works with kubectl: ``kubectl get gme -A``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import yaml

from localkube import images, kubelet
from localkube.cluster import Cluster
from localkube.controlplane import ControlPlane, wait_for
from localkube.controlplane import down as stop_pids
from localkube.kwok import GPU_TOLERATION, gpu_node
from xmem_admission.cluster import labels

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DIR = Path(tempfile.gettempdir()) / "xmem-playground"
DEFAULT_TORCH = "2.15.0:3.13"  # the newest end of the supported range (Makefile TORCH_ENDS)
NAMESPACE = "ml"
PULL_SECRET = "playground-registry"
NODES = [("a100", "A100-80GB", 2), ("h100", "H100-80GB", 2)]
# The example policy's estimation pods ask for 2 CPUs and 8Gi, a training node's share; the
# real node here is this machine (2 cores on the machines the project is built on), so the
# playground asks for 1 CPU and 3Gi (a GPT of the examples' size traces in under 1.5 GB with
# torch 2.15: tests/realnode) and lets two run at once.
ESTIMATION_RESOURCES = {"cpu": "1", "memory": "3Gi"}


def _gpt(layers: int, hidden: int, heads: int, batch: int) -> List[str]:
    return ["--layers", str(layers), "--hidden", str(hidden), "--heads", str(heads),
            "--vocab", "1000", "--seq-len", "64", "--batch-size", str(batch)]


# name, opted in (label), GPT arguments
EXAMPLES = [
    ("gpt-small", True, _gpt(2, 128, 4, 4)),
    ("gpt-medium", True, _gpt(4, 256, 8, 8)),
    ("gpt-small-again", True, _gpt(2, 128, 4, 4)),  # same training: shares the estimate
    ("not-opted-in", False, _gpt(2, 128, 4, 4)),
]


def example_job(name: str, opt_in: bool, args: Sequence[str], image: str) -> Dict[str, Any]:
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": NAMESPACE,
                     "labels": {labels.OPT_IN: "true"} if opt_in else {}},
        "spec": {"backoffLimit": 0, "template": {"spec": {
            "restartPolicy": "Never", "tolerations": [GPU_TOLERATION],
            "imagePullSecrets": [{"name": PULL_SECRET}],
            "containers": [{"name": "train", "image": image,
                            "command": ["python", "/app/train_gpt.py"], "args": list(args),
                            "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "4",
                                                     "memory": "16Gi"}},
                            "volumeMounts": [{"name": "code", "mountPath": "/app"}]}],
            "volumes": [{"name": "code", "configMap": {"name": "code"}}]}}},
    }


def build_images(root: Path, torch: str, python: str) -> Dict[str, str]:
    """The images the playground runs, in podman's store (each reused when it exists)."""
    print("images (the first time: a few minutes each, several GB for the training image):")
    built: Dict[str, str] = {}
    began = time.monotonic()
    base = images.build("base-image.sh", "bookworm")
    built["sandbox"] = kubelet.pause_image(base)
    context = root / "image-context"
    context.mkdir(parents=True, exist_ok=True)
    built["probe"] = images.project_image(context)
    print(f"  the project's image  {built['probe']}")
    built["train"] = images.training_image(torch, python)
    print(f"  a training image     {built['train']} (torch {torch}, Python {python})")
    print(f"  ready in {time.monotonic() - began:.0f} s")
    return built


def _release(version_output: str) -> str:
    """``v1.36.3`` out of what ``kubelet --version`` (or containerd's, runc's, ...) prints."""
    found = re.search(r"v?\d+\.\d+\.\d+\S*", version_output)
    return found.group(0) if found else version_output


def host(root: Path) -> None:
    """The background process: start everything, write ``ready``, run until SIGTERM."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    built = json.loads((root / "images.json").read_text())
    auth = ("playground", secrets.token_hex(8))
    nodes: List[kubelet.RealNode] = []

    def start_node(plane: ControlPlane) -> kubelet.RealNode:
        node = kubelet.RealNode(plane, root / "node", name="playground-node",
                                registry_auth=auth)
        nodes.append(node)
        return node.start(built["sandbox"])

    cluster = Cluster(root, start_node=start_node)
    try:
        cluster.start()
        node = nodes[0]
        cluster.probe_image = node.registry.push(built["probe"], "xmem/admission:playground")
        train = node.registry.push(built["train"], "ml/train:playground")
        for prefix, model, count in NODES:
            for i in range(count):
                cluster.apply(gpu_node(f"{prefix}-{i}", model))
        policy = yaml.safe_load((ROOT / "examples/policy.yaml").read_text())
        policy["spec"]["estimation"]["resources"] = dict(ESTIMATION_RESOURCES)
        cluster.apply(policy)
        cluster.ensure_namespace(NAMESPACE)  # jobs opt in one by one, with the label
        cluster.apply(dict(node.registry.pull_secret(PULL_SECRET),
                           metadata={"name": PULL_SECRET, "namespace": NAMESPACE}))
        cluster.serve("xmem-serve", policy["metadata"]["name"])
        cluster.controller("xmem-controller", policy["metadata"]["name"])
        versions = node.versions()
        (root / "ready").write_text(json.dumps({
            "kubeconfig": str(cluster.plane.admin_kubeconfig), "image": train,
            "version": cluster.plane.version(),
            "node": f"node {node.name}: " + ", ".join(
                f"{name} {_release(text)}" for name, text in versions.items())
                    + f"; its registry at {node.registry.address}",
            # what the node made on this machine under names of its own, gone after `down`
            "made": {"bridge": node.bridge, "cgroup": node.cgroup_root,
                     "registry": node.registry.address}}))
        stop.wait()
    except Exception as exc:  # noqa: BLE001 - reported to `up` through the file
        (root / "failed").write_text(repr(exc))
    finally:
        cluster.stop()


def _row(cluster: Cluster, name: str) -> Optional[Dict[str, str]]:
    job = cluster.get("batch/v1", "Job", name, NAMESPACE)
    if job is None:
        return None
    annotations = job["spec"]["template"]["metadata"].get("annotations") or {}
    held_now = labels.HELD_REASON in (job["metadata"].get("annotations") or {})
    pods = cluster.list("v1", "Pod", NAMESPACE, f"job-name={name}")
    node = pods[0]["spec"].get("nodeName", "") if pods else ""
    limits = pods[0]["spec"]["containers"][0]["resources"].get("limits", {}) if pods else {}
    mib = annotations.get(labels.REQUEST_BYTES)
    return {"job": name, "state": "held" if held_now else "released" if mib else "admitted",
            "estimate": f"{int(annotations[labels.ESTIMATE_BYTES]) >> 20} MiB"
            if labels.ESTIMATE_BYTES in annotations else "-",
            "request": f"nvidia.com/gpumem {limits['nvidia.com/gpumem']} MiB"
            if "nvidia.com/gpumem" in limits else ("whole GPU" if not mib else "-"),
            "gpu": annotations.get(labels.GPU_MODEL, "-"), "node": node or "(pending)"}


def up(root: Path, torch: str = DEFAULT_TORCH, timeout: float = 900) -> int:
    root.mkdir(parents=True, exist_ok=True)
    if (root / "run" / "playground.pid").exists():
        print(f"a playground is already running in {root}: `make playground-stop` first")
        return 1
    if os.geteuid() != 0:
        print("the playground's node (a kubelet, containerd, runc, a pod network) runs as root: "
              "run `make playground` as root")
        return 1
    reason = kubelet.missing() or kubelet.too_deep(root / "node")
    if reason:
        print(reason)
        return 1
    try:
        built = build_images(root, *torch.split(":"))
    except images.ImageBuildFailed as err:
        print(f"an image failed to build: {err}")
        return 1
    (root / "images.json").write_text(json.dumps(built))
    for stale in ("ready", "failed"):
        (root / stale).unlink(missing_ok=True)
    (root / "run").mkdir(exist_ok=True)
    log = open(root / "playground.log", "ab")  # noqa: SIM115 - handed to the child
    process = subprocess.Popen([sys.executable, "-m", "localkube.playground", "host",
                                str(root)], stdout=log, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)
    log.close()
    (root / "run" / "playground.pid").write_text(str(process.pid))
    started = time.monotonic()
    print("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kwok, "
          "a real node (kubelet, containerd, registry), xmem serve and xmem controller ...")
    ready = wait_for(lambda: (root / "ready").exists() or (root / "failed").exists()
                     or process.poll() is not None, timeout, "the playground to start")
    if not (root / "ready").exists():
        print("the playground failed to start: "
              + ((root / "failed").read_text() if (root / "failed").exists() else "")
              + f"\nsee {root / 'playground.log'} and {root / 'logs'}")
        down(root)
        return 1
    del ready
    info = json.loads((root / "ready").read_text())
    print(f"{info['version']} up in {time.monotonic() - started:.0f} s\n{info['node']}")
    cluster = Cluster(root)
    cluster.plane.admin_kubeconfig = Path(info["kubeconfig"])
    cluster.api = cluster.plane.api_client()
    cluster.apply({"apiVersion": "v1", "kind": "ConfigMap",
                   "metadata": {"name": "code", "namespace": NAMESPACE},
                   "data": {"train_gpt.py": (ROOT / "examples/train_gpt.py").read_text()}})
    wait_for(lambda: cluster.get("v1", "ServiceAccount", "default", NAMESPACE), 60,
             "the namespace's default service account")
    from kubernetes import client

    batch = client.BatchV1Api(cluster.api)
    print(f"\nsubmitting {len(EXAMPLES)} example jobs to namespace {NAMESPACE!r} "
          f"(opted in: labelled {labels.OPT_IN}=true):")
    for name, opt_in, args in EXAMPLES:
        obj = example_job(name, opt_in, args, info["image"])
        created = batch.create_namespaced_job(NAMESPACE, obj)
        print(f"  {name:<16} {'held at CREATE' if created.spec.suspend else 'admitted as is'}")

    def settled() -> Optional[List[Dict[str, str]]]:
        rows = [_row(cluster, name) for name, _, _ in EXAMPLES]
        done = all(r is not None and r["state"] != "held" and r["node"] != "(pending)"
                   for r in rows)
        return [r for r in rows if r] if done else None

    rows = wait_for(settled, timeout, "every example job to be released and scheduled",
                    interval=1)
    widths = {k: max(len(k), *(len(r[k]) for r in rows)) for k in rows[0]}
    print()
    print("  ".join(k.upper().ljust(widths[k]) for k in widths))
    for r in rows:
        print("  ".join(r[k].ljust(widths[k]) for k in widths))
    print(f"\nkubeconfig: {info['kubeconfig']}\n  e.g. kubectl --kubeconfig {info['kubeconfig']} "
          f"get gme,jobs,pods -n {NAMESPACE} -o wide\nstop it with: make playground-stop")
    cluster.api.close()
    return 0


def down(root: Path) -> int:
    pid_file = root / "run" / "playground.pid"
    if pid_file.exists():
        pid = int(pid_file.read_text())
        try:
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 180  # the node's teardown: pods, mounts, networks
            while time.monotonic() < deadline:
                os.kill(pid, 0)
                time.sleep(0.2)
        except ProcessLookupError:
            pass
        pid_file.unlink(missing_ok=True)
    # whatever the host could not stop itself (the node's own run folder too)
    leftovers = stop_pids(root / "node") + stop_pids(root)
    print("playground stopped" + (f" (also stopped: {', '.join(leftovers)})" if leftovers else ""))
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m localkube.playground")
    parser.add_argument("action", choices=["up", "down", "host"])
    parser.add_argument("dir", nargs="?", default=str(DEFAULT_DIR))
    parser.add_argument("--torch", default=DEFAULT_TORCH, metavar="RELEASE:PYTHON",
                        help="the training image's torch release and Python minor "
                             f"(default {DEFAULT_TORCH})")
    args = parser.parse_args(argv)
    root = Path(args.dir).resolve()
    if args.action == "host":
        host(root)
        return 0
    return up(root, args.torch) if args.action == "up" else down(root)


if __name__ == "__main__":
    sys.exit(main())
