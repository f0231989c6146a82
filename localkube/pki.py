"""The certificates and keys a control plane needs, made by the project (``cryptography``).

One CA signs everything: the API server's serving certificate (loopback, the ``kubernetes``
Service names), client certificates whose subject is the identity RBAC sees (common name = user,
organisation = groups), the API server's client certificate for the nodes' log endpoints, and
each node's serving certificate. The service-account signing key pair is RSA.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Tuple

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=30)


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@dataclass
class Pair:
    """A certificate and its key, as files."""

    cert: Path
    key: Path


class Authority:
    """A CA kept in ``directory`` (``ca.crt``, ``ca.key``), issuing into the same directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.cert_file = directory / "ca.crt"
        key_file = directory / "ca.key"
        if self.cert_file.exists() and key_file.exists():
            self._key = serialization.load_pem_private_key(key_file.read_bytes(), None)
            self._cert = x509.load_pem_x509_certificate(self.cert_file.read_bytes())
            return
        self._key = _key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "xmem-test-cluster-ca")])
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (
            x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(self._key, hashes.SHA256()))
        key_file.write_bytes(_pem_key(self._key))
        self.cert_file.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    @property
    def pem(self) -> bytes:
        return self.cert_file.read_bytes()

    def issue(self, stem: str, common_name: str, organisations: Sequence[str] = (),
              dns: Sequence[str] = (), ips: Sequence[str] = (), server: bool = False) -> Pair:
        """``<stem>.crt``/``<stem>.key``: a client certificate, or a serving one with SANs."""
        key = _key()
        attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organisations]
        attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        now = datetime.datetime.now(datetime.timezone.utc)
        builder = (
            x509.CertificateBuilder().subject_name(x509.Name(attributes))
            .issuer_name(self._cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH] if server else [ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False))
        if server:
            names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
            names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self._key, hashes.SHA256())
        pair = Pair(self.directory / f"{stem}.crt", self.directory / f"{stem}.key")
        pair.key.write_bytes(_pem_key(key))
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return pair


def service_account_keys(directory: Path) -> Tuple[Path, Path]:
    """``sa.key`` (private, the API server signs tokens with it) and ``sa.pub``."""
    private, public = directory / "sa.key", directory / "sa.pub"
    if not private.exists():
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        private.write_bytes(_pem_key(key))
        public.write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public
