"""The self-signed certificate hook (helm/xmem-admission/files/certgen.py): what it creates,
when it renews, and that the webhook server really serves with what it makes, to a client that
trusts only the generated CA and checks the Service's DNS name the API server uses."""

from __future__ import annotations

import datetime as dt
import importlib.util
import socket
import ssl
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.helm.chart import CHART, run

SCRIPT = CHART / "files" / "certgen.py"
SERVICE, NAMESPACE = "xmem-xmem-admission-webhook", "xmem-system"
NAMES = [SERVICE, f"{SERVICE}.{NAMESPACE}", f"{SERVICE}.{NAMESPACE}.svc",
         f"{SERVICE}.{NAMESPACE}.svc.cluster.local"]


@pytest.fixture(scope="module")
def certgen():
    spec = importlib.util.spec_from_file_location("certgen", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """What `certgen.py generate` writes, run as the hook runs it: a separate Python process."""
    import sys

    out = tmp_path_factory.mktemp("certs")
    run([sys.executable, str(SCRIPT), "generate", "--namespace", NAMESPACE, "--service", SERVICE,
         "--out", str(out), "--cert-days", "30"])
    return out


def _load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_generated_certificate_is_signed_by_the_ca_for_every_service_name(generated: Path) -> None:
    ca, cert = _load(generated / "ca.crt"), _load(generated / "tls.crt")
    cert.verify_directly_issued_by(ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == NAMES
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert dt.timedelta(days=29) < lifetime < dt.timedelta(days=31)
    assert oct((generated / "tls.key").stat().st_mode & 0o777) == "0o600"


def test_the_webhook_server_serves_the_generated_pair_to_a_client_that_checks_the_name(
        generated: Path) -> None:
    from tests.support.harness import make_policy
    from xmem_admission.cluster.admission.metrics import AdmissionMetrics
    from xmem_admission.cluster.admission.server import AdmissionServer, ServeConfig, ServerThread
    from xmem_admission.cluster.admission.webhook import Webhook
    from xmem_admission.cluster.policy.sources import StaticPolicySource
    from xmem_admission.cluster.policy.store import MemoryStore

    policy = StaticPolicySource(make_policy())
    server = AdmissionServer(
        Webhook(policy, MemoryStore(), AdmissionMetrics()), policy,
        ServeConfig(cert_file=str(generated / "tls.crt"), key_file=str(generated / "tls.key"),
                    host="127.0.0.1", port=0, metrics_port=0, log_level="warning"))
    with ServerThread(server):
        port = server.ports[0]
        context = ssl.create_default_context(cafile=str(generated / "ca.crt"))
        for name in (f"{SERVICE}.{NAMESPACE}.svc", f"{SERVICE}.{NAMESPACE}.svc.cluster.local"):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                with context.wrap_socket(raw, server_hostname=name) as tls:
                    assert tls.getpeercert()["subjectAltName"][2] == ("DNS", f"{SERVICE}.{NAMESPACE}.svc")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            with pytest.raises(ssl.SSLCertVerificationError):
                context.wrap_socket(raw, server_hostname="other.xmem-system.svc")


def test_an_empty_secret_gets_a_new_ca_and_certificate(certgen) -> None:
    data, reason = certgen.plan({}, NAMES, 3650, 365, 30, ca_name="test CA")
    assert reason == "new CA"
    assert set(data) == {"ca.crt", "ca.key", "tls.crt", "tls.key"}


def test_a_valid_secret_is_left_alone(certgen) -> None:
    data, _ = certgen.plan({}, NAMES, 3650, 365, 30, ca_name="test CA")
    again, reason = certgen.plan(data, NAMES, 3650, 365, 30, ca_name="test CA")
    assert again is None and reason == "certificate still valid"


def test_a_certificate_near_expiry_is_reissued_by_the_same_ca(certgen) -> None:
    """Renewal keeps the CA, so the caBundle already in the webhook configurations stays valid
    and the server picks the new pair up from disk without a restart."""
    data, _ = certgen.plan({}, NAMES, 3650, 365, 30, ca_name="test CA")
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=340)
    renewed, reason = certgen.plan(data, NAMES, 3650, 365, 30, ca_name="test CA", now=later)
    assert reason.startswith("expires") and "within 30 days" in reason
    assert renewed["ca.crt"] == data["ca.crt"] and renewed["ca.key"] == data["ca.key"]
    assert renewed["tls.crt"] != data["tls.crt"]
    x509.load_pem_x509_certificate(renewed["tls.crt"]).verify_directly_issued_by(
        x509.load_pem_x509_certificate(data["ca.crt"]))


def test_a_renamed_service_gets_a_certificate_for_its_new_names(certgen) -> None:
    data, _ = certgen.plan({}, NAMES, 3650, 365, 30, ca_name="test CA")
    other = certgen.service_names("renamed", NAMESPACE)
    renewed, reason = certgen.plan(data, other, 3650, 365, 30, ca_name="test CA")
    assert reason.startswith("missing names renamed")
    assert renewed["ca.crt"] == data["ca.crt"]


def test_a_certificate_from_another_ca_or_an_expiring_ca_is_replaced(certgen) -> None:
    mine, _ = certgen.plan({}, NAMES, 3650, 365, 30, ca_name="mine")
    theirs, _ = certgen.plan({}, NAMES, 3650, 365, 30, ca_name="theirs")
    mixed = dict(mine, **{"tls.crt": theirs["tls.crt"], "tls.key": theirs["tls.key"]})
    fixed, reason = certgen.plan(mixed, NAMES, 3650, 365, 30, ca_name="mine")
    assert reason == "not issued by the stored CA"
    assert fixed["ca.crt"] == mine["ca.crt"]
    short, _ = certgen.plan({}, NAMES, 20, 365, 30, ca_name="short-lived")
    replaced, reason = certgen.plan(short, NAMES, 3650, 365, 30, ca_name="short-lived")
    assert reason == "new CA" and replaced["ca.crt"] != short["ca.crt"]


def test_the_serving_certificate_never_outlives_its_ca(certgen) -> None:
    data, _ = certgen.plan({}, NAMES, 10, 365, 1, ca_name="test CA")
    ca = x509.load_pem_x509_certificate(data["ca.crt"])
    cert = x509.load_pem_x509_certificate(data["tls.crt"])
    assert cert.not_valid_after_utc <= ca.not_valid_after_utc


def test_the_hooks_create_the_secrets_once_and_patch_both_configurations_on_an_api_server(
        cluster) -> None:
    """Both hook commands, run as the Jobs run them (a separate Python process with the official
    kubernetes client), against the real kube-apiserver (the session's control plane):
    `create` writes the TLS Secret and the CA Secret and is idempotent, `patch` puts that CA into
    every entry of the rendered webhook configurations (renamed here, so that they stay apart
    from the ones other tests point at their webhooks)."""
    import base64
    import os
    import sys

    from kubernetes import client

    from tests.helm.chart import one, render

    objects = render({})
    namespace, webhook = "certgen-hooks", "certgen-hooks-xmem-admission"
    secret_name = "certgen-hooks-webhook-tls"
    mutating = one(objects, "MutatingWebhookConfiguration")
    validating = one(objects, "ValidatingWebhookConfiguration")
    for config in (mutating, validating):
        config["metadata"]["name"] = webhook
        for entry in config["webhooks"]:
            entry["namespaceSelector"] = {"matchLabels": {"certgen-hooks": "never-matches"}}
            entry.pop("objectSelector", None)
    api = cluster.plane.api_client()
    core = client.CoreV1Api(api)
    admission = client.AdmissionregistrationV1Api(api)
    cluster.ensure_namespace(namespace)
    admission.create_mutating_webhook_configuration(mutating)
    admission.create_validating_webhook_configuration(validating)
    try:
        env = dict(os.environ, KUBECONFIG=str(cluster.plane.admin_kubeconfig))
        create = [sys.executable, str(SCRIPT), "create", f"--namespace={namespace}",
                  f"--secret={secret_name}", f"--ca-secret={secret_name}-ca",
                  f"--service={SERVICE}"]

        def hook(args):
            result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, result.stdout + result.stderr
            return result.stdout

        assert "written (new CA)" in hook(create)
        tls = core.read_namespaced_secret(secret_name, namespace)
        ca = core.read_namespaced_secret(f"{secret_name}-ca", namespace)
        assert tls.type == "kubernetes.io/tls"
        assert set(tls.data) == {"ca.crt", "tls.crt", "tls.key"}  # no CA key where pods mount
        assert set(ca.data) == {"ca.crt", "ca.key"} and ca.data["ca.crt"] == tls.data["ca.crt"]
        assert "unchanged" in hook(create)
        assert core.read_namespaced_secret(secret_name, namespace).data == tls.data

        hook([sys.executable, str(SCRIPT), "patch", f"--namespace={namespace}",
              f"--secret={secret_name}", f"--webhook={webhook}"])
        for config in (admission.read_mutating_webhook_configuration(webhook),
                       admission.read_validating_webhook_configuration(webhook)):
            bundles = [base64.b64encode(w.client_config.ca_bundle).decode()
                       if isinstance(w.client_config.ca_bundle, bytes) else w.client_config.ca_bundle
                       for w in config.webhooks]
            assert bundles == [tls.data["ca.crt"]] * 2  # the chart: namespace and object entries
    finally:
        admission.delete_mutating_webhook_configuration(webhook)
        admission.delete_validating_webhook_configuration(webhook)
        cluster.delete("v1", "Namespace", namespace)
        api.close()
