"""The webhook's self-signed serving certificate: made, checked and renewed.

Without cert-manager the chart's hook Jobs (``files/certgen.py``, which imports this module)
make a CA and a serving certificate before install and upgrade, and put the CA into the webhook
configurations' ``caBundle``. Between upgrades the running webhook keeps them valid itself, as
Kueue's certificate controller does: ``Rotator.check`` (every ``--cert-check-seconds``) reads
the Secret, renews the serving certificate (and the CA, when it nears its own end) once it is
within ``renew_days`` of expiry, serves the Secret's pair as soon as it differs from the one
served, and writes the CA into every entry's ``caBundle`` where it is missing. A renewed CA is
written beside the one it replaces while that one is valid, so the API server trusts
certificates from either during the change-over. Replicas race safely: a Secret is replaced
with its resourceVersion, a conflict is left to the next check, which reads the winner's pair.
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
import os
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

log = logging.getLogger(__name__)

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


def make_ca(common_name: str, days: float) -> Tuple[bytes, bytes]:
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
    ca_pem: bytes, ca_key_pem: bytes, dns_names: Sequence[str], days: float
) -> Tuple[bytes, bytes]:
    """A serving certificate for ``dns_names`` signed by the CA: (certificate PEM, key PEM)."""
    ca = x509.load_pem_x509_certificate(ca_pem)
    ca_key: Any = serialization.load_pem_private_key(ca_key_pem, password=None)
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
    cert_pem: Optional[bytes], ca_pem: bytes, dns_names: Sequence[str], renew_days: float,
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


def ca_still_good(ca_pem: Optional[bytes], ca_key_pem: Optional[bytes], renew_days: float,
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
    data: Dict[str, Optional[bytes]], dns_names: Sequence[str], ca_days: float, cert_days: float, renew_days: float,
    ca_name: str, now: Optional[dt.datetime] = None,
) -> Tuple[Optional[Dict[str, bytes]], str]:
    """Given a Secret's decoded data, the new data to store (None: keep it) and why."""
    ca_pem, ca_key_pem = data.get(CA_KEY), data.get(CA_PRIVATE_KEY)
    if ca_pem is None or ca_key_pem is None or \
            not ca_still_good(ca_pem, ca_key_pem, renew_days, now):
        ca_pem, ca_key_pem = make_ca(ca_name, ca_days)
        reason = "new CA"
    else:
        why = needs_new_serving_cert(data.get(CERT_KEY), ca_pem, dns_names, renew_days, now)
        if why is None:
            return None, "certificate still valid"
        reason = why
    cert_pem, key_pem = make_serving_cert(ca_pem, ca_key_pem, dns_names, cert_days)
    return {CA_KEY: ca_pem, CA_PRIVATE_KEY: ca_key_pem, CERT_KEY: cert_pem, KEY_KEY: key_pem}, reason


def ca_patch(webhooks: Sequence[Any], ca_b64: str) -> List[Dict[str, str]]:
    """JSON patch setting caBundle on every entry; each index is guarded by a test of its name."""
    ops: List[Dict[str, str]] = []
    for index, hook in enumerate(webhooks):
        name = hook["name"] if isinstance(hook, dict) else hook.name
        ops.append({"op": "test", "path": f"/webhooks/{index}/name", "value": name})
        ops.append({"op": "add", "path": f"/webhooks/{index}/clientConfig/caBundle", "value": ca_b64})
    return ops


def _pems(bundle: bytes) -> List[bytes]:
    """The certificates of a PEM bundle, each as its own PEM block."""
    marker = b"-----END CERTIFICATE-----"
    return [part.strip() + b"\n" + marker + b"\n" for part in bundle.split(marker)[:-1]]


def trust_bundle(new_ca: bytes, old_bundle: Optional[bytes],
                 now: Optional[dt.datetime] = None) -> bytes:
    """The CA bundle to trust: the new CA first, then those of the old bundle still valid."""
    now = now or _now()
    out = [new_ca.strip() + b"\n"]
    for pem in _pems(old_bundle or b""):
        try:
            cert = x509.load_pem_x509_certificate(pem)
        except ValueError:
            continue
        if cert.not_valid_after_utc > now and pem.strip() != new_ca.strip():
            out.append(pem)
    return b"".join(out)


class Rotator:
    """Keeps the chart's self-signed serving certificate valid from inside the webhook.

    ``serve(cert_pem, key_pem)`` is called with the Secret's pair whenever it differs from the
    pair served (at the first check too). The Secrets and the webhook configurations must exist
    (the chart's hooks create them); the webhook's RBAC allows get and update of the two
    Secrets and get and patch of the two configurations, each by name.
    """

    def __init__(self, api: Any, namespace: str, secret: str, ca_secret: str, service: str,
                 webhook: str, serve: Callable[[bytes, bytes], None], ca_days: float = 3650,
                 cert_days: float = 365, renew_days: float = 30,
                 extra_names: Sequence[str] = ()) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api)
        self.admission = client.AdmissionregistrationV1Api(api)
        self.namespace, self.secret, self.ca_secret = namespace, secret, ca_secret
        self.webhook = webhook
        self.names = service_names(service, namespace) + [n for n in extra_names if n]
        self.ca_name = f"{service} CA"
        self.ca_days, self.cert_days, self.renew_days = ca_days, cert_days, renew_days
        self.serve = serve
        self.served: Optional[Tuple[bytes, bytes]] = None
        self.renewals = 0

    def _read(self, name: str) -> Tuple[Any, Dict[str, bytes]]:
        secret = self.core.read_namespaced_secret(name, self.namespace)
        return secret, {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}

    def _replace(self, secret: Any, data: Dict[str, bytes]) -> None:
        secret.data = {k: base64.b64encode(v).decode() for k, v in data.items()}
        self.core.replace_namespaced_secret(secret.metadata.name, self.namespace, secret)

    def check(self, now: Optional[dt.datetime] = None) -> str:
        """One pass; what it did, in words (also logged when it changed something)."""
        from kubernetes.client.exceptions import ApiException

        try:
            return self._check(now)
        except ApiException as exc:
            if exc.status == 409:
                return "the Secret changed meanwhile (another replica); read again next time"
            log.warning("certificate check failed: HTTP %s %s", exc.status, exc.reason)
            return f"HTTP {exc.status}"
        except (OSError, ValueError) as exc:
            log.warning("certificate check failed: %s", exc)
            return str(exc)

    def _check(self, now: Optional[dt.datetime]) -> str:
        done = []
        ca_secret, ca_data = self._read(self.ca_secret)
        tls_secret, tls_data = self._read(self.secret)
        current: Dict[str, Optional[bytes]] = {CA_KEY: ca_data.get(CA_KEY), CA_PRIVATE_KEY: ca_data.get(CA_PRIVATE_KEY),
                   CERT_KEY: tls_data.get(CERT_KEY), KEY_KEY: tls_data.get(KEY_KEY)}
        data, reason = plan(current, self.names, self.ca_days, self.cert_days, self.renew_days,
                            ca_name=self.ca_name, now=now)
        if data is not None:
            if data[CA_KEY] != ca_data.get(CA_KEY):
                self._replace(ca_secret, {CA_KEY: data[CA_KEY],
                                          CA_PRIVATE_KEY: data[CA_PRIVATE_KEY]})
            bundle = trust_bundle(data[CA_KEY], tls_data.get(CA_KEY), now)
            tls_data = {CA_KEY: bundle, CERT_KEY: data[CERT_KEY], KEY_KEY: data[KEY_KEY]}
            self._replace(tls_secret, tls_data)
            self.renewals += 1
            done.append(f"renewed the serving certificate ({reason})")
        pair = (tls_data.get(CERT_KEY) or b"", tls_data.get(KEY_KEY) or b"")
        if all(pair) and pair != self.served:
            self.serve(*pair)
            self.served = pair
            done.append("serving the Secret's certificate")
        trusted = tls_data.get(CA_KEY)
        if trusted:
            done += self._trust(base64.b64encode(trusted).decode())
        what = "; ".join(done)
        if what:
            log.info("certificate: %s", what)
        return what or "certificate still valid"

    def _trust(self, ca_b64: str) -> List[str]:
        """Write the CA bundle into both configurations' entries where it differs."""
        done = []
        for kind, read, patch in (
            ("MutatingWebhookConfiguration", self.admission.read_mutating_webhook_configuration,
             self.admission.patch_mutating_webhook_configuration),
            ("ValidatingWebhookConfiguration",
             self.admission.read_validating_webhook_configuration,
             self.admission.patch_validating_webhook_configuration),
        ):
            config = read(self.webhook)
            hooks = config.webhooks or []
            if all(h.client_config.ca_bundle == ca_b64 for h in hooks):
                continue
            patch(self.webhook, ca_patch(hooks, ca_b64))
            done.append(f"caBundle of {kind}/{self.webhook} set")
        return done


class FilePair:
    """Where the rotator writes the Secret's pair for the TLS context to load: a private folder.
    ``pending`` is set when a new pair is written; the server loads it on its own thread."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="xmem-tls-")
        self.cert_file = os.path.join(self.folder, "tls.crt")
        self.key_file = os.path.join(self.folder, "tls.key")
        self.pending = False

    def __call__(self, cert_pem: bytes, key_pem: bytes) -> None:
        for path, body in ((self.cert_file, cert_pem), (self.key_file, key_pem)):
            fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(body)
            os.replace(path + ".tmp", path)
        self.pending = True
