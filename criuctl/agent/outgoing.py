"""HTTP routes of the source side: `/v1/outgoing…`. They parse, authorise and render; `SourceMachine` decides.

POST   /v1/outgoing              freeze, stream to the target; one JSON event per line as it goes
POST   /v1/outgoing/{id}/commit  the client says the target runs it: the handoff checks, then ends
GET    /v1/outgoing/{id}         its state
DELETE /v1/outgoing/{id}         abort: before "sent" the tree thaws; after, only on the target's word
POST   /v1/outgoing/settle       a person declares the target down: thaw a sent move it stays silent on
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from aiohttp import web

from criuctl.agent import conn, pagesession, points, records, tickets, transfer, verdicts
from criuctl.agent.handoffleases import Handoff
from criuctl.agent.httpjson import body_json, error, fail, outcome_response, valid_id
from criuctl.agent.messages import (
    Failed,
    OutgoingEvent,
    OutgoingRequest,
    OutgoingStatus,
    Sent,
    SettleRequest,
    Started,
)
from criuctl.agent.protocol import (
    INCOMPLETE,
    SOURCE_FINAL,
    Mode,
    Outcome,
    Point,
    SettleOrder,
    SourceRecord,
    SourceSpec,
    SourceState,
    Ticket,
    UploadAnswer,
    Verdict,
    check_transition,
    settle_order_path,
    timeouts,
)
from criuctl.agent.source import SourceMachine, thaw_until_done
from criuctl.core import statedir, workloads
from criuctl.core.errors import CriuctlError
from criuctl.core.procinfo import Identity
from criuctl.core.retry import Backoff
from criuctl.engine import criu
from criuctl.format import bundle
from criuctl.gpu import gpus
from criuctl.local import checkpoint
from criuctl.net import readdress

if TYPE_CHECKING:
    from criuctl.agent.server import Agent

log = logging.getLogger("criuctl.agent")


async def spawn_source(spec: SourceSpec, folder: Path) -> Handoff:
    return await Handoff.spawn(
        "source", spec.to_json(), folder, statedir.HANDOFF_LOGS.ensure() / f"source-{folder.name}.log"
    )


class Outgoing:
    """The source side's routes and its live migrations."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.machines: dict[str, SourceMachine] = {}
        self.settling: set[asyncio.Task[None]] = set()
        # records this agent settled from disk (their handoff dead) and removed: how each ended
        self.recovered: dict[str, SourceState] = {}

    def routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/v1/outgoing", self.start)
        r.add_post("/v1/outgoing/settle", self.settle_by_hand)
        r.add_post("/v1/outgoing/{id}/commit", self.commit)
        r.add_get("/v1/outgoing/{id}", self.status)
        r.add_delete("/v1/outgoing/{id}", self.abort)

    @property
    def spool(self) -> Path:
        """Bundles in flight (may be a tmpfs)."""
        return statedir.OUTGOING_SPOOL.ensure()

    @property
    def records(self) -> Path:
        """Hold records (on disk: a frozen tree's record must outlive anything that empties the spool)."""
        return statedir.OUTGOING.ensure()

    def _get(self, r: web.Request) -> SourceMachine:
        m = self.machines.get(r.match_info["id"]) if valid_id(r.match_info["id"]) else None
        if m is None:
            raise error(404, f"no outgoing migration {r.match_info['id']} on node {self.agent.name}")
        return m

    async def start(self, r: web.Request) -> web.StreamResponse:
        body: OutgoingRequest = await body_json(r)
        try:
            name = workloads.validate_name(str(body.get("workload", "")))
            mode = Mode(body.get("mode", Mode.STOP_AND_COPY))
            ticket = Ticket.from_json(body.get("target"))
            moves = body.get("readdress")
            endpoints = readdress.EndpointMap.from_json(moves).to_json() if moves is not None else None
            boundary, live = body.get("boundary", True), body.get("live", True)
            direct = body.get("direct", False)
            if not all(isinstance(x, bool) for x in (boundary, live, direct)):
                raise ValueError("boundary, live and direct must be true or false")
            if direct and mode != Mode.STOP_AND_COPY:
                raise ValueError("direct pages are a stop-and-copy's")
            target_gpus = body.get("target_gpus")
            if target_gpus is not None:
                if not isinstance(target_gpus, list) or not all(isinstance(g, dict) for g in target_gpus):
                    raise ValueError("target_gpus must be a list of GPU records")
                target_gpus = [gpus.GpuInfo.from_dict(g).to_dict() for g in target_gpus]
        except CriuctlError as exc:
            return fail(400, exc.what, exc.hint)
        except (ValueError, TypeError) as exc:
            return fail(400, f"bad migration request: {exc}", "use `criuctl migrate`")
        try:
            w = await asyncio.to_thread(self.agent.runtimes.resolve, name)
            if mode == Mode.POST_COPY:
                await asyncio.to_thread(criu.ensure_lazy_pages)
        except CriuctlError as exc:
            return self.agent.error_response(exc)
        mid = uuid.uuid4().hex
        folder = self.spool / mid
        folder.mkdir(mode=0o700)
        pages_to, lazy_tls = None, None
        try:
            if direct:
                pages_to = await asyncio.to_thread(pagesession.open_at_target, ticket, folder / "pages")
            elif (
                mode == Mode.POST_COPY and urlsplit(ticket.url).scheme == "https"
            ):  # clear only under --insecure
                lazy_tls = await asyncio.to_thread(pagesession.pull_tls, ticket, folder / "pages")
        except CriuctlError as exc:
            await asyncio.to_thread(shutil.rmtree, folder, True)
            return fail(502, exc.what, exc.hint)
        spec = SourceSpec(
            mid,
            w.name,
            str(mode),
            str(self.records / f"{mid}.json"),
            str(folder),
            ticket.node,
            ticket,
            conn.free_port() if mode == Mode.POST_COPY else None,
            endpoints,
            boundary,
            live,
            pages_to.to_json() if pages_to else None,
            target_gpus,
            lazy_tls={k: str(v) for k, v in asdict(lazy_tls).items()} if lazy_tls else None,
        )

        async def send(source: Path | transfer.Source, counter: transfer.Counter) -> UploadAnswer:
            url = f"{ticket.base()}/bundle"
            auth, _ = tickets.proof(ticket, "PUT", urlsplit(url).path)
            return await transfer.send(source, url, auth, ticket.ca, counter, ticket.node)

        m = SourceMachine(spec, spawn_source, send, self._thaw_record)
        self.machines[mid] = m
        resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        await resp.prepare(r)

        async def say(event: OutgoingEvent) -> None:
            try:
                await resp.write(json.dumps(event).encode() + b"\n")
            except (ConnectionError, RuntimeError):
                m.client_gone = True

        await say(Started(event="started", id=mid))
        out = await m.run(say)
        if out.ok:
            self.agent.metrics.bytes.labels("sent").inc(out.facts["bytes"])
            m.lease = asyncio.ensure_future(self._lease(m))
            f = out.facts
            await say(Sent(event="sent", bytes=f["bytes"], seconds=f["seconds"], target=f["target"]))
        else:
            self.agent.metrics.migrations.labels("source", str(mode), "failed").inc()
            log.warning("outgoing failed", extra={"id": mid, "error": out.what})
            f = out.facts
            thawed, left, ended = f.get("thawed", "unconfirmed"), f.get("left"), f.get("ended") is True
            await say(
                Failed(event="error", what=out.what, hint=out.hint, thawed=thawed, left=left, ended=ended)
            )
            await self._after_failure(m)
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write_eof()
        return resp

    async def _lease(self, m: SourceMachine) -> None:
        """The lease, and once it settled the migration with the target (the client never came
        back), its forgetting — as a commit or an abort by the client would."""
        await m.lease_loop(self.agent.opts.lease_seconds)
        await self._forget_when_done(m)

    async def commit(self, r: web.Request) -> web.Response:
        m = self._get(r)
        out = await m.commit()
        if out.ok and out.facts.pop("now", False):  # this call committed it (not the lease, not a retry)
            downtime = out.facts.get("downtime_seconds")
            assert downtime is not None  # the commit that says "now" measured it
            self.agent.metrics.downtime.labels(m.spec.mode).observe(downtime)
            self.agent.metrics.migrations.labels("source", m.spec.mode, "succeeded").inc()
            fin = asyncio.ensure_future(self._forget_when_done(m))
            self.settling.add(fin)
            fin.add_done_callback(self.settling.discard)
        return outcome_response(out)

    async def status(self, r: web.Request) -> web.Response:
        m = self._get(r)
        return web.json_response(
            OutgoingStatus(
                state=str(m.state),
                pages_seconds=m.pages_seconds,
                downtime_seconds=m.downtime if m.downtime_measured else None,
            )
        )

    async def abort(self, r: web.Request) -> web.Response:
        m = self._get(r)
        out = await m.abort()
        if m.state in (SourceState.THAWED, SourceState.THAW_INCOMPLETE):
            self.agent.metrics.migrations.labels("source", m.spec.mode, "aborted").inc()
            self.agent.spawn(self._forget_when_done(m, linger=0.0))
        return outcome_response(out)

    async def settle_by_hand(self, r: web.Request) -> web.Response:
        """A person's word that the target of a sent move is down for good (`SettleRequest`).

        Refused unless the move waits on its target (SENT) and the target gives no signed answer
        now: a target that answers settles the move itself, whatever anyone declared. Otherwise the
        order goes to disk first, then to whoever holds the tree (`SettleOrder`), which asks once
        more and thaws only on silence."""
        body: SettleRequest = await body_json(r)
        try:
            name = workloads.validate_name(str(body.get("workload", "")))
        except CriuctlError as exc:
            return fail(400, exc.what, exc.hint)
        declared = body.get("declared")
        if not isinstance(declared, str) or not declared.strip() or len(declared) > 500:
            return fail(
                400,
                "settling a move needs its target declared down",
                "outside Kubernetes: criuctl settle NAME --node NODE --target-down, once the target "
                "node is off; on Kubernetes: delete its Node or taint it node.kubernetes.io/out-of-service",
            )
        found = await asyncio.to_thread(self._waiting, name)
        if found is None:
            return fail(
                404,
                f"no move of {name} waits for its target on node {self.agent.name}",
                f"`criuctl ps --node {self.agent.name}` lists what runs and what is frozen here",
            )
        path, rec = found
        if rec.state != SourceState.SENT:
            return fail(
                409,
                f"the move of {name} is {rec.state}, not waiting for its target",
                "only a move whose bundle was sent waits for its target; this one settles on its own",
                state=str(rec.state),
            )
        if (answer := await asyncio.to_thread(verdicts.heard, rec.ticket)) is not None:
            return fail(
                409,
                f"node {rec.ticket.node} answers for the move of {name} ({answer})",
                "a target that answers is not down: nothing to settle by hand; the source acts on "
                "its signed word once it gives one",
                state=str(rec.state),
            )
        await asyncio.to_thread(records.order_settle, path, SettleOrder(declared.strip(), time.time()))
        log.warning("settle ordered", extra={"id": rec.migration, "declared": declared})
        await points.areach(Point.SOURCE_SETTLE_ORDERED)
        m = self.machines.get(rec.migration)
        if m is not None and (m.handoff is None or not m.handoff.alive) and m.state == SourceState.SENT:
            self.machines.pop(rec.migration, None)  # its handoff died: this agent settles the record
            self.agent.spawn(self.settle(rec))
            m = None
        out = await m.settle() if m is not None else await self._settled_on_disk(path, rec.migration)
        if out.state in (SourceState.COMMITTED, SourceState.DONE):  # the target's word came first
            out = Outcome(out.state, False, f"node {rec.ticket.node} answered: the job runs there")
        if out.ok:
            self.agent.metrics.migrations.labels("source", rec.mode, "settled").inc()
            if m is not None:
                self.agent.spawn(self._forget_when_done(m, linger=0.0))
        if not path.exists():  # settled and forgotten meanwhile: no order outlives its record
            settle_order_path(path).unlink(missing_ok=True)
        return outcome_response(out)

    def _waiting(self, name: str) -> tuple[Path, SourceRecord] | None:
        """The record of the unsettled move of workload `name` on this node, if there is one (the
        one waiting on its target first: an older move's incomplete thaw never hides it)."""
        found = [
            (path, rec)
            for path, rec in records.scan(self.records, "*.json", SourceRecord.from_json)
            if isinstance(rec, SourceRecord) and rec.workload == name and rec.state not in SOURCE_FINAL
        ]
        found.sort(key=lambda pr: pr[1].state != SourceState.SENT)
        return found[0] if found else None

    async def _settled_on_disk(self, path: Path, mid: str) -> Outcome:
        """A move this agent holds no machine for (its handoff's agent died, or the handoff did): the
        handoff, or this agent's `settle` of the dead handoff's record, finds the order and acts on
        it; its record says how it ended."""
        deadline = time.monotonic() + timeouts().handoff_settle + timeouts().ask_target
        while time.monotonic() < deadline:
            rec = await asyncio.to_thread(records.read, path, SourceRecord.from_json)
            state = rec.state if isinstance(rec, SourceRecord) else self.recovered.get(mid)
            if rec is None and state is None:
                return Outcome(
                    "gone",
                    False,
                    "the move settled meanwhile, its record is gone",
                    f"`criuctl ps --node {self.agent.name}` says whether the job runs here",
                )
            if state in (SourceState.THAWED, SourceState.THAW_INCOMPLETE):
                thawed: bool | str = True if state == SourceState.THAWED else INCOMPLETE
                return Outcome(str(state), True, facts={"thawed": thawed})
            if state in (SourceState.COMMITTED, SourceState.DONE):
                return Outcome(str(state), False, "the target answered: the job runs there")
            await asyncio.sleep(0.2)
        return Outcome(
            str(SourceState.SENT),
            False,
            "the settle order is on disk, but nothing acted on it yet",
            f"node {self.agent.name}'s agent or the move's handoff acts on it once it runs; ask again",
        )

    async def _after_failure(self, m: SourceMachine) -> None:
        """Forget a failed migration once its tree runs here whole (an incomplete thaw is retried
        first), unless its handoff died holding a tree the target must settle."""
        rec = await asyncio.to_thread(records.read, Path(m.spec.record), SourceRecord.from_json)
        if m.state == SourceState.THAW_INCOMPLETE:
            self.agent.spawn(self._forget_when_done(m, linger=0.0))
            return
        if m.state in SOURCE_FINAL or not isinstance(rec, SourceRecord) or rec.state != SourceState.SENT:
            await self._forget(m)
            return
        self.machines.pop(m.id, None)
        self.agent.spawn(self.settle(rec))

    async def _forget_when_done(self, m: SourceMachine, linger: float = 60.0) -> None:
        """Once its finisher is done (the last page pulled, an incomplete thaw completed), and after
        `linger` (the client may still ask how long the pages took)."""
        if m.finisher is not None:
            await m.finisher
        await asyncio.sleep(linger)
        if m.state in SOURCE_FINAL:  # a thaw's retries whose handoff died: recovery has its record
            await self._forget(m)
        else:
            self.machines.pop(m.id, None)

    async def _forget(self, m: SourceMachine) -> None:
        """A final migration: drop its entry, its folder and its record (the target keeps the tombstone)."""
        if m.handoff is not None:
            await m.handoff.close()
        if m.lease is not None and m.lease is not asyncio.current_task():
            m.lease.cancel()
        self.machines.pop(m.id, None)
        await asyncio.to_thread(self._remove, m.id)

    def _remove(self, mid: str) -> None:
        """A settled migration: its bundle folder, then its record."""
        shutil.rmtree(self.spool / mid, ignore_errors=True)
        (self.records / f"{mid}.json").unlink(missing_ok=True)
        settle_order_path(self.records / f"{mid}.json").unlink(missing_ok=True)

    # ----------------------------------------------------------------------------------- restart

    def recover(self) -> list[SourceRecord]:
        """At start-up (in a thread): act on every record whose handoff died; those still to settle.

        A live handoff settles itself (its lease broke: it asks the target). A dead one left a
        tree that only this agent can settle now: before SENT it thaws; COMMITTED ends; SENT asks
        the target and an incomplete thaw is tried again, in `settle`. Each record on its own: one
        that cannot be settled is logged and left for the next start, never the end of the others.
        """
        later = []
        for path, rec in records.scan(self.records, "*.json", SourceRecord.from_json):
            if isinstance(rec, records.Unreadable):
                log.error("unreadable outgoing record", extra={"path": str(path), "why": rec.why})
                continue
            try:
                if self._recover_one(rec):
                    later.append(rec)
            except Exception as exc:  # this record only: the next start tries it again
                log.exception("outgoing record not settled", extra={"id": rec.migration, "error": str(exc)})
        return later

    def _recover_one(self, rec: SourceRecord) -> bool:
        """Settle one record whose handoff died, as far as can be done now; True: `settle` goes on."""
        if rec.hold().alive() and rec.state not in SOURCE_FINAL:
            log.warning("outgoing settles itself", extra={"id": rec.migration, "state": str(rec.state)})
            return False
        tree = rec.tree()
        if tree is not None and tree.alive():  # the very tree: a PID given out again is not touched
            if rec.state in (
                SourceState.FREEZING,
                SourceState.FROZEN,
                SourceState.SENDING,
                SourceState.THAW_INCOMPLETE,
            ):
                if not self._thaw_record(rec).complete:
                    return True
            elif rec.state == SourceState.COMMITTED:
                _end(tree, rec)
            elif rec.state == SourceState.SENT:
                return True
        log.warning("recovered outgoing", extra={"id": rec.migration, "state": str(rec.state)})
        self._remove(rec.migration)
        return False

    async def settle(self, rec: SourceRecord) -> None:
        """A record whose handoff died, still unsettled: a frozen tree in SENT asks the target until
        it answers and acts on its verdict; a thaw that did not complete is tried until it does."""
        path = self.records / f"{rec.migration}.json"
        if rec.state == SourceState.SENT:
            backoff = Backoff(timeouts().ask_backoff_max)
            while (verdict := await asyncio.to_thread(verdicts.ask_abort, rec.ticket)) == Verdict.UNKNOWN:
                order = records.settle_order(path)
                if order is not None and await asyncio.to_thread(verdicts.heard, rec.ticket) is None:
                    rec.settled = order.declared  # silent, and declared down
                    break
                # a new order ends the wait; one that did not stand (the address answers) does not
                await backoff.asleep(until=None if order else lambda: records.settle_order(path) is not None)
            log.warning("recovered outgoing", extra={"id": rec.migration, "verdict": str(verdict)})
            if verdict == Verdict.RUNNING and (tree := rec.tree()) is not None:
                await asyncio.to_thread(_end, tree, rec)
                self.recovered[rec.migration] = SourceState.DONE
                await asyncio.to_thread(self._remove, rec.migration)
                return
        await thaw_until_done(lambda: self._thaw_record(rec), timeouts().thaw_retry_max)
        self.recovered[rec.migration] = SourceState.THAWED
        await asyncio.to_thread(self._remove, rec.migration)

    def _thaw_record(self, rec: SourceRecord) -> checkpoint.Thaw:
        """Thaw the tree a record names (its handoff is gone), and write how it went into the record:
        THAW_INCOMPLETE with what is left, or THAWED. A tree that is no longer there has nothing
        left to thaw."""
        tree = rec.tree()
        if tree is None or not tree.alive():
            return checkpoint.Thaw()
        thaw = checkpoint.thaw_tree(tree.pid, _images(rec), rec.netlock_table, rec.workload)
        if rec.state not in SOURCE_FINAL:  # (a FAILED freeze was thawed where it failed)
            state = SourceState.THAWED if thaw.complete else SourceState.THAW_INCOMPLETE
            rec.state = check_transition(rec.state, state)
            rec.thaw_left, rec.updated = thaw.line() or None, time.time()
            records.write(self.records / f"{rec.migration}.json", rec.to_json())
        if not thaw.complete:
            log.error("thaw incomplete", extra={"id": rec.migration, "left": thaw.line()})
        return thaw

    def handed_over(self) -> dict[str, tuple[int | None, str]]:
        """Workloads whose job runs on the target now while their frozen tree lingers here (post-copy:
        it serves the pages the target still pulls, until DONE): name → (its root PID, the target
        node). The listing calls them moved, not running: the one copy that runs is the target's."""
        return {
            rec.workload: (rec.root_pid, rec.ticket.node)
            for _, rec in records.scan(self.records, "*.json", SourceRecord.from_json)
            if isinstance(rec, SourceRecord) and rec.state == SourceState.COMMITTED
        }

    def thaws_incomplete(self) -> int:
        """How many trees here run again with their thaw not complete (for /metrics)."""
        return sum(
            1
            for _, rec in records.scan(self.records, "*.json", SourceRecord.from_json)
            if isinstance(rec, SourceRecord) and rec.state == SourceState.THAW_INCOMPLETE
        )


def _end(tree: Identity, rec: SourceRecord) -> None:
    """The job runs on the target: end the frozen source tree (PID 1 of its namespace takes the rest),
    if it is still the very tree the record names."""
    w = workloads.load(rec.workload)
    if w is not None:
        w.moved_to = rec.ticket.node
    if left := checkpoint.end_frozen(tree, w, workloads.MIGRATED, rec.netlock_table):
        log.error("network lock of an ended tree left", extra={"id": rec.migration, "error": left})


def _images(rec: SourceRecord) -> Path | None:
    """The CRIU images of the record's dump (their inventory names its network-lock table)."""
    return Path(rec.bundle) / bundle.IMAGES_DIR if rec.bundle else None
