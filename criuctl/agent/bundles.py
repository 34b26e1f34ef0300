"""HTTP routes for bundles kept on this node, outside any migration.

    POST   /v1/workloads/{name}/checkpoint   dump into a bundle kept here (through a `dump` handoff);
                                             {"id": ID} names it (a caller that recorded the id
                                             first can tell a dump that happened from one that did not);
                                             {"lazy": {"clients": [PEM]}}: post-copy, the bundle kept
                                             without its pages, which the handoff serves on (the
                                             answer's `pages`: port, certificate; pageserving)
    POST   /v1/bundles/{id}/page-client      this node's page-client certificate for a post-copy bundle
    GET    /v1/bundles/{id}/pages            where this node serves a post-copy bundle's pages
    GET    /v1/bundles/{id}                  stream a bundle out (tar); with the header
                                             Criuctl-Seal: KEY, its manifest signed with that key
                                             for the one node that gave it (see below)
    GET    /v1/bundles/{id}/manifest         its manifest: whether it is kept here, unused
    POST   /v1/bundles/{id}/expect           a key for one copy of the bundle to come here
    PUT    /v1/bundles/{id}                  receive that copy (verified with that key, then
                                             signed with this node's own, before it is kept)
    POST   /v1/bundles/{id}/restore          restore a kept bundle, supervised by a handoff;
                                             {"into": CONTAINER} restores into a placeholder container.
                                             The bundle is used up: marked before the restored job
                                             may run, removed once it runs (it never restores twice)
    DELETE /v1/bundles/{id}                  delete a kept bundle (and stop serving its pages)

Every node signs its bundles with a key of its own (`bundle.key`, which never leaves it), so a
node's key opens no other node's bundles. A kept bundle crosses to another node only as a copy
that node asked for: it mints a key for that one copy (`expect`), the caller hands it to the
sender, which checks its own signature and signs the manifest with that key as it streams
(`bundle.signed_for`); the receiver checks it with the key, used once, and signs it anew with its
own (`bundle.adopt`).

A checkpoint freezes in a handoff process, like a migration, never in the agent: CRIU's ptrace
and a multi-second freeze have no place on the event loop, and an agent killed mid-dump must not
take the frozen tree's only keeper with it (the dump's own exactly-once commit still holds).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import secrets
import shutil
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from criuctl.agent import conn, pageserving, transfer, wire
from criuctl.agent.handoffleases import Handoff, HandoffFailed
from criuctl.agent.httpjson import BadInto, body_json, container_id, error, fail, valid_id
from criuctl.agent.messages import (
    SEAL_HEADER,
    BundleDeleted,
    BundleExpected,
    BundleKept,
    BundleRestored,
    BundleRestoreRequest,
    CheckpointAnswer,
    CheckpointRequest,
    PageClient,
    PagesServed,
)
from criuctl.agent.protocol import Command, Event, TargetSpec, timeouts
from criuctl.core import statedir, workloads
from criuctl.core.errors import CriuctlError
from criuctl.engine import criu
from criuctl.format import bundle
from criuctl.local import checkpoint
from criuctl.net import readdress
from criuctl_hook import durable

if TYPE_CHECKING:
    from criuctl.agent.server import Agent


USED = ".restored"  # in a bundle's folder: a restore of it reached the commit (see `restore`)
EXPECT_SECONDS = 3600.0  # a copy's key is good this long (client.agents.copy_bundle's own bound)


def _mark_used(path: Path) -> None:
    durable.replace(path, b"")


class Bundles:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.expected: dict[str, tuple[bytes, float]] = {}  # bundle id: (its copy's key, until)

    @property
    def root(self) -> Path:
        return statedir.BUNDLES.ensure()

    def routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/v1/workloads/{name}/checkpoint", self.checkpoint)
        r.add_get("/v1/bundles/{id}", self.send)
        r.add_get("/v1/bundles/{id}/manifest", self.manifest)
        r.add_post("/v1/bundles/{id}/expect", self.expect)
        r.add_put("/v1/bundles/{id}", self.receive, expect_handler=wire.defer_continue)
        r.add_post("/v1/bundles/{id}/restore", self.restore)
        r.add_post("/v1/bundles/{id}/page-client", self.page_client)
        r.add_get("/v1/bundles/{id}/pages", self.pages)
        r.add_delete("/v1/bundles/{id}", self.delete)

    def _path(self, r: web.Request) -> Path:
        bid = r.match_info["id"]
        if not valid_id(bid):
            raise error(400, f"{bid!r} is not a bundle id", "bundle ids are 32 hex digits")
        return self.root / bid

    async def checkpoint(self, r: web.Request) -> web.Response:
        body: CheckpointRequest = await body_json(r)
        try:
            name = workloads.validate_name(r.match_info["name"])
            w = await asyncio.to_thread(self.agent.runtimes.resolve, name)
        except workloads.BadName as exc:
            return fail(400, exc.what, exc.hint)
        except CriuctlError as exc:
            return self.agent.error_response(exc)
        bid = body.get("id") or uuid.uuid4().hex
        if not isinstance(bid, str) or not valid_id(bid):
            return fail(400, f"{str(bid)[:80]!r} is not a bundle id", "bundle ids are 32 hex digits")
        if (self.root / bid).exists():
            return fail(409, f"bundle {bid} already exists on node {self.agent.name}")
        spec: dict[str, object] = {
            "workload": w.name,
            "out": str(self.root / bid),
            "leave_running": bool(body.get("leave_running")),
            "connections": bool(body.get("connections")),
        }
        lazy = body.get("lazy")
        if lazy is not None:
            clients = lazy.get("clients") if isinstance(lazy, dict) else None
            if not isinstance(clients, list) or len(clients) > MAX_PAGE_CLIENTS:
                return fail(400, "lazy.clients must be a list of page-client certificates")
            try:
                await asyncio.to_thread(criu.ensure_lazy_pages)
            except CriuctlError as exc:
                return fail(422, f"node {self.agent.name} cannot serve post-copy pages: {exc.what}", exc.hint)
            spec["lazy"] = {"port": conn.free_port(), "clients": clients, "seconds": timeouts().serve}
        work = statedir.HANDOFF_LOGS.ensure() / bid
        work.mkdir(mode=0o700)
        h = await Handoff.spawn("dump", json.dumps(spec), work, work / "handoff.log")
        try:
            ev = await h.until({Event.DONE, Event.SERVING}, timeouts().freeze)
        except HandoffFailed as exc:
            return self.agent.error_response(exc)
        except TimeoutError:
            await h.kill_group()
            thaw = await asyncio.to_thread(checkpoint.thaw_tree, w.root_pid, None, None, w.name)
            how = (
                "it was thawed"
                if thaw.complete
                else f"it runs again, but its thaw did not complete: {thaw.line()}"
            )
            return fail(504, f"checkpoint of {w.name!r} took too long", f"{how}; see the agent log")
        finally:
            await h.close()
            if lazy is None:  # a serving handoff still writes its log there
                await asyncio.to_thread(shutil.rmtree, work, True)
        answer = CheckpointAnswer(id=bid, bytes=ev["bytes"], freeze_seconds=ev["freeze_seconds"])
        if ev.get("thaw_left"):  # --leave-running: the bundle is good, the job runs, not whole yet
            answer["thaw_incomplete"] = ev["thaw_left"]
        if ev["event"] == Event.SERVING:
            answer["pages"] = PagesServed(port=ev["port"], cert=ev["cert"])
        return web.json_response(answer)

    async def page_client(self, r: web.Request) -> web.Response:
        """This node's page-client certificate for post-copy bundle ID (made once): what the node
        serving its pages is told to accept (criuctl.agent.pageserving)."""
        path = self._path(r)
        try:
            me = await asyncio.to_thread(pageserving.asked_client, path.name)
        except pageserving.TooManyAsked as exc:
            return fail(
                429,
                f"node {self.agent.name} makes no more page-client keys now: {exc}",
                "ask again once moves have used them; an unused one goes after a day",
            )
        return web.json_response(PageClient(cert=me.pem))

    async def pages(self, r: web.Request) -> web.Response:
        """Where this node serves post-copy bundle ID's pages (its port, its certificate); 404 when
        it does not (any more)."""
        path = self._path(r)
        found = await asyncio.to_thread(pageserving.served, path.name)
        if found is None:
            return fail(404, f"node {self.agent.name} serves no pages of bundle {path.name}")
        return web.json_response(PagesServed(port=found[0], cert=found[1]))

    def _kept(self, r: web.Request) -> Path:
        """A kept bundle's folder; 404 for one absent, half-received or used up by a restore."""
        path = self._path(r)
        if not (path / bundle.MANIFEST).exists() or (path / USED).exists():
            raise error(404, f"no bundle {path.name} on node {self.agent.name}")
        return path

    async def manifest(self, r: web.Request) -> web.Response:
        path = self._kept(r)
        return web.Response(
            body=await asyncio.to_thread((path / bundle.MANIFEST).read_bytes), content_type="application/json"
        )

    async def send(self, r: web.Request) -> web.StreamResponse:
        path = self._kept(r)
        given: dict[str, bytes] = {}
        if seal := r.headers.get(SEAL_HEADER):
            try:
                key = bytes.fromhex(seal)
            except ValueError:
                key = b""
            if len(key) != 32:
                return fail(400, f"bad {SEAL_HEADER} header", "send the key the receiving node gave (expect)")
            try:
                raw, sig = await asyncio.to_thread(
                    lambda: bundle.signed_for(path, self.agent.bundle_key(), key)
                )
            except (bundle.BundleError, OSError) as exc:
                return self.agent.error_response(exc)
            given = {bundle.MANIFEST: raw, bundle.SIGNATURE: sig}
        resp = web.StreamResponse(headers={"Content-Type": "application/x-tar"})
        resp.content_length = await asyncio.to_thread(transfer.stream_size, path, given)
        await resp.prepare(r)
        async for piece in transfer.tar_pieces(path, given=given):
            await resp.write(piece)
        await resp.write_eof()
        self.agent.metrics.bytes.labels("sent").inc(resp.content_length)
        return resp

    async def expect(self, r: web.Request) -> web.Response:
        path = self._path(r)
        if path.exists():
            return fail(409, f"bundle {path.name} already exists on node {self.agent.name}")
        now = time.monotonic()
        self.expected = {b: e for b, e in self.expected.items() if e[1] > now}
        key = secrets.token_bytes(32)
        self.expected[path.name] = (key, now + EXPECT_SECONDS)
        return web.json_response(BundleExpected(seal=key.hex(), seconds=EXPECT_SECONDS))

    async def receive(self, r: web.Request) -> web.Response:
        path = self._path(r)
        if path.exists():
            return fail(409, f"bundle {path.name} already exists on node {self.agent.name}")
        key, until = self.expected.pop(path.name, (b"", 0.0))
        if until <= time.monotonic():
            return fail(
                409,
                f"node {self.agent.name} expects no copy of bundle {path.name}",
                f"ask it first (POST /v1/bundles/{path.name}/expect) and have the sender sign with "
                f"its key ({SEAL_HEADER}): criuctl's copy does",
            )
        try:
            await self.agent.receive(r, path, seal=key)
        except (CriuctlError, OSError) as exc:
            await asyncio.to_thread(shutil.rmtree, path, True)
            return self.agent.error_response(exc)
        return web.json_response(
            BundleKept(id=path.name, bytes=await asyncio.to_thread(bundle.size_bytes, path))
        )

    async def restore(self, r: web.Request) -> web.Response:
        path = self._path(r)
        body: BundleRestoreRequest = await body_json(r)
        try:
            name = workloads.validate_name(body["name"]) if body.get("name") else None
            into = container_id(body.get("into"))
            moves = body.get("readdress")
            table = readdress.EndpointMap.from_json(moves).to_json() if moves is not None else None
            page_server, page_tls = await asyncio.to_thread(_pages_from, path.name, body)
        except BadInto as exc:
            return fail(400, str(exc), "name the placeholder by its container ID (hex digits)")
        except ValueError as exc:
            return fail(400, f"bad readdress or page server: {exc}", "use `criuctl migrate`")
        except CriuctlError as exc:
            return fail(400, exc.what, exc.hint)
        if not (path / bundle.MANIFEST).exists():
            return fail(404, f"no bundle {path.name} on node {self.agent.name}")
        used = path / USED
        if used.exists():
            return fail(
                409,
                f"bundle {path.name} on node {self.agent.name} was restored already",
                "a bundle restores once: see `criuctl ps` there",
            )
        work = statedir.HANDOFF_LOGS.ensure()
        spec = TargetSpec(
            None,
            str(path),
            self.agent.name,
            name=name,
            placeholder=into,
            runtime=self.agent.runtimes.endpoint if into else None,
            readdress=table,
            page_server=page_server,
            page_tls=page_tls,
        )
        h = await Handoff.spawn("target", spec.to_json(), work, work / f"restore-{path.name}.log")
        try:
            ev = await h.until({Event.RESTORED}, timeouts().restore)
            await asyncio.to_thread(_mark_used, used)  # before the copy may run: never restored twice
            try:
                running = await h.ask(Command.COMMIT, {Event.RUNNING}, timeouts().target_commit)
            except BaseException:
                used.unlink(missing_ok=True)  # the copy never ran (the handoff kills it on failure)
                raise
        except (HandoffFailed, TimeoutError) as exc:
            await h.kill_group()
            return self.agent.error_response(exc)
        finally:
            await h.close()
        if page_server is None:  # post-copy: its handoff removes it once the last page is in
            await asyncio.to_thread(shutil.rmtree, path, True)  # the job runs: its pages need not stay
        return web.json_response(BundleRestored(pid=running["pid"], criu_seconds=ev["criu_seconds"]))

    async def delete(self, r: web.Request) -> web.Response:
        path = self._path(r)
        served = await asyncio.to_thread(pageserving.stop, path.name)  # its pages go with it
        if not path.exists() and not served:
            return fail(404, f"no bundle {path.name} on node {self.agent.name}")
        await asyncio.to_thread(shutil.rmtree, path, True)
        if not served:
            await asyncio.to_thread(pageserving.forget, path.name)
        return web.json_response(BundleDeleted(deleted=path.name))


MAX_PAGE_CLIENTS = 4  # the target's, the source's own is added here: a few at most


def _pages_from(bid: str, body: BundleRestoreRequest) -> tuple[str | None, dict[str, str] | None]:
    """A post-copy restore's page server (HOST:PORT, checked) and the TLS paths pinning its
    certificate; (None, None) for a bundle that holds its pages. ValueError for a bad one."""
    where = body.get("page_server")
    if where is None:
        return None, None
    host, _, port = str(where).rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{str(where)[:80]!r} is not HOST:PORT")
    ipaddress.ip_address(host.strip("[]"))  # an address, never a name to resolve
    tls = pageserving.pull_tls(bid, body.get("page_cert"))
    return f"{host}:{port}", {"peer_cert": str(tls.peer_cert), "cert": str(tls.cert), "key": str(tls.key)}
