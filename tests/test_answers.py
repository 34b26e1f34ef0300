"""Every answer true (issue 20), on real processes and real files, without a migration.

- A thaw whose network lock cannot be lifted still lets the tree run, and says it is incomplete
  until a later thaw completes it (`checkpoint.thaw_tree`).
- A record whose PID now names another process is refused in one line, and that process is left
  alone (`workloads`, `procinfo.Identity`).
- The agent's recovery settles each hold record on its own: one that fails does not stop the others.
- Files are replaced whole, by one helper (`durable`); records are never written to the spool; two
  `criuctl node add` at once both keep their node.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import pytest

from criuctl.agent import outgoing as outgoing_mod
from criuctl.agent import tickets, verdicts
from criuctl.agent.protocol import SourceRecord, SourceState, Ticket, Verdict
from criuctl.core import faults, procinfo, workloads
from criuctl.core.env import FAULT_DIR, SPOOL_DIR
from criuctl.local import checkpoint
from criuctl.net import netlock
from criuctl_hook import durable
from tests import impostor
from tests.cluster import agent_cert
from tests.conftest import parse_python
from tests.jobs import criuctl
from tests.requirements import needs

ROOT = needs("root")  # nftables tables, other processes
TICKET = Ticket("http://127.0.0.1:1", "f" * 32, "s", "b")


def _stopped_sleeper() -> subprocess.Popen:
    p = subprocess.Popen(["sleep", "300"])
    os.kill(p.pid, signal.SIGSTOP)
    _wait_status(p.pid, psutil.STATUS_STOPPED)
    return p


def _wait_status(pid: int, wanted: str, timeout: float = 5) -> None:
    deadline = time.monotonic() + timeout
    while psutil.Process(pid).status() != wanted:
        assert time.monotonic() < deadline, f"PID {pid} is {psutil.Process(pid).status()}, not {wanted}"
        time.sleep(0.01)


def _register(name: str, pid: int, **fields) -> None:
    rec = {
        "name": name,
        "command": ["sleep", "300"],
        "root_pid": pid,
        "supervisor_pid": 0,
        "stdio_pipes": {},
        "state": "running",
        "started": time.time(),
        **fields,
    }
    d = workloads.state_dir() / "workloads"
    d.mkdir(parents=True, exist_ok=True)
    (d / f"{name}.json").write_text(json.dumps(rec))


@pytest.fixture
def lock_table():
    """A real nftables table named like CRIU's network lock, in this network namespace."""
    name = netlock.table_name(str(uuid.uuid4()))
    with netlock.Nft() as nft:
        ok, _, err = nft.run(f"add table {netlock.FAMILY} {name}")
    assert ok, err
    yield name
    netlock.lift(name)


@ROOT
def test_a_thaw_whose_lock_cannot_be_lifted_still_lets_the_tree_run_and_says_so(
    tmp_path, monkeypatch, lock_table
):
    """Before: `netlock.lift` raising left the tree stopped (SIGCONT never sent) while the caller
    recorded a final state. Now the SIGCONT comes whatever failed, and the thaw says what is left."""
    sleeper = _stopped_sleeper()
    try:
        w = workloads.Workload.of_tree(
            sleeper.pid, name="job", command=["sleep"], supervisor_pid=0, stdio_pipes={}
        )
        workloads.save(w)
        monkeypatch.setenv(FAULT_DIR, str(tmp_path))
        (tmp_path / faults.Fault.NETLOCK_LIFT).touch()  # the kernel refuses to delete the table

        thaw = checkpoint.thaw_tree(sleeper.pid, table=lock_table, workload="job")

        _wait_status(sleeper.pid, psutil.STATUS_SLEEPING)  # it runs
        assert not thaw.complete and "network lock" in thaw.line() and lock_table in thaw.line()
        assert lock_table in netlock.tables()
        assert workloads.load("job").thaw_incomplete == thaw.line()  # `ps` shows it
        r = criuctl("ps")
        assert "thaw incomplete" in r.stdout and "its thaw did not complete" in r.stderr, r

        (tmp_path / faults.Fault.NETLOCK_LIFT).unlink()  # the kernel lets go: the retry completes it
        again = checkpoint.thaw_tree(sleeper.pid, table=lock_table, workload="job")
        assert again.complete and lock_table not in netlock.tables()
        assert workloads.load("job").thaw_incomplete is None
    finally:
        sleeper.kill()
        sleeper.wait()


@ROOT
def test_criuctl_thaw_finishes_an_incomplete_thaw_and_refuses_anything_else(tmp_path, lock_table):
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        _register(
            "job", sleeper.pid, root_start=procinfo.start_ticks(sleeper.pid), boot_id=procinfo.boot_id()
        )
        r = criuctl("thaw", "job")
        assert r.returncode == 1 and "has no thaw to finish" in r.stderr and "Traceback" not in r.stderr
        w = workloads.load("job")
        w.thaw_incomplete = "CRIU's network lock still drops its TCP connections (...)"
        workloads.save(w)
        r = criuctl("thaw", "job")
        assert r.returncode == 0, r.stderr
        assert workloads.load("job").thaw_incomplete is None
    finally:
        sleeper.kill()
        sleeper.wait()


@ROOT
@pytest.mark.parametrize("record", ["current", "older"])
def test_a_record_whose_pid_now_names_another_process_is_refused_and_that_process_untouched(tmp_path, record):
    """The workload ended and its PID went to an unrelated process (or the node rebooted): `dump`
    would have frozen, dumped and killed that process. A current record knows its process's start
    time; an older one (no start time) knows when it was written, after its process started."""
    stranger = subprocess.Popen(["sleep", "300"])
    try:
        start = procinfo.start_ticks(stranger.pid)
        if record == "current":
            _register("victim", stranger.pid, root_start=start - 7, boot_id=procinfo.boot_id())
        else:
            _register("victim", stranger.pid, started=time.time() - 3600)  # as criuctl before wrote it
        r = criuctl("dump", "victim", "--bundle", str(tmp_path / "b"))
        assert r.returncode == 3, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and f"was PID {stranger.pid}, which is now another process" in lines[0], lines
        assert not (tmp_path / "b").exists()
        assert stranger.poll() is None and psutil.Process(stranger.pid).status() == psutil.STATUS_SLEEPING
        assert procinfo.start_ticks(stranger.pid) == start
        r = criuctl("ps", "--all")
        assert "lost" in r.stdout, r.stdout  # not shown as running
    finally:
        stranger.kill()
        stranger.wait()


def test_identity_names_one_process_for_good():
    me = procinfo.Identity.of(os.getpid())
    assert me.alive() and not me.recycled()
    assert not procinfo.Identity(me.pid, me.start + 1, me.boot).alive()
    assert procinfo.Identity(me.pid, me.start + 1, me.boot).recycled()
    assert not procinfo.Identity(me.pid, me.start, "another-boot").alive()
    older = procinfo.Identity(me.pid, None, me.boot, born_by=time.time() - 3600)  # written before we ran
    assert older.recycled() and not older.alive()
    assert procinfo.Identity(me.pid, None, me.boot, born_by=time.time()).alive()


@ROOT
def test_recovery_settles_each_hold_record_on_its_own(tmp_path, monkeypatch, caplog):
    """A record that cannot be settled (here: ending its tree fails) is logged and left for the next
    start; before, its exception ended the recovery — the agent crash-looped, and a frozen tree of
    another record stayed frozen."""
    broken = SourceRecord(
        "0" * 32,
        "gone",
        "stop-and-copy",
        SourceState.COMMITTED,
        TICKET,
        1 << 22,
        procinfo.boot_id(),
        root_pid=os.getpid(),
        root_start=procinfo.start_ticks(os.getpid()),
    )
    sleeper = _stopped_sleeper()
    try:
        me = procinfo.Identity.of(sleeper.pid)
        frozen = SourceRecord(
            "f" * 32,
            "job",
            "stop-and-copy",
            SourceState.FROZEN,
            TICKET,
            1 << 22,
            me.boot,
            root_pid=me.pid,
            root_start=me.start,
        )
        og = outgoing_mod.Outgoing(agent=None)  # type: ignore[arg-type]
        for rec in (broken, frozen):
            durable.replace_json(og.records / f"{rec.migration}.json", rec.to_json())

        def end(tree, rec):
            raise RuntimeError("the kernel said no")

        monkeypatch.setattr(outgoing_mod, "_end", end)
        with caplog.at_level("ERROR", logger="criuctl.agent"):
            assert og.recover() == []
        _wait_status(sleeper.pid, psutil.STATUS_SLEEPING)  # the frozen tree of the other record runs
        assert not (og.records / f"{frozen.migration}.json").exists()
        assert (og.records / f"{broken.migration}.json").exists()  # left for the next start
        assert any("not settled" in r.getMessage() for r in caplog.records)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_records_go_to_the_state_dir_and_only_bundles_to_the_spool(tmp_path, monkeypatch):
    """A tmpfs spool loses its contents in a reboot: the records a recovery needs must not be there."""
    spool = tmp_path / "spool"
    monkeypatch.setenv(SPOOL_DIR, str(spool))
    og = outgoing_mod.Outgoing(agent=None)  # type: ignore[arg-type]
    assert og.records == workloads.state_dir() / "outgoing" and og.spool == spool / "outgoing"
    from criuctl.agent.incoming import Incoming
    from criuctl.agent.redirects import Redirects

    inc = Incoming(agent=None)  # type: ignore[arg-type]
    assert inc.records == workloads.state_dir() / "incoming" and inc.spool == spool / "incoming"
    assert Redirects(agent=None).folder == workloads.state_dir() / "redirects"  # type: ignore[arg-type]


def test_durable_replace_leaves_the_old_file_or_the_new_one_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "rec.json"
    durable.replace_json(path, {"v": 1})
    assert json.loads(path.read_text()) == {"v": 1} and path.stat().st_mode & 0o777 == 0o600

    def no_disk(_fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_disk)
    with pytest.raises(OSError):
        durable.replace_json(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["rec.json"]  # no temp file left


def test_two_processes_creating_one_key_agree_on_it(tmp_path):
    path = tmp_path / "key"
    assert durable.create(path, b"first") and not durable.create(path, b"second")
    assert path.read_bytes() == b"first" and [p.name for p in tmp_path.iterdir()] == ["key"]


def test_concurrent_node_adds_each_keep_their_node(tmp_path):
    """Before: each wrote `nodes.tmp` (one fixed name) and replaced the list it had read: two at once
    interleaved into one temp file, or the later one dropped the earlier one's node."""
    token = tmp_path / "token"
    token.write_text("x" * 32 + "\n")
    token.chmod(0o600)
    env = {**os.environ, "CRIUCTL_STATE_DIR": str(tmp_path / "state")}
    names = [f"n{i}" for i in range(12)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "criuctl.cli.main",
                "node",
                "add",
                n,
                f"https://10.9.0.{i}:7070",
                "--token-file",
                str(token),
            ],
            env=env,
            stderr=subprocess.PIPE,
        )
        for i, n in enumerate(names)
    ]
    assert all(p.wait(60) == 0 for p in procs), [p.stderr.read() for p in procs]
    nodes = json.loads((tmp_path / "state" / "nodes.json").read_text())
    assert sorted(nodes) == sorted(names)
    assert not [p for p in (tmp_path / "state").iterdir() if p.name.startswith(".nodes.json")]
    r = subprocess.run(
        [sys.executable, "-m", "criuctl.cli.main", "node", "rm", "n3"], env=env, capture_output=True
    )
    assert r.returncode == 0 and "n3" not in json.loads((tmp_path / "state" / "nodes.json").read_text())


def _renames(tree: ast.AST) -> list[ast.Call]:
    """Calls that replace or rename a file by hand: `os.rename/replace/renames`, `Path.rename/replace`
    (one argument: `str.replace` takes two), a hand-made temp file. (`shutil.move` is left alone:
    it carries a failed dump's log across file systems, where no rename can.)"""
    found = []
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call):
            continue
        f = call.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
        if owner in ("durable", "dataclasses"):
            continue
        if (
            (owner == "os" and name in ("rename", "replace", "renames"))
            or name in ("mkstemp", "NamedTemporaryFile")
            or (name in ("rename", "replace") and len(call.args) == 1 and not call.keywords)
        ):
            found.append(call)
    return found


def test_every_atomic_write_goes_through_durable():
    """One home for "write a file durably" (`criuctl_hook.durable`): no module of the package or of
    the in-process hook renames or replaces a file itself. Before: it scanned `criuctl/local/` for
    `os.replace` and `mkstemp` only, and the hook renamed its own files without syncing the folder."""
    homes = [Path(checkpoint.__file__).parents[1], Path(durable.__file__).parent]
    offenders = []
    for home in homes:
        for path in home.rglob("*.py"):
            if path == Path(durable.__file__):
                continue
            lines = path.read_text().splitlines()
            for call in _renames(parse_python("\n".join(lines))):
                offenders.append(
                    f"{path.relative_to(home.parent)}:{call.lineno}: {lines[call.lineno - 1].strip()}"
                )
    assert offenders == [], "\n".join(offenders)
    assert (  # the guard sees what it looks for: durable's own os.replace, os.rename and mkstemp
        len(_renames(parse_python(Path(durable.__file__).read_text()))) == 3
    )


SECRET, MID = "the-ticket-secret", "a" * 32
SIGN, VERIFY = tickets.new_signer()  # the target's key pair for this migration


def _genuine(state: str, status: int = 200) -> impostor.Respond:
    """The target itself: checks the proof, signs its state over the question's nonce."""

    def respond(method: str, path: str, headers) -> tuple[int, bytes]:
        auth = headers.get("Authorization", "")
        proven = tickets.checked_proof(auth, tickets.proof_key(SECRET), method, path)
        if proven is None:
            return 401, b'{"what": "refused"}'
        return status, json.dumps(tickets.signed_state(SIGN, MID, state, "boot-1", proven.nonce)).encode()

    return respond


def _edited(respond: impostor.Respond, **change: str) -> impostor.Respond:
    """`respond`'s answer with fields changed on the way (a man in the middle)."""

    def edit(method: str, path: str, headers) -> tuple[int, bytes]:
        status, body = respond(method, path, headers)
        return status, json.dumps({**json.loads(body), **change}).encode()

    return edit


def _replayed(respond: impostor.Respond) -> impostor.Respond:
    """The answer `respond` gave to an earlier question, sent again to this one."""
    earlier = _genuine_answer(respond)
    return impostor.fixed(200, earlier)


def _genuine_answer(respond: impostor.Respond) -> bytes:
    path = f"/v1/incoming/{MID}"
    header, _ = tickets.proof(_ticket("http://x"), "GET", path)
    return respond("GET", path, {"Authorization": header})[1]


def _ticket(url: str, ca: str | None = None) -> Ticket:
    return Ticket(url, MID, SECRET, "b", ca, verify=VERIFY)


@contextlib.contextmanager
def _serving(respond: impostor.Respond, cert: str | None = None, key: str | None = None):
    srv = impostor.server(0, respond, cert, key)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv
    finally:
        srv.shutdown()


def _answers(respond: impostor.Respond) -> tuple[Verdict, str | None]:
    """What a source makes of what `respond` answers at the target's address."""
    with _serving(respond) as srv:
        ticket = _ticket(f"http://127.0.0.1:{srv.server_address[1]}")
        return verdicts.ask_abort(ticket), verdicts.ask_state(ticket)


@pytest.mark.parametrize(
    ("respond", "verdict"),
    [
        (_genuine("aborted"), Verdict.ABORTED),
        (_genuine("running", 409), Verdict.RUNNING),
        # anything but the target's own signed word is no answer: the source stays frozen
        (impostor.fixed(404, b'{"what": "not found"}'), Verdict.UNKNOWN),  # whatever else listens there
        (impostor.fixed(200, b'{"state": "aborted"}'), Verdict.UNKNOWN),  # unsigned
        (_edited(_genuine("running"), state="aborted"), Verdict.UNKNOWN),  # a signed answer, edited
        (_edited(_genuine("aborted"), migration="b" * 32), Verdict.UNKNOWN),  # about another migration
        (_replayed(_genuine("aborted")), Verdict.UNKNOWN),  # the target's answer to an earlier question
        (impostor.forged, Verdict.UNKNOWN),  # all it can make of the question, the right id included
        (impostor.fixed(503, b'{"what": "could not end its copy yet"}'), Verdict.UNKNOWN),
    ],
)
def test_a_verdict_is_the_targets_signed_word_never_an_inference(respond, verdict):
    """Before: a 404 read as "aborted", and any 200 saying aborted was believed."""
    got, state = _answers(respond)
    assert got == verdict
    assert (state is None) == (verdict == Verdict.UNKNOWN)


def _relay(to: str, change: dict[str, str] | None = None) -> impostor.Respond:
    """A man in the middle under `--insecure`: passes each request on to `to` and its answer back,
    reading both, and with `change`, rewriting the answer (keeping the genuine signature, adding
    its own under every key it could have learnt: `impostor.forged`)."""

    def respond(method: str, path: str, headers) -> tuple[int, bytes]:
        c = http.client.HTTPConnection(urlsplit(to).netloc, timeout=10)
        try:
            c.request(method, path, headers={"Authorization": headers.get("Authorization", "")})
            resp = c.getresponse()
            status, body = resp.status, resp.read()
        finally:
            c.close()
        if change is None:
            return status, body
        forged = json.loads(impostor.forged(method, path, headers)[1])
        return 200, json.dumps({**json.loads(body), **forged, **change}).encode()

    return respond


def test_no_impostor_the_model_admits_makes_a_source_thaw(tmp_path):
    """Issue 42: before, the source sent the ticket's secret to whoever answered at the target's
    address, and the verdict key was derived from it: each case below made a source thaw while the
    real target ran the job. Every impostor has the right migration id; none has the target's key."""
    # 1. a process on the target's address (its agent dead), forging from every byte it was sent
    with _serving(impostor.forged) as srv:
        ticket = _ticket(f"http://127.0.0.1:{srv.server_address[1]}")
        assert verdicts.ask_abort(ticket) == Verdict.UNKNOWN and verdicts.ask_state(ticket) is None
        assert verdicts.heard(ticket) == "something answers there (HTTP 200, unsigned)"
        sent = json.dumps(srv.seen)
        assert srv.seen and MID in sent and SECRET not in sent, "the secret left the source"
    # 2. another node with its own valid certificate: one from the ticket's CA that names the
    # target's address (the cluster-wide certificate, or one issued by mistake)
    cert, key, ca = agent_cert(tmp_path / "pki", "c", "127.0.0.1")
    with _serving(impostor.forged, str(cert), str(key)) as srv:
        ticket = _ticket(f"https://127.0.0.1:{srv.server_address[1]}", ca.read_text())
        assert verdicts.ask_abort(ticket) == Verdict.UNKNOWN and verdicts.ask_state(ticket) is None
        assert srv.seen, "TLS refused it: this case did not reach the signature"
    # ... and with a certificate that names only its own address, TLS refuses it before that
    cert, key, _ = agent_cert(tmp_path / "pki", "d", "10.255.0.4")
    with _serving(impostor.forged, str(cert), str(key)) as srv:
        ticket = _ticket(f"https://127.0.0.1:{srv.server_address[1]}", ca.read_text())
        assert verdicts.ask_abort(ticket) == Verdict.UNKNOWN and not srv.seen
        assert "TLS server" in str(verdicts.heard(ticket))
    # 3. a man in the middle under --insecure, in front of the real target, which runs the job
    with _serving(_genuine("running", 409)) as target:
        real = f"http://127.0.0.1:{target.server_address[1]}"
        with _serving(_relay(real)) as honest:
            passed = _ticket(f"http://127.0.0.1:{honest.server_address[1]}")
            assert verdicts.ask_abort(passed) == Verdict.RUNNING
        with _serving(_relay(real, {"state": "aborted"})) as mitm:
            ticket = _ticket(f"http://127.0.0.1:{mitm.server_address[1]}")
            assert verdicts.ask_abort(ticket) == Verdict.UNKNOWN and verdicts.ask_state(ticket) is None
            assert SECRET not in json.dumps(mitm.seen)


@pytest.mark.parametrize(
    "line", [b"hello from a library\n", b'{"progress": 3}\n', b"[1, 2]\n", b"\xff\xfe\n"]
)
def test_a_line_that_is_not_an_event_is_the_handoffs_failure_not_a_crash(line):
    """Before: events were read from the handoff's stdout, where any library may print, and a line
    that was not JSON raised out of the state machine. Now they have their own pipe, and a line on
    it that is not an event is a failure of that handoff (the machines thaw or keep asking)."""
    from criuctl.agent.handoffleases import Handoff, HandoffFailed, _Process

    async def go() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(line)
        h = Handoff(_Process(proc=None, events=reader, transport=None), Path("/var/log/handoff.log"))  # type: ignore[arg-type]
        with pytest.raises(HandoffFailed, match="not an event"):
            await h.event()

    asyncio.run(go())


def test_a_job_that_ended_while_being_frozen_is_never_said_to_keep_running():
    """Before: a migration whose job ended on its own while its source froze it said "workload
    'job' ended while it was being frozen: ...; 'job' keeps running on a" (seen in CI). The handoff
    says the workload ended (WorkloadEnded), the source agent's failure event carries it, and the
    client's line says where the job is only when it is somewhere."""
    from types import SimpleNamespace

    from criuctl.agent.handoffleases import Handoff, HandoffFailed, _Process
    from criuctl.client import migrate
    from criuctl.client.agents import AgentError

    async def failure(ended: bool) -> HandoffFailed:
        reader = asyncio.StreamReader()
        ev = {"event": "error", "what": "workload 'job' ended while it was being frozen", "ended": ended}
        reader.feed_data(json.dumps(ev).encode() + b"\n")
        h = Handoff(_Process(proc=None, events=reader, transport=None), Path("/var/log/handoff.log"))  # type: ignore[arg-type]
        with pytest.raises(HandoffFailed) as e:
            await h.event()
        return e.value

    assert asyncio.run(failure(True)).ended and not asyncio.run(failure(False)).ended

    class Agent:  # the source failed before "sent": it forgot the migration (404)
        node = SimpleNamespace(name="b")

        def delete(self, path: str) -> None:
            raise AgentError("no such migration", "", 404, {"what": "no such migration", "hint": ""})

    for ended, says in ((True, False), (False, True)):
        exc = migrate.MigrationFailed("workload 'job' ended while it was being frozen", "see its logs")
        exc.ended = ended
        got = migrate.abort(Agent(), Agent(), "og", "inc", exc, "job", "a")  # type: ignore[arg-type]
        assert isinstance(got, migrate.MigrationFailed) and got.ended == ended
        assert ("'job' keeps running on a" in got.line()) == says, got.line()
        assert got.line().startswith("workload 'job' ended") and "see its logs" in got.line()


@needs("criu")
def test_lazy_pages_that_never_gets_ready_is_given_up_in_bounded_time(tmp_path):
    """Before: the restore read CRIU lazy-pages' readiness byte with no end; a daemon stuck before
    it is ready (here on an image that is a FIFO nobody writes) held the restore for ever."""
    from criuctl.engine import criu

    images = tmp_path / "images"
    images.mkdir()
    os.mkfifo(images / "inventory.img")
    started = time.monotonic()
    with pytest.raises(criu.CriuError, match="did not get ready within 2 s"):
        criu.lazy_pages_daemon(images, tmp_path, "127.0.0.1", 1, ready_timeout=2)
    assert time.monotonic() - started < 10
    assert not [
        p for p in psutil.process_iter(["cmdline"]) if str(images) in " ".join(p.info["cmdline"] or [])
    ]


def test_a_node_slow_to_list_is_asked_again_before_the_move_says_nothing_runs(tmp_path, monkeypatch):
    """CI: eight `criuctl migrate` at once, and agent a took 5-14 s to list its workloads to all
    of them (2 cores, eight trainers): one client gave up after 10 s and said "no node runs a
    workload named 'job1' (no answer from node a)". A silent node is now asked again, longer,
    when no other runs the job; a node that answers in time is asked once."""
    import http.server
    import threading

    from criuctl.client import agents, jobs

    asked: list[float] = []
    slow = [True]

    class Slow(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(time.monotonic())
            if slow.pop() if slow else False:  # slow once, as a busy agent
                time.sleep(0.6)
            body = json.dumps([{"name": "job", "state": "running", "alive": True}]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_a: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("t")
    node = agents.Node("a", f"http://127.0.0.1:{srv.server_address[1]}", str(token))
    monkeypatch.setattr(agents, "SURVEY_TIMEOUT", 0.2)
    try:
        found = agents.survey("job", [node])
        assert [n.name for n in found.running_on] == ["a"] and found.silent == [], found
        assert len(asked) == 2, asked  # the first ask timed out, the second waited for the answer
        asked.clear()
        found = agents.survey("job", [node])  # answers in time (not slow any more): asked once
        assert [n.name for n in found.running_on] == ["a"] and len(asked) == 1
        # the jobs' survey: before a move of a job it does not find yet, it waits for the slow
        # node (a rank there would be left out of it); a listing (`ps --jobs`) names it silent
        for wanted, silent, asks in (("job", [], 2), (None, ["a"], 1)):
            slow.append(True)
            asked.clear()
            got = jobs.survey([node], wanted=wanted)
            assert got.silent == silent and len(asked) == asks, (wanted, got, asked)
    finally:
        srv.shutdown()
