"""A cluster's day, the sweep: 120 trials of one program on the real control plane.

Starts the project's real control plane (``localkube``: kube-apiserver, controller-manager,
etcd, the process node that runs estimation pods as processes, the chart's CRDs and RBAC),
applies a GPUAdmissionPolicy with the chart's caps (4 estimation pods per namespace, 32 in the
cluster), mounts the example GPT script from a ConfigMap and creates ``--trials`` Jobs as Katib
or the Kubeflow SDK make them: one image and command, ``--lr`` a value of its own per trial,
``--batch-size`` one of ``--batch-sizes`` in turn, a tiny model. Each Job is held as the
webhook's mutation leaves it (this project's ``Webhook.review`` in-process, then created), all
at once; ``xmem controller`` runs as its own process with the chart's service account and the
chart's resync (30 s).

Prints the release times after submission (first, median, last), the estimation pods made
(estimates traced, each with its pod) and the batch sizes they traced, the estimates shared and
the options they were shared over; then submits one more trial with a batch size never seen and
says whether it was traced. Exits 1 when a must-show fails (``--within`` seconds for the last
release, ``--max-pods``).

    .venv/bin/python -m bench.cluster.cluster_sweep
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.cluster.cluster_scale import running_cluster  # noqa: E402
from localkube.cluster import Cluster  # noqa: E402
from localkube.controlplane import wait_for  # noqa: E402
from tests.controller.support import hold, training_job  # noqa: E402
from xmem_admission.cluster import labels  # noqa: E402
from xmem_admission.cluster.kube.client import Kube  # noqa: E402
from xmem_admission.cluster.policy.model import Policy  # noqa: E402

POLICY = "bench-sweep"
NAMESPACE = "sweep"
BASE = ["--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "100", "--seq-len", "32",
        "--steps", "2"]


def policy_spec() -> Dict[str, Any]:
    return {"targets": [{"gpu": "A100-80GB", "backend": "HAMi"},
                        {"gpu": "H100-80GB", "backend": "HAMi"}],
            "estimation": {"resources": {"cpu": "1", "memory": "2Gi"},
                           "activeDeadlineSeconds": 300, "maxHoldSeconds": 1800}}


def trial(name: str, lr: str, batch_size: str) -> Dict[str, Any]:
    job = training_job(name, NAMESPACE, args=BASE + ["--batch-size", batch_size, "--lr", lr])
    return job


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=120)
    parser.add_argument("--batch-sizes", default="2,4,8,16")
    parser.add_argument("--within", type=float, default=90.0)
    parser.add_argument("--max-pods", type=int, default=16)
    parser.add_argument("--root", default="")
    args = parser.parse_args()
    sizes = args.batch_sizes.split(",")

    with running_cluster(args.root, "cluster-sweep-") as cluster:
        failed = run(cluster, args, sizes)
    sys.exit(1 if failed else 0)


def prepare(cluster: Cluster, policy_name: str, namespace: str, spec: Dict[str, Any],
            code: Optional[Dict[str, str]] = None) -> Callable[[str], Any]:
    """The policy applied and the opted-in namespace with the ``code`` ConfigMap (the tests'
    scripts and ``code``'s); returns the ConfigMap versions lookup ``hold`` takes."""
    from tests.controller.support import code_map

    cluster.apply({"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
                   "metadata": {"name": policy_name}, "spec": spec})
    cluster.ensure_namespace(namespace, {labels.OPT_IN: labels.OPT_IN_VALUE})
    wait_for(lambda: cluster.get("v1", "ServiceAccount", "default", namespace), 60,
             "the default service account")
    config_map = code_map(namespace)
    config_map["data"].update(code or {})
    cluster.apply(config_map)
    kube = Kube(cluster.plane.api_client())

    def versions(namespace: str) -> Any:
        return lambda kind, name: kube.config_map_version(namespace, name) \
            if kind == "ConfigMap" else None
    return versions


def run(cluster: Cluster, args: argparse.Namespace, sizes: List[str]) -> bool:
    spec = policy_spec()
    versions = prepare(cluster, POLICY, NAMESPACE, spec)
    policy = Policy.from_spec(spec)
    jobs = [hold(trial(f"trial-{i:03d}", f"{1e-5 * (i + 1):.6f}", sizes[i % len(sizes)]),
                 policy, versions) for i in range(args.trials)]
    process = cluster.controller("controller", POLICY, "--no-leader-election",
                                 "--resync-seconds", "30")
    port = int(wait_for(lambda: (lambda m: m.group(1) if m else None)(re.search(
        r"metrics on http://127\.0\.0\.1:(\d+)/", cluster.log("controller"))), 60,
        "the controller's metrics port"))
    wait_for(lambda: "xmem_controller_leader 1.0" in urllib.request.urlopen(
        f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode(), 120,
        "the controller to lead with its informers synced", interval=0.2)
    jobs_api = cluster.resource("batch/v1", "Job")
    submitted: Dict[str, float] = {}
    for job in jobs:
        jobs_api.create(body=job, namespace=NAMESPACE)
        submitted[job["metadata"]["name"]] = time.monotonic()
    print(f"submitted {len(jobs)} Jobs in "
          f"{max(submitted.values()) - min(submitted.values()):.1f} s", flush=True)
    released = watch_releases(cluster, submitted, timeout=args.within * 6)
    after = sorted(released[n] - submitted[n] for n in released)
    gmes = cluster.list("xmem.io/v1alpha1", "GPUMemoryEstimate", NAMESPACE)
    traced = [g for g in gmes if "sharedFrom" not in (g.get("status") or {})]
    shared = [g for g in gmes if "sharedFrom" in (g.get("status") or {})]
    pods = sorted({str((g.get("status") or {}).get("podName") or "") for g in traced} - {""})
    traced_sizes = sorted({(g["spec"].get("trial") or {}).get("options", {}).get("--batch-size")
                           for g in traced}, key=lambda s: int(s or 0))
    over = sorted({o for g in shared for o in g["status"]["sharedFrom"]["options"]})
    print(f"released {len(after)} of {len(jobs)}: first {after[0]:.1f} s, median "
          f"{statistics.median(after):.1f} s, last {after[-1]:.1f} s after submission")
    print(f"estimation pods: {len(pods)} (estimates traced {len(traced)}, batch sizes "
          f"{', '.join(str(s) for s in traced_sizes)}); shared {len(shared)}, over "
          f"{', '.join(over) or 'nothing'}")

    name = "trial-new-batch"
    new = hold(trial(name, f"{1e-5:.6f}", "32"), policy, versions)
    jobs_api.create(body=new, namespace=NAMESPACE)
    start = time.monotonic()
    done = watch_releases(cluster, {name: start}, timeout=300)
    job = cluster.get("batch/v1", "Job", name, NAMESPACE) or {}
    estimate = (job.get("metadata", {}).get("annotations") or {}).get("xmem.io/estimate-name")
    gme = cluster.get("xmem.io/v1alpha1", "GPUMemoryEstimate", estimate, NAMESPACE) \
        if estimate else None
    new_traced = gme is not None and "sharedFrom" not in (gme.get("status") or {}) and \
        bool(gme["status"].get("podName"))
    print(f"a trial with --batch-size 32 (never seen): "
          f"{'traced' if new_traced else 'NOT traced'}, released "
          f"{done.get(name, float('nan')) - start:.1f} s after submission")
    cluster.stop_process(process)
    failures = []
    if len(after) < len(jobs) or after[-1] > args.within:
        failures.append(f"not all released within {args.within:.0f} s")
    if len(pods) > args.max_pods:
        failures.append(f"{len(pods)} estimation pods, more than {args.max_pods}")
    if traced_sizes != sorted(sizes, key=int):
        failures.append("not every batch size traced")
    if "--batch-size" in over or not new_traced:
        failures.append("--batch-size shared")
    for failure in failures:
        print(f"FAILED: {failure}")
    return bool(failures)


def watch_releases(cluster: Cluster, submitted: Dict[str, float],
                   timeout: float) -> Dict[str, float]:
    """When each Job was first seen without xmem's hold (polling the API every 0.25 s)."""
    released: Dict[str, float] = {}
    end = time.monotonic() + timeout
    while len(released) < len(submitted) and time.monotonic() < end:
        for job in cluster.list("batch/v1", "Job", NAMESPACE):
            name = job["metadata"]["name"]
            annotations: Optional[Dict[str, str]] = job["metadata"].get("annotations")
            if name in submitted and name not in released and \
                    labels.HELD_REASON not in (annotations or {}):
                released[name] = time.monotonic()
        time.sleep(0.25)
    return released


if __name__ == "__main__":
    main()
