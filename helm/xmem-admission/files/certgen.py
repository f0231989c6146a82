"""Self-signed certificates for the xmem webhook, run by the chart's hook Jobs.

Why a script of our own: the API server only calls webhooks over TLS and must trust the serving
certificate through the caBundle of the webhook configurations. Without cert-manager, something
has to make a CA, sign a certificate for ``<service>.<namespace>.svc`` (SANs: CN-only
certificates are rejected since Kubernetes 1.19), store both in a Secret the webhook mounts, and
put the CA into both configurations. The chart mounts this file into its own image (which has
``cryptography`` and the ``kubernetes`` client) so no third-party image is pulled.

Commands:
  create    pre-install/pre-upgrade hook: make or renew the webhook's Secret (type
            kubernetes.io/tls, keys tls.crt, tls.key, ca.crt) and the CA's own Secret (ca.crt,
            ca.key; mounted by nothing). An existing CA is kept, so a renewal never invalidates
            the caBundle already in the webhook configurations; the serving certificate is
            reissued when it is missing, expires within --renew-days, or lacks a needed name.
  patch     post-install/post-upgrade hook: copy ca.crt into every webhook entry's caBundle of
            the Mutating and Validating configurations named --webhook.
  generate  write ca.crt, tls.crt and tls.key to a directory, for plain manifests and tests.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The Secret keys cert-manager uses too, so the Deployment mounts the same layout either way.
CA_KEY = "ca.crt"
CERT_KEY = "tls.crt"
KEY_KEY = "tls.key"
# The CA's private key, kept in the CA Secret only, so renewals reuse the CA.
CA_PRIVATE_KEY = "ca.key"


def service_names(service: str, namespace: str) -> List[str]:
    """The DNS names the API server may use for the webhook Service."""
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def _now() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


def _key() -> ec.EllipticCurvePrivateKey:
    # P-256: accepted by every TLS stack the API server and Python use, and fast to make.
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def make_ca(common_name: str, days: int) -> Tuple[bytes, bytes]:
    """A new self-signed CA: (certificate PEM, private key PEM)."""
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # tolerate small clock skew
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def make_serving_cert(
    ca_pem: bytes, ca_key_pem: bytes, dns_names: Sequence[str], days: int
) -> Tuple[bytes, bytes]:
    """A serving certificate for ``dns_names`` signed by the CA: (certificate PEM, key PEM)."""
    ca = x509.load_pem_x509_certificate(ca_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = _key()
    now = _now()
    not_after = min(now + dt.timedelta(days=days), ca.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0])]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in dns_names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def needs_new_serving_cert(
    cert_pem: Optional[bytes], ca_pem: bytes, dns_names: Sequence[str], renew_days: int,
    now: Optional[dt.datetime] = None,
) -> Optional[str]:
    """Why the serving certificate must be reissued, or None when it is still good."""
    if not cert_pem:
        return "no serving certificate"
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        ca = x509.load_pem_x509_certificate(ca_pem)
    except ValueError as exc:
        return f"unreadable certificate ({exc})"
    if cert.issuer != ca.subject:
        return "not issued by the stored CA"
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, Exception) as exc:  # InvalidSignature has no common base
        return f"signature does not verify against the CA ({type(exc).__name__})"
    now = now or _now()
    if cert.not_valid_after_utc - now < dt.timedelta(days=renew_days):
        return f"expires {cert.not_valid_after_utc:%Y-%m-%d}, within {renew_days} days"
    try:
        sans = set(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
                   .value.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        sans = set()
    missing = [n for n in dns_names if n not in sans]
    if missing:
        return f"missing names {', '.join(missing)}"
    return None


def ca_still_good(ca_pem: Optional[bytes], ca_key_pem: Optional[bytes], renew_days: int,
                  now: Optional[dt.datetime] = None) -> bool:
    """True when the stored CA can keep signing: readable, with its key, not about to expire."""
    if not ca_pem or not ca_key_pem:
        return False
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        serialization.load_pem_private_key(ca_key_pem, password=None)
    except ValueError:
        return False
    now = now or _now()
    return ca.not_valid_after_utc - now >= dt.timedelta(days=renew_days)


def plan(
    data: dict, dns_names: Sequence[str], ca_days: int, cert_days: int, renew_days: int,
    ca_name: str, now: Optional[dt.datetime] = None,
) -> Tuple[Optional[dict], str]:
    """Given a Secret's decoded data, the new data to store (None: keep it) and why."""
    ca_pem, ca_key_pem = data.get(CA_KEY), data.get(CA_PRIVATE_KEY)
    if not ca_still_good(ca_pem, ca_key_pem, renew_days, now):
        ca_pem, ca_key_pem = make_ca(ca_name, ca_days)
        reason = "new CA"
    else:
        reason = needs_new_serving_cert(data.get(CERT_KEY), ca_pem, dns_names, renew_days, now)
        if reason is None:
            return None, "certificate still valid"
    cert_pem, key_pem = make_serving_cert(ca_pem, ca_key_pem, dns_names, cert_days)
    return {CA_KEY: ca_pem, CA_PRIVATE_KEY: ca_key_pem, CERT_KEY: cert_pem, KEY_KEY: key_pem}, reason


# --- Kubernetes side (the hook Jobs) -------------------------------------------------------


def _api():
    """The kubernetes client, with the pod's service account (the hook Jobs) or, run by hand
    outside a cluster, $KUBECONFIG."""
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    try:
        config.load_incluster_config()
    except ConfigException:
        config.load_kube_config()
    return client


def _retry(what: str, call, attempts: int = 30, delay: float = 2.0, not_found: bool = False):
    """Retry transient API failures (the API server may be busy during an upgrade). With
    ``not_found``, a 404 is waited out too: applied as plain manifests, the patch Job can start
    before the create Job has written the Secret."""
    from kubernetes.client.exceptions import ApiException

    for attempt in range(1, attempts + 1):
        try:
            return call()
        except ApiException as exc:
            # 409 is not retried: the body is stale; the Job restarts and reads again.
            transient = exc.status == 429 or exc.status >= 500
            if not (transient or (not_found and exc.status == 404)) or attempt == attempts:
                raise
            print(f"certgen: {what}: HTTP {exc.status}, retrying", file=sys.stderr)
            time.sleep(delay)


def _read_secret(core, name: str, namespace: str):
    from kubernetes.client.exceptions import ApiException

    try:
        secret = core.read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return None, {}
    return secret, {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}


def _write_secret(client, core, namespace: str, name: str, existing, kind: str, data: dict) -> None:
    body = client.V1Secret(
        metadata=client.V1ObjectMeta(
            name=name, namespace=namespace,
            labels={"app.kubernetes.io/managed-by": "xmem-certgen"},
        ),
        type=kind,
        data={k: base64.b64encode(v).decode() for k, v in data.items()},
    )
    if existing is None:
        _retry(f"create Secret {name}", lambda: core.create_namespaced_secret(namespace, body))
    else:
        # Optimistic concurrency: a concurrent writer makes this fail with 409, not vanish.
        body.metadata.resource_version = existing.metadata.resource_version
        _retry(f"replace Secret {name}",
               lambda: core.replace_namespaced_secret(name, namespace, body))


def cmd_create(args: argparse.Namespace) -> int:
    client = _api()
    core = client.CoreV1Api()
    names = service_names(args.service, args.namespace)
    # The CA key lives in its own Secret that no pod mounts: the webhook only needs its pair.
    ca_secret, ca_data = _read_secret(core, args.ca_secret, args.namespace)
    tls_secret, tls_data = _read_secret(core, args.secret, args.namespace)
    current = {CA_KEY: ca_data.get(CA_KEY), CA_PRIVATE_KEY: ca_data.get(CA_PRIVATE_KEY),
               CERT_KEY: tls_data.get(CERT_KEY), KEY_KEY: tls_data.get(KEY_KEY)}
    data, reason = plan(current, names, args.ca_days, args.cert_days, args.renew_days,
                        ca_name=f"{args.service} CA")
    if data is None and tls_data.get(CA_KEY) == ca_data.get(CA_KEY):
        print(f"certgen: Secret {args.namespace}/{args.secret}: {reason}; unchanged")
        return 0
    data = data or current
    if data[CA_KEY] != ca_data.get(CA_KEY) or data[CA_PRIVATE_KEY] != ca_data.get(CA_PRIVATE_KEY):
        _write_secret(client, core, args.namespace, args.ca_secret, ca_secret, "Opaque",
                      {CA_KEY: data[CA_KEY], CA_PRIVATE_KEY: data[CA_PRIVATE_KEY]})
    _write_secret(client, core, args.namespace, args.secret, tls_secret, "kubernetes.io/tls",
                  {CA_KEY: data[CA_KEY], CERT_KEY: data[CERT_KEY], KEY_KEY: data[KEY_KEY]})
    print(f"certgen: Secret {args.namespace}/{args.secret} written ({reason})")
    return 0


def ca_patch(webhooks: Sequence[object], ca_b64: str) -> List[dict]:
    """JSON patch setting caBundle on every entry; each index is guarded by a test of its name."""
    ops: List[dict] = []
    for index, hook in enumerate(webhooks):
        name = hook["name"] if isinstance(hook, dict) else hook.name
        ops.append({"op": "test", "path": f"/webhooks/{index}/name", "value": name})
        ops.append({"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": ca_b64})
    return ops


def cmd_patch(args: argparse.Namespace) -> int:
    client = _api()
    core = client.CoreV1Api()
    admission = client.AdmissionregistrationV1Api()
    secret = _retry("read secret", lambda: core.read_namespaced_secret(args.secret, args.namespace),
                    not_found=True)
    ca_b64 = (secret.data or {}).get(CA_KEY)
    if not ca_b64:
        print(f"certgen: Secret {args.namespace}/{args.secret} has no {CA_KEY}", file=sys.stderr)
        return 1
    for kind, read, patch in (
        ("MutatingWebhookConfiguration", admission.read_mutating_webhook_configuration,
         admission.patch_mutating_webhook_configuration),
        ("ValidatingWebhookConfiguration", admission.read_validating_webhook_configuration,
         admission.patch_validating_webhook_configuration),
    ):
        config = _retry(f"read {kind}", lambda read=read: read(args.webhook), not_found=True)
        ops = ca_patch(config.webhooks or [], ca_b64)
        # A list body makes the client send application/json-patch+json.
        _retry(f"patch {kind}", lambda patch=patch, ops=ops: patch(args.webhook, ops))
        print(f"certgen: {kind}/{args.webhook}: caBundle set on {len(ops) // 2} webhooks")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    data, _ = plan({}, service_names(args.service, args.namespace), args.ca_days,
                   args.cert_days, args.renew_days, ca_name=f"{args.service} CA")
    os.makedirs(args.out, exist_ok=True)
    for key in (CA_KEY, CERT_KEY, KEY_KEY):
        path = os.path.join(args.out, key)
        with open(path, "wb") as handle:
            handle.write(data[key])
        if key == KEY_KEY:
            os.chmod(path, 0o600)
    print(f"certgen: wrote {CA_KEY}, {CERT_KEY}, {KEY_KEY} to {args.out}")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="certgen", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name, func in (("create", cmd_create), ("patch", cmd_patch), ("generate", cmd_generate)):
        p = sub.add_parser(name)
        p.set_defaults(func=func)
        p.add_argument("--namespace", required=True)
        if name in ("create", "patch"):
            p.add_argument("--secret", required=True, help="the webhook's TLS Secret")
        if name == "create":
            p.add_argument("--ca-secret", required=True, help="the CA's Secret (with its key)")
        if name in ("create", "generate"):
            p.add_argument("--service", required=True)
            p.add_argument("--ca-days", type=int, default=3650)
            p.add_argument("--cert-days", type=int, default=365)
            p.add_argument("--renew-days", type=int, default=30)
        if name == "patch":
            p.add_argument("--webhook", required=True, help="name of both configurations")
        if name == "generate":
            p.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
