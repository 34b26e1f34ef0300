"""`criuctl agent`: the node daemon. Routes, authentication, metrics and upkeep; no state machine lives here.

    GET    /healthz                          liveness (the only call without a token)
    GET    /v1/info                          node name, CRIU version, what this kernel allows, TLS
    GET    /v1/workloads                     workloads on this node
    GET    /v1/workloads/{name}/logs         its stdout+stderr here (?tail=N; ?from=OFFSET: JSON, logs -f)
    POST   /v1/workloads/{name}/checkpoint   dump into a bundle kept here   ┐ criuctl.agent.bundles
    …      /v1/bundles/{id}[/restore]        stream out, receive, restore   ┘
    …      /v1/incoming…                     the target side of a migration   criuctl.agent.incoming
    …      /v1/outgoing…                     the source side of a migration   criuctl.agent.outgoing
    …      /v1/redirects…                    a staying rank's re-pointed peers ┐ criuctl.agent.redirects
    POST   /v1/workloads/{name}/brace        its backoff to a moving peer      ┘
    GET    /metrics                          Prometheus: migrations by result, bytes, downtime (the
                                             token, or the scrape token: --metrics-token-file)

Freezing and restoring happen in handoff processes (`criuctl.agent.handoff`) leased to this one;
the protocol they follow is `criuctl.agent.protocol`, the machines that drive them
`criuctl.agent.source` and `.target`. Nothing here blocks the event loop: CRIU runs in handoffs,
files are read and removed in threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from criuctl.agent import callers, grants, handoffleases, pageserving, receiver, tickets, transfer, wire
from criuctl.agent.bundles import Bundles
from criuctl.agent.httpjson import fail
from criuctl.agent.incoming import Incoming
from criuctl.agent.messages import Healthz, LogChunk, NodeInfo
from criuctl.agent.outgoing import Outgoing
from criuctl.agent.redirects import Redirects
from criuctl.agent.runtimes import Runtimes
from criuctl.agent.target import Vouch
from criuctl.container import containers, runtime
from criuctl.core import jsonlog, statedir, workloads, worklogs
from criuctl.core.errors import CriuctlError
from criuctl.core.tokens import read_token
from criuctl.engine import criu
from criuctl.format import bundle
from criuctl.gpu import gpus
from criuctl.net import peers

log = logging.getLogger("criuctl.agent")

# why another node's certificate (its names) may not make the request (method, path); None: it may
PeerRules = Callable[[frozenset[str], web.Request], Awaitable[str | None]]
# what a move's grant opens to the controller (criuctl.agent.grants): the two sides of a migration
_MOVE_ROUTE = re.compile(r"^/v1/(incoming|outgoing)(/.*)?$")
_NAMING_BODY = frozenset({"/v1/outgoing", "/v1/outgoing/settle"})  # their body's `workload`
_OUTGOING_ID = re.compile(r"^/v1/outgoing/([0-9a-f]{32})(/[a-z]+)?$")  # its workload: the machine's


@dataclass
class AgentOptions:
    host: str
    port: int
    # the bearer token callers show; None: callers prove themselves by certificate alone (`peer_ca`:
    # on Kubernetes, the controller's and the nodes' certificates, criuctl.agent.callers)
    token_file: Path | None
    name: str = field(default_factory=socket.gethostname)
    metrics_token_file: Path | None = None  # a scrape credential that opens GET /metrics only
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # the agents' CA: a caller's certificate is checked against it, and a ticket's routes open only
    # to the move's source (mutual TLS); None: no caller is asked for one
    peer_ca: Path | None = None
    lease_seconds: float = 120.0  # a frozen source waits this long for a commit before asking the target
    runtime_endpoint: str | None = None  # the container runtime's CRI socket (default: runtime.endpoint())
    inject_dir: Path | None = None  # where containers find criuctl's init (default containers.INJECT_DIR)
    # what the layers above add to the agent's process (the CLI composes them: criuctl.kube's
    # preStop listener and kept-bundle restorer), each called with the agent and its application
    extensions: list[Callable[[Agent, web.Application], None]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # the start-up checks' doubts, logged first


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.migrations = Counter(
            "criuctl_migrations",
            "Migrations by role, mode and result",
            ["role", "mode", "result"],
            registry=self.registry,
        )
        self.bytes = Counter(
            "criuctl_bytes_moved", "Bundle bytes moved", ["direction"], registry=self.registry
        )
        self.thaws_incomplete = Gauge(
            "criuctl_thaws_incomplete",
            "Workloads that run again here after a failed or aborted migration, but whose thaw has "
            "not completed (e.g. CRIU's network lock still drops their connections); retried",
            registry=self.registry,
        )
        self.downtime = Histogram(
            "criuctl_migration_downtime_seconds",
            "Freeze to running on the target",
            ["mode"],
            buckets=(0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 60, 120),
            registry=self.registry,
        )


class Agent:
    def __init__(self, opts: AgentOptions) -> None:
        self.opts = opts
        self.token = read_token(opts.token_file) if opts.token_file else None
        self.metrics_token = read_token(opts.metrics_token_file) if opts.metrics_token_file else None
        self.metrics = Metrics()
        self.incoming = Incoming(self)
        self.outgoing = Outgoing(self)
        self.bundles = Bundles(self)
        self.runtimes = Runtimes(self)
        self.redirects = Redirects(self)
        self.tasks: set[asyncio.Task[None]] = set()
        # what it serves HTTPS with, set by `serve`: an extension renewing the node's certificate
        # loads the new one into it (criuctl.kube.identity)
        self.tls: ssl.SSLContext | None = None
        # what another node's certificate opens here, beyond GET /healthz and its ticket's routes:
        # why not (None: allowed), for the caller's names and the request. Set by the layer that
        # knows what moves there are (criuctl.kube.peerrules); without it, nothing
        self.peer_rules: PeerRules | None = None
        self._authorities: list[Any] | None = None  # the public keys of --peer-ca: who signs grants

    @property
    def checks_peers(self) -> bool:
        return self.tls is not None and self.opts.peer_ca is not None

    async def peer_refusal(self, peer: dict[str, Any], request: web.Request) -> str | None:
        """Why a caller with this verified certificate may not make this request (None: it may)."""
        if callers.is_controller(peer):
            return await self.grant_refusal(request)
        names = callers.names(peer)
        if self.name.lower() in names:  # this agent itself: the CA signs a node's name for its agent alone
            return None
        if self.peer_rules is None:
            shown = ", ".join(sorted(names))
            return f"another node's certificate ({shown}) opens nothing here but its move's ticket"
        return await self.peer_rules(names, request)

    async def grant_refusal(self, request: web.Request) -> str | None:
        """Why the controller's certificate may not make this request (None: it may). Alone it reads
        what runs here; a move's routes take the grant of that move (criuctl.agent.grants)."""
        if (request.method, request.path) in callers.READS:
            return None
        if not _MOVE_ROUTE.match(request.path):
            return f"the controller may not call {request.method} {request.path} here: no move needs it"
        shown = request.headers.get(grants.GRANT_HEADER)
        if not shown:
            return f"the controller's call {request.method} {request.path} came without a move's grant"
        try:
            if self._authorities is None and self.opts.peer_ca is not None:
                self._authorities = await asyncio.to_thread(grants.authorities, self.opts.peer_ca)
            g = grants.read(shown, self._authorities or [], self.name)
        except grants.GrantRefused as exc:
            return str(exc)
        except (OSError, ValueError) as exc:
            return f"cannot read the agents' CA to check the controller's grant: {exc}"
        named = ""
        if request.method == "POST" and request.path in _NAMING_BODY:
            try:
                named = str((await request.json()).get("workload", ""))
            except (ValueError, AttributeError):
                return None  # the handler answers a body it cannot read with its own 400
        if not named and (og := _OUTGOING_ID.match(request.path)) is not None:
            started = self.outgoing.machines.get(og.group(1))  # a move it started: of that workload
            named = started.spec.workload if started is not None else ""
        if named:
            try:
                w = await asyncio.to_thread(workloads.load, workloads.validate_name(named))
            except workloads.BadName:
                w = None
            if w is None or w.pod_uid != g.uid:
                return f"the grant is for {g.what}; workload {named} here is not its container"
        return None

    @property
    def name(self) -> str:
        return self.opts.name

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
        self.bundles.routes(r)
        self.incoming.routes(r)
        self.outgoing.routes(r)
        self.runtimes.routes(r)
        self.redirects.routes(r)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        for extend in self.opts.extensions:
            extend(self, app)
        return app

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """A background task the agent keeps (and cancels at shutdown)."""
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _start(self, _app: web.Application) -> None:
        """Level-triggered recovery: read every record, settle what a dead handoff left, then upkeep."""
        await asyncio.to_thread(self.incoming.recover)
        await asyncio.to_thread(self.runtimes.prepare_inject_dir)
        for rec in await asyncio.to_thread(self.outgoing.recover):
            self.spawn(self.outgoing.settle(rec))
        for rid in await asyncio.to_thread(self.redirects.pending):
            self.spawn(self.redirects.settle(rid, 0.0))
        self.spawn(self._janitor())
        handoffleases.warm_up()  # the first migration's handoff need not start Python either

    async def _stop(self, _app: web.Application) -> None:
        for task in list(self.tasks):
            task.cancel()

    async def _janitor(self) -> None:
        """Final entries leave memory; unfinished incoming ones nobody drives are aborted in time."""
        while True:
            await asyncio.sleep(min(30.0, self.opts.lease_seconds))
            try:
                await self.incoming.tidy(stale_after=2 * self.opts.lease_seconds)
                await asyncio.to_thread(self.redirects.tidy)
                await asyncio.to_thread(pageserving.tidy)
            except Exception:  # upkeep must never stop
                log.exception("janitor")

    @web.middleware
    async def _log_requests(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.monotonic()
        resp = await handler(request)
        log.info(
            "request",
            extra={
                "method": request.method,
                "path": request.path,
                "status": resp.status,
                "seconds": round(time.monotonic() - started, 3),
            },
        )
        return resp

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path == "/healthz":
            return await handler(request)
        given = request.headers.get("Authorization", "")
        proven = self.incoming.ticket_opens(request, given)
        if proven is not None:  # a ticket's proof, for its own migration's routes only
            if (why := self.incoming.peer_refusal(request)) is not None:
                log.warning("refused", extra={"path": request.path, "reason": why})
                return fail(
                    403,
                    f"node {self.name} refused the call: {why}",
                    "a ticket works from its move's source agent alone, which presents its node's "
                    "certificate (docs/deploy.md, TLS)",
                )
            request[tickets.PROVEN] = proven
            return await handler(request)
        token = given.removeprefix("Bearer ").strip() if given.startswith("Bearer ") else ""
        if token and self.token and hmac.compare_digest(token.encode(), self.token.encode()):
            return await handler(request)
        shown = request.transport.get_extra_info("peercert") if request.transport else None
        # a certificate in place of a token only where the agent has none (Kubernetes): where it has
        # one, the CA given as --peer-ca may sign certificates for more than criuctl's agents
        peer = shown if self.checks_peers and self.token is None else None
        if peer and not token:
            why = await self.peer_refusal(peer, request)
            if why is None:
                return await handler(request)
            log.warning("refused", extra={"path": request.path, "reason": why})
            return fail(403, f"node {self.name} refused the call: {why}", "docs/deploy.md, Who holds what")
        scrape = request.method == "GET" and request.path == "/metrics" and self.metrics_token
        if token and scrape and hmac.compare_digest(token.encode(), str(self.metrics_token).encode()):
            return await handler(request)
        log.warning(
            "refused", extra={"path": request.path, "reason": "no token" if not token else "bad token"}
        )
        if self.token is None:
            return fail(
                401,
                f"node {self.name} refused the call: it takes no token; a caller shows its certificate",
                "call it as criuctl's controller or agent does, with a certificate of the agents' CA "
                "(docs/deploy.md, Who holds what)",
            )
        return fail(
            401,
            f"node {self.name} refused the call: " + ("no bearer token" if not token else "wrong token"),
            "use this node's token (criuctl node add NAME URL --token-file F)",
        )

    def error_response(self, exc: BaseException) -> web.Response:
        if isinstance(exc, workloads.UnknownWorkload | runtime.UnknownContainer):
            return fail(404, exc.what, exc.hint)
        if isinstance(exc, containers.NotCheckpointable | runtime.Unsupported):
            return fail(422, exc.what, exc.hint)
        if isinstance(exc, runtime.RuntimeUnavailable):
            return fail(503, f"node {self.name}: {exc.what}", exc.hint)
        if isinstance(exc, transfer.TransferError):
            return fail(400, exc.what, exc.hint)
        if isinstance(exc, bundle.BundleError):
            return fail(422, f"node {self.name} refused the bundle: {exc.what}", exc.hint)
        if isinstance(exc, OSError) and exc.errno == 28:
            return fail(
                507,
                f"disk full on node {self.name}",
                "free space in its state directory, or pick another node",
            )
        if isinstance(exc, CriuctlError):
            return fail(500, exc.what, exc.hint)
        return fail(500, f"{exc.__class__.__name__}: {exc}", f"see the agent log on node {self.name}")

    def bundle_key(self) -> bytes:
        """This node's own bundle key (made on first use): it signs what is kept here, and leaves
        no node (`criuctl.agent.bundles`)."""
        return bundle.load_key(statedir.key_path())

    async def receive(
        self, r: web.Request, dest: Path, vouch: Vouch | None = None, seal: bytes | None = None
    ) -> dict[str, str]:
        """Stream the request body into `dest`, hashing as it comes; verify (with what this node's
        page server says of pages that came straight from the dump, `vouch`); return the digests.
        `seal`: the key of the one move or copy that brought it, whose signature it must carry;
        it is then signed with this node's own key (`bundle.adopt`). None: signed with this
        node's key already (a move recorded before moves had keys of their own)."""
        counter = transfer.Counter(started=time.monotonic())
        async with wire.taken(r) as body:
            job = asyncio.ensure_future(receiver.receive(body, dest, counter))
            dog = asyncio.ensure_future(transfer.watchdog(counter, job, "receiving the bundle"))
            try:
                digests = await job
            except asyncio.CancelledError:
                if dog.done() and (stalled := dog.exception()) is not None:
                    raise stalled from None
                raise
            finally:
                dog.cancel()
                with contextlib.suppress(asyncio.CancelledError, transfer.TransferError):
                    await dog
        self.metrics.bytes.labels("received").inc(counter.done)
        own = await asyncio.to_thread(self.bundle_key)
        vouched = await vouch() if vouch is not None else None
        if seal is None:
            await asyncio.to_thread(bundle.verify, dest, own, digests, vouched)
        else:
            await asyncio.to_thread(bundle.adopt, dest, seal, own, digests, vouched)
        return digests

    # ------------------------------------------------------------------------------- node

    async def healthz(self, _r: web.Request) -> web.Response:
        return web.json_response(Healthz(ok=True, node=self.name))

    async def metrics_page(self, _r: web.Request) -> web.Response:
        self.metrics.thaws_incomplete.set(await asyncio.to_thread(self.outgoing.thaws_incomplete))
        return web.Response(
            body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def info(self, _r: web.Request) -> web.Response:
        out = NodeInfo(node=self.name, tls=self.opts.tls_cert is not None)
        try:
            out["criu"] = ".".join(map(str, await asyncio.to_thread(criu.require_version)))
            f = await asyncio.to_thread(criu.features)
            out["lazy_pages"] = f.lazy_pages
        except CriuctlError as exc:
            out["criu_error"] = exc.line()
        with contextlib.suppress(CriuctlError):  # NVML answered an error: the restore's own check stands
            out["gpus"] = [g.to_dict() for g in await asyncio.to_thread(gpus.list_gpus)]
        return web.json_response(out)

    async def list_workloads(self, _r: web.Request) -> web.Response:
        others = await asyncio.to_thread(self.runtimes.register_all)  # containers become workloads here
        return web.json_response(await asyncio.to_thread(self.workload_rows) + others)

    def workload_rows(self) -> list[workloads.WorkloadRow]:
        """Every workload here; a running one with its TCP endpoints (what joins ranks into jobs)."""
        out = workloads.rows()
        kept = self.redirects.kept()  # read once for the whole listing
        moved = self.outgoing.handed_over()
        for row in out:
            if (h := moved.get(row["name"])) is not None and h[0] == row["root_pid"]:
                row["state"], row["moved_to"], row["rss_bytes"] = workloads.MIGRATED, h[1], None
            if row["alive"] and row["state"] == workloads.RUNNING:  # a container's, in its pod's netns
                ends = peers.of_tree(row["root_pid"])
                raw, ends.connections = ends.connections, self.redirects.translate(ends.connections, kept)
                row["tcp"] = ends.to_json()
                sent = {(a[2], a[3], b[2]) for a, b in zip(raw, ends.connections, strict=True) if a != b}
                if sent:
                    row["redirected"] = [list(t) for t in sorted(sent)]
        return out

    async def workload_logs(self, r: web.Request) -> web.StreamResponse:
        """The last lines (`?tail=N`, text); or, with `?from=OFFSET` (`from=tail`: the last N lines
        first), a JSON LogChunk with the workload's state, for `criuctl logs -f`."""
        try:
            name = workloads.validate_name(r.match_info["name"])
            tail = int(r.query.get("tail", "0"))
            start = r.query.get("from")
            offset = None if start in (None, "tail") else int(start or "")
            if tail < 0 or (offset is not None and offset < 0):
                raise ValueError
        except CriuctlError as exc:
            return fail(400, exc.what, exc.hint)
        except ValueError:
            return fail(400, f"tail and from must be whole numbers, not {dict(r.query)!r}")
        if not workloads.log_path(name).exists():
            return fail(404, f"no logs for {name!r} on node {self.name}", "see `criuctl ps --node`")
        if start is None and not tail:  # the whole file, streamed
            return web.FileResponse(
                workloads.log_path(name), headers={"Content-Type": "text/plain; charset=utf-8"}
            )
        chunk = await asyncio.to_thread(worklogs.read, name, offset, tail)
        if start is None:
            return web.Response(body=chunk.text, content_type="text/plain", charset="utf-8")
        out: LogChunk = {
            "text": chunk.text.decode(errors="replace"),
            "end": chunk.end,
            "state": chunk.state,
            "moved_to": chunk.moved_to,
            "exit_code": chunk.exit_code,
        }
        return web.json_response(out)


def serve(opts: AgentOptions) -> None:
    jsonlog.to_stderr()
    for warning in opts.warnings:
        log.warning(warning)
    agent = Agent(opts)
    ctx = None
    if opts.tls_cert:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(opts.tls_cert, opts.tls_key)
        if opts.peer_ca is not None:  # asked of every caller, required on a ticket's routes only
            ctx.load_verify_locations(cafile=str(opts.peer_ca))
            ctx.verify_mode = ssl.CERT_OPTIONAL
    agent.tls = ctx
    log.info("listening", extra={"node": opts.name, "host": opts.host, "port": opts.port, "tls": bool(ctx)})
    web.run_app(agent.app(), host=opts.host, port=opts.port, ssl_context=ctx, print=None, access_log=None)
