"""Each agent's own TLS identity on Kubernetes, and the controller's: a key made where it is used
that never leaves it, and a certificate that names that node alone (its name and its InternalIP
addresses) or the controller alone (the URI `callers.CONTROLLER`), issued through the
`certificates.k8s.io/v1` CertificateSigningRequest API and signed by criuctl's signer from a CA
whose key only the signer's pod holds (the Secret `criuctl-ca`: criuctl.kube.signer).

Why the signer checks who asks, not only what is asked: every agent runs as the same
ServiceAccount, so a request's name proves nothing. The agent asks with a projected token bound to
its own pod (`/var/run/secrets/criuctl/token`, manifests/daemonset.yaml); for such a token the API
server writes the pod's name and UID into the request's `spec.extra` (k8s.io/apiserver's
serviceaccount.PodNameKey and PodUIDKey, copied by the CSR strategy's PrepareForCreate), which the
requester cannot set. The signer signs only for the node that pod runs on, only that node's
addresses, only for an agent pod of criuctl's DaemonSet. The kubelet's own serving certificates
follow the same path (pkg/kubelet/certificate) with the approval left to a checker: this is ours.

Since every client reaches an agent at its node's address and checks the certificate against that
address, a node's key serves as no other node.

The controller asks the same way, as its own ServiceAccount, for a client certificate whose one
name is the URI `callers.CONTROLLER` (`issue_controller`); no node's can carry it (the signer
signs DNS names and addresses only for an agent). Agents take it in place of a token: on
Kubernetes no credential is shared, so no node holds one that opens every other
(criuctl.agent.callers); and the controller, holding no CA key, can make no node.

Rotation: the agent asks for a new key and certificate when two thirds of the current one's life
has passed (or on SIGHUP), and loads them into the TLS context it serves with: handshakes from then
on get the new one, connections already open keep theirs, so a move in flight never notices. The
controller's renews the same way; a client presents the file as it is when it connects. The CA
does not change, so no client does either.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import ipaddress
import logging
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
from cryptography.x509.oid import NameOID

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
CONTROLLER_USER = f"system:serviceaccount:{SYSTEM_NS}:criuctl-controller"
CONTROLLER_CN = "criuctl-controller"
BOUND_TOKEN = Path("/var/run/secrets/criuctl/token")  # the projected token manifests/daemonset.yaml mounts
RENEW_AT = 2 / 3  # of a certificate's life: renewals start here, with a third left for retries
RETRY = 10.0  # s between two tries to renew (the signer may be restarting)
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
        return names_of(cert.subject, cert.extensions) == (node, node_sans(node, addresses))


def node_sans(node: str, addresses: list[str]) -> frozenset[str]:
    return frozenset({f"DNS:{node}", *(f"IP:{ipaddress.ip_address(a)}" for a in addresses)})


def names_of(subject: x509.Name, extensions: x509.Extensions) -> tuple[str, frozenset[str]]:
    """The common name and the subject alternative names ("DNS:x", "IP:y") of a request or certificate."""
    cn = subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    try:
        san = extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return (str(cn[0].value) if cn else "", frozenset())
    names = {f"DNS:{d}" for d in san.get_values_for_type(x509.DNSName)}
    names |= {f"IP:{i}" for i in san.get_values_for_type(x509.IPAddress)}
    names |= {f"URI:{u}" for u in san.get_values_for_type(x509.UniformResourceIdentifier)}
    if len(names) != len(list(san)):  # an email, a directory name: nothing criuctl's certificates name
        names.add("other")
    return (str(cn[0].value) if cn else "", frozenset(names))


def node_addresses(c: Cluster, node: str) -> list[str]:
    """The node's InternalIP addresses, as the kubelet registered them: where clients reach its agent."""
    n = c.serialize(call(f"node {node}", c.core.read_node, node))
    return [a["address"] for a in n.get("status", {}).get("addresses") or [] if a.get("type") == "InternalIP"]


def _request(
    key: ec.EllipticCurvePrivateKey, cn: str, san: list[x509.GeneralName]
) -> x509.CertificateSigningRequest:
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .sign(key, hashes.SHA256())
    )


def as_agent_pod(kubeconfig: str | None) -> Cluster:
    """The API server as the agent's pod itself, for every call: its bound token, read at each
    request (the kubelet renews the file). The API server then knows which pod, so which node,
    calls: the signer issues it that node's name alone, and criuctl's webhook lets it write only
    the move records that name that node (criuctl.kube.recordrules). With a kubeconfig, or outside
    a pod, the credentials given."""
    c = connect(kubeconfig)
    if kubeconfig is None and BOUND_TOKEN.exists():

        def fresh(cfg: Any) -> None:
            with contextlib.suppress(OSError):
                cfg.api_key = {"authorization": "Bearer " + BOUND_TOKEN.read_text().strip()}

        cfg = c.core.api_client.configuration
        cfg.refresh_api_key_hook = fresh
        fresh(cfg)
    return c


def _ask(
    c: Cluster, who: str, cn: str, san: list[x509.GeneralName], usages: list[str], path: Path, wait: float
) -> Identity:
    """A new key, and a certificate for it from criuctl's signer naming `cn` and `san` alone,
    written to `path` (root-only) once checked: what is on disk is always a pair. `who`: the
    asking component (criuctl-agent, criuctl-controller), the request's label."""
    assert c.certificates is not None
    key = ec.generate_private_key(ec.SECP256R1())
    req = _request(key, cn, san)
    base = who if cn == who else f"{who}-{cn}"  # an agent's names its node
    name = f"{base}-{uuid.uuid4().hex[:8]}"[:253]
    body = {
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": who}},
        "spec": {
            "request": base64.b64encode(req.public_bytes(serialization.Encoding.PEM)).decode(),
            "signerName": SIGNER,
            "usages": usages,
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
                    f"criuctl's signer refused {cn}'s certificate request {name}: {cond.get('message')}",
                    "see the signer's log (kubectl -n criuctl-system logs deploy/criuctl-signer)",
                )
        if status.get("certificate"):
            break
        if time.monotonic() > deadline:
            raise CriuctlError(
                f"no certificate for {cn} after {wait:.0f} s (request {name})",
                "is criuctl's signer running (kubectl -n criuctl-system get deploy criuctl-signer)?",
            )
        time.sleep(0.5)
    try:
        pem = base64.b64decode(status["certificate"])
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise CriuctlError(
            f"request {name} was answered with no certificate: {exc}", "see the signer's log"
        ) from exc
    mine = serialization.PublicFormat.SubjectPublicKeyInfo
    if names_of(cert.subject, cert.extensions) != names_of(
        req.subject, req.extensions
    ) or cert.public_key().public_bytes(serialization.Encoding.DER, mine) != key.public_key().public_bytes(
        serialization.Encoding.DER, mine
    ):
        raise CriuctlError(
            f"the certificate issued for {cn} is not for its key and names", "see the signer's log"
        )
    keep(path, pem, key)
    log.info("certificate issued", extra={"request": name, "serial": f"{cert.serial_number:x}"})
    return Identity(path)


def agent_node(c: Cluster, extra: dict[str, Any], live: bool = True) -> tuple[str, str]:
    """The node whose criuctl agent pod made a request, from the API server's own word on the
    caller (`extra`: its bound token's pod name and UID, as a CSR or an AdmissionReview carries
    them): (node, "") or ("", why not). `live`: a pod being deleted is refused too."""
    pod_name, pod_uid = (extra.get(POD_NAME) or [""])[0], (extra.get(POD_UID) or [""])[0]
    if not pod_name:
        return "", "asked without a token bound to a pod (mount /var/run/secrets/criuctl/token)"
    try:
        pod = c.serialize(call(f"pod {pod_name}", c.core.read_namespaced_pod, pod_name, SYSTEM_NS))
    except NotFound:
        return "", f"asked by pod {SYSTEM_NS}/{pod_name}, which is gone"
    meta = pod["metadata"]
    key, _, value = AGENT_LABEL.partition("=")
    if (
        meta.get("uid") != pod_uid
        or (meta.get("labels") or {}).get(key) != value
        or (live and meta.get("deletionTimestamp"))
    ):
        return "", f"asked by pod {SYSTEM_NS}/{pod_name}, not a live criuctl agent pod"
    node = (pod.get("spec") or {}).get("nodeName") or ""
    if not node:
        return "", f"asked by pod {SYSTEM_NS}/{pod_name}, which runs on no node yet"
    return node, ""


def issue(kubeconfig: str | None, node: str, path: Path, wait: float = ISSUE_WAIT) -> Identity:
    """A new key and a certificate naming node `node` (its name and addresses), asked as its agent's pod."""
    c = as_agent_pod(kubeconfig)
    addresses = node_addresses(c, node)
    if not addresses:
        raise CriuctlError(f"node {node} has no InternalIP address", "check the kubelet's --node-ip")
    san = [x509.DNSName(node), *(x509.IPAddress(ipaddress.ip_address(a)) for a in addresses)]
    usages = ["digital signature", "key encipherment", "server auth", "client auth"]
    return _ask(c, "criuctl-agent", node, san, usages, path, wait)


def issue_controller(kubeconfig: str | None, path: Path, wait: float = ISSUE_WAIT) -> Identity:
    """A new key and the controller's client certificate (URI `callers.CONTROLLER` alone), asked as
    the controller's ServiceAccount: what it shows the agents, and what signs its grants."""
    san: list[x509.GeneralName] = [x509.UniformResourceIdentifier(callers.CONTROLLER)]
    usages = ["digital signature", "key encipherment", "client auth"]
    return _ask(connect(kubeconfig), "criuctl-controller", CONTROLLER_CN, san, usages, path, wait)


def controller_renewal(kubeconfig: str | None, path: Path) -> None:
    """Forever: a new key and certificate once two thirds of the current one's life has passed."""
    while True:
        time.sleep(RETRY)
        try:
            if Identity(path).due():
                issue_controller(kubeconfig, path)
                log.info("controller certificate renewed")
        except CriuctlError as exc:
            log.warning("cannot renew the controller's certificate yet", extra={"error": exc.line()})
        except Exception:  # this loop must outlive any one try: the certificate ends otherwise
            log.exception("cannot renew the controller's certificate yet")


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


def keep(path: Path, pem: bytes, key: Any) -> None:
    """A certificate and its key as one root-only file, written in one piece (`Identity`)."""
    secret = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    durable.replace(path, pem + secret, 0o600)
