"""A move's grant: what the controller may ask of an agent for one PodMigration, and until when.

On Kubernetes the controller shows the agents a client certificate of their CA
(`criuctl.agent.callers.CONTROLLER`). That certificate alone opens nothing but what every agent may
read (`callers.READS`): a controller bug reaches no job's memory by it. What the controller does for
a move it does under a grant it signs, per move, with the key of that certificate: the pod
(namespace, name, UID), the nodes the move involves, and an expiry minutes away. The controller
signs a new one as the old one nears its end (`Granter`), so a long move never runs out, while a
grant copied off the wire opens, for minutes, the move routes of that one pod on those nodes alone.

Why the controller's own key and not the CA's: the CA's key makes node certificates, and a node
certificate receives a job's memory. It lives in the signer's pod alone (`criuctl.kube.signer`);
the controller gets its certificate from the signer like an agent does, so a stolen controller
can move pods between real nodes but can make no node, and so read no memory. Each grant carries
the certificate that signed it, so a renewed key needs no agent to learn anything.

An agent checks (`read`): that certificate, issued by the CA it trusts (`--peer-ca`), current, and
naming the controller (URI `callers.CONTROLLER`, which the signer puts in no node's); the signature
by its key; the expiry (a grant that claims more than `LONGEST` is refused: no controller signs
one); that it names this node; that the route is a move's (`/v1/incoming…`, `/v1/outgoing…`); and,
where the call names a workload (in its body, or as the workload of the outgoing move it names),
that the workload is that pod's container (its record's pod UID:
`criuctl.agent.server.Agent.grant_refusal`). The target's calls are scoped by node and time alone:
the placeholder it restores into is another pod.

Format (header `GRANT_HEADER`): base64url(canonical JSON) "." base64url(signature) "."
base64url(the signer's certificate, DER). The signature is the key's own kind: ECDSA with SHA-256,
Ed25519, or RSA PKCS#1 v1.5 with SHA-256.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

from criuctl.agent.callers import CONTROLLER

GRANT_HEADER = "Criuctl-Grant"
SECONDS = 300  # a grant's life; a new one is signed at half of it (`Granter`)
LONGEST = 3600  # an agent refuses a grant that claims to last longer (clocks may differ by less)
VERSION = 2  # 1: signed by the CA's key, which the controller no longer holds


class GrantRefused(Exception):
    """Why a grant opens nothing (one line, for the caller's 403)."""


@dataclass(frozen=True)
class Grant:
    namespace: str
    pod: str
    uid: str  # the pod's UID: a pod of the same name made later is another pod
    nodes: tuple[str, ...]  # the nodes the move involves (source, target): the agents it opens
    expires: float  # seconds since the epoch

    def payload(self) -> bytes:
        body = {
            "v": VERSION,
            "namespace": self.namespace,
            "pod": self.pod,
            "uid": self.uid,
            "nodes": sorted(n.lower() for n in self.nodes if n),
            "expires": int(self.expires),
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @property
    def what(self) -> str:
        return f"pod {self.namespace}/{self.pod} on {', '.join(sorted(self.nodes))}"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@dataclass(frozen=True)
class Signing:
    """The controller's key and the certificate the CA issued for it: what signs a grant."""

    key: Any
    cert: x509.Certificate

    @classmethod
    def load(cls, path: Path) -> Signing:
        """From one PEM file holding the certificate and its key (the controller's identity file)."""
        raw = path.read_bytes()
        return cls(serialization.load_pem_private_key(raw, None), x509.load_pem_x509_certificate(raw))


def sign(grant: Grant, signing: Signing) -> str:
    """The header value of `grant`, signed with the controller's key, its certificate attached."""
    key, data = signing.key, grant.payload()
    if isinstance(key, ed25519.Ed25519PrivateKey):
        sig = key.sign(data)
    elif isinstance(key, ec.EllipticCurvePrivateKey):
        sig = key.sign(data, ec.ECDSA(hashes.SHA256()))
    elif isinstance(key, rsa.RSAPrivateKey):
        sig = key.sign(data, padding.PKCS1v15(), hashes.SHA256())
    else:
        raise TypeError(f"a key of kind {type(key).__name__} signs no grant")
    return f"{_b64(data)}.{_b64(sig)}.{_b64(signing.cert.public_bytes(serialization.Encoding.DER))}"


def _verified(pub: Any, sig: bytes, data: bytes) -> bool:
    try:
        if isinstance(pub, ed25519.Ed25519PublicKey):
            pub.verify(sig, data)
        elif isinstance(pub, ec.EllipticCurvePublicKey):
            pub.verify(sig, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(pub, rsa.RSAPublicKey):
            pub.verify(sig, data, padding.PKCS1v15(), hashes.SHA256())
        else:
            return False
    except InvalidSignature:
        return False
    return True


def authorities(ca_file: Path) -> list[x509.Certificate]:
    """The certificates in `ca_file` (the agent's --peer-ca): who issues the controller's."""
    return x509.load_pem_x509_certificates(ca_file.read_bytes())


def _issued_by(cert: x509.Certificate, cas: list[x509.Certificate]) -> bool:
    for ca in cas:
        try:
            cert.verify_directly_issued_by(ca)
            return True
        except (ValueError, TypeError, InvalidSignature):
            continue
    return False


def _signer(der: bytes, cas: list[x509.Certificate], now: float) -> x509.Certificate:
    """The certificate a grant came with, if it is the controller's, issued by the agents' CA, now."""
    try:
        cert = x509.load_der_x509_certificate(der)
    except ValueError as exc:
        raise GrantRefused(f"the grant's certificate is not one ({exc})") from None
    if not _issued_by(cert, cas):
        raise GrantRefused("the grant's certificate is not issued by the agents' CA")
    at = dt.datetime.fromtimestamp(now, dt.UTC)
    if not cert.not_valid_before_utc <= at <= cert.not_valid_after_utc:
        raise GrantRefused(f"the grant's certificate is not valid now (until {cert.not_valid_after_utc})")
    try:
        uris = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        named = uris.get_values_for_type(x509.UniformResourceIdentifier)
    except x509.ExtensionNotFound:
        named = []
    if named != [CONTROLLER]:
        raise GrantRefused("the grant's certificate is not the controller's (a node's signs no grant)")
    return cert


def read(value: str, cas: list[x509.Certificate], node: str, now: float | None = None) -> Grant:
    """The grant in header `value`, checked: signed by the controller's certificate of one of `cas`,
    unexpired, naming `node`."""
    now = time.time() if now is None else now
    parts = value.strip().split(".")
    if len(parts) == 2:  # version 1's form: the CA's signature, no certificate
        raise GrantRefused(
            "the grant is of an older criuctl (signed by the CA's key): the controller and this agent run "
            "different versions; finish rolling both out"
        )
    try:
        if len(parts) != 3:
            raise ValueError(f"{len(parts)} parts, not 3")
        data, sig, der = (_unb64(p) for p in parts)
        body = json.loads(data)
    except (binascii.Error, ValueError) as exc:
        raise GrantRefused(f"the grant is not one criuctl's controller writes ({exc})") from None
    if not _verified(_signer(der, cas, now).public_key(), sig, data):
        raise GrantRefused("the grant's signature is not its certificate's")
    try:
        if body["v"] != VERSION:
            raise GrantRefused(f"the grant is of version {body['v']!r}; this agent reads {VERSION}")
        g = Grant(
            str(body["namespace"]),
            str(body["pod"]),
            str(body["uid"]),
            tuple(body["nodes"]),
            float(body["expires"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise GrantRefused(f"the grant lacks a field ({exc!r})") from None
    if g.expires <= now:
        raise GrantRefused(f"the grant for {g.what} expired {int(now - g.expires)} s ago")
    if g.expires > now + LONGEST:
        raise GrantRefused(f"the grant for {g.what} claims to last past {LONGEST} s from now")
    if node.lower() not in g.nodes:
        raise GrantRefused(f"the grant is for {g.what}, not node {node}")
    return g


Scope = tuple[str, str, str, tuple[str, ...]]  # namespace, pod, UID, nodes


class Granter:
    """The grant of one move, signed anew when half its life has passed or its scope changed (the
    controller learns the pod's UID and the nodes as it plans): what `criuctl.client.agents` shows
    with each of the controller's calls while the move is carried. "" while there is no scope yet.
    `signing` is read at each signature: the controller's key is renewed under long moves."""

    def __init__(self, scope: Callable[[], Scope | None], signing: Callable[[], Signing]) -> None:
        self.scope, self.signing = scope, signing
        self._lock = threading.Lock()
        self._value, self._expires = "", 0.0
        self._signed: Scope | None = None
        self._cert_ends = 0.0  # when the certificate the grant carries ends: it is re-signed before

    def __call__(self) -> str:
        scope = self.scope()
        if scope is None:
            return ""
        with self._lock:
            now = time.time()
            if scope != self._signed or min(self._expires, self._cert_ends) - now < SECONDS / 2:
                signing = self.signing()
                self._expires, self._signed = now + SECONDS, scope
                self._cert_ends = signing.cert.not_valid_after_utc.timestamp()
                self._value = sign(Grant(*scope, expires=self._expires), signing)
            return self._value


Mint = Callable[[], str]
