"""No wait without an end on the API server (issue 20): every call criuctl makes through the official
Kubernetes client is bounded (criuctl.kube.api). Checked against an API server that accepts
connections and never sends a byte, over plain HTTP and over TLS (whose handshake then never
completes): `criuctl migrate POD NODE` gives up in one line, the webhook answers an admission before
the API server's own timeout, and the agents' and the stand-in operator's calls end. Then that no
code makes an API object of its own, which would bypass the bounds.

No cluster, no root, no CRIU: a thread on loopback. A client without the bounds hangs in each of
these tests; subprocess timeouts and pytest-timeout turn that into a failure.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from localcluster import pytorchjob, trainjob

from criuctl.core.env import KUBE_TIMEOUTS
from criuctl.core.errors import CriuctlError
from criuctl.kube import api, cluster, events, moves, mutate, owners, prestop, successors
from tests.conftest import parse_python
from tests.jobs import CRIUCTL, criuctl
from tests.test_webhook import (
    ROOT,
    TRAIN,
    admission,
    client_context,
    free_port,
    listening,
    make_certs,
    manifest,
    named,
    pod,
    service_name,
)

FAST = api.KubeTimeouts(connect=1.0, read=1.0)
SCHEMES = ("https", "http")  # TLS whose handshake never completes; a request never answered


class Silent:
    """A TCP server on loopback that accepts every connection and never sends a byte (nor closes)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=128)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the tests are over
                return
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture(scope="module")
def silent() -> Iterator[Silent]:
    s = Silent()
    yield s
    s.close()


def kubeconfig(folder: Path, port: int, scheme: str) -> Path:
    """A kubeconfig for the silent server (token auth; TLS not verified: the handshake never ends)."""
    cluster_ = {"server": f"{scheme}://127.0.0.1:{port}"}
    if scheme == "https":
        cluster_["insecure-skip-tls-verify"] = True
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "silent",
        "clusters": [{"name": "silent", "cluster": cluster_}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "silent", "context": {"cluster": "silent", "user": "u", "namespace": "ml"}}],
    }
    path = folder / f"kubeconfig-{scheme}"
    path.write_text(json.dumps(doc))  # JSON is YAML
    return path


def bare_env() -> dict[str, str]:
    """The environment less anything that would point the client at another cluster or timeouts."""
    drop = ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", KUBE_TIMEOUTS)
    return {k: v for k, v in os.environ.items() if k not in drop}


# ------------------------------------------------------------------------- criuctl migrate


@pytest.mark.parametrize("scheme", SCHEMES)
def test_migrate_gives_up_on_a_silent_api_server_in_bounded_time_with_one_line(
    silent: Silent, tmp_path: Path, scheme: str
) -> None:
    config = kubeconfig(tmp_path, silent.port, scheme)
    env = {**bare_env(), KUBE_TIMEOUTS: json.dumps({"connect": FAST.connect, "read": FAST.read})}
    accepted = len(silent.held)
    started = time.monotonic()
    r = criuctl(
        "migrate",
        "train",
        "b",
        "--state-dir",
        str(tmp_path / "state"),
        "--kubeconfig",
        str(config),
        timeout=60,
        env=env,
    )
    took = time.monotonic() - started
    assert len(silent.held) > accepted, "the client never reached the silent server"
    assert r.returncode == 1, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    # its first call: the API server's dry run of the PodMigration
    assert lines[0].startswith(
        "criuctl: error: the API server does not answer (podmigrations in namespace ml: no"
    )
    assert "check the cluster" in lines[0], lines
    # the first call gives up after connect + read; the margin is the interpreter's start
    assert took < 2 * (FAST.connect + FAST.read) + 10, f"took {took:.1f} s"


def test_a_bad_timeouts_setting_is_one_line() -> None:
    for raw in ('{"read": -1}', '{"reed": 2}', "[1]", "nan", '{"read": "soon"}', '{"connect": 1e999}'):
        with pytest.raises(CriuctlError) as e:
            api.timeouts(raw)
        assert e.value.line().startswith(f"{KUBE_TIMEOUTS}=") and "\n" not in e.value.line()
    assert api.timeouts('{"read": 2, "retries": 0}') == api.KubeTimeouts(read=2.0, retries=0)
    r = criuctl(
        "migrate",
        "train",
        "b",
        "--kubeconfig",
        "/nonexistent",
        timeout=60,
        env={**bare_env(), KUBE_TIMEOUTS: "{"},
    )
    assert r.returncode == 1 and len(r.stderr.splitlines()) == 1, r.stderr


# -------------------------------------------------------------------------------- the webhook


def test_the_admission_lookup_ends_before_the_api_servers_webhook_timeout() -> None:
    t = api.KubeTimeouts().admission()
    assert t.retries == 0
    for hook in manifest()["MutatingWebhookConfiguration"]["webhooks"]:
        # the lookup's worst case, and a second for TLS, the review's JSON and the answer
        assert t.connect + t.read + 1 <= hook["timeoutSeconds"], hook["name"]


@pytest.fixture(scope="module")
def webhook_on_silent(silent: Silent, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """`criuctl webhook` given the silent server's kubeconfig, with the shipped timeouts. Plain HTTP:
    the lookup then waits for the read timeout, the longer of the two."""
    folder = tmp_path_factory.mktemp("webhook-silent")
    certs = make_certs(folder / "tls")
    port, log = free_port(), folder / "stderr"
    config = kubeconfig(folder, silent.port, "http")
    argv = [
        *CRIUCTL,
        "webhook",
        "--state-dir",
        str(folder / "state"),
        "--listen",
        f"127.0.0.1:{port}",
        "--tls-cert",
        str(certs / "tls.crt"),
        "--tls-key",
        str(certs / "tls.key"),
        "--prestop-port",
        "7071",
        "--kubeconfig",
        str(config),
    ]
    with listening(argv, port, log):
        yield port, certs


async def _post(port: int, certs: Path, body: Any) -> tuple[dict, float]:
    ctx, started = client_context(certs / "ca.crt"), time.monotonic()
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.post(
            f"https://127.0.0.1:{port}/mutate", json=body, ssl=ctx, server_hostname=service_name()
        ) as r,
    ):
        assert r.status == 200
        return (await r.json())["response"], time.monotonic() - started


def test_the_webhook_answers_in_time_when_the_api_server_does_not(webhook_on_silent) -> None:
    """A labelled pod (failurePolicy Fail) is refused, saying why; a pod opted in by its namespace
    (Ignore) is admitted unchanged; both before the API server's webhook timeout."""
    port, certs = webhook_on_silent
    limit = min(h["timeoutSeconds"] for h in manifest()["MutatingWebhookConfiguration"]["webhooks"])
    labelled = named(pod(TRAIN))
    by_namespace = named(pod(TRAIN), "st-1")
    del by_namespace["metadata"]["labels"][mutate.LABEL]

    async def both() -> list[tuple[dict, float]]:
        return await asyncio.gather(
            _post(port, certs, admission(labelled)), _post(port, certs, admission(by_namespace))
        )

    (refused, took_refused), (admitted, took_admitted) = asyncio.run(both())
    assert refused["allowed"] is False and refused["status"]["code"] == 503, refused
    message = refused["status"]["message"]
    assert "pod ml/st-0 may be the successor of a pending move" in message, message
    assert "the API server does not answer (a move record: no reply" in message, message
    assert admitted["allowed"] is True and "patch" not in admitted, admitted
    assert max(took_refused, took_admitted) < limit, (took_refused, took_admitted)


# ----------------------------------------------- the agents' side and the PyTorchJob stand-in


def _owned_pod(name: str, kind: str, owner: str) -> dict:
    ref = {"kind": kind, "name": owner, "controller": True}
    return {"metadata": {"name": name, "namespace": "ml", "uid": "u0", "ownerReferences": [ref]}}


STS_POD, PTJ_POD = (
    _owned_pod("st-0", "StatefulSet", "st"),
    _owned_pod("mnist-master-0", "PyTorchJob", "mnist"),
)
MOVE = moves.Move("ml", "st-0", "u0", "a", "train", moves.Phase.REQUESTED, target="b")

# Each is one of the calls the node agent (preStop hook, moves loop) and `criuctl migrate` of a
# controller's pod make first: each must end in one line, within the timeouts.
CALLS: dict[str, Callable[[cluster.Cluster], Any]] = {
    "moves loop": lambda c: successors.tick(c, "a"),
    "preStop hook": lambda c: prestop.leaving(c, "ml", "st-0", "a"),
    "StatefulSet owner": lambda c: owners.owner(c, STS_POD),
    "PyTorchJob owner": lambda c: owners.owner(c, PTJ_POD),
    "move record write": lambda c: moves.save(c, MOVE),
    "pod delete": lambda c: cluster.delete_now(c, STS_POD),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("name", CALLS)
def test_the_agents_calls_end_in_one_line(silent: Silent, tmp_path: Path, scheme: str, name: str) -> None:
    c = cluster.connect(str(kubeconfig(tmp_path, silent.port, scheme)), FAST)
    started = time.monotonic()
    with pytest.raises(CriuctlError) as e:
        CALLS[name](c)
    took = time.monotonic() - started
    assert e.value.line().startswith("the API server does not answer ("), e.value.line()
    assert took < FAST.connect + FAST.read + 1, f"took {took:.1f} s"


@pytest.mark.timeout(60)
def test_an_event_that_gets_no_answer_is_given_up_in_time(silent: Silent, tmp_path: Path) -> None:
    c = cluster.connect(str(kubeconfig(tmp_path, silent.port, "http")), FAST)
    started = time.monotonic()
    events.record(c, STS_POD, events.Reason.STARTED, "moving")  # a courtesy: never raises
    assert time.monotonic() - started < FAST.connect + FAST.read + 1


@pytest.mark.timeout(60)
def test_the_pytorchjob_stand_in_ends_each_poll(silent: Silent, tmp_path: Path, monkeypatch, caplog) -> None:
    config = str(kubeconfig(tmp_path, silent.port, "http"))
    monkeypatch.setenv(KUBE_TIMEOUTS, json.dumps({"connect": FAST.connect, "read": FAST.read}))
    for step in (
        lambda: pytorchjob.install(config),
        lambda: pytorchjob.Controller(api.api_client(config, FAST)[0], FAST).sync(),
        lambda: trainjob.Controller(api.api_client(config, FAST)[0], FAST).sync(),
    ):
        started = time.monotonic()
        with pytest.raises(api.NoAnswer):
            step()
        assert time.monotonic() - started < FAST.connect + FAST.read + 1
    stop = threading.Event()
    kinds = (pytorchjob.Controller, trainjob.Controller)
    loop = threading.Thread(target=pytorchjob.run, args=(config, stop, 0.1, kinds), daemon=True)
    loop.start()
    time.sleep(FAST.connect + FAST.read + 0.5)
    stop.set()
    loop.join(FAST.connect + FAST.read + 1)
    assert not loop.is_alive(), "the stand-in's loop did not stop: a poll did not end"
    for kind in ("PyTorchJob", "TrainJob"):
        assert f"{kind} stand-in: " in caplog.text, "no poll ended with its failure logged"


# ------------------------------------------------------------------------------ no bypass


class Loud:
    """A fake API object that fails loudly when called without a request timeout."""

    api_client = "the ApiClient"

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def method(*args: Any, **kw: Any) -> tuple[str, Any]:
            if kw.get("_request_timeout") is None:
                raise AssertionError(f"{name} called without _request_timeout")
            return name, kw["_request_timeout"]

        return method


def test_every_method_of_a_bounded_api_carries_the_timeouts() -> None:
    b = api.Bounded(Loud(), FAST)
    assert b.read_namespaced_pod("p", "ml") == ("read_namespaced_pod", (1.0, 1.0))
    assert b.list_node(_request_timeout=None) == ("list_node", (1.0, 1.0)), "None would mean no bound"
    assert b.list_node(_request_timeout=(2, 3)) == ("list_node", (2, 3))
    assert b.api_client == "the ApiClient"


def test_a_connected_cluster_has_only_bounded_apis(tmp_path: Path) -> None:
    c = cluster.connect(str(kubeconfig(tmp_path, 1, "https")), FAST)
    for field in ("core", "custom", "apps"):
        assert isinstance(getattr(c, field), api.Bounded) and getattr(c, field).timeouts == FAST
    retries = c.core.api_client.configuration.retries
    assert retries.total == FAST.retries and type(retries).__name__ == "_NoRetryAfterTimeout"


# what makes an API object, a client, or a request of its own: only criuctl/kube/api.py may
MAKERS = {
    "ApiClient",
    "new_client_from_config",
    "load_kube_config",
    "load_incluster_config",
    "Watch",
    "call_api",
}


def _makers(tree: ast.AST) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in MAKERS or (name.endswith("Api") and name[:1].isupper()):  # CoreV1Api, CustomObjectsApi...
            yield node.lineno, name


def test_no_code_makes_an_api_object_of_its_own() -> None:
    found = []
    for path in sorted((ROOT / "criuctl").rglob("*.py")):
        if path == ROOT / "criuctl" / "kube" / "api.py":
            continue
        where = path.relative_to(ROOT)
        found += [f"{where}:{line} {name}" for line, name in _makers(parse_python(path.read_text()))]
    assert not found, "these bypass criuctl.kube.api's timeouts: " + "; ".join(found)
    here = parse_python((ROOT / "criuctl" / "kube" / "api.py").read_text())
    assert {name for _, name in _makers(here)} >= {"ApiClient", "load_kube_config"}, "the scan finds nothing"


def test_the_scan_finds_a_bypass() -> None:
    bypass = "from kubernetes import client\nclient.CoreV1Api(x).list_node()\nconfig.load_kube_config()\n"
    assert sorted(name for _, name in _makers(parse_python(bypass))) == ["CoreV1Api", "load_kube_config"]
