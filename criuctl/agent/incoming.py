"""HTTP routes of the target side: `/v1/incoming…`. They parse, authorise and render; `TargetMachine` decides.

POST   /v1/incoming                make room, mint an upload ticket (token)
PUT    /v1/incoming/{id}/bundle    the source agent streams the bundle (ticket)
POST   /v1/incoming/{id}/restore   restore it stopped (token)
POST   /v1/incoming/{id}/commit    let it run (token)
GET    /v1/incoming/{id}           its state (ticket or token)
DELETE /v1/incoming/{id}           the verdict: abort unless it runs here (ticket or token);
                                   200 {"state": "aborted"} or 409 {"state": "running"}
DELETE /v1/incoming/{id}/cut       a job's rank: lift its cut now (token; else at commit, or a
                                   lease after an abort)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web

from criuctl.agent import callers, records, tickets, wire
from criuctl.agent.handoffleases import Handoff
from criuctl.agent.httpjson import BadInto, body_json, container_id, error, fail, outcome_response, valid_id
from criuctl.agent.messages import (
    IncomingAnswer,
    IncomingRequest,
    IncomingStatus,
    PagesAnswer,
    PagesRequest,
    RestoreRequest,
    StateAnswer,
)
from criuctl.agent.protocol import (
    TARGET_FINAL,
    Mode,
    TargetRecord,
    TargetSpec,
    TargetState,
    Ticket,
    UploadAnswer,
    Verdict,
    timeouts,
)
from criuctl.agent.target import TargetMachine
from criuctl.core import statedir, workloads
from criuctl.core.errors import CriuctlError
from criuctl.engine import criu
from criuctl.format import bundle
from criuctl.net import netcut
from criuctl.net.pagetls import PeerCertError

if TYPE_CHECKING:
    from criuctl.agent.server import Agent

log = logging.getLogger("criuctl.agent")


def _nonce(r: web.Request) -> str:
    """The nonce of the ticket's proof this request came with ("" with the node's token)."""
    proven = r.get(tickets.PROVEN)
    return proven.nonce if proven is not None else ""


async def spawn_target(spec: TargetSpec, folder: Path) -> Handoff:
    return await Handoff.spawn(
        "target", spec.to_json(), folder, statedir.HANDOFF_LOGS.ensure() / f"target-{folder.name}.log"
    )


class Incoming:
    """The target side's routes and its table of migrations (live ones in memory, the rest on disk)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.machines: dict[str, TargetMachine] = {}

    def routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/v1/incoming", self.new)
        r.add_put("/v1/incoming/{id}/bundle", self.upload, expect_handler=wire.defer_continue)
        r.add_post("/v1/incoming/{id}/pages", self.pages)
        r.add_post("/v1/incoming/{id}/restore", self.restore)
        r.add_post("/v1/incoming/{id}/commit", self.commit)
        r.add_get("/v1/incoming/{id}", self.status)
        r.add_delete("/v1/incoming/{id}", self.abort)
        r.add_delete("/v1/incoming/{id}/cut", self.lift_cut)

    @property
    def spool(self) -> Path:
        """Bundles in flight (may be a tmpfs)."""
        return statedir.INCOMING_SPOOL.ensure()

    @property
    def records(self) -> Path:
        """Migration records and tombstones (on disk: they outlive a reboot)."""
        return statedir.INCOMING.ensure()

    def machine(self, rec: TargetRecord) -> TargetMachine:
        return TargetMachine(
            rec, self.spool / rec.migration, self.records / f"{rec.migration}.json", spawn_target
        )

    def lookup(self, mid: str) -> TargetMachine | None:
        """A migration by id: the live one, else its record (a restarted agent, a pruned entry)."""
        if not valid_id(mid):
            return None
        m = self.machines.get(mid)
        if m is not None:
            return m
        rec = records.read(self.records / f"{mid}.json", TargetRecord.from_json)
        if not isinstance(rec, TargetRecord):
            return None
        m = self.machine(rec)
        self.machines[mid] = m
        return m

    def ticket_opens(self, request: web.Request, header: str) -> tickets.Proven | None:
        """What a ticket's proof (`tickets.proof`) that opens this request vouches for: a ticket opens
        only its own migration's upload, page session, status and verdict. None for anything else."""
        path = request.path
        if not header.startswith(tickets.SCHEME) or not path.startswith("/v1/incoming/"):
            return None
        if not (
            request.method in ("GET", "DELETE")
            or (request.method == "PUT" and path.endswith("/bundle"))
            or (request.method == "POST" and path.endswith("/pages"))
        ):
            return None
        m = self.lookup(request.match_info.get("id", ""))
        return None if m is None else tickets.checked_proof(header, m.rec.proof_key, request.method, path)

    def peer_refusal(self, request: web.Request) -> str | None:
        """Why the caller of a ticket's route that feeds or ends the move (its upload, page session,
        abort) is not the move's source (None: it is, or this agent checks no peers): mutual TLS,
        the caller's certificate checked against the agents' CA (`--peer-ca`) and the source's
        address the client named when it asked for the ticket."""
        if request.method == "GET":  # a read of the signed state: a job's other ranks' targets ask it too
            return None  # (`TargetRecord.follow`), and it changes nothing
        m = self.lookup(request.match_info.get("id", ""))
        if m is None or m.rec.source is None or not self.agent.checks_peers:
            return None
        names = callers.names(request.transport.get_extra_info("peercert") if request.transport else None)
        if m.rec.source in names:
            return None
        said = f"its certificate names {', '.join(sorted(names))}" if names else "it presented no certificate"
        return f"the caller is not migration {m.id}'s source {m.rec.source}: {said}"

    def _get(self, r: web.Request) -> TargetMachine:
        m = self.lookup(r.match_info["id"])
        if m is None:
            raise error(404, f"no migration {r.match_info['id']} on node {self.agent.name}", state="unknown")
        return m

    # ----------------------------------------------------------------------------------- routes

    async def new(self, r: web.Request) -> web.Response:
        body: IncomingRequest = await body_json(r)
        try:
            name = workloads.validate_name(str(body.get("workload", "")))
            into = container_id(body.get("into"))
            mode = Mode(body.get("mode", Mode.STOP_AND_COPY))
        except BadInto as exc:
            return fail(400, str(exc), "name the placeholder by its container ID (hex digits)")
        except ValueError:
            return fail(400, f"unknown mode {body.get('mode')!r}", f"one of {', '.join(Mode)}")
        except CriuctlError as exc:
            return fail(400, exc.what, exc.hint)
        try:
            cut = netcut.parse(body.get("cut") or [], "apap")
            follow = Ticket.from_json(body["follow"]) if body.get("follow") is not None else None
            source = callers.address(body["source"]) if body.get("source") else None
        except (ValueError, TypeError) as exc:
            return fail(400, f"bad job move: {exc}", "use `criuctl migrate`")
        try:
            await asyncio.to_thread(criu.require_version)
            if mode == Mode.POST_COPY:
                await asyncio.to_thread(criu.ensure_lazy_pages)
            await asyncio.to_thread(self.agent.bundle_key)
        except OSError as exc:
            return fail(
                503,
                f"node {self.agent.name} cannot make its bundle key: {exc.strerror or exc}",
                "check its state dir",
            )
        except CriuctlError as exc:
            return fail(503, f"node {self.agent.name} cannot restore: {exc.what}", exc.hint)
        w = await asyncio.to_thread(workloads.load, name)
        if w is not None and w.state == workloads.RUNNING and w.alive():
            return fail(
                409, f"a workload named {name!r} already runs on node {self.agent.name}", "rename one"
            )
        secret = tickets.new_secret()
        sign_key, verify = tickets.new_signer()
        m = await asyncio.to_thread(
            TargetMachine.create,
            uuid.uuid4().hex,
            name,
            mode,
            tickets.proof_key(secret),
            self.spool,
            self.records,
            spawn_target,
            placeholder=into,
            runtime=self.agent.runtimes.endpoint,
            sign_key=sign_key,
            source=source,
            seal_key=tickets.seal_key(secret).hex(),
        )
        self.machines[m.id] = m
        if follow is not None:
            m.rec.follow = follow
            await asyncio.to_thread(records.write, m.record_path, m.rec.to_json())
        if cut:  # before anything is frozen: no peer of the rank can reach this node's kernel first
            try:
                m.rec.cut = await asyncio.to_thread(netcut.cut, m.id, cut)
            except CriuctlError as exc:
                await m.verdict()
                return fail(
                    503, f"node {self.agent.name} cannot cut the job's connections: {exc.what}", exc.hint
                )
            await asyncio.to_thread(records.write, m.record_path, m.rec.to_json())
        log.info("incoming", extra={"id": m.id, "workload": name, "mode": str(mode)})
        return web.json_response(IncomingAnswer(id=m.id, ticket=secret, verify=verify))

    async def pages(self, r: web.Request) -> web.Response:
        """A page session with this migration's source, before anything is frozen (`TargetMachine.
        open_pages`): the source's certificate in, this end's out. The proof must cover the body
        and the answer is signed with the migration's key, so that a man in the middle (under
        `--insecure`) can swap neither certificate."""
        m = self._get(r)
        raw = await r.read()
        proven = r.get(tickets.PROVEN)
        if proven is None or not proven.covers(raw):
            return fail(
                401, "a page session's certificate must come with the ticket's proof of it", "use criuctl"
            )
        try:
            body: PagesRequest = json.loads(raw)
            port, pem = await m.open_pages(body.get("cert") if isinstance(body, dict) else None)
        except ValueError:
            return fail(400, "the body is not JSON", 'send {"cert": PEM}')
        except CriuctlError as exc:
            return fail(400 if isinstance(exc, PeerCertError) else 409, exc.what, exc.hint)
        sig = tickets.signed_cert(m.rec.sign_key, m.id, proven.nonce, pem) if m.rec.sign_key else ""
        return web.json_response(PagesAnswer(port=port, cert=pem, sig=sig))

    async def upload(self, r: web.Request) -> web.Response:
        m = self._get(r)
        started = time.monotonic()
        try:
            seal = bytes.fromhex(m.rec.seal_key) if m.rec.seal_key else None
            out = await m.receive(lambda dest, vouch: self.agent.receive(r, dest, vouch, seal))
        except (CriuctlError, OSError) as exc:
            self.agent.metrics.migrations.labels("target", m.rec.mode, "failed").inc()
            log.warning("receive failed", extra={"id": m.id, "error": str(exc)})
            return self.agent.error_response(exc)
        if not out.ok:
            return fail(409, out.what, out.hint, state=out.state)
        size = await asyncio.to_thread(bundle.size_bytes, m.bundle_dir)
        return web.json_response(UploadAnswer(bytes=size, seconds=time.monotonic() - started))

    async def restore(self, r: web.Request) -> web.Response:
        m = self._get(r)
        body: RestoreRequest = await body_json(r)
        page_server = body.get("page_server")
        if page_server is not None and not isinstance(page_server, str):
            return fail(400, "page_server must be HOST:PORT")
        out = await m.restore(page_server, self.agent.name)
        if not out.ok and m.state == TargetState.FAILED:
            self.agent.metrics.migrations.labels("target", m.rec.mode, "failed").inc()
            return fail(500, out.what, out.hint, state=out.state)
        return outcome_response(out)

    async def commit(self, r: web.Request) -> web.Response:
        m = self._get(r)
        out = await m.commit()
        if out.ok:
            self.agent.metrics.migrations.labels("target", m.rec.mode, "succeeded").inc()
            await asyncio.to_thread(_lift_cut, m.rec)  # the rank runs here: its peers may reach it
        return outcome_response(out, str(m.state))

    async def status(self, r: web.Request) -> web.Response:
        m = self._get(r)
        answer = m.answer(_nonce(r))
        return web.json_response(IncomingStatus(**answer, workload=m.rec.workload))

    async def abort(self, r: web.Request) -> web.Response:
        m = self._get(r)
        verdict = await m.verdict()
        if verdict == Verdict.RUNNING:
            return fail(
                409,
                f"migration {m.id} already runs on node {self.agent.name}; it cannot be aborted",
                **m.answer(_nonce(r)),
            )
        if verdict == Verdict.UNKNOWN:
            return fail(
                503,
                f"node {self.agent.name} could not end its copy of migration {m.id} yet",
                "ask again",
                state=str(m.state),
            )
        self.agent.metrics.migrations.labels("target", m.rec.mode, "aborted").inc()
        self.machines.pop(m.id, None)
        return web.json_response(m.answer(_nonce(r)))

    async def lift_cut(self, r: web.Request) -> web.Response:
        m = self._get(r)
        if m.state not in TARGET_FINAL:
            return fail(
                409,
                f"migration {m.id} is {m.state}: its cut stays until it runs or is aborted",
                state=str(m.state),
            )
        await asyncio.to_thread(_lift_cut, m.rec)
        return web.json_response(StateAnswer(state=str(m.state)))

    # ----------------------------------------------------------------------------------- upkeep

    def recover(self) -> None:
        """At start-up (in a thread): settle every record whose handoff is gone."""
        for path, rec in records.scan(self.records, "*.json", TargetRecord.from_json):
            if isinstance(rec, records.Unreadable):
                log.error("unreadable incoming record", extra={"path": str(path), "why": rec.why})
                continue
            m = self.machine(rec)
            try:
                m.recover()
            except OSError as exc:
                log.error("incoming record not settled", extra={"id": m.id, "error": str(exc)})
            log.warning("recovered incoming", extra={"id": m.id, "state": str(m.state)})

    async def tidy(self, stale_after: float) -> None:
        """Drop final entries from memory, abort stale unfinished ones, forget old tombstones."""
        now = time.time()
        for m in list(self.machines.values()):
            if m.lock.locked():
                continue
            if m.state in TARGET_FINAL:
                if m.handoff is None or not m.handoff.alive or m.state == TargetState.RUNNING:
                    self.machines.pop(m.id, None)
            elif m.state != TargetState.RECEIVING and now - m.rec.updated > stale_after:  # idle since
                log.warning("stale incoming dropped", extra={"id": m.id, "state": str(m.state)})
                with contextlib.suppress(OSError):
                    await m.verdict()
                self.machines.pop(m.id, None)
        await asyncio.to_thread(_forget_tombstones, self.records, set(self.machines))
        await asyncio.to_thread(self._lift_stale_cuts, stale_after)

    def _lift_stale_cuts(self, linger: float) -> None:
        """A cut outlives its migration only while a peer may still be re-pointed at this node."""
        for table in netcut.tables(netcut.CUT):
            m = self.lookup(table.removeprefix(netcut.CUT))
            if (
                m is None
                or m.state == TargetState.RUNNING
                or (
                    m.state in (TargetState.ABORTED, TargetState.FAILED)
                    and time.time() - m.rec.updated > linger
                )
            ):
                netcut.remove(table)


def _lift_cut(rec: TargetRecord) -> None:
    if rec.cut:
        netcut.remove(rec.cut)


def _forget_tombstones(folder: Path, live: set[str]) -> None:
    horizon = time.time() - timeouts().tombstone
    for path, rec in records.scan(folder, "*.json", TargetRecord.from_json):
        if isinstance(rec, TargetRecord) and rec.migration not in live and rec.updated < horizon:
            path.unlink(missing_ok=True)
