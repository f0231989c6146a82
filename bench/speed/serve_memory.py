"""Memory bound of ``xmem serve``: its resident memory after 10,000 maximal reviews, against the
memory limit the Helm chart gives the webhook.

Run with no arguments (``--reviews N`` for another count). It starts ``xmem serve`` in its own
process (TLS on loopback, a HAMi policy that enforces), then sends over one keep-alive
connection, in rotation, the largest reviews each bound lets through and the hostile ones it
must refuse cheaply:

    update-3MiB     a Job UPDATE: 1.5 MiB object (etcd's limit) and its 1.5 MiB old version,
                    thousands of env entries; a new workload name each time
    values-7MiB     7 MiB of empty JSON objects (more values than any review holds: refused
                    before parsing)
    body-9MiB       a 9 MiB chunked body (refused once 8 MiB have streamed in)
    names-1MB       a Pod whose owner, name and namespace are 1 MB each, sized from a
                    recorded estimate (a metrics series whose labels must stay bounded)
    job-20KB        an ordinary Job, a new name each time (per-workload series up to the cap)

and scrapes ``/metrics`` every 500 reviews. It prints the server's RSS before and after, its
peak (``VmHWM``), the scrape sizes and the chart's limit; the last line is
``rss_mib: R peak_mib: P limit_mib: L reviews: N errors: E ok: yes|no`` (``ok``: the peak stays
under the limit and every answer was HTTP 200). Loopback only; everything stops by itself.
"""

from __future__ import annotations

import argparse
import copy
import http.client
import json
import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from bench.speed.webhook_load import GPUS, _job  # noqa: E402 - after the path set-up

MiB = 1 << 20
JOB_CONTROLLER = "system:serviceaccount:kube-system:job-controller"


def chart_limit_bytes() -> int:
    """The webhook's memory limit in the chart's values (``webhook.resources.limits.memory``)."""
    import yaml

    from xmem_admission.cluster.kube.quantity import parse_bytes

    values = yaml.safe_load((ROOT / "helm/xmem-admission/values.yaml").read_text())
    return parse_bytes(values["webhook"]["resources"]["limits"]["memory"])


def _review(obj: Dict[str, Any], operation: str = "CREATE", old: Any = None,
            user: str = "alice") -> Dict[str, Any]:
    group, _, version = obj["apiVersion"].rpartition("/")
    plural = {"Job": "jobs", "Pod": "pods"}[obj["kind"]]
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u", "kind": {"group": group, "version": version, "kind": obj["kind"]},
        "resource": {"group": group, "version": version, "resource": plural},
        "name": obj["metadata"]["name"], "namespace": obj["metadata"]["namespace"],
        "operation": operation, "userInfo": {"username": user}, "object": obj,
        "oldObject": old, "dryRun": False}}


def _big_job(name: str, target: int) -> Dict[str, Any]:
    job = _job(name, True)
    container = job["spec"]["template"]["spec"]["containers"][0]
    entry = len(json.dumps({"name": "E00000", "value": "v" * 200})) + 1
    container["env"] = [{"name": f"E{i:05d}", "value": "v" * 200}
                        for i in range(target // entry)]
    return job


def workloads(directory: Path) -> Dict[str, Tuple[bytes, bytes]]:
    """(body template with NAME where a fresh name goes, what a good answer contains)."""
    from xmem_admission.cluster.integrations.pod import PodIntegration
    from xmem_admission.cluster.policy import fingerprint
    from xmem_admission.contract import gpus

    out: Dict[str, Tuple[bytes, bytes]] = {}
    big = _big_job("NAME", int(1.5 * MiB))
    old = copy.deepcopy(big)
    big["spec"]["suspend"] = False
    out["update-3MiB"] = (json.dumps(_review(big, "UPDATE", old)).encode(), b'"allowed"')
    out["values-7MiB"] = (b'{"a":[' + b"{}," * (7 * MiB // 3) + b"{}]}", b'"code":400')
    out["body-9MiB"] = (b" " * (9 * MiB), b'"code":413')
    pod = copy.deepcopy(_job("x", True)["spec"]["template"])
    huge = "n" * 1_000_000
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": dict(
        pod["metadata"], name="NAME" + huge, namespace="research",
        ownerReferences=[{"apiVersion": "batch/v1", "kind": "Job", "name": "NAME" + huge,
                          "uid": "u", "controller": True}]), "spec": pod["spec"]}
    fp = fingerprint.of_templates([r.template for r in PodIntegration().pod_templates(pod)], GPUS)
    rows = [{"gpu": g, "capacity_bytes": gpus.lookup(g).capacity_bytes,
             "peak_reserved_bytes": 30 << 30, "total_bytes": 31 << 30,
             "recommended_request_bytes": 33 << 30, "fits": True, "mig_profile": None}
            for g in GPUS]
    (directory / "estimates").mkdir()
    (directory / "estimates" / "pod.json").write_text(json.dumps({
        "fingerprint": fp, "gpus": rows, "workload": {"namespace": "research", "kind": "Job",
                                                       "name": "x"}}))
    out["names-1MB"] = (json.dumps(_review(pod, user=JOB_CONTROLLER)).encode(), b'"patch"')
    out["job-20KB"] = (json.dumps(_review(_job("NAME", True))).encode(), b'"patch"')
    return out


def _rss(pid: int) -> Tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in bytes."""
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields["VmRSS"], fields["VmHWM"]


def _chunks(body: bytes, size: int = 1 << 20) -> Iterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start:start + size]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reviews", type=int, default=10_000)
    args = parser.parse_args()
    import trustme

    work = Path(tempfile.mkdtemp(prefix="xmem-serve-memory-"))
    ca = trustme.CA()
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.private_key_pem.write_to_path(str(work / "tls.key"))
    cert.cert_chain_pems[0].write_to_path(str(work / "tls.crt"))
    policy = {"apiVersion": "xmem.io/v1alpha1", "kind": "GPUAdmissionPolicy",
              "metadata": {"name": "default"},
              "spec": {"targets": [{"gpu": g, "backend": "HAMi"} for g in GPUS],
                       "enforcement": "Enforce"}}
    (work / "policy.yaml").write_text(json.dumps(policy))
    mix = workloads(work)
    log = open(work / "serve.log", "wb")  # noqa: SIM115 - owned by the child
    server = subprocess.Popen(
        [sys.executable, "-m", "xmem_admission.cli", "serve", "--cert-file", str(work / "tls.crt"),
         "--key-file", str(work / "tls.key"), "--host", "127.0.0.1", "--port", "0",
         "--metrics-port", "0", "--policy", str(work / "policy.yaml"), "--estimates",
         str(work / "estimates"), "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    log.close()
    try:
        return _drive(server, work, ca, mix, args.reviews)
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


def _drive(server: subprocess.Popen, work: Path, ca: Any, mix: Dict[str, Tuple[bytes, bytes]],
           reviews: int) -> int:
    import re

    deadline = time.monotonic() + 30
    ports = None
    while ports is None and time.monotonic() < deadline:
        found = re.search(rb"admission on https://127\.0\.0\.1:(\d+).*health on "
                          rb"http://127\.0\.0\.1:(\d+)", (work / "serve.log").read_bytes())
        ports = (int(found.group(1)), int(found.group(2))) if found else None
        time.sleep(0.05)
    if ports is None:
        print((work / "serve.log").read_text(), file=sys.stderr)
        return 2
    context = ssl.create_default_context()
    ca.configure_trust(context)
    start_rss, _ = _rss(server.pid)
    print(f"xmem serve pid {server.pid}: rss at start {start_rss / MiB:.1f} MiB", flush=True)
    names = list(mix)
    connection = None
    errors = 0
    scrapes: List[int] = []
    began = time.monotonic()
    for index in range(reviews):
        name = names[index % len(names)]
        template, expect = mix[name]
        body = template.replace(b"NAME", f"w{index:06d}".encode()) if b"NAME" in template \
            else template
        if connection is None:
            connection = http.client.HTTPSConnection("localhost", ports[0], context=context,
                                                     timeout=60)
        try:
            if name == "body-9MiB":
                connection.request("POST", "/mutate", _chunks(body),
                                   {"Content-Type": "application/json",
                                    "Transfer-Encoding": "chunked"}, encode_chunked=True)
            else:
                connection.request("POST", "/mutate", body, {"Content-Type": "application/json"})
            reply = connection.getresponse()
            data = reply.read()
            if reply.status != 200 or expect not in data:
                errors += 1
                print(f"{name}: HTTP {reply.status} {data[:200]!r}", file=sys.stderr)
            if reply.getheader("Connection", "").lower() == "close":
                connection.close()
                connection = None
        except (OSError, http.client.HTTPException) as exc:
            errors += 1
            print(f"{name}: {type(exc).__name__}: {exc}", file=sys.stderr)
            connection.close()
            connection = None
        if (index + 1) % 500 == 0:
            scrape = http.client.HTTPConnection("127.0.0.1", ports[1], timeout=30)
            scrape.request("GET", "/metrics")
            scrapes.append(len(scrape.getresponse().read()))
            scrape.close()
            rss, peak = _rss(server.pid)
            print(f"{index + 1:6d} reviews  rss {rss / MiB:6.1f} MiB  peak {peak / MiB:6.1f} MiB"
                  f"  /metrics {scrapes[-1] / 1024:7.1f} KiB  {time.monotonic() - began:6.1f} s",
                  flush=True)
    rss, peak = _rss(server.pid)
    limit = chart_limit_bytes()
    ok = peak < limit and errors == 0
    print(f"largest /metrics scrape: {max(scrapes or [0]) / 1024:.1f} KiB")
    print(f"rss_mib: {rss / MiB:.1f} peak_mib: {peak / MiB:.1f} limit_mib: {limit / MiB:.0f} "
          f"reviews: {reviews} errors: {errors} ok: {'yes' if ok else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
