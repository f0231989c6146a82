"""A cluster's day on the real control plane: a backlog of held Jobs, and a big cluster.

Starts the project's real control plane (``localkube``: kube-apiserver, controller-manager,
etcd, the process node that runs estimation pods as processes, the chart's CRDs and RBAC),
creates ``--plain`` suspended Jobs nobody opted in (spread over ``--plain-namespaces``
namespaces, many creates at once) and ``--held`` held Jobs with distinct arguments in
``--namespaces`` opted-in namespaces (as the webhook's mutation leaves them: this project's
``Webhook.review`` in-process, then created; each namespace's Jobs one after another, so that
their submission order is known), and runs ``xmem controller`` as its own process with the
chart's service account, its requests going through a counting proxy, for ``--minutes``.

Prints: the controller's startup (process start to informers synced: ``leader`` 1 on its
/metrics), its RSS (start, peak, end) and CPU, log lines a minute, its API requests a second
(watches counted once), estimation pods started and whether each namespace's started in
submission order, and the cached objects per resource. ``--held-after-start`` creates the held
Jobs after the controller is up (a backlog arriving), otherwise everything exists first (a
big cluster the controller starts into).

    .venv/bin/python -m bench.cluster.cluster_scale --held 1000 --held-after-start --minutes 5
    .venv/bin/python -m bench.cluster.cluster_scale --plain 13000 --held 2000 --minutes 5
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import os
import re
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import jsonpatch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from localkube.cluster import CONTROLLER_SA, NAMESPACE, Cluster  # noqa: E402
from localkube.controlplane import wait_for  # noqa: E402
from localkube.faultproxy import FaultProxy  # noqa: E402
from xmem_admission.cluster import labels  # noqa: E402
from xmem_admission.cluster.admission.webhook import Endpoint, Webhook  # noqa: E402
from xmem_admission.cluster.policy.model import Policy  # noqa: E402
from xmem_admission.cluster.policy.sources import StaticPolicySource  # noqa: E402
from xmem_admission.cluster.policy.store import MemoryStore  # noqa: E402

IMAGE = "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
SCRIPT = (ROOT / "examples/train_gpt.py").read_text()  # tiny: about 6 s an estimation
TINY_GPT = ["--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "100",
            "--seq-len", "32", "--batch-size", "2", "--steps", "2"]
POLICY = "bench-scale"
POD_SELECTOR = "app.kubernetes.io/component=estimation"


def policy_spec(per_namespace: int, cluster: int) -> Dict[str, Any]:
    return {"targets": [{"gpu": "A100-80GB", "backend": "HAMi"}],
            "estimation": {"resources": {"cpu": "1", "memory": "2Gi"},
                           "activeDeadlineSeconds": 120, "maxHoldSeconds": 3600,
                           "maxConcurrentPerNamespace": per_namespace,
                           "maxConcurrent": cluster}}


def held_job(name: str, namespace: str, index: int) -> Dict[str, Any]:
    """An opted-in GPU Job training a tiny GPT (quick estimations), its own arguments."""
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {labels.OPT_IN: "true", "team": namespace}},
            "spec": {"backoffLimit": 0, "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"restartPolicy": "Never", "containers": [{
                    "name": "train", "image": IMAGE, "command": ["python", "/app/train.py"],
                    "args": [*TINY_GPT, "--seed", str(index)],
                    "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "4",
                                             "memory": "16Gi"}},
                    "volumeMounts": [{"name": "code", "mountPath": "/app"}]}],
                    "volumes": [{"name": "code", "configMap": {"name": "code"}}]}}}}


def plain_job(name: str, namespace: str, index: int) -> Dict[str, Any]:
    """A suspended CPU Job of some other team (labels, env, a few KiB as such Jobs are)."""
    env = [{"name": f"SETTING_{k}", "value": f"value-{index}-{k}"} for k in range(12)]
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"app": "etl", "shard": str(index % 50)},
                         "annotations": {"owner": "data-platform", "run": f"run-{index}"}},
            "spec": {"suspend": True, "backoffLimit": 2, "template": {
                "metadata": {"labels": {"app": "etl"}},
                "spec": {"restartPolicy": "Never", "containers": [{
                    "name": "main", "image": "registry.example/etl:1.4", "env": env,
                    "command": ["python", "-m", "etl.run"], "args": ["--shard", str(index)],
                    "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}}}]}}}}


def hold(webhook: Webhook, obj: Dict[str, Any]) -> Dict[str, Any]:
    """The Job as the webhook's mutation leaves it at CREATE (held, fingerprinted)."""
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "3c6a4b7e-0000-4000-8000-000000000001",
        "kind": {"group": "batch", "version": "v1", "kind": "Job"},
        "resource": {"group": "batch", "version": "v1", "resource": "jobs"},
        "name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"],
        "operation": "CREATE", "userInfo": {"username": "alice"}, "object": obj,
        "dryRun": False}}
    answer = json.loads(webhook.review(json.dumps(review).encode(), Endpoint.MUTATE))["response"]
    assert answer["allowed"], answer
    ops = json.loads(base64.b64decode(answer["patch"])) if answer.get("patch") else []
    return jsonpatch.apply_patch(obj, ops)


class Process:
    """RSS and CPU time of a process, from /proc."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.ticks = 100.0

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self.ticks


class Requests:
    """The controller's API requests, as the proxy in front of it answered them."""

    def __init__(self, proxy: FaultProxy) -> None:
        self.count = 0
        self.watches = 0
        self.by_verb: Dict[str, int] = {}
        self.lock = threading.Lock()
        proxy.on_request(self.observe)
        self.proxy = proxy

    def observe(self, method: str, path: str, status: int) -> None:
        parts = path.strip("/").split("/")
        if "namespaces" in parts[:-1]:  # .../namespaces/<ns>/<resource>[/<name>[/status]]
            parts = parts[parts.index("namespaces") + 2:]
        else:
            parts = parts[-1:]  # a cluster-wide list or watch
        what = f"{method} {'/'.join(p for i, p in enumerate(parts) if i % 2 == 0)}"
        with self.lock:
            self.count += 1
            self.by_verb[what] = self.by_verb.get(what, 0) + 1


class PodOrder:
    """Estimation pods in the order the API server made them (a watch's ADDED events)."""

    def __init__(self, api: Any) -> None:
        from kubernetes import client, watch

        self.order: List[Tuple[str, str]] = []
        self.when: List[Any] = []  # each pod's creationTimestamp (a second)
        self.stop = threading.Event()
        core = client.CoreV1Api(api)

        def run() -> None:
            seen = set()
            version = ""
            while not self.stop.is_set():
                w = watch.Watch()
                kwargs: Dict[str, Any] = {"label_selector": POD_SELECTOR, "timeout_seconds": 30}
                if version:
                    kwargs["resource_version"] = version
                try:
                    for event in w.stream(core.list_pod_for_all_namespaces, **kwargs):
                        pod = event["object"]
                        version = pod.metadata.resource_version
                        if event["type"] == "ADDED" and pod.metadata.uid not in seen:
                            seen.add(pod.metadata.uid)
                            workload = (pod.metadata.annotations or {}).get("xmem.io/workload", "")
                            self.order.append((pod.metadata.namespace,
                                               workload.split("/", 1)[-1]))
                            self.when.append(pod.metadata.creation_timestamp)
                except Exception:  # noqa: BLE001 - a dropped watch is watched again
                    version = ""
        threading.Thread(target=run, daemon=True).start()

    def in_submission_order(self) -> Tuple[bool, int]:
        """Whether each namespace's pods started in its Jobs' submission order; pods made in
        the same second are one round of the line (two workers create a round's pods at once,
        in either order)."""
        rounds: Dict[str, Dict[Any, List[int]]] = {}
        for (namespace, name), when in zip(self.order, self.when):
            found = re.search(r"(\d+)$", name)
            if found:
                rounds.setdefault(namespace, {}).setdefault(when, []).append(int(found.group(1)))
        ok = True
        for per_second in rounds.values():
            ordered = [per_second[when] for when in sorted(per_second)]
            ok = ok and all(max(a) < min(b) for a, b in zip(ordered, ordered[1:]))
        return ok, len(self.order)


def create_all(api: Any, jobs: List[Dict[str, Any]], threads: int) -> float:
    from kubernetes import client

    batch = client.BatchV1Api(api)

    def one(job: Dict[str, Any]) -> None:
        for attempt in range(5):
            try:
                batch.create_namespaced_job(job["metadata"]["namespace"], job,
                                            _preload_content=False)
                return
            except client.ApiException as exc:
                if exc.status == 409:
                    return
                if attempt == 4:
                    raise
                time.sleep(0.5)

    start = time.monotonic()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, jobs))
    return time.monotonic() - start


def create_in_order(api: Any, by_namespace: Dict[str, List[Dict[str, Any]]]) -> float:
    """Each namespace's Jobs one after another (their submission order), namespaces at once."""
    from kubernetes import client

    batch = client.BatchV1Api(api)

    def namespace(jobs: List[Dict[str, Any]]) -> None:
        for job in jobs:
            batch.create_namespaced_job(job["metadata"]["namespace"], job,
                                        _preload_content=False)

    start = time.monotonic()
    with ThreadPoolExecutor(len(by_namespace) or 1) as pool:
        list(pool.map(namespace, by_namespace.values()))
    return time.monotonic() - start


def metric(port: int, name: str) -> Dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    found: Dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name):
            key, _, value = line.rpartition(" ")
            found[key[len(name):]] = float(value)
    return found


@contextlib.contextmanager
def running_cluster(root: str, prefix: str) -> Iterator[Cluster]:
    """A localkube cluster under ``root`` (a new temporary folder named ``prefix...`` when
    empty), started with its start-up time printed, and stopped on the way out."""
    cluster = Cluster(Path(root or tempfile.mkdtemp(prefix=prefix)))
    began = time.monotonic()
    try:
        cluster.start()
        print(f"control plane up in {time.monotonic() - began:.0f} s "
              f"({cluster.plane.version()})", flush=True)
        yield cluster
    finally:
        cluster.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--held", type=int, default=1000)
    parser.add_argument("--namespaces", type=int, default=10)
    parser.add_argument("--plain", type=int, default=0)
    parser.add_argument("--plain-namespaces", type=int, default=20)
    parser.add_argument("--held-after-start", action="store_true")
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--per-namespace", type=int, default=4)
    parser.add_argument("--cluster", type=int, default=4,
                        help="estimation pods at once in the cluster (the machine's cores)")
    parser.add_argument("--threads", type=int, default=24)
    parser.add_argument("--root", default="")
    parser.add_argument("--also-from", metavar="SRC", default="",
                        help="then start a controller from another tree's src/ (an earlier "
                        "commit's) on the same cluster: its startup and RSS")
    args = parser.parse_args()
    with running_cluster(args.root, "cluster-scale-") as cluster:
        measure(cluster, args)


def measure(cluster: Cluster, args: argparse.Namespace) -> None:
    api = cluster.plane.api_client()
    api.configuration.connection_pool_maxsize = args.threads + 4
    spec = policy_spec(args.per_namespace, args.cluster)
    cluster.apply({"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
                   "metadata": {"name": POLICY}, "spec": spec})
    teams = [f"team-{i:02d}" for i in range(args.namespaces)]
    others = [f"bulk-{i:02d}" for i in range(args.plain_namespaces)] if args.plain else []
    for name in teams:
        cluster.ensure_namespace(name, {labels.OPT_IN: labels.OPT_IN_VALUE})
    for name in others:
        cluster.ensure_namespace(name)
    for name in teams:
        wait_for(lambda n=name: cluster.get("v1", "ServiceAccount", "default", n), 60,
                 f"the default service account of {name}")
        cluster.apply({"apiVersion": "v1", "kind": "ConfigMap",
                       "metadata": {"name": "code", "namespace": name},
                       "data": {"train.py": SCRIPT}})
    if args.plain:
        plain = [plain_job(f"etl-{i:05d}", others[i % len(others)], i) for i in range(args.plain)]
        seconds = create_all(api, plain, args.threads)
        print(f"created {args.plain} plain Jobs in {seconds:.0f} s "
              f"({args.plain / seconds:.0f}/s)", flush=True)
        del plain

    webhook = Webhook(StaticPolicySource(Policy.from_spec(spec)), MemoryStore())
    held: Dict[str, List[Dict[str, Any]]] = {name: [] for name in teams}
    for index in range(args.held):
        namespace = teams[index % len(teams)]
        held[namespace].append(hold(webhook, held_job(f"held-{index:05d}", namespace, index)))

    proxy = FaultProxy(cluster.plane.port, str(cluster.plane._authority().cert_file)).start()
    requests = Requests(proxy)
    kubeconfig = cluster.plane.service_account_kubeconfig(NAMESPACE, CONTROLLER_SA,
                                                          server=proxy.url)
    order = PodOrder(api)

    def create_held() -> None:
        seconds = create_in_order(api, held)
        print(f"created {args.held} held Jobs in {seconds:.0f} s in {len(teams)} namespaces",
              flush=True)

    if not args.held_after_start:
        create_held()
    started = time.monotonic()
    process = cluster.controller("controller", POLICY, "--no-leader-election",
                                 "--resync-seconds", "30", kubeconfig=kubeconfig)
    proc = Process(process.pid)
    port = int(wait_for(lambda: (lambda m: m.group(1) if m else None)(re.search(
        r"metrics on http://127\.0\.0\.1:(\d+)/", cluster.log("controller"))), 60,
        "the controller's metrics port"))
    rss: List[float] = [proc.rss_mib()]
    wait_for(lambda: metric(port, "xmem_controller_leader").get("", 0) == 1, 600,
             "the controller's informers to sync", interval=0.1)
    startup = time.monotonic() - started
    rss_synced = proc.rss_mib()
    print(f"controller synced in {startup:.1f} s, RSS {rss_synced:.0f} MiB", flush=True)
    if args.held_after_start:
        threading.Thread(target=create_held, daemon=True).start()

    samples: List[Tuple[float, float, float, int, int]] = []  # t, rss, cpu, lines, requests
    end = time.monotonic() + args.minutes * 60
    while time.monotonic() < end and process.poll() is None:
        lines = cluster.log("controller").count("\n")
        samples.append((time.monotonic() - started, proc.rss_mib(), proc.cpu_seconds(), lines,
                        requests.count))
        rss.append(samples[-1][1])
        time.sleep(5)
    cached = metric(port, "xmem_controller_cached_objects")
    held_now = metric(port, "xmem_controller_held_workloads")
    late = sum(metric(port, "xmem_controller_estimations_expected_late").values())
    cluster.stop_process(process)
    order.stop.set()

    first, last = samples[0], samples[-1]
    minutes = (last[0] - first[0]) / 60
    half = samples[len(samples) // 2]
    in_order, pods = order.in_submission_order()
    cpu = (last[2] - first[2]) / (last[0] - first[0]) * 100
    print("---")
    print(f"cluster: {args.plain} plain Jobs in {len(others)} namespaces, {args.held} held Jobs "
          f"in {len(teams)} opted-in namespaces; caps {args.per_namespace}/ns "
          f"{args.cluster}/cluster; resync 30 s")
    print(f"startup_to_synced_s: {startup:.1f}")
    print(f"rss_mib start: {rss[0]:.0f} synced: {rss_synced:.0f} peak: {max(rss):.0f} "
          f"end: {rss[-1]:.0f} (second half: {half[1]:.0f} -> {last[1]:.0f})")
    print(f"cpu_percent_of_a_core: {cpu:.1f} over {minutes:.1f} min")
    print(f"log_lines_per_minute: {(last[3] - first[3]) / minutes:.0f} "
          f"(total {last[3]})")
    print(f"api_requests_per_second: {(last[4] - first[4]) / (last[0] - first[0]):.2f} "
          f"(second half {(last[4] - half[4]) / max(1.0, last[0] - half[0]):.2f}; "
          f"by verb and resource {dict(sorted(requests.by_verb.items()))})")
    print(f"estimation_pods_started: {pods} in_submission_order_per_namespace: {in_order}")
    if not in_order:
        print(f"estimation pods in the order made: {list(zip(order.order, order.when))}")
    print(f"held_at_end: {held_now} expected_late: {late:.0f}")
    print(f"cached_objects: {cached}")
    if args.also_from:
        compare(cluster, args.also_from, kubeconfig)
    proxy.stop()


def compare(cluster: Cluster, src: str, kubeconfig: Path) -> None:
    """Another tree's controller on the same cluster: startup to synced, RSS then and 60 s
    later."""
    os.environ["PYTHONPATH"] = src
    try:
        started = time.monotonic()
        process = cluster.controller("controller-other", POLICY, "--no-leader-election",
                                     "--resync-seconds", "30", kubeconfig=kubeconfig)
    finally:
        del os.environ["PYTHONPATH"]
    proc = Process(process.pid)
    port = int(wait_for(lambda: (lambda m: m.group(1) if m else None)(re.search(
        r"metrics on http://127\.0\.0\.1:(\d+)/", cluster.log("controller-other"))), 60,
        "the other controller's metrics port"))
    wait_for(lambda: metric(port, "xmem_controller_leader").get("", 0) == 1, 600,
             "the other controller's informers to sync", interval=0.1)
    startup = time.monotonic() - started
    synced = proc.rss_mib()
    time.sleep(60)
    print(f"controller from {src}: startup_to_synced_s: {startup:.1f} rss_mib synced: "
          f"{synced:.0f} after 60 s: {proc.rss_mib():.0f}")
    cluster.stop_process(process)


if __name__ == "__main__":
    main()
