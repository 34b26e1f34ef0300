"""Live migration between nodes (network namespaces, one agent each) with real CRIU on real jobs.

Every test ends by checking the only thing a user cares about: the job ran exactly once — on one
node at any time, never on both, never on neither — and its losses and final weights are those of
an uninterrupted run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests

from criuctl.agent import tickets
from criuctl.core.env import TIMEOUTS
from tests.cluster import Cluster, TicketAuth, agent_cert
from tests.conftest import needs_criu
from tests.jobs import CRIUCTL, Ref
from tests.requirements import needs
from tests.test_errors import assert_error_line

pytestmark = [needs_criu, pytest.mark.slow]

MLP = ("train_mlp.py", "--steps", "100", "--step-time", "0.1")


@pytest.fixture
def mlp_ref(reference):
    return reference("train_mlp.py", "--steps", "100", "--step-time", "0")


@pytest.fixture
def cluster(tmp_path):
    with Cluster(tmp_path / "c") as c:
        yield c


def assert_ran_once(c: Cluster, name: str, ref: Ref, where: str) -> None:
    """The job runs only on `where` (or already finished there), with the reference losses and weights."""
    now = c.running(name)
    assert now in ([where], []), f"{name} runs on {now}, expected only on {where}"
    c.wait_finished(name)
    ended = [
        (n.name, r["exit_code"])
        for n in c.nodes.values()
        for r in n.records()
        if r["name"] == name and r["state"] == "exited"
    ]
    assert ended == [(where, 0)], f"{name} ended on {ended}, expected once on {where}"
    assert c.steps(name) == ref.steps
    assert c.final(name) == [ref.final], "final weights differ from an uninterrupted run"


def _mlp_on_a(c: Cluster, step: int) -> None:
    """The small training job, started on node a, once it has logged `step`."""
    c.run("a", "mlp", *MLP)
    c.wait_step("mlp", step)


def _migrate_ok(c: Cluster, name: str, to: str, *flags: str) -> dict:
    r = c.migrate(name, to, *flags)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def _follow_logs(c: Cluster, node: str) -> subprocess.Popen:
    """`criuctl logs cnn --node NODE -f`, from the client's seat, running on."""
    env = {**os.environ, "CRIUCTL_STATE_DIR": str(c.client_state)}
    argv = [*CRIUCTL, "logs", "cnn", "--node", node, "-f"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _followed(p: subprocess.Popen, until: int) -> str:
    """A follower ended by itself (the job moved away or ended) with exit 0, having printed the
    job's steps up to `until` at least, in order, none twice; its last stderr line."""
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-2000:]
    logged = [int(x.split()[1]) for x in out.splitlines() if x.startswith("step ")]
    assert logged == sorted(set(logged)) and logged and logged[-1] >= until, out[-2000:]
    return err.strip().splitlines()[-1]


def _failed(r: subprocess.CompletedProcess) -> str:
    """A failed migrate: non-zero, one `criuctl: error:` line that says the job keeps running."""
    assert r.returncode != 0, r.stdout
    errors = [line for line in r.stderr.splitlines() if line.startswith("criuctl: error:")]
    assert len(errors) == 1, r.stderr[-2000:]
    return errors[0]


# ------------------------------------------------------------------------------------------ modes


def test_stop_and_copy_a_to_b_to_a_with_dataloader_workers(tmp_path, monkeypatch):
    """There `direct` (CRIUCTL_STREAM): the dump sends the memory pages into CRIU's page server on
    the target, over TLS pinned to certificates the two agents made for this move; the agents'
    stream carries only the other images and the signed manifest. Back `live`: the whole bundle
    streams while CRIU writes it. (One job for both: the two were separate runs of it, 72 s more.)"""
    # ~0.3 s a step (32 reads of 20 ms over 2 workers): 40 steps left after the first move's step 20
    # give the second move's start-up room; at 4 ms a read the job ended first on a slow VM (CI)
    steps = 60
    args = ("--steps", str(steps), "--workers", "2", "--read-latency", "0.02")
    ref_log = tmp_path / "ref.log"
    ref = Ref(tmp_path / "ref", "train_cnn_loader.py", *args, "--log", str(ref_log))
    with Cluster(tmp_path / "c") as c:
        log = tmp_path / "train.log"
        job = c.run("a", "cnn", "train_cnn_loader.py", *args, "--log", str(log))
        c.wait_step("cnn", 8)
        monkeypatch.setenv("CRIUCTL_STREAM", "direct")
        there = _migrate_ok(c, "cnn", "b", "--mode", "stop-and-copy")
        assert job.wait(60) == 0 and "moved to node b" in job.err[-1]
        assert c.running("cnn") == ["b"]
        assert there["bytes_moved"] < 20 << 20, there  # ~200 MB of memory, not through the stream
        followers = {"b": _follow_logs(c, "b")}
        c.wait_step("cnn", 20)
        monkeypatch.setenv("CRIUCTL_STREAM", "live")
        back = _migrate_ok(c, "cnn", "a", "--mode", "stop-and-copy")
        followers["a"] = _follow_logs(c, "a")
        assert _followed(followers.pop("b"), until=21).endswith("`criuctl logs cnn --node a -f`")
        assert back["downtime_seconds"] > 0
        assert back["bytes_moved"] > 100 << 20, back
        assert_ran_once(c, "cnn", ref, "a")
        assert _followed(followers.pop("a"), until=steps - 1).endswith("cnn exited with code 0 on node a")
        # the log file the job holds open kept being appended to, on every node, in order
        logged = [int(x.split()[1]) for x in log.read_text().splitlines() if x.startswith("step ")]
        assert logged == list(range(steps))
        r = c.client("ps", "--node", "a", "--all")
        assert "cnn" in r.stdout, r.stdout
        r = c.client("logs", "cnn", "--node", "b", "--tail", "3")
        assert r.returncode == 0 and r.stdout.strip(), r.stderr


def test_a_ticket_opens_its_routes_to_the_moves_source_node_alone(cluster, tmp_path):
    """Mutual TLS: the client names the source's address when it asks the target for a ticket, and
    the target takes the ticket's proofs for what feeds or ends the move (upload, page session,
    abort) only from a caller whose certificate (from the agents' CA) names that address. Another
    node's valid certificate, none, or one naming the source from another CA: refused, although
    the proof itself is good."""
    a, b = cluster.nodes["a"], cluster.nodes["b"]
    inc = requests.post(
        f"{b.url}/v1/incoming",
        json={"workload": "x", "mode": "stop-and-copy", "source": a.addr},
        headers=b.auth(),
        timeout=30,
        verify=b.verify,
    ).json()
    ticket = TicketAuth(inc)
    url = f"{b.url}/v1/incoming/{inc['id']}"

    def abort(cert: tuple[str, str] | None) -> requests.Response:
        return requests.delete(url, auth=ticket, timeout=30, verify=b.verify, cert=cert)

    r = abort(None)
    assert r.status_code == 403 and "presented no certificate" in r.json()["what"], r.text
    r = abort((str(b.tls[0]), str(b.tls[1])))  # a node of the cluster, but not this move's source
    assert r.status_code == 403 and f"not migration {inc['id']}'s source {a.addr}" in r.json()["what"], r.text
    stranger = agent_cert(tmp_path / "other-ca", "a", a.addr)  # a's name, from a CA no agent trusts
    with pytest.raises(requests.exceptions.ConnectionError):  # the handshake fails (TLS 1.3: seen as a reset)
        abort((str(stranger[0]), str(stranger[1])))
    # its signed state is for any holder of the ticket to read (a job's later ranks' targets ask it)
    r = requests.get(url, auth=ticket, timeout=30, verify=b.verify)
    assert r.ok and r.json()["state"] == "new", r.text
    # the client's own calls (the node's token, no certificate) are not a ticket's: unaffected
    assert requests.get(url, headers=b.auth(), timeout=30, verify=b.verify).ok
    r = abort((str(a.tls[0]), str(a.tls[1])))
    assert r.ok and r.json()["state"] == "aborted", r.text


def test_an_agent_with_a_token_takes_no_certificate_in_its_place(cluster, tmp_path):
    """Outside Kubernetes an agent has a token, and the CA given as --peer-ca may sign more than
    criuctl's agents: a certificate alone (the controller's name, the node's own, another node's)
    opens nothing but its move's ticket there; the token still does. (Where an agent has no token,
    on Kubernetes, the certificates are what opens it: tests/test_kube_identity.py.)"""
    from criuctl.kube import signer

    a, b = cluster.nodes["a"], cluster.nodes["b"]
    pki = b.tls[2].parent
    ctl = signer.controller_identity(signer.CA.load(pki / "ca.crt", pki / "ca.key"), tmp_path / "ctl.pem")

    def call(cert: tuple[str, str] | None, headers: dict | None = None) -> requests.Response:
        return requests.get(f"{b.url}/v1/workloads", timeout=30, verify=b.verify, cert=cert, headers=headers)

    for cert in [(str(ctl.path),) * 2, (str(b.tls[0]), str(b.tls[1])), (str(a.tls[0]), str(a.tls[1])), None]:
        r = call(cert)  # type: ignore[arg-type]
        assert r.status_code == 401 and "no bearer token" in r.json()["what"], (cert, r.text)
    assert call((str(a.tls[0]), str(a.tls[1])), b.auth()).ok


def test_a_page_session_opens_once_for_its_own_stop_and_copy_ticket_only(cluster):
    """POST /v1/incoming/ID/pages: a proof of the upload ticket opens it (a node token, another
    ticket or one whose proof does not cover the body does not), for a stop-and-copy still waiting
    for its bundle or a post-copy (no port: its pages come the other way), once; what comes as the
    source's certificate must be one, and the target's answer is signed over the question's nonce."""
    b = cluster.nodes["b"]

    def incoming(mode: str) -> tuple[str, TicketAuth]:
        inc = requests.post(
            f"{b.url}/v1/incoming",
            json={"workload": "x", "mode": mode},
            headers=b.auth(),
            timeout=30,
            verify=b.verify,
        ).json()
        return inc["id"], TicketAuth(inc)

    def pages(mid: str, auth: TicketAuth | None, cert: object) -> requests.Response:
        url = f"{b.url}/v1/incoming/{mid}/pages"
        return requests.post(url, json={"cert": cert}, auth=auth, timeout=30, verify=b.verify)

    from criuctl.net import pagetls

    pem = pagetls.make_identity(cluster.root / "pem", "source").pem
    mid, ticket = incoming("stop-and-copy")
    _, other_ticket = incoming("stop-and-copy")
    assert pages(mid, other_ticket, pem).status_code == 401
    assert pages(mid, None, pem).status_code == 401
    for bad in (None, "garbage", pem + pem, "x" * 20000):
        r = pages(mid, ticket, bad)
        assert r.status_code == 400 and "certificate" in r.json()["what"], (bad, r.text)
    # a certificate swapped on the way (the proof covers the body): refused
    url = f"{b.url}/v1/incoming/{mid}/pages"
    swapped = requests.Request("POST", url, json={"cert": pem}, auth=ticket).prepare()
    swapped.body = json.dumps({"cert": pagetls.make_identity(cluster.root / "pem2", "mitm").pem}).encode()
    swapped.headers["Content-Length"] = str(len(swapped.body))
    with requests.Session() as s:
        assert s.send(swapped, timeout=30, verify=b.verify).status_code == 401
    r = pages(mid, ticket, pem)
    assert r.ok, r.text
    assert 0 < r.json()["port"] < 65536 and r.json()["cert"].startswith("-----BEGIN CERTIFICATE-----")
    # the answer's certificate is the target's own word: signed over this question's nonce
    assert tickets.checked_cert(ticket.ticket, ticket.nonce, r.json()["cert"], r.json()["sig"])
    assert not tickets.checked_cert(other_ticket.ticket, ticket.nonce, r.json()["cert"], r.json()["sig"])
    assert pages(mid, ticket, pem).status_code == 409  # once
    # post-copy: no page server here (its pages come the other way), this end's certificate for
    # the lazy-pages daemon that pulls them, once
    post, post_ticket = incoming("post-copy")
    pr = pages(post, post_ticket, pem)
    assert pr.ok and pr.json()["port"] == 0 and pr.json()["cert"].startswith("-----BEGIN CERTIFICATE-----")
    assert pages(post, post_ticket, pem).status_code == 409
    # an abort ends the page server that waited for a dump that never came
    assert requests.delete(f"{b.url}/v1/incoming/{mid}", auth=ticket, timeout=30, verify=b.verify).ok
    port = r.json()["port"]
    deadline = time.monotonic() + 10
    while _listening(b, port) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _listening(b, port), "the aborted migration's page server still listens"


def _listening(node, port: int) -> bool:
    r = subprocess.run([*node.inside(), "ss", "-Htln", f"sport = :{port}"], capture_output=True, text=True)
    return bool(r.stdout.strip())


@needs("userfaultfd")
def test_post_copy_a_to_b_to_a(cluster, mlp_ref):
    c = cluster
    job = c.run("a", "mlp", *MLP)
    c.wait_step("mlp", 10)
    there = _migrate_ok(c, "mlp", "b", "--mode", "post-copy")
    assert job.wait(60) == 0
    assert there["mode"] == "post-copy" and there["pages_seconds"] is not None
    # the bundle holds no memory pages: far less than the job's memory crossed before it ran again
    assert there["bytes_moved"] < 64 << 20, there
    c.wait_step("mlp", 30)
    _migrate_ok(c, "mlp", "a")  # default mode: post-copy, the kernels allow it
    assert_ran_once(c, "mlp", mlp_ref, "a")


def _info(c: Cluster, node: str) -> dict:
    """GET /v1/info of a node's agent, with its token."""
    n = c.nodes[node]
    return requests.get(f"{n.url}/v1/info", headers=n.auth(), timeout=10, verify=n.verify).json()


def test_pre_copy_is_not_offered_until_it_exists(cluster):
    """Pre-copy is not built: it is in no list (`--mode`, doctor, the agent's info), and asking for it
    is refused before anything is asked of an agent."""
    r = cluster.client("migrate", "mlp", "b", "--mode", "pre-copy")
    assert r.returncode == 2 and "invalid choice: 'pre-copy'" in r.stderr, r.stderr
    assert "pre-copy" not in cluster.client("migrate", "--help").stdout
    assert "pre-copy" not in cluster.client("doctor").stdout
    assert "pre_copy" not in _info(cluster, "a")


# ------------------------------------------------------------------------------------------ faults


def _wait_for_process(c: Cluster, pattern: str, timeout: float = 60) -> psutil.Process:
    """A process of this test's cluster (a handoff, or a CRIU a handoff started) matching `pattern`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for h in c.handoffs():
            with contextlib.suppress(psutil.Error):
                for p in [h, *h.children(recursive=True)]:
                    if pattern in " ".join(p.cmdline()):
                        return p
        time.sleep(0.02)
    raise AssertionError(f"no process of this cluster matching {pattern!r}")


def _wait_for_child(parent: psutil.Process, pattern: str, timeout: float = 60) -> int:
    """A descendant of `parent` matching `pattern`, found through the kernel's children lists (as
    CRIU walks a tree). `_wait_for_process`'s look at every process on the machine was slower than
    a whole dump in a loaded CI run: it never saw the source's CRIU, and the move ended meanwhile."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        todo = [parent.pid]
        while todo:
            pid = todo.pop()
            with contextlib.suppress(OSError, ValueError):
                argv = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
                if pid != parent.pid and pattern in argv:
                    return pid
                for kids in Path(f"/proc/{pid}/task").glob("*/children"):
                    todo += [int(k) for k in kids.read_text().split()]
        if not parent.is_running():
            break
        time.sleep(0.005)
    raise AssertionError(f"no process under {parent.pid} matching {pattern!r}")


def _background_migrate(c: Cluster, name: str, to: str, *flags: str) -> subprocess.Popen:
    env = {**os.environ, "CRIUCTL_STATE_DIR": str(c.client_state)}
    return subprocess.Popen(
        [*CRIUCTL, "migrate", name, "--to", to, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _finish(p: subprocess.Popen, timeout: float = 180) -> subprocess.CompletedProcess:
    out, err = p.communicate(timeout=timeout)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def test_source_agent_killed_mid_dump(cluster, mlp_ref):
    c = cluster
    _mlp_on_a(c, 10)
    p = _background_migrate(c, "mlp", "b", "--mode", "stop-and-copy")
    source = _wait_for_child(psutil.Process(c.nodes["a"].agent.pid), "criuctl.agent.handoff source")
    dumping = _wait_for_child(psutil.Process(source), "criu swrk")
    os.kill(
        dumping, signal.SIGSTOP
    )  # CRIU, freezing and dumping the tree, holds there until a's agent is dead
    try:
        c.nodes["a"].agent.kill()
        c.nodes["a"].agent.wait(30)
    finally:
        os.kill(dumping, signal.SIGCONT)
    _failed(_finish(p))
    deadline = time.monotonic() + 60  # the handoff sees its lease break once CRIU is done, and thaws
    while c.running("mlp") != ["a"]:
        assert time.monotonic() < deadline, "the source never thawed after its agent died"
        time.sleep(0.1)
    assert_ran_once(c, "mlp", mlp_ref, "a")


def test_target_agent_killed_mid_restore(tmp_path, mlp_ref):
    """The target's agent dies while its handoff restores: nobody can say yet whether b's copy is dead.

    The source stays frozen rather than risk a second copy, and says so (`thawed: unconfirmed`);
    once b's agent is back (a DaemonSet restarts it), its record says the copy never ran, and a's
    lease thaws the job, which runs on where it was.
    """
    with Cluster(tmp_path / "c", lease=5) as c:
        _mlp_on_a(c, 10)
        p = _background_migrate(c, "mlp", "b", "--mode", "stop-and-copy")
        _wait_for_process(c, "criuctl.agent.handoff target")
        c.nodes["b"].agent.kill()
        line = _failed(_finish(p))
        assert "stays frozen on a" in line and "thawed: unconfirmed" in line, line
        assert c.running("mlp") == [], "the job runs somewhere although nobody confirmed b's copy is dead"
        c.nodes["b"].start_agent(lease=c.lease)
        deadline = time.monotonic() + 90
        while c.running("mlp") != ["a"]:
            assert time.monotonic() < deadline, "the source never settled once b's agent was back"
            time.sleep(0.2)
        assert_ran_once(c, "mlp", mlp_ref, "a")


def test_client_killed_before_the_commit_source_settles_with_target(tmp_path, mlp_ref):
    """The client vanishes with the source frozen and the target restored, both waiting for it.

    The source agent's lease runs out; it asks the target to abort its copy, and only once the
    target confirms does it thaw the job, which runs on where it was.
    """
    with Cluster(tmp_path / "c", lease=5) as c:
        _mlp_on_a(c, 10)
        p = _background_migrate(c, "mlp", "b", "--mode", "stop-and-copy")
        _wait_for_process(c, "criuctl.agent.handoff target")  # the bundle was sent; restore began
        p.kill()
        p.wait()
        deadline = time.monotonic() + 60
        while c.running("mlp") != ["a"]:
            assert time.monotonic() < deadline, "the source never settled its frozen job"
            time.sleep(0.2)
        while "lease expired" not in c.nodes["a"].agent_log():  # it thaws, then logs how it settled
            assert time.monotonic() < deadline, "the source settled, but not through its lease"
            time.sleep(0.1)
        assert_ran_once(c, "mlp", mlp_ref, "a")


def test_client_killed_mid_transfer(cluster, mlp_ref):
    """The client disconnects while the source agent streams to it: the source thaws, nothing runs twice."""
    c = cluster
    _mlp_on_a(c, 10)
    p = _background_migrate(c, "mlp", "b", "--mode", "stop-and-copy")
    _wait_for_bytes(c.nodes["b"].state / "incoming", 20 << 20, p)
    p.kill()
    p.wait()
    deadline = time.monotonic() + 60
    while c.running("mlp") != ["a"]:
        assert time.monotonic() < deadline, "the source never thawed after its client went away"
        time.sleep(0.2)
    assert_ran_once(c, "mlp", mlp_ref, "a")


def _wait_for_bytes(folder: Path, n: int, p: subprocess.Popen) -> None:
    """Until `n` bytes of a bundle have arrived under `folder`: the transfer is under way."""
    deadline = time.monotonic() + 60
    while sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) < n:
        assert time.monotonic() < deadline and p.poll() is None, "the transfer never started"
        time.sleep(0.01)


def test_link_cut_mid_transfer(tmp_path, monkeypatch, mlp_ref):
    monkeypatch.setenv(TIMEOUTS, json.dumps({"stall": 5}))  # both agents give up after 5 s, not 20
    with Cluster(tmp_path / "c") as c:
        _mlp_on_a(c, 10)
        p = _background_migrate(c, "mlp", "b", "--mode", "stop-and-copy")
        _wait_for_bytes(c.nodes["b"].state / "incoming", 20 << 20, p)
        c.link("b", up=False)
        try:
            line = _failed(_finish(p))
        finally:
            c.link("b", up=True)
        assert "keeps running on a" in line and "stalled" in line, line
        assert_ran_once(c, "mlp", mlp_ref, "a")


def test_target_disk_full(tmp_path, mlp_ref):
    with Cluster(tmp_path / "c", tmpfs={"b": "48m"}) as c:
        _mlp_on_a(c, 10)
        line = _failed(c.migrate("mlp", "b", "--mode", "stop-and-copy"))
        assert "disk full on node b" in line and "keeps running on a" in line, line
        left = list((c.nodes["b"].state / "incoming").iterdir())
        assert [p.suffix for p in left] == [".json"], f"the partial bundle was left behind: {left}"
        assert json.loads(left[0].read_text())["state"] in ("failed", "aborted")  # what a late source reads
        assert_ran_once(c, "mlp", mlp_ref, "a")


def test_one_corrupted_byte_in_transit(tmp_path, mlp_ref):
    """Over plain HTTP (--insecure), where nothing but criuctl's own checksums stands between a
    flipped bit and a restore (over TLS the record's MAC would end the connection first)."""
    with Cluster(tmp_path / "c", tls=False) as c:
        b = c.nodes["b"]
        proxy = _CorruptingProxy(("0.0.0.0", 7171), (b.addr, 7070), flip_at=50 << 20)
        r = c.client("node", "add", "b-proxied", f"http://{c.net}.1:7171", "--token-file", str(b.token_file))
        assert r.returncode == 0, r.stderr
        _mlp_on_a(c, 10)
        try:
            line = _failed(c.migrate("mlp", "b-proxied", "--mode", "stop-and-copy"))
        finally:
            proxy.close()
        assert proxy.flipped, "the proxy never corrupted a byte: the test proved nothing"
        assert "refused" in line or "damaged" in line or "broke" in line, line
        assert_ran_once(c, "mlp", mlp_ref, "a")


def test_target_node_unreachable(cluster, mlp_ref):
    c = cluster
    _mlp_on_a(c, 5)
    c.link("b", up=False)
    try:
        line = _failed(c.migrate("mlp", "b"))
    finally:
        c.link("b", up=True)
    assert "node b" in line and "did not answer" in line and "nothing was frozen" in line, line
    assert_ran_once(c, "mlp", mlp_ref, "a")


def test_criu_missing_on_target(cluster, mlp_ref):
    c = cluster
    c.nodes["b"].stop_agent()
    c.nodes["b"].start_agent(env={"CRIUCTL_CRIU": "/nonexistent/criu"})
    _mlp_on_a(c, 5)
    line = _failed(c.migrate("mlp", "b"))
    assert "node b cannot restore" in line and "CRIU not found" in line, line
    assert_ran_once(c, "mlp", mlp_ref, "a")


def test_restore_failing_on_target(tmp_path):
    """Node b's filesystem lacks the folder of a file the job holds open: CRIU's restore fails there.

    The job's TMPDIR (where torch's DataLoader binds its fd-passing unix socket) is in that folder
    too, as on real nodes whose /tmp is their own: a restore attempt on a node that shared it would
    re-bind the source's socket path and break the source job it was meant to leave alone.
    """
    data = tmp_path / "data"
    (data / "tmp").mkdir(parents=True)
    # ~0.3 s a step: the job is still running when the move freezes it, on a slow VM too
    args = ("--steps", "40", "--workers", "1", "--read-latency", "0.01")
    ref = Ref(tmp_path / "ref", "train_cnn_loader.py", *args, "--log", str(tmp_path / "ref.log"))
    with Cluster(tmp_path / "c", hide={"b": data}) as c:
        c.run(
            "a",
            "cnn",
            "train_cnn_loader.py",
            *args,
            "--log",
            str(data / "train.log"),
            env={"TMPDIR": str(data / "tmp")},
        )
        c.wait_step("cnn", 5)
        line = _failed(c.migrate("cnn", "b", "--mode", "stop-and-copy"))
        assert "CRIU restore failed" in line and "keeps running on a" in line, line
        assert_ran_once(c, "cnn", ref, "a")


# ------------------------------------------------------------------------------------------ auth, TLS, scale


def test_agent_refuses_missing_wrong_and_other_nodes_tokens(cluster):
    c = cluster
    a, b = c.nodes["a"], c.nodes["b"]
    url = f"{a.url}/v1/workloads"
    assert requests.get(f"{a.url}/healthz", timeout=5, verify=a.verify).ok
    for headers in ({}, {"Authorization": "Bearer wrong-token-0123456789"}, b.auth()):
        r = requests.get(url, headers=headers, timeout=5, verify=a.verify)
        assert r.status_code == 401, (headers, r.text)
        assert "refused" in r.json()["what"]
        r = requests.post(
            f"{a.url}/v1/outgoing",
            json={"workload": "x", "target": {}},
            headers=headers,
            timeout=5,
            verify=a.verify,
        )
        assert r.status_code == 401
    assert requests.get(url, headers=a.auth(), timeout=5, verify=a.verify).ok
    metrics = requests.get(f"{a.url}/metrics", headers=a.auth(), timeout=5, verify=a.verify)
    assert metrics.ok and "criuctl_migration_downtime_seconds" in metrics.text
    assert requests.get(f"{a.url}/metrics", timeout=5, verify=a.verify).status_code == 401
    # an upload ticket opens only its own migration's upload, nothing else
    inc = requests.post(
        f"{b.url}/v1/incoming", json={"workload": "x"}, headers=b.auth(), timeout=30, verify=b.verify
    ).json()
    ticket = TicketAuth(inc)
    assert requests.get(f"{b.url}/v1/workloads", auth=ticket, timeout=5, verify=b.verify).status_code == 401
    url = f"{b.url}/v1/incoming/{inc['id']}"
    restore = requests.post(f"{url}/restore", auth=ticket, timeout=5, verify=b.verify)
    assert restore.status_code == 401
    assert requests.get(url, auth=ticket, timeout=5, verify=b.verify).ok
    # the secret itself opens nothing: it never leaves the source, so whoever holds it stole it
    bearer = {"Authorization": f"Bearer {inc['ticket']}"}
    status = requests.get(url, headers=bearer, timeout=5, verify=b.verify)
    assert status.status_code == 401


def test_agent_refuses_a_token_file_others_can_read(tmp_path):
    token = tmp_path / "token"
    token.write_text("x" * 32)
    os.chmod(token, 0o644)
    argv = [*CRIUCTL, "agent", "--listen", "127.0.0.1:7199", "--token-file", str(token), "--insecure"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert r.returncode != 0 and "readable by others" in r.stderr and "chmod 600" in r.stderr


def test_migration_over_tls(tmp_path, mlp_ref):
    """The default: every agent serves HTTPS with its own node's certificate. Clients verify it
    against the CA given to `node add --ca`, the source agent against the CA the ticket carries (none
    of ours is in the system store); another node's certificate is refused, by the agent's start-up
    warning and by every client."""
    with Cluster(tmp_path / "c") as c:
        a, b = c.nodes["a"], c.nodes["b"]
        assert a.url.startswith("https://") and a.tls and b.tls and a.tls[0] != b.tls[0]
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(f"{a.url}/healthz", timeout=5, verify=True)  # not a CA the system trusts
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"http://{a.addr}:7070/healthz", timeout=5)  # no plain HTTP beside it
        info = requests.get(f"{b.url}/v1/info", headers=b.auth(), timeout=30, verify=b.verify).json()
        assert info["tls"] is True
        assert "warning" not in b.agent_log(), b.agent_log()[-2000:]

        own = b.tls
        b.stop_agent()
        b.tls = a.tls  # node a's certificate copied to node b
        b.start_agent(check_cert=False)
        assert f"names {a.addr}, none of this node's addresses ({b.addr})" in b.agent_log()
        mismatch = f"IP address mismatch, certificate is not valid for '{b.addr}'"
        assert_error_line(c.client("ps", "--node", "b"), "node b", "failed the TLS check", mismatch, "--ca")
        assert "TLS refused: IP address mismatch" in c.client("node", "ls").stdout
        b.stop_agent()
        b.tls = own
        b.start_agent()

        _mlp_on_a(c, 10)
        _migrate_ok(c, "mlp", "b", "--mode", "stop-and-copy")
        assert_ran_once(c, "mlp", mlp_ref, "b")


def test_migration_over_plain_http_with_insecure(tmp_path, mlp_ref):
    """`--insecure` agents (the benchmarks' setup) still move a job, over the plain socket path."""
    with Cluster(tmp_path / "c", tls=False) as c:
        assert c.nodes["b"].url.startswith("http://")
        assert "serving plain HTTP (--insecure)" in c.nodes["b"].agent_log()
        _mlp_on_a(c, 10)
        _migrate_ok(c, "mlp", "b", "--mode", "stop-and-copy")
        assert_ran_once(c, "mlp", mlp_ref, "b")
        said = c.nodes["b"].agent_log()
        assert "upload spliced from its socket" in said, "b read the bundle through aiohttp"


def test_eight_concurrent_migrations_between_one_pair(cluster, tmp_path):
    c = cluster
    args = ("--steps", "400", "--step-time", "0.1")  # long enough to still run after 8 freezes in a row
    ref = Ref(tmp_path / "ref8", "train_mlp.py", "--steps", "400", "--step-time", "0")
    names = [f"job{i}" for i in range(8)]
    for n in names:
        c.run("a", n, "train_mlp.py", *args)
    for n in names:
        c.wait_step(n, 3, timeout=300)
    results: dict[str, subprocess.CompletedProcess] = {}

    def move(n: str) -> None:
        results[n] = c.migrate(n, "b", "--mode", "stop-and-copy")

    threads = [threading.Thread(target=move, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for n in names:
        assert results[n].returncode == 0, (n, results[n].stderr[-1500:])
    for n in names:
        assert_ran_once(c, n, ref, "b")


class _CorruptingProxy:
    """A TCP relay that flips one bit of the byte at `flip_at` in the client→server direction."""

    def __init__(self, listen: tuple[str, int], upstream: tuple[str, int], flip_at: int) -> None:
        import socket

        self.upstream, self.flip_at, self.flipped = upstream, flip_at, False
        self.srv = socket.create_server(listen, reuse_port=True)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        while True:
            try:
                down, _ = self.srv.accept()
            except OSError:
                return
            up = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(down, up, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(up, down, False), daemon=True).start()

    def _pipe(self, src, dst, corrupt: bool) -> None:
        seen = 0
        try:
            while data := src.recv(1 << 16):
                if corrupt and not self.flipped and seen <= self.flip_at < seen + len(data):
                    i = self.flip_at - seen
                    data = data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]
                    self.flipped = True
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(2)

    def close(self) -> None:
        self.srv.close()


def test_checkpoint_api_then_bundle_carried_by_hand_and_restored(cluster, mlp_ref):
    """The kept-bundle API: checkpoint on a (through a dump handoff), carry the tar to b, restore
    there. Each node signs with a key of its own: b takes a's bundle only as the one copy it asked
    for, signed by a with the key b gave for it; a's own signature, or a key b gave before, opens nothing."""
    c = cluster
    a, b = c.nodes["a"], c.nodes["b"]
    on_a = {"headers": a.auth(), "verify": a.verify}
    on_b = {"headers": b.auth(), "verify": b.verify}
    _mlp_on_a(c, 10)
    r = requests.post(f"{a.url}/v1/workloads/mlp/checkpoint", json={}, timeout=300, **on_a)
    assert r.ok, r.text
    bid = r.json()["id"]
    assert (
        r.json()["bytes"] > 1 << 20 and c.running("mlp") == []
    )  # dumped and stopped: it lives in the bundle

    def expect() -> str:
        got = requests.post(f"{b.url}/v1/bundles/{bid}/expect", timeout=30, **on_b)
        assert got.ok, got.text
        return got.json()["seal"]

    def put(body: bytes) -> requests.Response:
        return requests.put(f"{b.url}/v1/bundles/{bid}", data=body, timeout=300, **on_b)

    as_kept = requests.get(f"{a.url}/v1/bundles/{bid}", timeout=300, **on_a)
    assert as_kept.ok and len(as_kept.content) > 1 << 20
    unasked = put(as_kept.content)
    assert unasked.status_code == 409 and "expects no copy" in unasked.json()["what"], unasked.text
    expect()
    own_signature = put(as_kept.content)  # signed with a's own key: it verifies on a alone
    assert own_signature.status_code == 422, own_signature.text
    assert "signature does not verify" in own_signature.json()["what"]

    def sealed(seal: str) -> bytes:
        auth = {"headers": {**a.auth(), "Criuctl-Seal": seal}, "verify": a.verify}
        tar = requests.get(f"{a.url}/v1/bundles/{bid}", timeout=300, **auth)
        assert tar.ok and len(tar.content) == len(as_kept.content) and tar.content != as_kept.content
        return tar.content

    stale = sealed(expect())
    expect()  # b asks for a copy anew: the key it gave before opens nothing now
    assert put(stale).status_code == 422
    tar = sealed(expect())
    up = put(tar)
    assert up.ok, up.text
    assert (a.state / "bundle.key").read_text() != (b.state / "bundle.key").read_text()
    again = put(tar)
    assert again.status_code == 409
    r = requests.post(f"{b.url}/v1/bundles/{bid}/restore", json={}, timeout=300, **on_b)
    assert r.ok, f"{r.text}\n{b.agent_log()[-3000:]}"  # the agent's log holds CRIU's, should it fail
    assert_ran_once(c, "mlp", mlp_ref, "b")
    assert requests.delete(f"{a.url}/v1/bundles/{bid}", timeout=30, **on_a).ok
    assert requests.get(f"{a.url}/v1/bundles/{bid}", timeout=30, **on_a).status_code == 404
