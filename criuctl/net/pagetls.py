"""Certificates made for one migration, for CRIU's page server: memory pages go from the source's
dump straight into the target's page server over CRIU's own TLS (gnutls), mutual and pinned.

Why not the cluster's certificates: any node holds one, and the page server would take pages from
any of them. Each end makes a key pair for this migration alone (ECDSA P-256, valid a day), hands
its certificate to the other over the agents' authenticated channel, and CRIU on each end trusts
that one certificate and nothing else. The private keys never leave their node, and are gone with
the migration's folder. The source signs both fingerprints into the bundle's manifest, so the
restore can tell that the pages it restores came over the session the signed manifest names.
"""

from __future__ import annotations

import datetime
import hashlib
import ssl
from dataclasses import dataclass
from pathlib import Path

from criuctl.core.errors import CriuctlError
from criuctl.engine.criu import PageTls
from criuctl_hook import durable

MAX_PEM = 16 << 10  # one certificate; anything longer is not what the other agent sends
VALID = datetime.timedelta(days=1)
SKEW = datetime.timedelta(minutes=5)  # nodes' clocks differ a little


class PeerCertError(CriuctlError):
    """What came as the other end's certificate is not one."""


@dataclass(frozen=True)
class Identity:
    """This end's key pair for one migration: files (root-only) for CRIU, the PEM for the peer."""

    cert: Path
    key: Path
    pem: str
    fingerprint: str  # sha256 of the DER certificate, hex


def fingerprint(pem: str) -> str:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()


def make_identity(folder: Path, who: str) -> Identity:
    """A fresh key and a self-signed certificate that may sign (CRIU takes it as its CA file: gnutls
    accepts a trusted certificate as itself), written into `folder` as `who.crt` and `who.key`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"criuctl page server {who}")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - SKEW)
        .not_valid_after(now + VALID)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    pem = cert.public_bytes(serialization.Encoding.PEM).decode()
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    paths = folder / f"{who}.crt", folder / f"{who}.key"
    durable.replace(paths[0], pem.encode(), 0o600, sync=False)  # gone with the migration anyway
    durable.replace(paths[1], key_pem, 0o600, sync=False)
    return Identity(paths[0], paths[1], pem, fingerprint(pem))


def pin(folder: Path, who: str, pem: object) -> tuple[Path, str]:
    """The other end's certificate, checked to be exactly one well-formed certificate, written as
    `who.crt` for CRIU's CA file; with its fingerprint. Anything else is refused with one line."""
    if not isinstance(pem, str) or len(pem) > MAX_PEM:
        raise PeerCertError(f"the {who}'s page-server certificate is not a PEM certificate")
    begin, end = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"
    body = pem.strip()
    if not (body.startswith(begin) and body.endswith(end)) or body.count(begin) != 1:
        raise PeerCertError(f"the {who}'s page-server certificate is not one PEM certificate")
    try:
        from cryptography import x509

        x509.load_pem_x509_certificate(body.encode())
        digest = fingerprint(body)
    except (ValueError, TypeError) as exc:
        raise PeerCertError(f"the {who}'s page-server certificate does not parse: {exc}") from None
    path = folder / f"{who}.crt"
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    durable.replace(path, (body + "\n").encode(), 0o600, sync=False)
    return path, digest


def load_identity(folder: Path, who: str) -> Identity | None:
    """The key pair `make_identity` wrote into `folder` as `who`, None when there is none."""
    paths = folder / f"{who}.crt", folder / f"{who}.key"
    try:
        pem = paths[0].read_text()
    except FileNotFoundError:
        return None
    if not paths[1].exists():
        return None
    return Identity(paths[0], paths[1], pem, fingerprint(pem))


def pin_all(folder: Path, who: str, pems: list[object]) -> Path:
    """Several peers' certificates, each checked as `pin` does, in one CA file `who.crt`: a page
    server that takes any of them (the target's client, and this node's own for a fallback)."""
    bodies = []
    for i, pem in enumerate(pems):
        one, _ = pin(folder, f"{who}-{i}", pem)
        bodies.append(one.read_text())
        one.unlink()
    if not bodies:
        raise PeerCertError(f"no {who} certificate to pin")
    path = folder / f"{who}.crt"
    durable.replace(path, "".join(bodies).encode(), 0o600, sync=False)
    return path


def tls(mine: Identity, peer_cert: Path) -> PageTls:
    return PageTls(peer_cert=peer_cert, cert=mine.cert, key=mine.key)
