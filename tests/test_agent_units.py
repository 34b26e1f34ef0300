"""The agent's pure parts, without CRIU: the bundle stream, mode choice, token rules, the node list,
the JSON its routes answer."""

from __future__ import annotations

import asyncio
import io
import json
import os
import secrets
import socket
import subprocess
import sys
import tarfile
import threading
import time
import typing

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from criuctl.agent import livesend, messages, receiver, tickets, transfer, wire
from criuctl.agent.server import Agent, AgentOptions
from criuctl.client import agents, migrate
from criuctl.core import workloads
from criuctl.core.errors import CriuctlError
from criuctl.core.tokens import read_token
from criuctl.format import bundle
from tests.requirements import needs


def _bundle(tmp_path, key: bytes):
    root = tmp_path / "b"
    (root / "images").mkdir(parents=True)
    (root / "images" / "pages-1.img").write_bytes(os.urandom(3 << 20) + b"tail")
    (root / "images" / "core-1.img").write_bytes(b"core")
    m = bundle.Manifest(
        workload="w", command=["x"], processes=[], open_files=[], uses_gpu=False, criu_version="4.1"
    )
    bundle.seal(root, m, key)
    return root


def _stream(root) -> bytes:
    async def collect() -> bytes:
        return b"".join([piece async for piece in transfer.tar_pieces(root)])

    return asyncio.run(collect())


def _receive(data: bytes, dest, piece: int = 65536):
    """Feed `data` to the receiver in network-sized pieces, as aiohttp's StreamReader.read would."""
    stream = io.BytesIO(data)

    async def read(n: int) -> bytes:
        return stream.read(min(n, piece))

    return asyncio.run(receiver.receive(read, dest))


def test_bundle_stream_round_trip_hashes_what_arrives(tmp_path):
    key = os.urandom(32)
    root = _bundle(tmp_path, key)
    stream = _stream(root)
    assert len(stream) == transfer.stream_size(root)
    digests = _receive(stream, tmp_path / "in")
    assert bundle.verify(tmp_path / "in", key, digests).workload == "w"
    listed = bundle.read_manifest(root).files
    assert {k: digests[k] for k in listed} == listed
    assert (tmp_path / "in" / bundle.MANIFEST).stat().st_mode & 0o777 == 0o600


def test_a_flipped_byte_in_the_stream_is_refused(tmp_path):
    key = os.urandom(32)
    root = _bundle(tmp_path, key)
    stream = bytearray(_stream(root))
    stream[len(stream) // 2] ^= 1  # inside pages-1.img
    digests = _receive(bytes(stream), tmp_path / "in")
    with pytest.raises(bundle.BundleError, match=r"pages-1\.img"):
        bundle.verify(tmp_path / "in", key, digests)


def test_a_truncated_stream_is_refused(tmp_path):
    root = _bundle(tmp_path, os.urandom(32))
    stream = _stream(root)
    with pytest.raises(transfer.TransferError, match="broke off"):
        _receive(stream[: len(stream) // 2], tmp_path / "in")


@pytest.mark.parametrize("name", ["../evil", "/etc/evil", "images/../../evil"])
def test_a_stream_that_writes_outside_its_folder_is_refused(tmp_path, name):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo(name)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(transfer.TransferError, match="refused"):
        _receive(buf.getvalue(), tmp_path / "in")
    assert not (tmp_path / "evil").exists()


def test_a_stream_with_a_symlink_is_refused(tmp_path):
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo("images/link")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/shadow"
        tar.addfile(info)
    with pytest.raises(transfer.TransferError, match="not a regular file"):
        _receive(buf.getvalue(), tmp_path / "in")


async def _put_to(take: str, dest, source, counter: transfer.Counter) -> tuple[typing.Any, dict]:
    """PUT `source` with the agents' sender into a real aiohttp server on loopback whose handler
    receives it as the agent does: `take="splice"` takes the socket (`criuctl.agent.wire`), `"aiohttp"`
    reads aiohttp's stream, as an agent before the socket was taken does. The answer (or the error
    the sender raised) and what the handler saw."""
    seen: dict = {}

    async def put(r: web.Request) -> web.Response:
        try:
            if take == "splice":
                async with wire.taken(r) as body:
                    seen["wire"] = type(body).__name__
                    seen["digests"] = await receiver.receive(body, dest)
            else:
                seen["digests"] = await receiver.receive(r.content.read, dest)
        except transfer.TransferError as exc:
            return web.json_response({"what": exc.what, "hint": exc.hint}, status=400)
        return web.json_response({"ok": True})

    app = web.Application()
    kw = {"expect_handler": wire.defer_continue} if take == "splice" else {}
    app.router.add_put("/b", put, **kw)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        return await transfer.send(source, f"http://127.0.0.1:{port}/b", "Bearer t", None, counter, "b"), seen
    except transfer.TransferError as exc:
        return exc, seen
    finally:
        await runner.cleanup()


TAKES = ["splice", "aiohttp"]


@pytest.mark.parametrize("take", TAKES)
def test_a_live_stream_sends_pages_as_they_are_written_and_the_bundle_verifies(tmp_path, take):
    """The dump and the transfer overlap: page bytes leave while the "dump" still writes them, over a
    real socket to the real receiver, and the bundle that arrives verifies against the manifest
    sealed after the last page was written (and is refused if a sent byte changes afterwards).
    Chunked: the spliced wire reads the chunks' framing itself."""
    key = os.urandom(32)
    src, dest = tmp_path / "src", tmp_path / "in"
    (src / "images").mkdir(parents=True)
    live = livesend.Live(src)
    before_seal: list[int] = []

    def dump() -> None:  # a stand-in for CRIU: appends pages, then the rest, then the seal
        with open(src / "images" / "pages-1.img", "wb", buffering=0) as f:
            for _ in range(8):
                f.write(os.urandom(1 << 20))
                time.sleep(0.05)
        deadline = time.monotonic() + 10
        while counter.done < 8 << 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        before_seal.append(counter.done)
        (src / "images" / "core-1.img").write_bytes(b"core")
        (src / "images" / "empty.img").write_bytes(b"")
        m = bundle.Manifest(
            workload="w", command=["x"], processes=[], open_files=[], uses_gpu=False, criu_version="4.1"
        )
        bundle.seal(src, m, key, durable=False)
        live.sealed.set()

    async def main() -> tuple[typing.Any, dict]:
        writer = threading.Thread(target=dump)
        writer.start()
        try:
            return await _put_to(take, dest, live, counter)
        finally:
            writer.join()

    counter = transfer.Counter()
    answer, seen = asyncio.run(main())
    assert answer == {"ok": True}, answer
    assert seen.get("wire", "SpliceWire") == "SpliceWire", seen
    assert before_seal == [8 << 20], "every page byte was sent before the bundle was sealed"
    m = bundle.verify(dest, key, seen["digests"])
    assert set(m.files) == {"images/pages-1.img", "images/core-1.img", "images/empty.img"}
    with open(dest / "images" / "pages-1.img", "r+b") as f:
        f.write(b"\0")
    with pytest.raises(bundle.BundleError, match=r"pages-1\.img"):
        bundle.verify(dest, key)


@pytest.mark.parametrize("take", TAKES)
def test_a_sealed_bundle_is_spliced_into_its_files_and_verifies(tmp_path, take):
    """A sealed bundle (tar, Content-Length) over a real socket: the files arrive whole and their
    digests are those of what was written; one byte changed on disk afterwards is caught."""
    key = os.urandom(32)
    root = _bundle(tmp_path, key)
    answer, seen = asyncio.run(_put_to(take, tmp_path / "in", root, transfer.Counter()))
    assert answer == {"ok": True}, answer
    assert seen.get("wire", "SpliceWire") == "SpliceWire", seen
    assert bundle.verify(tmp_path / "in", key, seen["digests"]).workload == "w"
    for p in root.rglob("*"):
        if p.is_file():
            assert (tmp_path / "in" / p.relative_to(root)).read_bytes() == p.read_bytes(), p


class _Hostile:
    """A tar stream that writes outside its folder, with 32 MiB after it: the target refuses at the
    name, and the sender must still read why (the rest drained, not a reset)."""

    name = "../evil"

    def __init__(self) -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            info = tarfile.TarInfo(self.name)
            info.size = 32 << 20
            tar.addfile(info, io.BytesIO(bytes(info.size)))
        self.data = buf.getvalue()

    def headers(self) -> dict[str, str]:
        return {"Content-Type": "application/x-tar", "Content-Length": str(len(self.data))}

    def body(self, sock, counter: transfer.Counter) -> None:
        sock.sendall(self.data)
        counter.done += len(self.data)


class _CutShort(_Hostile):
    """A stream whose sender stops halfway through a file and closes its side."""

    name = "images/pages-1.img"

    def body(self, sock, counter: transfer.Counter) -> None:
        sock.sendall(self.data[: len(self.data) // 2])
        sock.shutdown(socket.SHUT_WR)


@pytest.mark.parametrize("take", TAKES)
@pytest.mark.parametrize(
    ("source", "said"),
    [
        (_Hostile, {"splice": "with the path '../evil'", "aiohttp": "with the path '../evil'"}),
        # aiohttp drops a connection whose sender shut its side: the sender hears only that
        (_CutShort, {"splice": "broke off before its end", "aiohttp": "lost the connection to node b"}),
    ],
)
def test_a_refused_stream_reaches_its_sender_as_one_clear_line(tmp_path, take, source, said):
    answer, seen = asyncio.run(_put_to(take, tmp_path / "in", source(), transfer.Counter()))
    assert isinstance(answer, transfer.TransferError), answer
    assert said[take] in answer.what, answer.line()
    assert not (tmp_path / "evil").exists()
    assert seen.get("wire", "SpliceWire") == "SpliceWire", seen


def test_mode_choice_follows_both_kernels():
    both = {"node": "a", "lazy_pages": True}
    no_uffd = {"node": "b", "lazy_pages": False}
    assert migrate.choose_mode(None, both, {**both, "node": "b"}) == "post-copy"
    assert migrate.choose_mode(None, both, no_uffd) == "stop-and-copy"
    assert migrate.choose_mode("stop-and-copy", both, both) == "stop-and-copy"
    with pytest.raises(migrate.MigrationFailed, match="node b's kernel lacks"):
        migrate.choose_mode("post-copy", both, no_uffd)
    with pytest.raises(migrate.MigrationFailed, match="unknown mode 'pre-copy'"):
        migrate.choose_mode("pre-copy", both, both)


def test_token_file_must_be_private_and_long(tmp_path):
    t = tmp_path / "token"
    t.write_text("s" * 32 + "\n")
    os.chmod(t, 0o600)
    assert read_token(t) == "s" * 32
    os.chmod(t, 0o640)
    with pytest.raises(CriuctlError, match="readable by others"):
        read_token(t)
    t.write_text("short")
    os.chmod(t, 0o600)
    with pytest.raises(CriuctlError, match="too short"):
        read_token(t)
    with pytest.raises(CriuctlError, match="cannot read token file"):
        read_token(tmp_path / "missing")


def test_node_list(tmp_path):
    token = tmp_path / "t"
    token.write_text("x" * 20)
    os.chmod(token, 0o644)
    with pytest.raises(CriuctlError, match="readable by others"):  # the agent would refuse it too
        agents.add_node(agents.Node("a", "http://10.0.0.2:7070", str(token)))
    os.chmod(token, 0o600)
    agents.add_node(agents.Node("a", "http://10.0.0.2:7070", str(token)))
    assert agents.get_node("a").host == "10.0.0.2"
    with pytest.raises(agents.UnknownNode, match="no node named 'z' \\(known: a\\)"):
        agents.get_node("z")
    with pytest.raises(CriuctlError, match="not an http"):
        agents.add_node(agents.Node("b", "10.0.0.3:7070", str(token)))
    with pytest.raises(CriuctlError, match="cannot read the token file"):
        agents.add_node(agents.Node("c", "http://10.0.0.4:7070", str(tmp_path / "none")))
    agents.remove_node("a")
    assert agents.all_nodes() == {}


def test_an_unreachable_node_is_one_clear_error(tmp_path):
    token = tmp_path / "t"
    token.write_text("x" * 20)
    node = agents.Node("gone", "http://127.0.0.1:9", str(token))  # discard port: nothing listens
    with pytest.raises(agents.NodeUnreachable, match=r"node gone .* did not answer"):
        agents.AgentClient(node).get("/v1/info")


def test_a_warm_handoff_exits_when_its_agent_closes_the_lease_and_takes_its_title_with_its_job(tmp_path):
    """The handoff started ahead (`warmstart`): gone with its agent's pipe; once it has a job, its
    command line reads as a cold handoff's, which is how ps and the tests find a migration's handoff."""
    from criuctl.agent import warmstart

    def start() -> tuple[subprocess.Popen, int]:
        r, w = os.pipe()  # its events' own pipe, as the agent makes it
        argv = [sys.executable, "-m", "criuctl.agent.handoff", warmstart.WARM, warmstart.blank()]
        p = subprocess.Popen(
            [*argv, "--events-fd", str(w)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(w,)
        )
        os.close(w)
        return p, r

    p, events = start()
    p.stdin.close()
    assert p.wait(30) == 0 and p.stdout.read() == b"" and os.read(events, 100) == b""
    os.close(events)

    # a job whose paths hold spaces (a state dir may): the warm process runs it as a cold one would
    spec, log = tmp_path / "a dir" / "dump-spec.json", tmp_path / "a dir" / "handoff log"
    spec.parent.mkdir()
    spec.write_text('{"workload": "nosuchworkload", "out": "/nonexistent/out"}')
    p, events = start()
    out, _ = p.communicate(warmstart.job_line("dump", spec, log), timeout=60)
    with os.fdopen(events, "rb") as f:
        said = f.read()
    assert b'"event": "error"' in said and b"/nonexistent does not exist" in said, said
    assert out == b"", "its events go to their own pipe, never stdout"
    assert log.exists(), "its stdout and stderr went to the job's log"

    spec = tmp_path / "dump-spec.json"  # the title: shown as the cold command line
    probe = (
        "import sys; from criuctl.agent import warmstart; "
        f"warmstart._retitle(['-m', 'criuctl.agent.handoff', 'dump', {str(spec)!r}]); "
        "sys.stdout.write(open('/proc/self/cmdline', 'rb').read().decode())"
    )
    shown = subprocess.run([sys.executable, "-c", probe, warmstart.blank()], capture_output=True, text=True)
    assert shown.stdout.split("\0")[:5] == [sys.executable, "-m", "criuctl.agent.handoff", "dump", str(spec)]


def test_a_handoff_that_hits_a_bug_says_so_on_its_events_pipe_with_the_traceback_in_its_log(tmp_path):
    """An exception no role expected (here: a spec that is not JSON) is an error event naming it,
    so the agent's one line tells what broke; before, the process died and the line said only
    that it ended without reporting."""
    spec, log = tmp_path / "target-spec.json", tmp_path / "handoff.log"
    spec.write_text("{not json")
    r, w = os.pipe()
    with log.open("wb") as out:
        p = subprocess.run(
            [sys.executable, "-m", "criuctl.agent.handoff", "target", str(spec), "--events-fd", str(w)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            pass_fds=(w,),
            timeout=60,
        )
    os.close(w)
    with os.fdopen(r, "rb") as f:
        said = [json.loads(line) for line in f.read().splitlines()]
    assert p.returncode == 1
    assert len(said) == 1 and said[0]["event"] == "error", said
    assert said[0]["what"].startswith("the target handoff failed: JSONDecodeError: "), said
    assert "Traceback" in log.read_text()


def _fits(answer: object, kind: type) -> None:
    """`answer` is what the TypedDict `kind` says: an object with every required field and no field
    it does not name (its annotations read with Required/NotRequired, as mypy reads them)."""
    assert isinstance(answer, dict), answer
    hints = typing.get_type_hints(kind, include_extras=True)
    required = {
        k
        for k, h in hints.items()
        if typing.get_origin(h) is typing.Required
        or (typing.get_origin(h) is not typing.NotRequired and k in kind.__required_keys__)
    }
    assert set(answer) <= set(hints), f"{kind.__name__} does not name {sorted(set(answer) - set(hints))}"
    assert required <= set(answer), f"{kind.__name__} lacks {sorted(required - set(answer))}"


@needs("criu")  # making room for a migration asks CRIU its version
def test_the_agents_answers_have_the_fields_their_types_name(tmp_path, state_dir):
    """The real agent app, in-process: each answer's fields are those its type in
    `criuctl.agent.messages` names (the type the client reads it with): a workload row, a node's
    facts, a migration made, its state, its abort, refusals. Field names are checked by mypy where
    they are written; this checks what the agent really sends, rows built from records included."""
    token = tmp_path / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    (state_dir / "bundle.key").write_text(secrets.token_bytes(32).hex())
    (state_dir / "bundle.key").chmod(0o600)
    job = subprocess.Popen(["sleep", "60"])
    record = workloads.Workload.of_tree(
        job.pid, name="probe", command=["sleep", "60"], supervisor_pid=job.pid, stdio_pipes={}
    )
    workloads.save(record)
    agent = Agent(AgentOptions("127.0.0.1", 0, token, name="probe", runtime_endpoint="unix:///nonexistent"))
    auth = {"Authorization": f"Bearer {token.read_text()}"}

    async def go() -> None:
        async with TestClient(TestServer(agent.app())) as client:

            async def call(method: str, path: str, status: int, kind: type, body: object = None) -> dict:
                resp = await client.request(method, path, headers=auth, json=body)
                assert resp.status == status, await resp.text()
                answer = await resp.json()
                _fits(answer, kind)
                return answer

            _fits(await (await client.get("/healthz")).json(), messages.Healthz)
            await call("GET", "/v1/info", 200, messages.NodeInfo)
            rows = await (await client.get("/v1/workloads", headers=auth)).json()
            assert [r["name"] for r in rows] == ["probe"] and "tcp" in rows[0]
            _fits(rows[0], workloads.WorkloadRow)
            _fits(rows[0]["tcp"], workloads.EndpointsJson)
            await call("POST", "/v1/incoming", 400, messages.ErrorAnswer, {"workload": "w", "mode": "x"})
            await call("GET", f"/v1/incoming/{'0' * 32}", 404, messages.ErrorAnswer)
            made = await call("POST", "/v1/incoming", 200, messages.IncomingAnswer, {"workload": "w"})
            await call("GET", f"/v1/incoming/{made['id']}", 200, messages.IncomingStatus)
            await call("POST", f"/v1/incoming/{made['id']}/commit", 409, messages.ErrorAnswer)
            await call("DELETE", f"/v1/incoming/{made['id']}", 200, tickets.SignedState)
            await call("DELETE", f"/v1/incoming/{made['id']}/cut", 200, messages.StateAnswer)
            await call("GET", f"/v1/outgoing/{'0' * 32}", 404, messages.ErrorAnswer)

    try:
        asyncio.run(go())
    finally:
        job.kill()
        job.wait()


def test_page_client_keys_another_node_asks_for_are_capped_and_go_unused_after_a_day(
    state_dir, monkeypatch
) -> None:
    """`POST /v1/bundles/ID/page-client` is open to any agent of the CA (criuctl.kube.peerrules):
    what it makes a node keep is capped, an unused pair goes after a day, and one in use (a
    server's pinned certificate beside it) stays."""
    from criuctl.agent import pageserving

    monkeypatch.setattr(pageserving, "MOST_UNUSED", 2)
    first, second, third = "a" * 32, "b" * 32, "c" * 32
    mine = pageserving.asked_client(first)
    pageserving.asked_client(second)
    with pytest.raises(pageserving.TooManyAsked, match="2 page-client key pairs"):
        pageserving.asked_client(third)
    assert pageserving.asked_client(first).pem == mine.pem  # asked again: the same, no new one
    (pageserving.folder(second) / f"{pageserving.SERVER_PEER}.crt").write_text("pinned")  # a pull's
    day_ago = time.time() - pageserving.UNUSED_SECONDS - 60
    for bid in (first, second):
        os.utime(pageserving.folder(bid), (day_ago, day_ago))
    pageserving.tidy()
    assert not pageserving.folder(first).exists() and pageserving.folder(second).exists()
    pageserving.asked_client(third)  # room again


def test_what_a_dead_serving_handoff_left_is_cleared_once_its_time_is_up(state_dir) -> None:
    """A post-copy bundle whose serving handoff died (killed, OOM) while its CRIU served on: the
    janitor leaves the CRIU while its pages may still be pulled, kills it past its time, then
    clears the bundle, its keys and its record. A live handoff's bundle is never touched."""
    from criuctl.agent import pageserving
    from criuctl.core import statedir

    criu = subprocess.Popen(["sleep", "60"])  # stands for the CRIU that serves the pages
    gone = subprocess.Popen(["true"])
    gone.wait()  # the handoff: dead
    bid, live = "a" * 32, "b" * 32
    for b in (bid, live):
        (statedir.BUNDLES.ensure() / b).mkdir()
        pageserving.client(b)  # its keys
    pageserving.note_serving(live, 1234, None, time.time() + 1000)  # this process: alive
    record = pageserving.folder(bid) / pageserving.SERVING
    try:
        for until, alive in ((time.time() + 1000, True), (time.time() - 1, False)):
            pageserving.note_serving(bid, 1234, criu.pid, until)
            rec = json.loads(record.read_text())
            rec["pid"] = gone.pid  # written by a handoff that is gone now
            record.write_text(json.dumps(rec))
            assert pageserving.tidy() == []
            time.sleep(0.2)
            assert (criu.poll() is None) == alive
        criu.wait(5)
        assert pageserving.tidy() == [bid]
        assert not (statedir.BUNDLES.path() / bid).exists() and not pageserving.folder(bid).exists()
        assert (statedir.BUNDLES.path() / live).exists() and pageserving.serving(live)
        assert pageserving.served(live) is None  # no page server's certificate: nothing to pin, nothing said
    finally:
        criu.kill()
