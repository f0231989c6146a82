"""Driving the webhook: over real HTTPS on loopback, or in-process through the same entry point.

``HttpsWebhook`` runs the real server (``xmem_admission.cluster.admission.server``: uvicorn, the TLS context it
reloads, the FastAPI app) in a thread with a trustme CA and a serving certificate with SANs,
and posts AdmissionReview JSON with httpx, verifying the certificate. ``LocalWebhook`` calls
``Webhook.review`` with the same bytes, for the property tests that send thousands of reviews.
Both return an ``Answer`` whose patch is decoded and applied with the ``jsonpatch`` library, an
implementation independent of ours.
"""

from __future__ import annotations

import base64
import json
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Type

import httpx
import jsonpatch
import orjson
import trustme

from xmem_admission.cluster.admission.metrics import AdmissionMetrics
from xmem_admission.cluster.admission.server import AdmissionServer, ServeConfig, ServerThread
from xmem_admission.cluster.admission.webhook import Endpoint, Scope, Webhook
from xmem_admission.cluster.policy.model import Policy
from xmem_admission.cluster.policy.sources import StaticPolicySource
from xmem_admission.cluster.policy.store import EstimateRecord, MemoryStore

FIXED_NOW = "2026-01-31T12:00:00Z"


def make_policy(backend: str = "HAMi", gpus: Iterable[str] = ("A100-80GB", "H100-80GB"),
                **spec: Any) -> Policy:
    """A policy with the given backend for every target GPU, plus any spec fields."""
    body: Dict[str, Any] = {"targets": [{"gpu": g, "backend": backend} for g in gpus]}
    body.update(spec)
    return Policy.from_spec(body)


@dataclass
class Answer:
    """A decoded AdmissionReview response."""

    review: Dict[str, Any]
    request: Dict[str, Any]

    @property
    def response(self) -> Dict[str, Any]:
        return self.review["response"]

    @property
    def allowed(self) -> bool:
        return self.response["allowed"]

    @property
    def ops(self) -> List[Dict[str, Any]]:
        raw = self.response.get("patch")
        if raw is None:
            return []
        assert self.response["patchType"] == "JSONPatch"
        return json.loads(base64.b64decode(raw))

    @property
    def warnings(self) -> List[str]:
        return self.response.get("warnings", [])

    @property
    def status(self) -> Dict[str, Any]:
        return self.response.get("status", {})

    def patched(self) -> Dict[str, Any]:
        """The request's object with the patch applied (by the jsonpatch library)."""
        obj = self.request["request"]["object"]
        return jsonpatch.apply_patch(obj, self.ops) if self.ops else obj


class _Base:
    store: MemoryStore
    webhook: Webhook

    def use(self, policy: Policy) -> None:
        self.webhook.policy = StaticPolicySource(policy)

    def record(self, *records: EstimateRecord) -> None:
        for record in records:
            self.store.put(record)

    def post(self, path: str, body: bytes) -> Dict[str, Any]:
        raise NotImplementedError

    def send(self, review: Dict[str, Any], endpoint: str = "mutate", scope: str = "") -> Answer:
        path = f"/{endpoint}" + (f"/{scope}" if scope else "")
        return Answer(self.post(path, orjson.dumps(review)), review)


class LocalWebhook(_Base):
    """``Webhook.review`` in this thread: the code path the HTTP handler calls."""

    def __init__(self, policy: Policy, on_hold: Any = None):
        self.store = MemoryStore()
        self.webhook = Webhook(StaticPolicySource(policy), self.store, AdmissionMetrics(),
                               clock=lambda: FIXED_NOW, on_hold=on_hold)

    def post(self, path: str, body: bytes) -> Dict[str, Any]:
        parts = path.strip("/").split("/")
        scope = Scope(parts[1]) if len(parts) > 1 else Scope.OBJECT
        return orjson.loads(self.webhook.review(body, Endpoint(parts[0]), scope))


class Certificates:
    """A CA and a serving certificate with the SANs a cluster Service and loopback need."""

    def __init__(self, directory: Path):
        self.ca = trustme.CA()
        self.directory = directory
        self.cert_file = directory / "tls.crt"
        self.key_file = directory / "tls.key"
        self.ca_file = directory / "ca.crt"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self.rotate()

    def rotate(self) -> None:
        """Issue a new serving certificate and write it where the server reads it."""
        cert = self.ca.issue_cert(
            "xmem-admission.xmem-system.svc", "xmem-admission.xmem-system.svc.cluster.local",
            "localhost", "127.0.0.1",
        )
        cert.private_key_pem.write_to_path(str(self.key_file))
        cert.cert_chain_pems[0].write_to_path(str(self.cert_file))

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context()
        self.ca.configure_trust(context)
        return context


class HttpsWebhook(_Base):
    """The real server on loopback, TLS with a certificate the client verifies."""

    def __init__(self, policy: Policy, certs: Certificates, on_hold: Any = None,
                 reload_seconds: float = 0.2, webhook_class: Type[Webhook] = Webhook,
                 **config: Any):
        self.certs = certs
        self.store = MemoryStore()
        self.webhook = webhook_class(StaticPolicySource(policy), self.store, AdmissionMetrics(),
                                     clock=lambda: FIXED_NOW, on_hold=on_hold)
        config = ServeConfig(cert_file=str(certs.cert_file), key_file=str(certs.key_file),
                             host="127.0.0.1", port=0, metrics_port=0,
                             reload_seconds=reload_seconds, log_level="warning", **config)
        self.server = AdmissionServer(self.webhook, self.webhook.policy, config)
        self.thread = ServerThread(self.server).start()
        self.port, self.health_port = self.server.ports
        self.client = httpx.Client(
            base_url=f"https://localhost:{self.port}", verify=certs.client_context(), timeout=10
        )
        self.health = httpx.Client(base_url=f"http://127.0.0.1:{self.health_port}", timeout=10)

    def post(self, path: str, body: bytes) -> Dict[str, Any]:
        reply = self.client.post(path, content=body, headers={"Content-Type": "application/json"})
        assert reply.status_code == 200, (reply.status_code, reply.text)
        return reply.json()

    def post_raw(self, path: str, body: bytes, headers: Optional[Dict[str, str]] = None) -> httpx.Response:
        return self.client.post(path, content=body, headers=headers or {})

    def close(self) -> None:
        self.client.close()
        self.health.close()
        self.thread.stop()


class ServeProcess:
    """``xmem serve`` in its own process, as it runs in a pod (``gc.freeze`` and all), on
    loopback: admission over TLS with ``certs``, health and metrics in plain HTTP."""

    def __init__(self, root: Path, certs: Certificates, *args: str, name: str = "serve") -> None:
        import re
        import subprocess
        import sys
        import time

        self.log = root / f"{name}.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "xmem_admission.cli", "serve", "--cert-file",
                 str(certs.cert_file), "--key-file", str(certs.key_file), "--host", "127.0.0.1",
                 "--port", "0", "--metrics-port", "0", "--log-level", "warning", *args],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        found = None
        while found is None:
            found = re.search(r"admission on https://127\.0\.0\.1:(\d+).*health on "
                              r"http://127\.0\.0\.1:(\d+)", self.log.read_text())
            if found is None:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"xmem serve did not start:\n{self.log.read_text()}")
                time.sleep(0.05)
        self.port, self.health_port = int(found.group(1)), int(found.group(2))

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.health_port}/metrics", timeout=10).text

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(10)
        except Exception:  # noqa: BLE001 - a stuck server is killed
            self.process.kill()
            self.process.wait(10)


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of every sample of a metric whose labels include these (0 when none)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v
                                              for k, v in labels.items()))


def metric(text: str, name: str, **labels: str) -> Optional[float]:
    """The value of one sample in a Prometheus exposition, None when absent."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None
