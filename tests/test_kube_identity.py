"""Each node's agent its own identity on the real local cluster (criuctl.kube.identity): a key made
on the node, a certificate naming that node alone signed by criuctl's signer from a CA only it mounts,
issued through the API server's CertificateSigningRequest API to the agent pod of that node and to
nothing else, renewed under a running cluster without a client noticing."""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import signal
import socket
import ssl
import time
import uuid
from typing import Any

import psutil
import pytest
import requests
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding
from cryptography.x509.oid import NameOID

from criuctl.agent import callers, grants
from criuctl.kube import identity, signer
from criuctl.kube.cluster import AGENT_PORT, SYSTEM_NS
from tests.conftest import needs_criu
from tests.kube import Kubectl

pytestmark = [needs_criu, pytest.mark.slow]

RENEWED_EVERY = datetime.timedelta(minutes=10)  # two thirds of the signer's --cert-seconds 900


def _served(ip: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(ssl.get_server_certificate((ip, AGENT_PORT)).encode())


def _public(cert: x509.Certificate) -> bytes:
    return cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


def _handshake(ca: str, ip: str, expect: str) -> None:
    """A TLS handshake with the agent at `ip`, by a client that wants the node at address `expect`."""
    ctx = ssl.create_default_context(cafile=ca)
    with (
        socket.create_connection((ip, AGENT_PORT), timeout=10) as s,
        ctx.wrap_socket(s, server_hostname=expect),
    ):
        pass


def _node(node: str, ip: str) -> tuple[str, list[x509.GeneralName]]:
    return node, [x509.DNSName(node), x509.IPAddress(ipaddress.ip_address(ip))]


CONTROLLER = (identity.CONTROLLER_CN, [x509.UniformResourceIdentifier(callers.CONTROLLER)])


def _token(k: Kubectl, account: str, pod: dict | None = None) -> str:
    """A token of ServiceAccount criuctl-system/`account`, bound to `pod` if given (as the agents' are)."""
    spec: dict[str, Any] = {"expirationSeconds": 600}
    if pod is not None:
        spec["boundObjectRef"] = {
            "kind": "Pod",
            "apiVersion": "v1",
            "name": pod["metadata"]["name"],
            "uid": pod["metadata"]["uid"],
        }
    bound = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
    path = f"/api/v1/namespaces/{SYSTEM_NS}/serviceaccounts/{account}/token"
    r = k("create", "--raw", path, "-f", "-", input=json.dumps(bound))
    return json.loads(r.stdout)["status"]["token"]


def _ask(k: Kubectl, names: tuple[str, list[x509.GeneralName]], *token: str) -> str:
    """A certificate request to criuctl's signer for common name and SANs `names`, made as the
    admin or with `token`; the Denied condition's message once the signer has judged it (or a
    failure if approved)."""
    key = ec.generate_private_key(ec.SECP256R1())
    cn, sans = names
    san = x509.SubjectAlternativeName(sans)
    req = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .add_extension(san, critical=False)
        .sign(key, hashes.SHA256())
    )
    name = f"impostor-{uuid.uuid4().hex[:8]}"
    csr = {
        "apiVersion": "certificates.k8s.io/v1",
        "kind": "CertificateSigningRequest",
        "metadata": {"name": name},
        "spec": {
            "request": base64.b64encode(req.public_bytes(serialization.Encoding.PEM)).decode(),
            "signerName": identity.SIGNER,
            "usages": ["digital signature", "key encipherment", "server auth", "client auth"],
        },
    }
    k(*(("--token", token[0]) if token else ()), "create", "-f", "-", input=json.dumps(csr))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        status = (k.get("csr", name) or {}).get("status") or {}
        assert not status.get("certificate"), f"the signer signed {name} for {cn}"
        for cond in status.get("conditions") or []:
            assert cond["type"] == "Denied", f"the signer approved {name}: {cond}"
            return cond["message"]
        time.sleep(0.5)
    pytest.fail(f"the signer never judged {name}")


def _agent_pod(k: Kubectl, node: str) -> dict:
    (pod,) = [
        p for p in k.pods(SYSTEM_NS, "app.kubernetes.io/name=criuctl-agent") if p["spec"]["nodeName"] == node
    ]
    return pod


def _agent_process(node: str) -> psutil.Process:
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "--tls-from-cluster" in cmd:
            try:
                if p.environ().get("NODE_NAME") == node:
                    return p
            except psutil.Error:
                continue
    pytest.fail(f"no agent process of node {node}")


def test_each_agent_serves_its_own_nodes_certificate_and_no_one_else_gets_one(local_cluster) -> None:
    lay, k = local_cluster
    ca_path = str(lay.pki / "criuctl-ca.crt")
    ca = x509.load_pem_x509_certificate((lay.pki / "criuctl-ca.crt").read_bytes())
    ips = {n: lay.node(n).ip for n in lay.nodes}
    served = {}
    for node, ip in ips.items():
        cert = _served(ip)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == node
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == [ip], f"{node}'s names: {san}"
        assert san.get_values_for_type(x509.DNSName) == [node]
        assert cert.issuer == ca.subject
        # the test cluster's certificates last 15 minutes (tools/localcluster/addons.py): renewed
        # every 10, under the moves of the tests around this one
        assert cert.not_valid_after_utc - cert.not_valid_before_utc == RENEWED_EVERY * 1.5 + identity.BACKDATE
        ca.public_key().verify(
            cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(), cert.signature_hash_algorithm
        )
        served[node] = cert
    assert len({_public(c) for c in served.values()}) == len(served), "two nodes share a key"
    # every client reaches an agent at its node's address and checks the certificate against it:
    # a's certificate opens no connection meant for b (before: one certificate named every node)
    a, b = sorted(ips)
    _handshake(ca_path, ips[a], ips[a])
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(ca_path, ips[a], ips[b])

    # a request for a's name by anyone else is denied, with why: the admin (no pod) ...
    said = _ask(k, _node(a, ips[a]))
    assert "not criuctl's agent" in said, said
    # ... and b's own agent pod, with a token bound to it as its own is, asking for a's name
    token = _token(k, "criuctl-agent", _agent_pod(k, b))
    said = _ask(k, _node(a, ips[a]), token)
    assert f"runs on node '{b}'" in said, said
    # ... or for the controller's name (which opens every agent's reads and signs grants)
    said = _ask(k, CONTROLLER, token)
    assert "asked for" in said, said
    # the controller's ServiceAccount gets the controller's name alone: not a node's
    said = _ask(k, _node(a, ips[a]), _token(k, "criuctl-controller"))
    assert "not the controller's name alone" in said, said
    said = _ask(k, CONTROLLER)
    assert "not criuctl's agent" in said, said
    # and the controller got its own from the signer (it holds no CA): a client certificate of the
    # agents' CA, naming its URI alone
    issued = [
        c
        for c in json.loads(
            k("get", "csr", "-l", "app.kubernetes.io/name=criuctl-controller", "-o", "json").stdout
        )["items"]
        if (c.get("status") or {}).get("certificate")
    ]
    assert issued, "the controller has no certificate from criuctl's signer"
    cert = x509.load_pem_x509_certificate(base64.b64decode(issued[-1]["status"]["certificate"]))
    assert cert.issuer == ca.subject
    assert cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value == x509.SubjectAlternativeName([x509.UniformResourceIdentifier(callers.CONTROLLER)])
    assert [
        u.dotted_string for u in cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    ] == ["1.3.6.1.5.5.7.3.2"]  # client auth: it serves nothing

    # rotation: SIGHUP asks for a new key now; the agent serves it, for the same node, and goes on
    before, restarts = served[a], _restarts(k, a)
    _agent_process(a).send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while _public(now := _served(ips[a])) == _public(before):
        assert time.monotonic() < deadline, "the agent did not renew its certificate on SIGHUP"
        time.sleep(0.5)
    assert now.subject == before.subject and now.serial_number != before.serial_number
    _handshake(ca_path, ips[a], ips[a])
    assert _restarts(k, a) == restarts, "the agent restarted to renew"


def _restarts(k: Kubectl, node: str) -> int:
    return _agent_pod(k, node)["status"]["containerStatuses"][0]["restartCount"]


def test_no_token_is_shared_a_nodes_certificate_opens_on_another_only_what_a_move_needs(
    local_cluster, tmp_path
) -> None:
    """No Secret holds a token: the agents take certificates of their CA. A node's, on another
    node, opens what runs there and what a pending move that names both needs
    (criuctl.kube.peerrules): not a checkpoint, not a bundle no move names. The controller's alone
    reads what runs there; a move's routes take that move's grant, naming the node (and, for a
    call that names a workload, its pod's container: criuctl.agent.grants)."""
    lay, k = local_cluster
    ips = {n: lay.node(n).ip for n in lay.nodes}
    a, b = sorted(ips)
    ca = str(lay.pki / "criuctl-ca.crt")
    mine = str(lay.node_dir(a) / "var-lib-criuctl" / "identity.pem")
    ctl = signer.controller_identity(
        signer.CA.load(lay.pki / "criuctl-ca.crt", lay.pki / "criuctl-ca.key"), tmp_path / "ctl.pem"
    )

    def call(method: str, path: str, cert: str | None) -> requests.Response:
        url = f"https://{ips[b]}:{AGENT_PORT}{path}"
        return requests.request(method, url, verify=ca, cert=cert and (cert, cert), timeout=30)

    r = call("GET", "/v1/workloads", None)
    assert r.status_code == 401 and "takes no token" in r.json()["what"], r.text
    assert call("GET", "/v1/workloads", mine).ok
    r = call("POST", "/v1/workloads/x/checkpoint", mine)
    assert r.status_code == 403 and "the controller's, or this node's own" in r.json()["what"], r.text
    r = call("DELETE", "/v1/bundles/" + "0" * 32, mine)
    assert r.status_code == 403 and "no pending move of bundle" in r.json()["what"], r.text
    r = call("GET", "/v1/bundles/" + "0" * 32, mine)  # a bundle's bytes: its holder's own call alone
    assert r.status_code == 403, r.text
    own = str(lay.node_dir(b) / "var-lib-criuctl" / "identity.pem")
    assert call("GET", "/v1/bundles/" + "0" * 32, own).status_code == 404  # b itself: let in, none there
    # the controller's certificate alone reads what runs there; a move's routes take the move's grant
    assert call("GET", "/v1/workloads", str(ctl.path)).ok
    og = "/v1/outgoing/" + "0" * 32
    r = call("GET", og, str(ctl.path))
    assert r.status_code == 403 and "without a move's grant" in r.json()["what"], r.text
    key = grants.Signing.load(ctl.path)

    def granted(method: str, path: str, nodes: tuple[str, ...], body: Any = None) -> requests.Response:
        shown = grants.sign(grants.Grant("default", "p", "u", nodes, time.time() + 60), key)
        url = f"https://{ips[b]}:{AGENT_PORT}{path}"
        cert = (str(ctl.path), str(ctl.path))
        return requests.request(
            method, url, json=body, verify=ca, cert=cert, headers={grants.GRANT_HEADER: shown}, timeout=30
        )

    assert granted("GET", og, (a, b)).status_code == 404  # let in: no such move there
    r = granted("GET", og, (a,))
    assert r.status_code == 403 and f"not node {b}" in r.json()["what"], r.text
    r = granted("POST", "/v1/workloads/x/checkpoint", (a, b))
    assert r.status_code == 403 and "no move needs it" in r.json()["what"], r.text
    r = granted("POST", "/v1/outgoing", (a, b), {"workload": "ctr-000000000000", "mode": "stop-and-copy"})
    assert r.status_code == 403 and "is not its container" in r.json()["what"], r.text
    assert k.get("secret", "criuctl-agent", SYSTEM_NS) is None, "a token Secret is still installed"


def test_an_agent_writes_only_the_move_records_its_node_begins_or_is_part_of(local_cluster) -> None:
    """criuctl's webhook judges every write of a move record on the API server's word on the
    writer (criuctl.kube.recordrules): with tokens bound to the agent pods, as theirs are, b's agent
    cannot begin a move of a's pod (naming a as source, or itself), a's can, for its pod being
    deleted there; b, its target, cannot turn its target or bundle, but may hold it; the
    controller writes requests alone. A refusal names the rule; nothing refused is written."""
    from tests.test_kube import _sleeper

    _, k = local_cluster
    nodes = sorted({p["spec"]["nodeName"] for p in k.pods(SYSTEM_NS, "app.kubernetes.io/name=criuctl-agent")})
    a, b = nodes[:2]
    pod = _sleeper("rr-0", node=a)
    pod["metadata"]["finalizers"] = ["criuctl.io/test-hold"]  # deleted, it stays: being deleted on a
    k.apply(pod)
    live = k.wait_running("rr-0")
    key = "move.default.rr-0"
    tokens = {n: _token(k, "criuctl-agent", _agent_pod(k, n)) for n in (a, b)}
    tokens["controller"] = _token(k, "criuctl-controller")

    def record(**data: str) -> dict:
        base = {
            "namespace": "default",
            "pod": "rr-0",
            "uid": live["metadata"]["uid"],
            "source": a,
            "container": "main",
            "phase": "dumping",
            "target": b,
            "bundle": uuid.uuid4().hex,
            "source_pod": "rr-0",
            "since": repr(time.time()),
        }
        return {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": key, "namespace": SYSTEM_NS, "labels": {"criuctl.io/move": "true"}},
            "data": {**base, **data},
        }

    def write(by: str, verb: str, body: dict) -> str:
        r = k("--token", tokens[by], verb, "-f", "-", input=json.dumps(body), check=False)
        return "" if r.returncode == 0 else r.stderr

    try:
        said = write(b, "create", record())
        assert "records.criuctl.io" in said and "only a move from its own node" in said, said
        said = write(b, "create", record(source=b))
        assert f"not being deleted on node {b}" in said, said
        said = write(a, "create", record())
        assert f"not being deleted on node {a}" in said, "a's pod, not yet being deleted: " + said
        said = write("controller", "create", record())
        assert "writes only requested" in said, said
        assert k.get("configmap", key, SYSTEM_NS) is None, "nothing refused was written"
        k("delete", "pod", "rr-0", "--wait=false")
        assert write(a, "create", record()) == "", "its source begins it, its pod being deleted there"
        kept = k.get("configmap", key, SYSTEM_NS)
        assert kept is not None
        kept["data"].update(phase="kept", target=a)
        assert "may not change target" in write(b, "replace", kept)
        kept["data"].update(target=b, holder=b)
        assert write(b, "replace", kept) == "", "its target holds it"
        assert write(b, "delete", kept) == "", "a node it names ends it"
    finally:
        k("-n", SYSTEM_NS, "delete", "configmap", key, "--ignore-not-found")
        k(
            "patch",
            "pod",
            "rr-0",
            "--type=json",
            "-p",
            '[{"op":"remove","path":"/metadata/finalizers"}]',
            check=False,
        )
        k("delete", "pod", "rr-0", "--wait=false", "--ignore-not-found")
