"""`criuctl agent`: the node daemon. An authenticated HTTP API over the workloads on this node.

    GET    /healthz                          liveness (the only call without a token)
    GET    /v1/info                          node name, CRIU version, what this kernel allows
    GET    /v1/workloads                     workloads on this node
    GET    /v1/workloads/{name}/logs         a workload's stdout+stderr on this node
    POST   /v1/workloads/{name}/checkpoint   dump into a bundle kept here
    GET    /v1/bundles/{id}                  stream a bundle out (tar)
    PUT    /v1/bundles/{id}                  receive a bundle (verified before it is kept)
    POST   /v1/bundles/{id}/restore          restore a kept bundle, supervised by this agent
    DELETE /v1/bundles/{id}                  delete a kept bundle
    POST   /v1/incoming                      target of a migration: make room, get an upload ticket
    PUT    /v1/incoming/{id}/bundle          ... the source agent streams the bundle (ticket)
    POST   /v1/incoming/{id}/restore         ... restore it stopped (post-copy: pages from the source)
    POST   /v1/incoming/{id}/commit          ... let it run
    GET    /v1/incoming/{id}                 ... its state (ticket or token)
    DELETE /v1/incoming/{id}                 ... abort: kill what was restored, drop the bundle
    POST   /v1/outgoing                      source of a migration: freeze, stream to the target;
                                             answers with one JSON event per line as it goes
    POST   /v1/outgoing/{id}/commit          ... the target runs it: end the source tree
    GET    /v1/outgoing/{id}                 ... its state
    DELETE /v1/outgoing/{id}                 ... abort: the source tree runs on
    GET    /metrics                          Prometheus: migrations by result, bytes, downtime

Freezing and restoring happen in handoff processes (`criuctl.agent.handoff`) leased to this one,
so that an agent that dies mid-migration leaves the job running exactly once. The source side
never ends its tree before the client has committed the target; if the client vanishes after the
bundle was sent, the source asks the target, with the same ticket, whether the job runs there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest

from criuctl import bundle, checkpoint, criu, procinfo, workloads
from criuctl.agent import transfer
from criuctl.agent.handoff import HOLD_FILE
from criuctl.agent.handoffs import Handoff, HandoffFailed
from criuctl.errors import CriuctlError

log = logging.getLogger("criuctl.agent")

STOP_AND_COPY, POST_COPY, PRE_COPY = "stop-and-copy", "post-copy", "pre-copy"
MODES = (STOP_AND_COPY, POST_COPY, PRE_COPY)
FREEZE_TIMEOUT = 1800.0


@dataclass
class AgentOptions:
    host: str
    port: int
    token_file: Path
    name: str = field(default_factory=socket.gethostname)
    tls_cert: Path | None = None
    tls_key: Path | None = None
    lease_seconds: float = 120.0  # a frozen source waits this long for a commit before asking the target


def read_token(path: Path) -> str:
    """The bearer token, from a file nobody but its owner may read."""
    try:
        st = path.stat()
        token = path.read_text().strip()
    except OSError as exc:
        raise CriuctlError(
            f"cannot read token file {path}: {exc.strerror}", "create it with `chmod 600`"
        ) from exc
    if st.st_mode & 0o077:
        raise CriuctlError(
            f"token file {path} is readable by others (mode {st.st_mode & 0o777:o})", f"chmod 600 {path}"
        )
    if len(token) < 16:
        raise CriuctlError(f"token in {path} is too short", "use at least 16 random characters")
    return token


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.migrations = Counter(
            "criuctl_migrations", "Migrations by role, mode and result", ["role", "mode", "result"],
            registry=self.registry,
        )  # fmt: skip
        self.bytes = Counter(
            "criuctl_bytes_moved", "Bundle bytes moved", ["direction"], registry=self.registry
        )
        self.downtime = Histogram(
            "criuctl_migration_downtime_seconds", "Freeze to running on the target", ["mode"],
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60, 120), registry=self.registry,
        )  # fmt: skip


@dataclass
class Incoming:
    id: str
    ticket: str
    workload: str
    mode: str
    dir: Path
    state: str = "new"  # new → receiving → received → restored → running | failed | aborted
    handoff: Handoff | None = None
    created: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # restore, commit and abort never overlap

    @property
    def bundle_dir(self) -> Path:
        return self.dir / "bundle"


@dataclass
class Outgoing:
    id: str
    workload: str
    mode: str
    dir: Path
    target: dict
    state: str = "freezing"  # freezing → sending → sent → committed → done | aborted | failed
    handoff: Handoff | None = None
    freeze_started: float = 0.0  # monotonic
    lease: asyncio.Task | None = None
    finisher: asyncio.Task | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # commit and abort never overlap
    pages_seconds: float | None = None


def _fail(status: int, what: str, hint: str = "") -> web.Response:
    return web.json_response({"what": what, "hint": hint}, status=status)


def _error_response(exc: BaseException, node: str) -> web.Response:
    if isinstance(exc, workloads.UnknownWorkload):
        return _fail(404, exc.what, exc.hint)
    if isinstance(exc, bundle.BundleError):
        return _fail(422, f"node {node} refused the bundle: {exc.what}", exc.hint)
    if isinstance(exc, OSError) and exc.errno == 28:
        return _fail(
            507, f"disk full on node {node}", "free space in its state directory, or pick another node"
        )
    if isinstance(exc, CriuctlError):
        return _fail(500, exc.what, exc.hint)
    return _fail(500, f"{exc.__class__.__name__}: {exc}", f"see the agent log on node {node}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Agent:
    def __init__(self, opts: AgentOptions) -> None:
        self.opts = opts
        self.token = read_token(opts.token_file)
        self.metrics = Metrics()
        self.incoming: dict[str, Incoming] = {}
        self.outgoing: dict[str, Outgoing] = {}
        self.bundles = workloads.logs_dir("bundles")

    # ------------------------------------------------------------------------------- plumbing

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._log_requests, self._auth],
            client_max_size=1 << 20,
            # a bundle upload may run ahead of the receiver by this much before TCP is paused;
            # aiohttp's 64 KiB default caps a migration stream at a fraction of the link
            handler_args={"read_bufsize": 4 * transfer.PIECE},
        )
        r = app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/metrics", self.metrics_page)
        r.add_get("/v1/info", self.info)
        r.add_get("/v1/workloads", self.list_workloads)
        r.add_get("/v1/workloads/{name}/logs", self.workload_logs)
        r.add_post("/v1/workloads/{name}/checkpoint", self.checkpoint)
        r.add_get("/v1/bundles/{id}", self.bundle_out)
        r.add_put("/v1/bundles/{id}", self.bundle_in)
        r.add_post("/v1/bundles/{id}/restore", self.bundle_restore)
        r.add_delete("/v1/bundles/{id}", self.bundle_delete)
        r.add_post("/v1/incoming", self.incoming_new)
        r.add_put("/v1/incoming/{id}/bundle", self.incoming_bundle)
        r.add_post("/v1/incoming/{id}/restore", self.incoming_restore)
        r.add_post("/v1/incoming/{id}/commit", self.incoming_commit)
        r.add_get("/v1/incoming/{id}", self.incoming_status)
        r.add_delete("/v1/incoming/{id}", self.incoming_abort)
        r.add_post("/v1/outgoing", self.outgoing_start)
        r.add_post("/v1/outgoing/{id}/commit", self.outgoing_commit)
        r.add_get("/v1/outgoing/{id}", self.outgoing_status)
        r.add_delete("/v1/outgoing/{id}", self.outgoing_abort)
        app.on_startup.append(self._recover)
        app.on_startup.append(self._start_janitor)
        return app

    async def _start_janitor(self, app: web.Application) -> None:
        app["janitor"] = asyncio.ensure_future(self._janitor())

    @web.middleware
    async def _log_requests(self, request: web.Request, handler):
        started = time.monotonic()
        resp = await handler(request)
        log.info(
            "request",
            extra={"method": request.method, "path": request.path, "status": resp.status,
                   "seconds": round(time.monotonic() - started, 3)},
        )  # fmt: skip
        return resp

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.path == "/healthz":
            return await handler(request)
        given = request.headers.get("Authorization", "")
        token = given.removeprefix("Bearer ").strip() if given.startswith("Bearer ") else ""
        if token and hmac.compare_digest(token.encode(), self.token.encode()):
            return await handler(request)
        inc = self.incoming.get(request.match_info.get("id", ""))
        ticketed = request.path.startswith("/v1/incoming/") and (
            request.method in ("GET", "DELETE") or request.path.endswith("/bundle")
        )
        if (
            token
            and inc is not None
            and ticketed
            and hmac.compare_digest(token.encode(), inc.ticket.encode())
        ):
            return await handler(request)
        log.warning(
            "refused", extra={"path": request.path, "reason": "no token" if not token else "bad token"}
        )
        return _fail(
            401,
            f"node {self.opts.name} refused the call: " + ("no bearer token" if not token else "wrong token"),
            "use this node's token (criuctl node add NAME URL --token-file F)",
        )

    async def _recover(self, _app: web.Application) -> None:
        """After a restart: a freeze whose handoff process died is thawed, or finished if committed."""
        for hold in workloads.spool_dir("outgoing").glob(f"*/{HOLD_FILE}"):
            rec = json.loads(hold.read_text())
            if rec.get("hold_pid") and psutil.pid_exists(rec["hold_pid"]):
                continue
            if rec["state"] == "committed":
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rec["root_pid"], signal.SIGKILL)
            else:
                for pid in procinfo.tree_pids(rec["root_pid"]):
                    procinfo.send_signal(pid, signal.SIGCONT)
            log.warning("recovered", extra={"outgoing": hold.parent.name, "state": rec["state"]})
            shutil.rmtree(hold.parent, ignore_errors=True)

    # ------------------------------------------------------------------------------- node

    async def healthz(self, _r: web.Request) -> web.Response:
        return web.json_response({"ok": True, "node": self.opts.name})

    async def metrics_page(self, _r: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def info(self, _r: web.Request) -> web.Response:
        out: dict = {"node": self.opts.name}
        try:
            out["criu"] = ".".join(map(str, await asyncio.to_thread(criu.require_version)))
            f = await asyncio.to_thread(criu.features)
            out["lazy_pages"], out["pre_copy"] = f.lazy_pages, f.mem_track
        except CriuctlError as exc:
            out["criu_error"] = exc.line()
        return web.json_response(out)

    async def list_workloads(self, _r: web.Request) -> web.Response:
        return web.json_response(await asyncio.to_thread(workloads.rows))

    async def workload_logs(self, r: web.Request) -> web.Response:
        name = r.match_info["name"]
        path = workloads.log_path(name)
        if not path.exists():
            return _fail(404, f"no logs for {name!r} on node {self.opts.name}", "see `criuctl ps --node`")
        tail = int(r.query.get("tail", "0"))
        text = path.read_text(errors="replace")
        if tail:
            text = "\n".join(text.splitlines()[-tail:]) + "\n"
        return web.Response(text=text)

    # ------------------------------------------------------------------------------- bundles

    def _bundle_path(self, r: web.Request) -> Path:
        bid = r.match_info["id"]
        if not bid.replace("-", "").isalnum():
            raise web.HTTPBadRequest(text="bad bundle id")
        return self.bundles / bid

    async def checkpoint(self, r: web.Request) -> web.Response:
        body = await r.json() if r.can_read_body else {}
        bid = uuid.uuid4().hex
        try:
            out = await asyncio.to_thread(
                checkpoint.dump, r.match_info["name"], self.bundles / bid, bool(body.get("leave_running"))
            )
        except (CriuctlError, OSError) as exc:
            return _error_response(exc, self.opts.name)
        return web.json_response({"id": bid, "bytes": out.size_bytes, "freeze_seconds": out.freeze_seconds})

    async def bundle_out(self, r: web.Request) -> web.StreamResponse:
        path = self._bundle_path(r)
        if not (path / bundle.MANIFEST).exists():
            return _fail(404, f"no bundle {path.name} on node {self.opts.name}")
        resp = web.StreamResponse(headers={"Content-Type": "application/x-tar"})
        resp.content_length = transfer.stream_size(path)
        await resp.prepare(r)
        async for piece in transfer.tar_pieces(path):
            await resp.write(piece)
        await resp.write_eof()
        self.metrics.bytes.labels("sent").inc(resp.content_length)
        return resp

    async def bundle_in(self, r: web.Request) -> web.Response:
        path = self._bundle_path(r)
        if path.exists():
            return _fail(409, f"bundle {path.name} already exists on node {self.opts.name}")
        try:
            await self._receive(r, path)
        except (CriuctlError, OSError) as exc:
            shutil.rmtree(path, ignore_errors=True)
            return _error_response(exc, self.opts.name)
        return web.json_response({"id": path.name, "bytes": bundle.size_bytes(path)})

    async def bundle_restore(self, r: web.Request) -> web.Response:
        path = self._bundle_path(r)
        body = await r.json() if r.can_read_body else {}
        args = ["target", "--bundle", str(path), "--node", self.opts.name]
        if body.get("name"):
            args += ["--name", body["name"]]
        try:
            h = await Handoff.spawn(args, workloads.logs_dir() / f"handoff-{path.name}.log")
            ev = await h.event()
            running = await h.settle("commit", "running")
        except HandoffFailed as exc:
            return _error_response(exc, self.opts.name)
        return web.json_response({"pid": running["pid"], "criu_seconds": ev["criu_seconds"]})

    async def bundle_delete(self, r: web.Request) -> web.Response:
        path = self._bundle_path(r)
        if not path.exists():
            return _fail(404, f"no bundle {path.name} on node {self.opts.name}")
        shutil.rmtree(path)
        return web.json_response({"deleted": path.name})

    async def _receive(self, r: web.Request, dest: Path) -> dict[str, str]:
        """Stream the request body into `dest`, hashing as it comes; verify; return the digests."""
        counter = transfer.Counter(started=time.monotonic())
        job = asyncio.ensure_future(transfer.receive(r.content.read, dest, counter))
        dog = asyncio.ensure_future(transfer.watchdog(counter, job, "receiving the bundle"))
        try:
            digests = await job
        except asyncio.CancelledError:
            if dog.done() and dog.exception() is not None:
                raise dog.exception() from None
            raise
        finally:
            dog.cancel()
            with contextlib.suppress(asyncio.CancelledError, transfer.TransferError):
                await dog
        self.metrics.bytes.labels("received").inc(counter.done)
        key = bundle.load_key(workloads.key_path(), create=False)
        await asyncio.to_thread(bundle.verify, dest, key, digests)
        return digests

    # ------------------------------------------------------------------------------- target side

    def _incoming(self, r: web.Request) -> Incoming:
        inc = self.incoming.get(r.match_info["id"])
        if inc is None:
            raise web.HTTPNotFound(
                text=json.dumps({"what": f"no migration {r.match_info['id']} on node {self.opts.name}",
                                 "state": "unknown"}),
                content_type="application/json",
            )  # fmt: skip
        return inc

    async def incoming_new(self, r: web.Request) -> web.Response:
        body = await r.json()
        mode, name = body.get("mode", STOP_AND_COPY), body["workload"]
        try:
            await asyncio.to_thread(criu.require_version)
            if mode == POST_COPY:
                await asyncio.to_thread(criu.ensure_lazy_pages)
            bundle.load_key(workloads.key_path(), create=False)
        except CriuctlError as exc:
            return _fail(503, f"node {self.opts.name} cannot restore: {exc.what}", exc.hint)
        w = workloads.load(name)
        if w is not None and w.state == workloads.RUNNING and w.alive():
            return _fail(
                409, f"a workload named {name!r} already runs on node {self.opts.name}", "rename one"
            )
        inc = Incoming(
            uuid.uuid4().hex, secrets.token_urlsafe(32), name, mode, workloads.spool_dir("incoming")
        )
        inc.dir = inc.dir / inc.id
        inc.dir.mkdir(mode=0o700)
        self.incoming[inc.id] = inc
        log.info("incoming", extra={"id": inc.id, "workload": name, "mode": mode})
        return web.json_response({"id": inc.id, "ticket": inc.ticket})

    async def incoming_bundle(self, r: web.Request) -> web.Response:
        inc = self._incoming(r)
        if inc.state != "new":
            return _fail(409, f"migration {inc.id} already has a bundle ({inc.state})")
        inc.state = "receiving"
        started = time.monotonic()
        try:
            digests = await self._receive(r, inc.bundle_dir)
        except (CriuctlError, OSError) as exc:
            inc.state = "failed"
            shutil.rmtree(inc.dir, ignore_errors=True)
            self.metrics.migrations.labels("target", inc.mode, "failed").inc()
            log.warning("receive failed", extra={"id": inc.id, "error": str(exc)})
            return _error_response(exc, self.opts.name)
        (inc.dir / "digests.json").write_text(json.dumps(digests))
        inc.state = "received"
        return web.json_response(
            {"bytes": bundle.size_bytes(inc.bundle_dir), "seconds": time.monotonic() - started}
        )

    async def incoming_restore(self, r: web.Request) -> web.Response:
        inc = self._incoming(r)
        body = await r.json() if r.can_read_body else {}
        if inc.state != "received":
            return _fail(409, f"migration {inc.id} is {inc.state}, not received")
        args = ["target", "--bundle", str(inc.bundle_dir), "--name", inc.workload, "--node", self.opts.name,
                "--digests", str(inc.dir / "digests.json")]  # fmt: skip
        if body.get("page_server"):
            args += ["--page-server", body["page_server"]]
        async with inc.lock:
            if inc.state != "received":
                return _fail(409, f"migration {inc.id} is {inc.state}, not received")
            try:
                inc.handoff = await Handoff.spawn(args, inc.dir / "handoff.log")
                ev = await inc.handoff.event(timeout=FREEZE_TIMEOUT)
            except (TimeoutError, HandoffFailed) as exc:
                inc.state = "failed"
                self.metrics.migrations.labels("target", inc.mode, "failed").inc()
                return _error_response(exc, self.opts.name)
            inc.state = "restored"
        return web.json_response({"pid": ev["pid"], "criu_seconds": ev["criu_seconds"]})

    async def incoming_commit(self, r: web.Request) -> web.Response:
        inc = self._incoming(r)
        async with inc.lock:
            if inc.state == "running":
                return web.json_response({"state": "running"})
            if inc.state != "restored" or inc.handoff is None:
                return _fail(409, f"migration {inc.id} is {inc.state}, not restored")
            try:
                ev = await inc.handoff.settle("commit", "running", timeout=60)
            except (TimeoutError, HandoffFailed) as exc:
                inc.state = "failed"
                return _error_response(exc, self.opts.name)
            inc.state = "running"
        self.metrics.migrations.labels("target", inc.mode, "succeeded").inc()
        if inc.mode != POST_COPY:  # post-copy: the lazy-pages daemon still reads the images
            shutil.rmtree(inc.bundle_dir, ignore_errors=True)
        return web.json_response({"state": "running", "pid": ev["pid"]})

    async def incoming_status(self, r: web.Request) -> web.Response:
        inc = self._incoming(r)
        return web.json_response({"state": inc.state, "workload": inc.workload})

    async def incoming_abort(self, r: web.Request) -> web.Response:
        inc = self._incoming(r)
        if not await self._abort_incoming(inc):
            return _fail(
                409, f"migration {inc.id} already runs on node {self.opts.name}; it cannot be aborted"
            )
        return web.json_response({"state": "aborted"})

    async def _abort_incoming(self, inc: Incoming) -> bool:
        """Kill what was restored and drop the bundle; False if the job already runs here."""
        async with inc.lock:
            if inc.state == "running":
                return False
            if inc.handoff is not None and inc.handoff.proc.returncode is None:
                with contextlib.suppress(HandoffFailed, asyncio.TimeoutError):
                    await inc.handoff.settle("abort", "aborted", timeout=30)
            if inc.state not in ("failed", "aborted"):
                self.metrics.migrations.labels("target", inc.mode, "aborted").inc()
            inc.state = "aborted"
            shutil.rmtree(inc.dir, ignore_errors=True)
            return True

    async def _janitor(self) -> None:
        """Incoming migrations nobody finished (client and source both gone) are dropped in time."""
        while True:
            await asyncio.sleep(min(30.0, self.opts.lease_seconds))
            stale = time.monotonic() - 2 * self.opts.lease_seconds
            for inc in list(self.incoming.values()):
                idle = inc.state in ("new", "received", "restored", "failed")  # not mid-upload, not running
                if idle and inc.created < stale and not inc.lock.locked():
                    log.warning("stale incoming dropped", extra={"id": inc.id, "state": inc.state})
                    await self._abort_incoming(inc)

    # ------------------------------------------------------------------------------- source side

    def _outgoing(self, r: web.Request) -> Outgoing:
        og = self.outgoing.get(r.match_info["id"])
        if og is None:
            raise web.HTTPNotFound(
                text=f"no outgoing migration {r.match_info['id']} on node {self.opts.name}"
            )
        return og

    async def outgoing_start(self, r: web.Request) -> web.StreamResponse:
        body = await r.json()
        mode, target = body.get("mode", STOP_AND_COPY), body["target"]
        try:
            w = workloads.resolve(body["workload"])
            if mode == POST_COPY:
                await asyncio.to_thread(criu.ensure_lazy_pages)
        except CriuctlError as exc:
            return _error_response(exc, self.opts.name)
        og = Outgoing(uuid.uuid4().hex, w.name, mode, workloads.spool_dir("outgoing"), target)
        og.dir = og.dir / og.id
        og.dir.mkdir(mode=0o700)
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(r)
        client = {"gone": False}

        async def say(event: str, **fields: object) -> None:
            try:
                await resp.write(json.dumps({"event": event, **fields}).encode() + b"\n")
            except (ConnectionError, RuntimeError):
                client["gone"] = True

        port = _free_port() if mode == POST_COPY else None
        args = ["source", "--workload", w.name, "--parent", str(og.dir), "--to", target.get("node", "?")]
        if port:
            args += ["--lazy-port", str(port)]
        try:
            await say("started", id=og.id)
            og.handoff = await Handoff.spawn(args, og.dir.parent / f"{og.id}.log")
            frozen = await og.handoff.event(timeout=FREEZE_TIMEOUT)
            og.freeze_started = time.monotonic() - frozen["started_ago"]
            bdir = Path(frozen["bundle"])
            total = transfer.stream_size(bdir)
            await say("frozen", freeze_seconds=frozen["freeze_seconds"], bytes=total, page_server_port=port)
            og.state = "sending"
            counter = transfer.Counter(total=total, started=time.monotonic())
            t = og.target
            url = f"{t['url'].rstrip('/')}/v1/incoming/{t['incoming']}/bundle"
            job = asyncio.ensure_future(
                transfer.send(bdir, url, t["ticket"], t.get("ca"), counter, t.get("node", "?"))
            )
            while not job.done():
                await asyncio.wait([job], timeout=0.25)
                await say("transfer", done=counter.done, total=total)
            sent = job.result()
            if client["gone"]:
                raise CriuctlError("the client went away during the transfer", "nothing was committed")
            self.metrics.bytes.labels("sent").inc(counter.done)
            og.state = "sent"
            self.outgoing[og.id] = og
            og.lease = asyncio.ensure_future(self._lease(og))
            await say("sent", bytes=counter.done, seconds=time.monotonic() - counter.started, target=sent)
        except (TimeoutError, CriuctlError, OSError) as exc:
            await self._abort_outgoing(og, "failed")
            what = exc.what if isinstance(exc, CriuctlError) else str(exc)
            hint = exc.hint if isinstance(exc, CriuctlError) else ""
            log.warning("outgoing failed", extra={"id": og.id, "error": what})
            await say("error", what=what, hint=hint, thawed=True)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write_eof()
        return resp

    async def _abort_outgoing(self, og: Outgoing, result: str) -> None:
        if og.handoff is not None and og.handoff.proc.returncode is None:
            with contextlib.suppress(HandoffFailed, asyncio.TimeoutError):
                await og.handoff.settle("abort", "thawed", timeout=120)
        og.state = "aborted" if result == "aborted" else "failed"
        self.metrics.migrations.labels("source", og.mode, result).inc()
        shutil.rmtree(og.dir, ignore_errors=True)

    async def _lease(self, og: Outgoing) -> None:
        """No commit or abort came from the client in time: settle it with the target.

        The target is asked to abort first; only once it confirms (or has never heard of the
        migration) does the source thaw. A target that answers "already running" gets the commit.
        A silent target keeps the source frozen — not lost — and is asked again.
        """
        await asyncio.sleep(self.opts.lease_seconds)
        while og.state == "sent":
            verdict = await asyncio.to_thread(self._abort_target, og)
            log.warning("lease expired", extra={"id": og.id, "target_says": verdict})
            async with og.lock:
                if og.state != "sent":
                    return
                if verdict == "running":
                    await self._commit_outgoing(og)
                elif verdict == "aborted":
                    await self._abort_outgoing(og, "aborted")
            if verdict is None:
                await asyncio.sleep(10)

    def _abort_target(self, og: Outgoing) -> str | None:
        """DELETE the target's side with the upload ticket: 'aborted', 'running' or None (no answer)."""
        t = og.target
        ca = og.dir / "ca.pem"
        if t.get("ca") and not ca.exists():
            ca.write_text(t["ca"])
        try:
            resp = requests.delete(
                f"{t['url'].rstrip('/')}/v1/incoming/{t['incoming']}",
                headers={"Authorization": f"Bearer {t['ticket']}"},
                verify=str(ca) if t.get("ca") else True,
                timeout=60,
            )
        except requests.RequestException:
            return None
        if resp.ok or resp.status_code == 404:
            return "aborted"
        return "running" if resp.status_code == 409 else None

    async def _commit_outgoing(self, og: Outgoing) -> float:
        if og.lease is not None and og.lease is not asyncio.current_task():
            og.lease.cancel()
        await og.handoff.settle("commit", "committed", timeout=60)  # callers hold og.lock
        downtime = time.monotonic() - og.freeze_started
        og.state = "committed"
        self.metrics.downtime.labels(og.mode).observe(downtime)
        self.metrics.migrations.labels("source", og.mode, "succeeded").inc()
        og.finisher = asyncio.ensure_future(self._finish_outgoing(og))
        return downtime

    async def _finish_outgoing(self, og: Outgoing) -> None:
        with contextlib.suppress(HandoffFailed):
            ev = await og.handoff.event()
            og.pages_seconds = ev.get("pages_seconds")
        await og.handoff.proc.wait()
        og.state = "done"
        shutil.rmtree(og.dir, ignore_errors=True)

    async def outgoing_commit(self, r: web.Request) -> web.Response:
        og = self._outgoing(r)
        async with og.lock:
            if og.state in ("committed", "done"):
                return web.json_response({"state": og.state})
            if og.state != "sent":
                return _fail(409, f"outgoing migration {og.id} is {og.state}, not sent")
            try:
                downtime = await self._commit_outgoing(og)
            except (TimeoutError, HandoffFailed) as exc:
                return _error_response(exc, self.opts.name)
        return web.json_response({"state": og.state, "downtime_seconds": downtime})

    async def outgoing_status(self, r: web.Request) -> web.Response:
        og = self._outgoing(r)
        return web.json_response({"state": og.state, "pages_seconds": og.pages_seconds})

    async def outgoing_abort(self, r: web.Request) -> web.Response:
        og = self._outgoing(r)
        async with og.lock:
            if og.state in ("committed", "done"):
                return _fail(409, f"outgoing migration {og.id} is committed; the job runs on the target")
            if og.lease is not None:
                og.lease.cancel()
            if og.state == "sent":
                await self._abort_outgoing(og, "aborted")
        return web.json_response({"state": og.state})


class JsonFormatter(logging.Formatter):
    """One JSON object per line: what a log collector on a node wants."""

    _STD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message"}

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "msg": record.getMessage()}
        out.update({k: v for k, v in record.__dict__.items() if k not in self._STD})
        return json.dumps(out, default=str)


def serve(opts: AgentOptions) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    agent = Agent(opts)
    ctx = None
    if opts.tls_cert:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(opts.tls_cert, opts.tls_key)
    log.info("listening", extra={"node": opts.name, "host": opts.host, "port": opts.port, "tls": bool(ctx)})
    web.run_app(agent.app(), host=opts.host, port=opts.port, ssl_context=ctx, print=None, access_log=None)
