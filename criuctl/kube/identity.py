"""Each agent's own TLS identity on Kubernetes: a key made on its node that never leaves it, and a
certificate that names that node alone (its name and its InternalIP addresses), issued through the
`certificates.k8s.io/v1` CertificateSigningRequest API and signed by the controller from a CA whose
key only the controller holds (the Secret `criuctl-ca`, mounted in its pod and nowhere else).

Why the controller checks who asks, not only what is asked: every agent runs as the same
ServiceAccount, so a request's name proves nothing. The agent asks with a projected token bound to
its own pod (`/var/run/secrets/criuctl/token`, manifests/daemonset.yaml); for such a token the API
server writes the pod's name and UID into the request's `spec.extra` (k8s.io/apiserver's
serviceaccount.PodNameKey and PodUIDKey, copied by the CSR strategy's PrepareForCreate), which the
requester cannot set. The controller signs only for the node that pod runs on, only that node's
addresses, only for an agent pod of criuctl's DaemonSet. The kubelet's own serving certificates
follow the same path (pkg/kubelet/certificate) with the approval left to a checker: this is ours.

Since every client reaches an agent at its node's address and checks the certificate against that
address, a node's key serves as no other node.

The controller has an identity too: a client certificate it makes itself from the CA it holds
(`controller_identity`), whose one name is the URI `callers.CONTROLLER`, which no node's can carry
(`judge` signs DNS names and addresses only). Agents take it in place of a token: on Kubernetes no
credential is shared, so no node holds one that opens every other (criuctl.agent.callers).

Rotation: the agent asks for a new key and certificate when two thirds of the current one's life
has passed (or on SIGHUP), and loads them into the TLS context it serves with: handshakes from then
on get the new one, connections already open keep theirs, so a move in flight never notices. The
CA does not change, so no client does either.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import ipaddress
import logging
import secrets
import signal
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from criuctl.agent import callers
from criuctl.core.errors import CriuctlError
from criuctl.kube.cluster import AGENT_LABEL, SYSTEM_NS, Cluster, NotFound, call, connect
from criuctl_hook import durable

if TYPE_CHECKING:
    from aiohttp import web

    from criuctl.agent.server import Agent

log = logging.getLogger("criuctl.kube")

SIGNER = "criuctl.io/agent"
AGENT_USER = f"system:serviceaccount:{SYSTEM_NS}:criuctl-agent"
POD_NAME = "authentication.kubernetes.io/pod-name"  # k8s.io/apiserver serviceaccount.PodNameKey
POD_UID = "authentication.kubernetes.io/pod-uid"
BOUND_TOKEN = Path("/var/run/secrets/criuctl/token")  # the projected token manifests/daemonset.yaml mounts
RENEW_AT = 2 / 3  # of a certificate's life: renewals start here, with a third left for retries
RETRY = 10.0  # s between two tries to renew (the controller may be changing leaders)
ISSUE_WAIT = 60.0  # s an agent waits for its first certificate before it stops with one line
BACKDATE = dt.timedelta(minutes=1)  # a node whose clock is a little behind still accepts it
DEFAULT_SECONDS = 7 * 24 * 3600
CONTROLLER_FILE = "controller.pem"  # in the controller's STATE_DIR/kube: its client key and certificate


class Refused(CriuctlError):
    """The controller denied the request: what it said, as the Denied condition's message."""


# ---- the agent's side


@dataclass(frozen=True)
class Identity:
    """The node's key and certificate, one PEM file (certificate then key) written in one piece:
    a crash never leaves a key beside another key's certificate."""

    path: Path

    def certificate(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.path.read_bytes())

    def due(self, now: dt.datetime | None = None) -> bool:
        """Past two thirds of its life, or unreadable: time for another."""
        try:
            cert = self.certificate()
        except (OSError, ValueError):
            return True
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
        return (now or dt.datetime.now(dt.UTC)) >= start + (end - start) * RENEW_AT

    def names(self, node: str, addresses: list[str]) -> bool:
        try:
            cert = self.certificate()
        except (OSError, ValueError):
            return False
        return _names_of(cert.subject, cert.extensions) == (node, _sans(node, addresses))


def _sans(node: str, addresses: list[str]) -> frozenset[str]:
    return frozenset({f"DNS:{node}", *(f"IP:{ipaddress.ip_address(a)}" for a in addresses)})


def _names_of(subject: x509.Name, extensions: x509.Extensions) -> tuple[str, frozenset[str]]:
    """The common name and the subject alternative names ("DNS:x", "IP:y") of a request or certificate."""
    cn = subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    try:
        san = extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return (str(cn[0].value) if cn else "", frozenset())
    names = {f"DNS:{d}" for d in san.get_values_for_type(x509.DNSName)}
    names |= {f"IP:{i}" for i in san.get_values_for_type(x509.IPAddress)}
    if len(names) != len(list(san)):  # an email, a URI: nothing a node's certificate names
        names.add("other")
    return (str(cn[0].value) if cn else "", frozenset(names))


def node_addresses(c: Cluster, node: str) -> list[str]:
    """The node's InternalIP addresses, as the kubelet registered them: where clients reach its agent."""
    n = c.serialize(call(f"node {node}", c.core.read_node, node))
    return [a["address"] for a in n.get("status", {}).get("addresses") or [] if a.get("type") == "InternalIP"]


def _request_pem(key: ec.EllipticCurvePrivateKey, node: str, addresses: list[str]) -> bytes:
    san = [x509.DNSName(node), *(x509.IPAddress(ipaddress.ip_address(a)) for a in addresses)]
    req = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node)]))
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .sign(key, hashes.SHA256())
    )
    return req.public_bytes(serialization.Encoding.PEM)


def _bound(kubeconfig: str | None) -> Cluster:
    """The API server as the agent's pod itself: its bound token, read now (the kubelet renews it)."""
    c = connect(kubeconfig)
    if kubeconfig is None and BOUND_TOKEN.exists():
        cfg = c.core.api_client.configuration
        cfg.refresh_api_key_hook = None
        cfg.api_key = {"authorization": "Bearer " + BOUND_TOKEN.read_text().strip()}
    return c


def issue(kubeconfig: str | None, node: str, path: Path, wait: float = ISSUE_WAIT) -> Identity:
    """A new key and a certificate for it from the controller, written to `path` (root-only)."""
    c = _bound(kubeconfig)
    assert c.certificates is not None
    addresses = node_addresses(c, node)
    if not addresses:
        raise CriuctlError(f"node {node} has no InternalIP address", "check the kubelet's --node-ip")
    key = ec.generate_private_key(ec.SECP256R1())
    name = f"criuctl-agent-{node}-{uuid.uuid4().hex[:8]}"[:253]
    body = {
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "criuctl-agent"}},
        "spec": {
            "request": base64.b64encode(_request_pem(key, node, addresses)).decode(),
            "signerName": SIGNER,
            "usages": ["digital signature", "key encipherment", "server auth", "client auth"],
        },
    }
    call(f"certificate request {name}", c.certificates.create_certificate_signing_request, body)
    deadline = time.monotonic() + wait
    while True:
        csr = c.serialize(
            call(f"certificate request {name}", c.certificates.read_certificate_signing_request, name)
        )
        status = csr.get("status") or {}
        for cond in status.get("conditions") or []:
            if cond.get("type") in ("Denied", "Failed") and cond.get("status", "True") == "True":
                raise Refused(
                    f"the controller refused node {node}'s certificate request {name}: {cond.get('message')}",
                    "see the controller's log (kubectl -n criuctl-system logs deploy/criuctl-controller)",
                )
        if status.get("certificate"):
            break
        if time.monotonic() > deadline:
            raise CriuctlError(
                f"no certificate for node {node} after {wait:.0f} s (request {name})",
                "is the controller running with --agent-ca-cert (manifests/controller.yaml)?",
            )
        time.sleep(0.5)
    try:
        pem = base64.b64decode(status["certificate"])
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise CriuctlError(
            f"request {name} was answered with no certificate: {exc}", "see the controller's log"
        ) from exc
    mine = serialization.PublicFormat.SubjectPublicKeyInfo
    if _names_of(cert.subject, cert.extensions) != (
        node,
        _sans(node, addresses),
    ) or cert.public_key().public_bytes(serialization.Encoding.DER, mine) != key.public_key().public_bytes(
        serialization.Encoding.DER, mine
    ):
        raise CriuctlError(
            f"the certificate issued for node {node} is not for its key and names", "see the controller's log"
        )
    _keep(path, pem, key)  # checked first: what is on disk is always a pair
    log.info("certificate issued", extra={"request": name, "serial": f"{cert.serial_number:x}"})
    return Identity(path)


def obtain(kubeconfig: str | None, node: str, path: Path) -> Identity:
    """The node's identity at start-up: the one on disk while it is current and names this node as
    the API server has it, else a new one (an agent restarted while the controller is away still serves)."""
    ident = Identity(path)
    try:
        current = ident.names(node, node_addresses(connect(kubeconfig), node)) and not ident.due()
    except CriuctlError:
        current = False
    return ident if current else issue(kubeconfig, node, path)


def renewal(ident: Identity, kubeconfig: str | None) -> Callable[[Agent, web.Application], None]:
    """The agent's extension that renews its certificate before it ends, and on SIGHUP."""

    def attach(agent: Agent, app: web.Application) -> None:
        now = asyncio.Event()

        async def forever() -> None:
            while True:
                if ident.due() or now.is_set():
                    now.clear()
                    try:
                        await asyncio.to_thread(issue, kubeconfig, agent.name, ident.path)
                        if agent.tls is not None:  # new handshakes get the new one
                            agent.tls.load_cert_chain(ident.path)
                    except CriuctlError as exc:
                        log.warning("cannot renew the node's certificate yet", extra={"error": exc.line()})
                    except Exception:  # this loop must outlive any one try: the certificate ends otherwise
                        log.exception("cannot renew the node's certificate yet")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(now.wait(), RETRY)

        async def start(_app: web.Application) -> None:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, now.set)
            agent.tasks.add(asyncio.ensure_future(forever()))

        app.on_startup.append(start)

    return attach


# ---- the controller's side


@dataclass(frozen=True)
class CA:
    cert: x509.Certificate
    key: Any  # a private key cryptography loads: RSA, EC or Ed25519

    @classmethod
    def load(cls, cert: Path, key: Path) -> CA:
        try:
            return cls(
                x509.load_pem_x509_certificate(cert.read_bytes()),
                serialization.load_pem_private_key(key.read_bytes(), None),
            )
        except (OSError, ValueError, TypeError) as exc:
            raise CriuctlError(
                f"cannot load the agents' CA ({cert}, {key}): {exc}",
                "mount the Secret criuctl-ca (tls.crt, tls.key: docs/deploy.md, TLS)",
            ) from exc

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
    """The controller's client key and certificate (root-only, one file), made from the CA it holds:
    what it shows the agents it drives instead of a token every agent would hold too."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "criuctl-controller")])
    san = x509.SubjectAlternativeName([x509.UniformResourceIdentifier(callers.CONTROLLER)])
    pem = ca.certificate(name, key.public_key(), san, [ExtendedKeyUsageOID.CLIENT_AUTH], seconds)
    _keep(path, pem, key)
    return Identity(path)


def _keep(path: Path, pem: bytes, key: ec.EllipticCurvePrivateKey) -> None:
    """A certificate and its key as one root-only file, written in one piece (`Identity`)."""
    secret = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    durable.replace(path, pem + secret, 0o600)


def controller_renewal(ca: CA, path: Path, seconds: int = DEFAULT_SECONDS) -> None:
    """Forever: a new key and certificate once two thirds of the current one's life has passed (a
    client presents the file as it is when it connects: nothing to reload)."""
    while True:
        try:
            if Identity(path).due():
                controller_identity(ca, path, seconds)
                log.info("controller certificate renewed")
        except Exception:  # this loop must outlive any one try: the certificate ends otherwise
            log.exception("cannot renew the controller's certificate yet")
        time.sleep(RETRY)


class Signer:
    """Approves and signs the agents' certificate requests that pass `judge`, denies the others."""

    def __init__(self, c: Cluster, ca: CA, seconds: int = DEFAULT_SECONDS) -> None:
        assert c.certificates is not None
        self.c, self.ca, self.seconds = c, ca, seconds

    def judge(self, csr: dict[str, Any]) -> tuple[x509.CertificateSigningRequest | None, str]:
        """The request, if criuctl's agent pod on node N asks for N's name and addresses; else why not."""
        spec = csr.get("spec") or {}
        if spec.get("username") != AGENT_USER:
            return None, f"asked by {spec.get('username')!r}, not criuctl's agent ({AGENT_USER})"
        extra = spec.get("extra") or {}
        pod_name, pod_uid = (extra.get(POD_NAME) or [""])[0], (extra.get(POD_UID) or [""])[0]
        if not pod_name:
            return None, "asked without a token bound to a pod (mount /var/run/secrets/criuctl/token)"
        try:
            pod = self.c.serialize(
                call(f"pod {pod_name}", self.c.core.read_namespaced_pod, pod_name, SYSTEM_NS)
            )
        except NotFound:
            return None, f"asked by pod {SYSTEM_NS}/{pod_name}, which is gone"
        meta = pod["metadata"]
        key, _, value = AGENT_LABEL.partition("=")
        if (
            meta.get("uid") != pod_uid
            or (meta.get("labels") or {}).get(key) != value
            or meta.get("deletionTimestamp")
        ):
            return None, f"asked by pod {SYSTEM_NS}/{pod_name}, not a live criuctl agent pod"
        node = (pod.get("spec") or {}).get("nodeName") or ""
        if not node:
            return None, f"asked by pod {SYSTEM_NS}/{pod_name}, which runs on no node yet"
        try:
            req = x509.load_pem_x509_csr(base64.b64decode(spec.get("request", "")))
        except ValueError as exc:
            return None, f"not a certificate request: {exc}"
        if not req.is_signature_valid:
            return None, "the request's signature does not verify"
        cn, sans = _names_of(req.subject, req.extensions)
        wanted = _sans(node, node_addresses(self.c, node))
        if cn != node or not sans or not sans <= wanted:
            return None, f"pod {pod_name} runs on node {node!r}, and asked for {cn!r} {sorted(sans)}"
        return req, f"criuctl's agent on node {node}"

    def sign(self, req: x509.CertificateSigningRequest) -> bytes:
        san = req.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
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
                log.warning("cannot sign the agents' requests now", extra={"error": exc.line()})
            time.sleep(every)


def _is_ed(key: Any) -> bool:
    from cryptography.hazmat.primitives.asymmetric import ed448, ed25519

    return isinstance(key, ed25519.Ed25519PrivateKey | ed448.Ed448PrivateKey)
