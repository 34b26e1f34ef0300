"""criuctl's signer: the one holder of the agents' CA key (the Secret `criuctl-ca`, mounted in its
pod and nowhere else), which approves and signs the certificate requests of criuctl.kube.identity.

Why a component of its own: the CA's key makes node certificates, and a node's certificate is
what a source sends a job's memory to. Held by the controller (as before), a stolen controller
could mint a node and read any job. Held here, the controller is one more client of the signer:
its certificate names only `callers.CONTROLLER`, with which it moves pods between the nodes that
are there (under grants it signs with that certificate's key, criuctl.agent.grants), but it can
make no node. The signer runs no move, calls no agent, and reads only what it judges by: the
asking pod and its node's addresses.

One replica: two signing the same request at once would have the second's write refused by the
API server (the object changed), and a restart costs only a few seconds of waiting requests.
"""

from __future__ import annotations

import base64
import datetime as dt
import logging
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from criuctl.agent import callers
from criuctl.core.errors import CriuctlError
from criuctl.kube.cluster import Cluster, call, connect
from criuctl.kube.identity import (
    AGENT_USER,
    BACKDATE,
    CONTROLLER_CN,
    CONTROLLER_USER,
    DEFAULT_SECONDS,
    SIGNER,
    Identity,
    agent_node,
    keep,
    names_of,
    node_addresses,
    node_sans,
)

log = logging.getLogger("criuctl.kube")


@dataclass(frozen=True)
class CA:
    cert: x509.Certificate
    key: Any  # a private key cryptography loads: RSA, EC or Ed25519

    @classmethod
    def load(cls, cert: Path, key: Path) -> CA:
        try:
            ca = cls(
                x509.load_pem_x509_certificate(cert.read_bytes()),
                serialization.load_pem_private_key(key.read_bytes(), None),
            )
        except (OSError, ValueError, TypeError) as exc:
            raise CriuctlError(
                f"cannot load the agents' CA ({cert}, {key}): {exc}",
                "mount the Secret criuctl-ca (tls.crt, tls.key: docs/deploy.md, TLS)",
            ) from exc
        der, spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        if ca.cert.public_key().public_bytes(der, spki) != ca.key.public_key().public_bytes(der, spki):
            # what it signed would verify against no one's ca.crt: every agent would fail to start
            raise CriuctlError(
                f"the key {key} is not the key of the CA certificate {cert}",
                "put the CA's certificate and its own key into the Secret criuctl-ca",
            )
        return ca

    def certificate(
        self, subject: x509.Name, key: Any, san: x509.SubjectAlternativeName, usages: list, seconds: int
    ) -> bytes:
        """A certificate (PEM) for `key`, signed by this CA, valid `seconds` from now."""
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.cert.subject)
            .public_key(key)
            .serial_number(int.from_bytes(secrets.token_bytes(16)) >> 1)
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + dt.timedelta(seconds=seconds))
            .add_extension(san, critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(True, True, False, False, False, False, False, False, False), critical=True
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .sign(self.key, None if _is_ed(self.key) else hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)


def controller_identity(ca: CA, path: Path, seconds: int = DEFAULT_SECONDS) -> Identity:
    """A controller's client key and certificate (root-only, one file) made straight from the CA:
    for whoever holds the CA outside a cluster (a host deployment's operator, the tests); in a
    cluster the controller asks the signer for its own (`identity.issue_controller`)."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "criuctl-controller")])
    san = x509.SubjectAlternativeName([x509.UniformResourceIdentifier(callers.CONTROLLER)])
    pem = ca.certificate(name, key.public_key(), san, [ExtendedKeyUsageOID.CLIENT_AUTH], seconds)
    keep(path, pem, key)
    return Identity(path)


class Signer:
    """Approves and signs the certificate requests that pass `judge` (an agent's for its node, the
    controller's for its URI), denies the others with why."""

    def __init__(self, c: Cluster, ca: CA, seconds: int = DEFAULT_SECONDS) -> None:
        assert c.certificates is not None
        self.c, self.ca, self.seconds = c, ca, seconds

    def judge(self, csr: dict[str, Any]) -> tuple[x509.CertificateSigningRequest | None, str]:
        """The request, if criuctl's agent pod on node N asks for N's name and addresses, or the
        controller's ServiceAccount for the controller's URI; else why not."""
        spec = csr.get("spec") or {}
        if spec.get("username") == CONTROLLER_USER:
            return _judge_controller(spec)
        if spec.get("username") != AGENT_USER:
            return None, f"asked by {spec.get('username')!r}, not criuctl's agent ({AGENT_USER})"
        node, why = agent_node(self.c, spec.get("extra") or {})
        if not node:
            return None, why
        req, why = _request(spec)
        if req is None:
            return None, why
        cn, sans = names_of(req.subject, req.extensions)
        wanted = node_sans(node, node_addresses(self.c, node))
        if cn != node or not sans or not sans <= wanted:
            return None, f"its pod runs on node {node!r}, and asked for {cn!r} {sorted(sans)}"
        return req, f"criuctl's agent on node {node}"

    def sign(self, req: x509.CertificateSigningRequest) -> bytes:
        """A node's certificate serves and calls; the controller's only calls."""
        san = req.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if not san.get_values_for_type(x509.UniformResourceIdentifier):
            usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        return self.ca.certificate(req.subject, req.public_key(), san, usages, self.seconds)

    def sweep(self) -> None:
        """Every pending request to criuctl's signer: approved and signed, or denied with the reason."""
        listed = call("certificate requests", self.c.certificates.list_certificate_signing_request)
        for item in listed.items:
            # read off the typed object first: every request of the last hour is listed each
            # second (the API server keeps issued ones an hour), and only a pending one of ours
            # is worth serialising
            if item.spec.signer_name != SIGNER or (item.status and item.status.certificate):
                continue
            csr = self.c.serialize(item)
            status = csr.get("status") or {}
            done = {cond.get("type") for cond in status.get("conditions") or []}
            if done & {"Denied", "Failed"}:
                continue
            name = csr["metadata"]["name"]
            try:
                self.settle(name, csr, done)
            except CriuctlError as exc:  # the next request is not held up by this one
                log.warning(
                    "cannot settle a certificate request now", extra={"request": name, "error": exc.line()}
                )

    def settle(self, name: str, csr: dict[str, Any], done: set[str]) -> None:
        """Approve and sign one request, or deny it; an approval written before is not written again."""
        req, why = self.judge(csr)
        verdict = "Approved" if req is not None else "Denied"
        what = f"certificate request {name}"
        if verdict not in done:
            status = csr.setdefault("status", {}) or {}
            status.setdefault("conditions", []).append(
                {"type": verdict, "status": "True", "reason": f"Criuctl{verdict}", "message": why}
            )
            csr["status"] = status
            call(what, self.c.certificates.replace_certificate_signing_request_approval, name, csr)
            log.info(f"certificate request {verdict.lower()}", extra={"request": name, "why": why})
        if req is not None:
            csr = self.c.serialize(call(what, self.c.certificates.read_certificate_signing_request, name))
            csr.setdefault("status", {})["certificate"] = base64.b64encode(self.sign(req)).decode()
            call(what, self.c.certificates.replace_certificate_signing_request_status, name, csr)

    def forever(self, every: float = 1.0) -> None:
        while True:
            try:
                self.sweep()
            except CriuctlError as exc:
                log.warning("cannot sign certificate requests now", extra={"error": exc.line()})
            time.sleep(every)


def _request(spec: dict[str, Any]) -> tuple[x509.CertificateSigningRequest | None, str]:
    try:
        req = x509.load_pem_x509_csr(base64.b64decode(spec.get("request", "")))
    except ValueError as exc:
        return None, f"not a certificate request: {exc}"
    if not req.is_signature_valid:
        return None, "the request's signature does not verify"
    return req, ""


def _judge_controller(spec: dict[str, Any]) -> tuple[x509.CertificateSigningRequest | None, str]:
    """The controller's ServiceAccount may have the controller's name and URI, and nothing else."""
    req, why = _request(spec)
    if req is None:
        return None, why
    cn, sans = names_of(req.subject, req.extensions)
    if (cn, sans) != (CONTROLLER_CN, frozenset({f"URI:{callers.CONTROLLER}"})):
        return None, f"the controller asked for {cn!r} {sorted(sans)}, not the controller's name alone"
    return req, "criuctl's controller"


def _is_ed(key: Any) -> bool:
    from cryptography.hazmat.primitives.asymmetric import ed448, ed25519

    return isinstance(key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey)


def run(kubeconfig: str | None, ca: CA, seconds: int = DEFAULT_SECONDS) -> None:
    """Sign until the process ends (`criuctl signer`)."""
    c = connect(kubeconfig)
    call("the API server", c.core.get_api_resources)  # one line now if it cannot be reached
    log.info("signing", extra={"signer": SIGNER, "ca": ca.cert.subject.rfc4514_string()})
    Signer(c, ca, seconds).forever()
