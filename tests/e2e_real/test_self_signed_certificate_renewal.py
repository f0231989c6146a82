"""The chart's self-signed certificate is renewed by the running webhook, not only by helm
upgrade, on the real control plane: with a CA and serving certificate that live 30 seconds
(as the chart's hook leaves them, short-lived), ``xmem serve`` under the webhook's own service
account (the chart's RBAC) renews both in their Secrets before they expire, serves the new pair
at once, writes the new CA into both webhook configurations beside the old one, and the API
server, with failurePolicy Fail, still calls it once the first certificate has expired. A pair
written into the Secret from elsewhere (another replica) is served within a check."""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
import socket
import ssl
import sys
import urllib.request
from typing import Any, Dict

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from kubernetes import client

from localkube.cluster import NAMESPACE, Webhook, render_chart
from localkube.controlplane import wait_for
from tests.e2e_real.support import held, job
from tests.support.harness import metric
from xmem_admission.cluster.admission import certificates as certs

SERVICE = "xmem-xmem-admission-webhook"
SECRET, CA_SECRET = f"{SERVICE}-tls", f"{SERVICE}-tls-ca"
CONFIGURATION = "xmem-xmem-admission"
DAY = 86400.0


def _secret(core: Any, name: str, kind: str, data: Dict[str, bytes]) -> None:
    body = {"metadata": {"name": name, "namespace": NAMESPACE}, "type": kind,
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}
    try:
        core.delete_namespaced_secret(name, NAMESPACE)
    except client.ApiException as exc:
        assert exc.status == 404, exc.body
    core.create_namespaced_secret(NAMESPACE, body)


def _read(core: Any, name: str) -> Dict[str, bytes]:
    data = core.read_namespaced_secret(name, NAMESPACE).data or {}
    return {k: base64.b64decode(v) for k, v in data.items()}


def _served(port: int) -> bytes:
    """The certificate the webhook presents, DER."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("localhost", port), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname="localhost") as tls:
        return tls.getpeercert(binary_form=True) or b""


def _der(pem: bytes) -> bytes:
    return x509.load_pem_x509_certificate(pem).public_bytes(Encoding.DER)


def _not_after(pem: bytes) -> dt.datetime:
    return x509.load_pem_x509_certificate(pem).not_valid_after_utc


def test_the_running_webhook_renews_its_self_signed_certificate_and_ca_before_expiry(xmem,
                                                                                       tmp_path):
    cluster, ns = xmem.cluster, xmem.namespace
    core = client.CoreV1Api(cluster.api)
    names = certs.service_names(SERVICE, NAMESPACE) + ["localhost"]
    first, _ = certs.plan({}, names, ca_days=30 / DAY, cert_days=30 / DAY, renew_days=0,
                          ca_name=f"{SERVICE} CA")
    assert first is not None
    _secret(core, CA_SECRET, "Opaque", {k: first[k] for k in (certs.CA_KEY, certs.CA_PRIVATE_KEY)})
    _secret(core, SECRET, "kubernetes.io/tls",
            {k: first[k] for k in (certs.CA_KEY, certs.CERT_KEY, certs.KEY_KEY)})
    # The files the Deployment mounts from the Secret (a kubelet would keep them in step).
    (tmp_path / "tls.crt").write_bytes(first[certs.CERT_KEY])
    (tmp_path / "tls.key").write_bytes(first[certs.KEY_KEY])

    name = f"serve-{ns}"
    process = cluster._spawn(name, [
        sys.executable, "-m", "xmem_admission.cli", "serve",
        "--cert-file", str(tmp_path / "tls.crt"), "--key-file", str(tmp_path / "tls.key"),
        "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
        "--kubeconfig", str(cluster.webhook_kubeconfig), "--policy-name", xmem.policy_name,
        "--cert-secret", SECRET, "--ca-secret", CA_SECRET, "--cert-namespace", NAMESPACE,
        "--cert-service", SERVICE, "--webhook-configuration", CONFIGURATION,
        "--cert-extra-name", "localhost", "--ca-days", "1", "--cert-days", "1",
        "--renew-days", str(20 / DAY), "--cert-check-seconds", "1", "--reload-seconds", "0.5"])
    log = lambda: cluster.log(name)  # noqa: E731
    port, health = (int(p) for p in wait_for(lambda: re.search(
        r"admission on https://127\.0\.0\.1:(\d+).*health on http://127\.0\.0\.1:(\d+)",
        log()), 60, "xmem serve to listen").groups())
    xmem.webhook = Webhook(cluster, name, process, port)
    # Fail: a call that fails is an error, not a silent admission; 30 s: a loaded machine's
    # first review may be slow.
    for doc in render_chart({"webhook": {"failurePolicy": "Fail", "timeoutSeconds": 30}}):
        if doc["kind"].endswith("WebhookConfiguration"):
            for entry in doc["webhooks"]:
                path = entry["clientConfig"]["service"]["path"]
                entry["clientConfig"] = {
                    "url": f"https://localhost:{port}{path}",
                    "caBundle": base64.b64encode(first[certs.CA_KEY]).decode()}
            cluster.apply(doc)

    # The API server calls it (a dry run; the first review also warms the webhook up).
    batch = client.BatchV1Api(cluster.api)
    wait_for(lambda: held(json.loads(batch.create_namespaced_job(
        ns, job("before", ns), dry_run="All", _preload_content=False).data)), 30,
        "the API server to call the webhook")

    # Renewed within its last 20 seconds: a new CA (the old one expires too) and certificate.
    renewed = wait_for(lambda: (lambda d: d if d[certs.CERT_KEY] != first[certs.CERT_KEY]
                                else None)(_read(core, SECRET)), 40,
                       f"the certificate to be renewed (log: {log()[-2000:]})")
    new_ca = _read(core, CA_SECRET)
    assert new_ca[certs.CA_KEY] != first[certs.CA_KEY]
    assert _not_after(renewed[certs.CERT_KEY]) > _not_after(first[certs.CERT_KEY]) + \
        dt.timedelta(hours=23)
    # The Secret's CA bundle: the new CA first, the old one while it is valid.
    assert renewed[certs.CA_KEY] == new_ca[certs.CA_KEY].strip() + b"\n" + \
        first[certs.CA_KEY].strip() + b"\n"
    wait_for(lambda: "renewed the serving certificate (new CA)" in log(), 10,
             "the renewal in the webhook's log")

    # Served at once, and the expiry metric follows.
    wait_for(lambda: _served(port) == _der(renewed[certs.CERT_KEY]), 10,
             "the renewed certificate to be served")
    scraped = urllib.request.urlopen(f"http://127.0.0.1:{health}/metrics", timeout=5).read()
    expiry = metric(scraped.decode(), "xmem_admission_certificate_expiry_timestamp_seconds")
    assert expiry == _not_after(renewed[certs.CERT_KEY]).timestamp()

    # Both configurations trust the new CA, every entry.
    bundle = base64.b64encode(renewed[certs.CA_KEY]).decode()
    admission = client.AdmissionregistrationV1Api(cluster.api)
    wait_for(lambda: all(h.client_config.ca_bundle == bundle
                         for read in (admission.read_mutating_webhook_configuration,
                                      admission.read_validating_webhook_configuration)
                         for h in read(CONFIGURATION).webhooks), 10, "the caBundles")

    # Past the first certificate's and CA's end, the API server still calls the webhook.
    wait_for(lambda: dt.datetime.now(dt.timezone.utc) > _not_after(first[certs.CERT_KEY]), 40,
             "the first certificate to expire")
    created = batch.create_namespaced_job(ns, job("after-expiry", ns), _preload_content=False)
    assert held(json.loads(created.data))

    # A pair another replica wrote into the Secret is served within a check.
    other, key = certs.make_serving_cert(new_ca[certs.CA_KEY], new_ca[certs.CA_PRIVATE_KEY],
                                         names, 2)
    secret = core.read_namespaced_secret(SECRET, NAMESPACE)
    secret.data[certs.CERT_KEY] = base64.b64encode(other).decode()
    secret.data[certs.KEY_KEY] = base64.b64encode(key).decode()
    core.replace_namespaced_secret(SECRET, NAMESPACE, secret)
    wait_for(lambda: _served(port) == _der(other), 10, "the Secret's new pair to be served")
