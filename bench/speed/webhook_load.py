"""Admission throughput and latency of ``xmem serve`` over HTTPS on loopback.

Run with no arguments. It makes a CA and a serving certificate (trustme), a HAMi policy for
A100-80GB and H100-80GB and a directory of recorded estimates, starts ``xmem serve`` in its own
process, then runs the load generator in another process: ``--connections`` keep-alive TLS
connections (threads, closed loop: each sends its next review when the previous answer is in),
cycling through a fixed mix of AdmissionReviews:

    35%  Job CREATE, ~20 KB (managedFields, env, volumes), opted in, estimate recorded -> patched
    10%  Job CREATE, ~20 KB, opted in, no estimate                                   -> held
    15%  Job CREATE, ~20 KB, not opted in                                             -> unchanged
    30%  Pod CREATE of a released Job (xmem.io/request-bytes on the pod)              -> HAMi form
    10%  Pod CREATE, not opted in                                                    -> unchanged

It warms up, measures for ``--seconds`` (at most ``--max-requests`` reviews), stops the server
and prints the figures; the last line is ``rps: N p50_ms: X p99_ms: Y errors: E``. An error is a
failed connection, an HTTP status other than 200, or an answer that is not the review's own
(its uid, and the verdict the mix expects). Target on the 2-core machine: >= 1000 rps with
p99 <= 5 ms and no errors. Traffic goes to 127.0.0.1 only; everything stops by itself.
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))

MIX = (("job-estimated", 35), ("job-held", 10), ("job-plain", 15), ("pod-released", 30),
       ("pod-plain", 10))
GPUS = ("A100-80GB", "H100-80GB")


# --- the workloads ------------------------------------------------------------------------------


def _job(name: str, opted_in: bool) -> Dict[str, Any]:
    """A Job as the API server sends it in a review: ~20 KB with managedFields and a real spec."""
    env = [{"name": f"TRAIN_OPTION_{i:03d}", "value": f"value-{i:03d}-" + "x" * 40} for i in range(110)]
    env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}})
    volumes = [{"name": f"data-{i}", "persistentVolumeClaim": {"claimName": f"dataset-shard-{i}"}}
               for i in range(12)]
    mounts = [{"name": f"data-{i}", "mountPath": f"/data/shard-{i}", "readOnly": True} for i in range(12)]
    fields = {f"f:TRAIN_OPTION_{i:03d}": {".": {}, "f:name": {}, "f:value": {}} for i in range(110)}
    labels = {"app": "llm-finetune", "team": "research", "run": name}
    if opted_in:
        labels["xmem.io/estimate"] = "true"
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name, "namespace": "research", "labels": labels,
            "annotations": {"owner": "alice@example.com", "description": "fine-tune " * 20},
            "managedFields": [{
                "manager": "kubectl-client-side-apply", "operation": "Update",
                "apiVersion": "batch/v1", "time": "2026-01-31T12:00:00Z", "fieldsType": "FieldsV1",
                "fieldsV1": {"f:spec": {"f:template": {"f:spec": {"f:containers": {
                    'k:{"name":"train"}': {"f:env": fields}}}}}},
            }],
        },
        "spec": {
            "backoffLimit": 2, "completions": 1, "parallelism": 1, "ttlSecondsAfterFinished": 86400,
            "template": {
                "metadata": {"labels": dict(labels)},
                "spec": {
                    "restartPolicy": "Never",
                    "serviceAccountName": "trainer",
                    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                    "containers": [{
                        "name": "train",
                        "image": "ghcr.io/acme/llm-finetune:2026.01.3",
                        "command": ["python", "-m", "finetune.train"],
                        "args": ["--model", "llama-3-8b", "--batch-size", "8", "--seq-len", "4096",
                                 "--bf16", "--grad-ckpt", "--run", name],
                        "env": env,
                        "resources": {"limits": {"nvidia.com/gpu": "1", "cpu": "8", "memory": "64Gi"},
                                      "requests": {"cpu": "8", "memory": "64Gi"}},
                        "volumeMounts": mounts,
                    }, {
                        "name": "metrics-sidecar", "image": "ghcr.io/acme/metrics:1.4",
                        "resources": {"limits": {"cpu": "100m", "memory": "128Mi"}},
                    }],
                    "volumes": volumes,
                },
            },
        },
    }


def _requester(obj: Dict[str, Any]) -> str:
    """Who creates it: the Job controller makes a Job's pods, a tenant the rest."""
    if obj["kind"] == "Pod" and obj["metadata"].get("ownerReferences"):
        return "system:serviceaccount:kube-system:job-controller"
    return "alice"


def _review(obj: Dict[str, Any], uid: str, kind: Tuple[str, str, str]) -> bytes:
    group, version, resource = kind
    review = {
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": group, "version": version, "kind": obj["kind"]},
            "resource": {"group": group, "version": version, "resource": resource},
            "name": obj["metadata"].get("name", ""), "namespace": "research",
            "operation": "CREATE", "userInfo": {"username": _requester(obj)},
            "object": obj, "oldObject": None, "dryRun": False,
        },
    }
    return json.dumps(review, separators=(",", ":")).encode()


def build_workload(directory: Path) -> List[Tuple[str, bytes, bytes]]:
    """(name, review body, bytes the answer must contain), and the estimate files they need."""
    from xmem_admission.cluster.integrations.job import JobIntegration
    from xmem_admission.cluster.policy import fingerprint
    from xmem_admission.contract import gpus

    job_kind = ("batch", "v1", "jobs")
    pod_kind = ("", "v1", "pods")
    bodies: Dict[str, Tuple[bytes, bytes]] = {}
    estimated = _job("llm-a", True)
    refs = JobIntegration().pod_templates(estimated)
    fp = fingerprint.of_templates([r.template for r in refs], GPUS)
    record = {"fingerprint": fp, "gpus": []}
    for name in GPUS:
        gpu = gpus.lookup(name)
        total = 38 << 30
        record["gpus"].append({"gpu": gpu.key, "capacity_bytes": gpu.capacity_bytes,
                               "peak_reserved_bytes": total - (400 << 20), "total_bytes": total,
                               "recommended_request_bytes": int(total * 1.05), "fits": True,
                               "mig_profile": "3g.40gb"})
    (directory / "estimates").mkdir()
    (directory / "estimates" / "llm-a.json").write_text(json.dumps(record))

    bodies["job-estimated"] = (_review(estimated, "uid-job-estimated", job_kind), b'"patch"')
    bodies["job-held"] = (_review(_job("llm-b", True), "uid-job-held", job_kind), b'"patch"')
    bodies["job-plain"] = (_review(_job("llm-c", False), "uid-job-plain", job_kind), b'"allowed":true}')
    pod = copy.deepcopy(estimated["spec"]["template"])
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": dict(pod["metadata"], name="llm-a-x7k2p", namespace="research",
                            annotations={"xmem.io/request-bytes": str(40 << 30),
                                         "xmem.io/gpu-model": "A100-80GB",
                                         "xmem.io/estimate-bytes": str(38 << 30)},
                            ownerReferences=[{"apiVersion": "batch/v1", "kind": "Job", "name": "llm-a",
                                              "uid": "6b1c5e2a-0000-4000-8000-000000000001",
                                              "controller": True}]),
           "spec": pod["spec"]}
    bodies["pod-released"] = (_review(pod, "uid-pod-released", pod_kind), b'"patch"')
    plain_pod = copy.deepcopy(pod)
    del plain_pod["metadata"]["labels"]["xmem.io/estimate"]
    bodies["pod-plain"] = (_review(plain_pod, "uid-pod-plain", pod_kind), b'"allowed":true}')
    sequence: List[Tuple[str, bytes, bytes]] = []
    for name, weight in MIX:
        body, expect = bodies[name]
        sequence.extend([(name, body, expect)] * weight)
    # interleave so every connection sees the whole mix
    return [sequence[(i * 37) % len(sequence)] for i in range(len(sequence))]


# --- the load generator (its own process) -------------------------------------------------------


def _read_response(tls: ssl.SSLSocket, buffer: bytearray) -> Tuple[int, bytes]:
    while b"\r\n\r\n" not in buffer:
        chunk = tls.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed")
        buffer += chunk
    head, _, rest = bytes(buffer).partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    body = bytearray(rest)
    while len(body) < length:
        chunk = tls.recv(65536)
        if not chunk:
            raise ConnectionError("connection closed")
        body += chunk
    buffer[:] = body[length:]
    return status, bytes(body[:length])


def client(port: int, ca_file: str, connections: int, seconds: float, warmup: float,
           max_requests: int, workload_dir: str) -> Dict[str, Any]:
    requests = []
    for _name, body, expect in build_workload_cached(Path(workload_dir)):
        head = (f"POST /mutate HTTP/1.1\r\nHost: xmem-admission.xmem-system.svc\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        uid = json.loads(body)["request"]["uid"].encode()
        requests.append((head + body, uid, expect))
    context = ssl.create_default_context(cafile=ca_file)
    latencies: List[List[float]] = [[] for _ in range(connections)]
    errors = [0] * connections
    counts = [0] * connections
    start_measure = time.perf_counter() + warmup
    stop = start_measure + seconds
    per_connection = max_requests // connections

    def worker(index: int) -> None:
        buffer = bytearray()
        tls = None
        position = index * 11
        while True:
            now = time.perf_counter()
            if now >= stop or counts[index] >= per_connection:
                break
            payload, uid, expect = requests[position % len(requests)]
            position += 1
            began = time.perf_counter()
            try:
                if tls is None:
                    raw = socket.create_connection(("127.0.0.1", port), timeout=10)
                    raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    tls = context.wrap_socket(raw, server_hostname="xmem-admission.xmem-system.svc")
                    buffer = bytearray()
                began = time.perf_counter()
                tls.sendall(payload)
                status, body = _read_response(tls, buffer)
                took = time.perf_counter() - began
                ok = status == 200 and b'"uid":"' + uid + b'"' in body and expect in body
            except (OSError, ValueError, IndexError):
                ok, took = False, 0.0
                if tls is not None:
                    tls.close()
                tls = None
            if began >= start_measure:
                counts[index] += 1
                latencies[index].append(took)
                if not ok:
                    errors[index] += 1
        if tls is not None:
            tls.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    measured = min(time.perf_counter(), stop) - start_measure
    merged = sorted(x for lat in latencies for x in lat)
    total = len(merged)

    def pct(p: float) -> float:
        return merged[min(total - 1, int(p * total))] * 1000 if total else float("nan")

    return {"requests": total, "seconds": measured, "rps": total / measured if measured > 0 else 0,
            "p50_ms": pct(0.50), "p90_ms": pct(0.90), "p99_ms": pct(0.99),
            "max_ms": merged[-1] * 1000 if total else float("nan"), "errors": sum(errors)}


def build_workload_cached(directory: Path) -> List[Tuple[str, bytes, bytes]]:
    """The client reads the bodies the parent wrote, so both sides send identical bytes."""
    data = json.loads((directory / "bodies.json").read_text())
    return [(n, base64.b64decode(b), base64.b64decode(e)) for n, b, e in data]


# --- orchestration ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(port: int, process: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"xmem serve exited with {process.returncode} while starting")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("xmem serve did not become ready")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--connections", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--max-requests", type=int, default=200_000)
    parser.add_argument("--client", nargs=3, metavar=("PORT", "CA", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        port, ca_file, directory = args.client
        print(json.dumps(client(int(port), ca_file, args.connections, args.seconds, args.warmup,
                                args.max_requests, directory)))
        return 0

    import trustme

    with tempfile.TemporaryDirectory(prefix="xmem-bench-") as tmp:
        work = Path(tmp)
        ca = trustme.CA()
        cert = ca.issue_cert("xmem-admission.xmem-system.svc", "localhost", "127.0.0.1")
        cert.private_key_pem.write_to_path(str(work / "tls.key"))
        cert.cert_chain_pems[0].write_to_path(str(work / "tls.crt"))
        ca.cert_pem.write_to_path(str(work / "ca.crt"))
        (work / "policy.yaml").write_text(
            "apiVersion: xmem.io/v1alpha1\nkind: GPUAdmissionPolicy\nmetadata: {name: bench}\n"
            "spec:\n  targets:\n  - {gpu: A100-80GB, backend: HAMi}\n"
            "  - {gpu: H100-80GB, backend: HAMi}\n"
        )
        sequence = build_workload(work)
        (work / "bodies.json").write_text(json.dumps(
            [(n, base64.b64encode(b).decode(), base64.b64encode(e).decode()) for n, b, e in sequence]))
        sizes = sorted({n: len(b) for n, b, _ in sequence}.items())
        port, health = _free_port(), _free_port()
        env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
        server = subprocess.Popen(
            [sys.executable, "-m", "xmem_admission.cli", "serve", "--host", "127.0.0.1",
             "--port", str(port), "--metrics-port", str(health),
             "--cert-file", str(work / "tls.crt"), "--key-file", str(work / "tls.key"),
             "--policy", str(work / "policy.yaml"), "--estimates", str(work / "estimates"),
             "--log-level", "warning"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        try:
            _wait_ready(health, server)
            load = subprocess.run(
                [sys.executable, __file__, "--connections", str(args.connections),
                 "--seconds", str(args.seconds), "--warmup", str(args.warmup),
                 "--max-requests", str(args.max_requests),
                 "--client", str(port), str(work / "ca.crt"), str(work)],
                env=env, capture_output=True, text=True, timeout=args.seconds + args.warmup + 120,
            )
            if load.returncode != 0:
                print(load.stderr, file=sys.stderr)
                return 1
            result = json.loads(load.stdout)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        print("review sizes (bytes): " + ", ".join(f"{n} {s}" for n, s in sizes))
        print(f"connections: {args.connections}  measured: {result['seconds']:.1f} s  "
              f"requests: {result['requests']}  p90_ms: {result['p90_ms']:.2f}  "
              f"max_ms: {result['max_ms']:.2f}  server exit: {server.returncode}")
        print(f"rps: {result['rps']:.0f} p50_ms: {result['p50_ms']:.2f} "
              f"p99_ms: {result['p99_ms']:.2f} errors: {result['errors']}")
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
