"""A cluster's day, the repeat burst: 3 programs x 100 identical copies on the real control plane.

Starts the project's real control plane (``localkube``: kube-apiserver with
OwnerReferencesPermissionEnforcement, controller-manager, etcd, the process node that runs
estimation pods as processes, the chart's CRDs and RBAC), applies the sweep's policy (the
chart's caps: 4 estimation pods per namespace, 32 in the cluster), runs ``xmem serve`` (the
webhook, with the chart's webhook configurations) and creates ``--copies`` identical copies of
each of three programs in one namespace, all at once (16 creates at a time), held by the
webhook at CREATE: the example GPT script (tiny), the same with ``--grad-ckpt``, and the example
CNN script (tiny). ``xmem controller`` runs as its own process with the chart's service account
and resync (30 s), straight to the API server (``--proxy``: through a counting proxy).

Prints: the estimation pods made (a watch on their label) and the estimates traced; for each
program when its estimate was recorded (first seen ``Succeeded``) and when its last copy was
released, after submission; the refused requests (403, 409, 422) in the controller's log (and as
the proxy saw them answered) (a 409 on a write of a Job is optimistic concurrency: the write
carried the resourceVersion it was computed from, another writer came first, and the
controller's pass starts over; it is counted, not failed). Then deletes the Job each estimate
was made for (its ``spec.workload``), waits for the garbage collector to take it and its pods
and for one resync, and says whether each estimate is still there (same uid) and whether the
other copies are still sized (the Jobs' pod templates carry the estimate's request, and their
pods the HAMi limit the webhook made of it at Pod CREATE). Exits 1 when a must-show fails
(``--max-pods``; a copy released later than ``--within`` seconds after its program's estimate; a
refused request in the controller's log, or a 403 or 422 at the proxy; an estimate or a sized
copy gone).

    .venv/bin/python -m bench.cluster.cluster_burst
    .venv/bin/python -m bench.cluster.cluster_burst --copies 30
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.cluster.cluster_scale import (  # noqa: E402
    PodOrder,
    Process,
    create_all,
    metric,
    running_cluster,
)
from bench.cluster.cluster_sweep import BASE, policy_spec, prepare  # noqa: E402
from localkube.cluster import CONTROLLER_SA, Cluster  # noqa: E402
from localkube.cluster import NAMESPACE as CHART_NAMESPACE  # noqa: E402
from localkube.controlplane import wait_for  # noqa: E402
from localkube.faultproxy import FaultProxy  # noqa: E402
from tests.controller.support import template_annotations, training_job  # noqa: E402
from xmem_admission.cluster import labels  # noqa: E402
from xmem_admission.cluster.backends.base import mib  # noqa: E402
from xmem_admission.cluster.controller.workloads import ESTIMATE_NAME  # noqa: E402
from xmem_admission.cluster.kube.resources import HAMI_GPUMEM  # noqa: E402

POLICY = "bench-burst"
NAMESPACE = "burst"
GME = ("xmem.io/v1alpha1", "GPUMemoryEstimate")
REQUEST = labels.REQUEST_BYTES
PROGRAMS: Dict[str, Tuple[str, List[str]]] = {
    "gpt": ("train_gpt.py", BASE + ["--batch-size", "2"]),
    "gpt-ckpt": ("train_gpt.py", BASE + ["--batch-size", "2", "--grad-ckpt"]),
    "cnn": ("train_cnn.py", ["--model", "resnet18", "--num-classes", "10", "--image-size", "32",
                             "--batch-size", "2", "--steps", "2"]),
}
STAMP = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ")  # a log line's time
REFUSED = re.compile(r"\b(403|409|422)\b|Forbidden|Conflict|AlreadyExists|Unprocessable")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=100, help="copies of each program")
    parser.add_argument("--within", type=float, default=20.0,
                        help="seconds from a program's estimate to its last copy's release")
    parser.add_argument("--max-pods", type=int, default=3)
    parser.add_argument("--proxy", action="store_true",
                        help="the controller's requests through a counting proxy (each request "
                        "a new TLS connection from this process: it slows them)")
    parser.add_argument("--root", default="")
    args = parser.parse_args()
    with running_cluster(args.root, "cluster-burst-") as cluster:
        failed = run(cluster, args)
    sys.exit(1 if failed else 0)


def run(cluster: Cluster, args: argparse.Namespace) -> bool:
    spec = policy_spec()
    prepare(cluster, POLICY, NAMESPACE, spec,
            {"train_cnn.py": (ROOT / "examples/train_cnn.py").read_text()})
    api = cluster.plane.api_client()
    api.configuration.connection_pool_maxsize = 20
    webhook = cluster.serve("webhook", POLICY)

    program_of: Dict[str, str] = {}
    jobs: List[Dict[str, Any]] = []
    for copy in range(args.copies):
        for program, (script, argv) in PROGRAMS.items():
            name = f"{program}-{copy:03d}"
            program_of[name] = program
            jobs.append(training_job(name, NAMESPACE, script=script, args=argv))

    answered: Dict[str, int] = {}  # "<status> <method> <resource>": how many
    seen: List[Tuple[float, str]] = []  # (when, "<method> <resource>") of every request

    def refusal(method: str, path: str, status: int) -> None:
        parts = path.split("?")[0].strip("/").split("/")
        rest = parts[parts.index("namespaces") + 2:] if "namespaces" in parts[:-1] \
            else parts[-1:]
        what = f"{method} {'/'.join(rest[0::2])}"
        seen.append((time.monotonic(), what))
        if status in (403, 409, 422):
            answered[f"{status} {what}"] = answered.get(f"{status} {what}", 0) + 1
    proxy: Optional[FaultProxy] = None
    kubeconfig: Optional[Path] = None  # the chart's service account, straight to the server
    if args.proxy:
        proxy = FaultProxy(cluster.plane.port, str(cluster.plane._authority().cert_file)).start()
        proxy.on_request(refusal)
        kubeconfig = cluster.plane.service_account_kubeconfig(CHART_NAMESPACE, CONTROLLER_SA,
                                                              server=proxy.url)
    pods = PodOrder(api)
    process = cluster.controller("controller", POLICY, "--no-leader-election",
                                 "--resync-seconds", "30", kubeconfig=kubeconfig)
    port = int(wait_for(lambda: (lambda m: m.group(1) if m else None)(re.search(
        r"metrics on http://127\.0\.0\.1:(\d+)/", cluster.log("controller"))), 60,
        "the controller's metrics port"))
    wait_for(lambda: metric(port, "xmem_controller_leader").get("", 0) == 1, 120,
             "the controller to lead with its informers synced", interval=0.2)

    before = server_latencies(api)
    start = time.monotonic()
    seconds = create_all(api, jobs, 16)
    print(f"submitted {len(jobs)} Jobs ({len(PROGRAMS)} programs x {args.copies}) in "
          f"{seconds:.1f} s", flush=True)
    cpu = Process(process.pid)
    released, recorded, samples = watch(cluster, set(program_of), cpu, timeout=600)
    after = server_latencies(api)
    gmes = {g["metadata"]["name"]: g for g in cluster.list(*GME, NAMESPACE)}
    estimate_of = {program_of[j["metadata"]["name"]]:
                   (j["metadata"].get("annotations") or {}).get(ESTIMATE_NAME)
                   for j in cluster.list("batch/v1", "Job", NAMESPACE)
                   if j["metadata"]["name"] in released}
    traced = [g for g in gmes.values() if (g.get("status") or {}).get("podName")
              and "sharedFrom" not in g["status"]]
    failures: List[str] = []
    print(f"released {len(released)} of {len(jobs)}")
    print(f"estimation pods: {len(pods.order)} made (estimates traced {len(traced)}, "
          f"estimates {len(gmes)})")
    for program in PROGRAMS:
        estimate = estimate_of.get(program)
        copies = [released[n] - start for n in released if program_of[n] == program]
        at = recorded.get(estimate or "")
        if at is None or not copies:
            failures.append(f"{program}: no estimate recorded or no copy released")
            print(f"  {program}: estimate {estimate}: not recorded; released {len(copies)}")
            continue
        lag = max(copies) - (at - start)
        print(f"  {program}: estimate {estimate} recorded {at - start:.1f} s after submission; "
              f"{len(copies)} copies released, first {min(copies):.1f} s, last "
              f"{max(copies):.1f} s ({lag:.1f} s after the estimate)")
        if len(copies) < args.copies or lag > args.within:
            failures.append(f"{program}: not every copy released within {args.within:.0f} s "
                            "of its estimate")
    if recorded and released:
        begin, end = min(recorded.values()), max(released.values())
        used = [c for t, c in samples if begin <= t <= end]
        verbs: Dict[str, int] = {}
        for when, what in seen:
            if begin <= when <= end:
                verbs[what] = verbs.get(what, 0) + 1
        print(f"from the first estimate to the last release ({end - begin:.1f} s): controller "
              f"CPU {used[-1] - used[0] if used else 0:.1f} s"
              + (f", requests {dict(sorted(verbs.items()))}" if proxy else ""))
    timed = {key: (total - before.get(key, [0.0, 0.0])[0],
                   count - before.get(key, [0.0, 0.0])[1]) for key, (total, count) in after.items()}
    print("the API server, submission to the last release (mean ms x count): " + ", ".join(
        f"{key} {total / count * 1000:.0f} x {count:.0f}" for key, (total, count)
        in sorted(timed.items(), key=lambda kv: -kv[1][0]) if count and (
            key.startswith("webhook") or key.split()[-1] in (
                "jobs", "events", "pods", "gpumemoryestimates", "gpumemoryestimates/status"))))
    refused = [line for line in cluster.log("controller").splitlines()
               if REFUSED.search(STAMP.sub("", line))]
    print(f"refused requests in the controller's log: {len(refused)}" + (
        f"; answered by the API server (proxy): {answered or 'none'}; requests in all "
        f"{len(seen)}" if proxy else ""))
    for line in refused[:5]:
        print(f"  {line[:300]}")
    if len(pods.order) > args.max_pods:
        failures.append(f"{len(pods.order)} estimation pods, more than {args.max_pods}")
    if refused or any(not what.startswith("409 PUT ") for what in answered):
        failures.append("refused requests")

    failures += delete_first(cluster, gmes, estimate_of, program_of, released)
    pods.stop.set()
    cluster.stop_process(process)
    webhook.stop()
    if proxy is not None:
        proxy.stop()
    for failure in failures:
        print(f"FAILED: {failure}")
    return bool(failures)


SERVER_METRICS = re.compile(
    r'^(apiserver_request_duration_seconds|apiserver_admission_webhook_admission_duration_seconds)'
    r'_(sum|count)\{(.*)\} (\S+)$')


def server_latencies(api: Any) -> Dict[str, List[float]]:
    """The API server's request and webhook latency sums and counts, by what they time:
    "PUT jobs", "webhook <name> <type> <operation>"."""
    text = api.call_api("GET", api.configuration.host + "/metrics").read().decode()
    found: Dict[str, List[float]] = {}
    for line in text.splitlines():
        match = SERVER_METRICS.match(line)
        if not match:
            continue
        name, part, raw, value = match.groups()
        tags = dict(re.findall(r'(\w+)="([^"]*)"', raw))
        if name.startswith("apiserver_request"):
            key = f"{tags.get('verb')} {tags.get('resource')}" + \
                (f"/{tags['subresource']}" if tags.get("subresource") else "")
        else:
            key = f"webhook {tags.get('name')} {tags.get('type')} {tags.get('operation')}"
        found.setdefault(key, [0.0, 0.0])[part == "count"] += float(value)
    return found


def watch(cluster: Cluster, names: Set[str], process: Process, timeout: float) -> Tuple[
        Dict[str, float], Dict[str, float], List[Tuple[float, float]]]:
    """When each Job was first seen released and each estimate first seen Succeeded (polling
    the API every 0.25 s), and the controller's CPU seconds at each poll."""
    released: Dict[str, float] = {}
    recorded: Dict[str, float] = {}
    samples: List[Tuple[float, float]] = []
    end = time.monotonic() + timeout
    while len(released) < len(names) and time.monotonic() < end:
        now = time.monotonic()
        samples.append((now, process.cpu_seconds()))
        for gme in cluster.list(*GME, NAMESPACE):
            if (gme.get("status") or {}).get("phase") == "Succeeded":
                recorded.setdefault(gme["metadata"]["name"], now)
        for job in cluster.list("batch/v1", "Job", NAMESPACE):
            annotations: Optional[Dict[str, str]] = job["metadata"].get("annotations")
            name = job["metadata"]["name"]
            if name in names and labels.HELD_REASON not in (annotations or {}):
                released.setdefault(name, now)
        time.sleep(0.25)
    samples.append((time.monotonic(), process.cpu_seconds()))
    return released, recorded, samples


def delete_first(cluster: Cluster, gmes: Dict[str, Dict[str, Any]],
                 estimate_of: Dict[str, Optional[str]], program_of: Dict[str, str],
                 released: Dict[str, float]) -> List[str]:
    """Delete the Job each estimate was made for; the estimates and the other copies stay
    sized."""
    first = {program: gmes[name]["spec"]["workload"]["name"]
             for program, name in estimate_of.items() if name in gmes}
    for name in first.values():
        cluster.delete("batch/v1", "Job", name, NAMESPACE)
    for name in first.values():
        wait_for(lambda n=name: cluster.get("batch/v1", "Job", n, NAMESPACE) is None, 120,
                 f"job {name} deleted")
        wait_for(lambda n=name: not cluster.list("v1", "Pod", NAMESPACE, f"job-name={n}"), 120,
                 f"the pods of {name} garbage-collected")
    others = {n for n in released if n not in first.values()}
    wait_for(lambda: len({(p["metadata"].get("labels") or {}).get("job-name")
                          for p in cluster.list("v1", "Pod", NAMESPACE)} & others)
             == len(others), 300, "a pod for every other copy", interval=2)
    time.sleep(35)  # one resync of the controller's (30 s) after the deletions
    failures: List[str] = []
    jobs = {j["metadata"]["name"]: j for j in cluster.list("batch/v1", "Job", NAMESPACE)}
    pods_of: Dict[str, List[Dict[str, Any]]] = {}
    for pod in cluster.list("v1", "Pod", NAMESPACE):
        pods_of.setdefault((pod["metadata"].get("labels") or {}).get("job-name", ""),
                           []).append(pod)
    for program, deleted in first.items():
        name = estimate_of[program] or ""
        kept = cluster.get(*GME, name, NAMESPACE)
        same = kept is not None and kept["metadata"]["uid"] == gmes[name]["metadata"]["uid"]
        want = str(gmes[name]["status"]["requestBytes"])
        copies = [n for n in others if program_of[n] == program]
        sized = [n for n in copies if n in jobs and
                 template_annotations(jobs[n]).get(REQUEST) == want]
        pods = [p for n in copies for p in pods_of.get(n, [])]
        limit = str(mib(int(want)))
        pods_sized = [p for p in pods
                      if (p["metadata"].get("annotations") or {}).get(REQUEST) == want and
                      p["spec"]["containers"][0]["resources"].get("limits", {}).get(
                          HAMI_GPUMEM) == limit]
        limits = pods[0]["spec"]["containers"][0]["resources"].get("limits", {}) if pods else {}
        gpu = {k: v for k, v in limits.items() if "nvidia.com" in k}
        print(f"after deleting {deleted}: estimate {name} "
              f"{'still there (same uid)' if same else 'GONE'}; {len(sized)} of {len(copies)} "
              f"other copies sized ({REQUEST} {want}); their pods {len(pods_sized)} of "
              f"{len(pods)} sized from it, limits {gpu}")
        if not same or len(sized) < len(copies) or len(pods_sized) < len(pods) or not pods:
            failures.append(f"{program}: the others did not stay sized after {deleted} went")
    return failures


if __name__ == "__main__":
    main()
