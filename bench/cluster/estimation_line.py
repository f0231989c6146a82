"""What one dispatch of the estimation line costs, and the order it serves, with a large backlog.

Run with no arguments. It fills the controller's own caches (``Informer`` objects, filled with
``put`` as the watch would; nothing is started and no API call is made) with ``--jobs`` held Jobs
spread over ``--namespaces`` namespaces, one waiting ``GPUMemoryEstimate`` each, and
``--running`` estimation pods already running. Then it lets the line drain as estimations finish
one at a time: each round marks one running pod Succeeded (the oldest), runs
``estimation_line.dispatch`` (the code the controller runs) and puts a pod for each estimate the
dispatch granted, as the estimate's reconcile would. It prints the dispatch time (median and
worst) and checks the order served: in each namespace by the Jobs' creation, and no namespace
served twice in a row while another waits when the cluster's cap is the limit. The workloads
are marked told of the backlog beforehand, so no Event is sent (there is no API server).
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from typing import Any, Dict, List

from kubernetes import client

from xmem_admission.cluster.controller import estimation_line, podspec, records
from xmem_admission.cluster.controller.context import Context, Workload
from xmem_admission.cluster.controller.metrics import ControllerMetrics
from xmem_admission.cluster.integrations.job import JobIntegration
from xmem_admission.cluster.kube.client import GME, POD, Kube
from xmem_admission.cluster.kube.informer import Informer, WorkQueue
from xmem_admission.cluster.policy.model import Policy
from xmem_admission.cluster.policy.sources import StaticPolicySource

T0 = datetime.datetime(2026, 12, 6, 12, 0, tzinfo=datetime.timezone.utc)


def _context(per_namespace: int, cluster: int) -> Context:
    api = client.ApiClient(client.Configuration(host="http://127.0.0.1:9"))  # never called
    kube = Kube(api)
    policy = Policy.from_spec({"targets": [{"gpu": "A100-80GB", "backend": "HAMi"}],
                               "estimation": {"maxConcurrentPerNamespace": per_namespace,
                                              "maxConcurrent": cluster}})
    job = JobIntegration()
    return Context(kube=kube, policy=StaticPolicySource(policy),
                   workloads={"Job": Workload(job, Informer(kube, job.resource))},
                   estimates=Informer(kube, GME), pods=Informer(kube, POD), queue=WorkQueue(),
                   metrics=ControllerMetrics(), probe_image="x",
                   now=lambda: T0 + datetime.timedelta(seconds=600))


def _pod(gme: Dict[str, Any], phase: str) -> Dict[str, Any]:
    m = gme["metadata"]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": podspec.pod_name(gme), "namespace": m["namespace"],
                         "uid": f"pod-{m['uid']}", "resourceVersion": "1",
                         "creationTimestamp": records.stamp(T0),
                         "ownerReferences": [{"kind": GME.kind, "name": m["name"],
                                              "uid": m["uid"], "controller": True}]},
            "status": {"phase": phase}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--namespaces", type=int, default=20)
    parser.add_argument("--per-namespace", type=int, default=4)
    parser.add_argument("--cluster", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    ctx = _context(args.per_namespace, args.cluster)
    jobs = ctx.workloads["Job"].informer
    created: Dict[str, datetime.datetime] = {}
    for index in range(args.jobs):
        namespace = f"team-{index % args.namespaces:02d}"
        name = f"job-{args.jobs - index:05d}"  # against name order
        when = T0 + datetime.timedelta(milliseconds=250 * index)
        uid = f"uid-{index}"
        job = {"apiVersion": "batch/v1", "kind": "Job",
               "metadata": {"name": name, "namespace": namespace, "uid": uid,
                            "resourceVersion": "1", "creationTimestamp": records.stamp(when),
                            "annotations": {"xmem.io/held-reason": "Estimating",
                                            "xmem.io/fingerprint": f"{index:032x}"}}}
        jobs.put(job)
        ctx.line.saw(job)
        ctx.line.told.add(uid)
        gme = {"apiVersion": GME.api_version, "kind": GME.kind,
               "metadata": {"name": records.name_for(f"{index:032x}"), "namespace": namespace,
                            "uid": f"gme-uid-{index}", "resourceVersion": "1",
                            "creationTimestamp": records.stamp(when)},
               "spec": {"workload": {"kind": "Job", "name": name}},
               "status": {"phase": "Pending"}}
        ctx.estimates.put(gme)
        created[f"{namespace}/{gme['metadata']['name']}"] = when
    for seconds in (40.0,) * 5:
        ctx.line.finished(seconds)
    timings: List[float] = []
    served: List[str] = []
    running: List[Dict[str, Any]] = []
    for _ in range(args.rounds):
        if running:
            done = running.pop(0)
            ctx.pods.put(dict(done, status={"phase": "Succeeded"},
                              metadata=dict(done["metadata"], resourceVersion="2")))
        start = time.perf_counter()
        estimation_line.dispatch(ctx)
        timings.append(time.perf_counter() - start)
        with ctx.line.lock:
            granted = sorted(ctx.line.grants.items(), key=lambda kv: kv[1])
        for (namespace, name), _ in granted:
            gme = ctx.estimates.get(namespace, name)
            assert gme is not None
            pod = _pod(gme, "Running")
            ctx.pods.put(pod)
            ctx.line.started((namespace, name))
            running.append(pod)
            served.append(f"{namespace}/{name}")
    per_namespace: Dict[str, List[datetime.datetime]] = {}
    for key in served:
        per_namespace.setdefault(key.split("/")[0], []).append(created[key])
    in_order = all(times == sorted(times) for times in per_namespace.values())
    tail = [key.split("/")[0] for key in served[args.cluster:]]
    repeats = sum(1 for a, b in zip(tail, tail[1:]) if a == b)
    print(f"jobs: {args.jobs} namespaces: {args.namespaces} caps: {args.per_namespace}/ns "
          f"{args.cluster}/cluster rounds: {args.rounds} served: {len(served)}")
    print(f"dispatch_ms median: {statistics.median(timings) * 1000:.1f} "
          f"worst: {max(timings) * 1000:.1f}")
    print(f"first_come_first_served_per_namespace: {in_order} "
          f"same_namespace_twice_in_a_row_after_the_first_{args.cluster}: {repeats}")


if __name__ == "__main__":
    main()
