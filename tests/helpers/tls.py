"""Certificates for TLS tests, made on the spot: a CA, a server certificate it signs for 127.0.0.1 /
localhost, a client certificate it signs, and a second CA that nothing trusts (`cryptography`)."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Certs:
    ca: str
    """The CA's certificate (PEM path): trust it to trust the server, or ask for clients it signed."""
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str
    """An unrelated CA: a client that trusts only it does not trust the server."""
    stranger_cert: str
    """A client certificate the unrelated CA signed (the server's CA did not)."""
    stranger_key: str

    def read(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()


def make_certs(directory: str) -> Certs:
    ca_key, ca = _ca("deepinfer test CA")
    other_key, other = _ca("unrelated CA")
    paths = {}
    paths["ca"] = _write(directory, "ca.pem", _pem(ca))
    paths["other_ca"] = _write(directory, "other-ca.pem", _pem(other))
    for name, issuer, issuer_key, server in (
        ("server", ca, ca_key, True),
        ("client", ca, ca_key, False),
        ("stranger", other, other_key, False),
    ):
        key, cert = _leaf(name, issuer, issuer_key, server)
        paths[f"{name}_cert"] = _write(directory, f"{name}.pem", _pem(cert))
        paths[f"{name}_key"] = _write(directory, f"{name}-key.pem", _key_pem(key))
    return Certs(**paths)


def _ca(name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _builder(subject, subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(ca=True), critical=True)
        .sign(key, _sha256())
    )
    return key, cert


def _leaf(name: str, issuer, issuer_key, server: bool):
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        _builder(subject, issuer.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(ca=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if server:
        names = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return key, builder.sign(issuer_key, _sha256())


def _builder(subject, issuer, public_key):
    from cryptography import x509

    now = datetime.datetime.now(datetime.timezone.utc)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _key_usage(ca: bool):
    from cryptography import x509

    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=not ca,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )


def _new_key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _sha256():
    from cryptography.hazmat.primitives import hashes

    return hashes.SHA256()


def _pem(cert) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(directory: str, name: str, data: bytes) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(data)
    return path
