"""HTTP routes and records of the redirects a node keeps for ranks that stay while a peer moves.

POST   /v1/redirects             install one (token): the rules, and the moved rank's upload ticket;
                                 or the rules and a workload here (a pod's), in its network namespace
POST   /v1/redirects/{id}/keep   the moved rank runs on its new node: keep it for the job's life
DELETE /v1/redirects/{id}        remove it (the move was aborted)
POST   /v1/workloads/{name}/brace  bound the backoff of its connections to a peer about to move

A redirect (`criuctl.net.netcut`) is right exactly when the moved rank runs on its new node, so it
follows that rank's migration, never the client: one the client neither kept nor removed within
the lease (the client died) asks the moved rank's target, with the ticket, what became of it —
running: keep; aborted: remove; no answer: ask again. A restarted agent asks the same for every
record it finds pending. A kept redirect goes once its connections are gone (the job ended), and
the listing of workloads shows each connection through the kept ones: the peer's true address.

A pod's redirect (its rank stays, a peer pod moves through its successor) lives in the pod's own
network namespace, where it translates only that pod's packets and ends with it. It follows no
ticket: the successor's restore (criuctl.kube.jobmoves) keeps it once the moved rank runs, or
removes it when that restore failed; its record goes once the pod's namespace is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
from aiohttp import web

from criuctl.agent import records, verdicts
from criuctl.agent.httpjson import body_json, error, fail, valid_id
from criuctl.agent.messages import (
    BraceAnswer,
    BraceRequest,
    RedirectAnswer,
    RedirectRequest,
    Rows,
    StateAnswer,
)
from criuctl.agent.protocol import TargetState, Ticket, timeouts
from criuctl.core import procinfo, statedir, workloads
from criuctl.core.errors import CriuctlError
from criuctl.core.retry import Backoff
from criuctl.net import netcut, peers, rto
from criuctl.net.readdress import canonical

if TYPE_CHECKING:
    from psutil._ntuples import sconn

    from criuctl.agent.server import Agent

log = logging.getLogger("criuctl.agent")

PENDING, KEPT = "pending", "kept"


@dataclass
class RedirectRecord:
    id: str
    rules: Rows  # [[local, port, old remote, port, new remote], ...]
    ticket: Ticket | None  # the moved rank's migration on its target: its outcome decides
    table: str
    state: str = PENDING
    created: float = field(default_factory=time.time)
    pid: int | None = None  # a pod's: a process in its network namespace, where the rules are
    netns: int | None = None  # that namespace's inode (a reused PID is another namespace)
    move: str | None = None  # a pod's: the move it follows, which may ask for it again

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ticket": self.ticket.to_json() if self.ticket else None}

    @classmethod
    def from_json(cls, d: object) -> RedirectRecord:
        if not isinstance(d, dict):
            raise ValueError("not an object")
        return cls(**{**d, "ticket": Ticket.from_json(d["ticket"]) if d.get("ticket") else None})

    def where(self) -> int | None:
        """The PID to act through (None: this namespace); NamespaceGone once the pod ended."""
        if self.pid is None:
            return None
        try:
            if os.stat(f"/proc/{self.pid}/ns/net").st_ino == self.netns:
                return self.pid
        except OSError:
            pass
        raise NamespaceGone(self.id)


class NamespaceGone(Exception):
    """A pod's redirect whose namespace is gone: so are its rules."""


def parse_rules(raw: object) -> list[netcut.Redirect]:
    """[[local, port, old remote, port, new remote], ...] with IPv4 addresses; ValueError otherwise."""
    if not raw:
        raise ValueError("a redirect needs at least one rule")
    return netcut.parse(raw, "apapa")


def _path(rid: str) -> Path:
    return statedir.REDIRECTS.ensure() / f"{rid}.json"


def load(rid: str) -> RedirectRecord | None:
    """Redirect `rid` of this node, None if there is none (or `rid` is no id)."""
    if not valid_id(rid):
        return None
    rec = records.read(_path(rid), RedirectRecord.from_json)
    return rec if isinstance(rec, RedirectRecord) else None


class Redirects:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def routes(self, r: web.UrlDispatcher) -> None:
        r.add_post("/v1/redirects", self.new)
        r.add_post("/v1/redirects/{id}/keep", self.keep)
        r.add_delete("/v1/redirects/{id}", self.remove)
        r.add_post("/v1/workloads/{name}/brace", self.brace)

    @property
    def folder(self) -> Path:
        return statedir.REDIRECTS.ensure()

    def _get(self, r: web.Request) -> RedirectRecord:
        rec = load(r.match_info["id"])
        if rec is None:
            raise error(404, f"no redirect {r.match_info['id']} on node {self.agent.name}")
        return rec

    # ----------------------------------------------------------------------------------- routes

    async def new(self, r: web.Request) -> web.Response:
        body: RedirectRequest = await body_json(r)
        pid = netns = None
        move: str | None = None
        try:
            rules = parse_rules(body.get("rules"))
            ticket = None if "workload" in body else Ticket.from_json(body.get("ticket"))
            if "workload" in body:
                if "move" in body:
                    move = str(body["move"])
                    if not valid_id(move):
                        raise ValueError(f"bad move id {move[:60]!r}")
                w = await asyncio.to_thread(
                    self.agent.runtimes.resolve, workloads.validate_name(str(body["workload"]))
                )
                pid = w.root_pid
                netns = os.stat(f"/proc/{pid}/ns/net").st_ino
        except (ValueError, TypeError) as exc:
            return fail(400, f"bad redirect: {exc}", "use `criuctl migrate`")
        except OSError as exc:
            return fail(409, f"the workload's network namespace is gone: {exc.strerror}")
        except CriuctlError as exc:
            return self.agent.error_response(exc)
        wanted: Rows = [list(x) for x in rules]
        if move is not None and (same := await asyncio.to_thread(self._of_move, move, netns)):
            if same.rules == wanted:
                log.info("redirect asked again", extra={"id": same.id, "move": move})
                return web.json_response(RedirectAnswer(id=same.id))
            if same.state == KEPT:
                return fail(409, f"redirect {same.id} of move {move} is kept with other rules", state=KEPT)
            await asyncio.to_thread(self._drop, same)  # the move's successor changed: its rules go
        rid = uuid.uuid4().hex
        rec = RedirectRecord(rid, wanted, ticket, netcut.NAT + rid, pid=pid, netns=netns, move=move)
        await asyncio.to_thread(records.write, _path(rid), rec.to_json())  # before the rules
        try:
            await asyncio.to_thread(netcut.redirect, rid, rules, pid)
        except CriuctlError as exc:
            await asyncio.to_thread(self._drop, rec)
            return fail(
                503, f"node {self.agent.name} cannot redirect the job's connections: {exc.what}", exc.hint
            )
        if ticket is not None:
            self.agent.spawn(self.settle(rid, self.agent.opts.lease_seconds))
        log.info("redirect", extra={"id": rid, "rules": len(rules), "target": ticket.node if ticket else pid})
        return web.json_response(RedirectAnswer(id=rid))

    async def keep(self, r: web.Request) -> web.Response:
        rec = self._get(r)
        rec.state = KEPT
        await asyncio.to_thread(records.write, _path(rec.id), rec.to_json())
        return web.json_response(StateAnswer(state=KEPT))

    async def remove(self, r: web.Request) -> web.Response:
        rec = self._get(r)
        if rec.state == KEPT:
            return fail(
                409, f"redirect {rec.id} is kept: the rank it follows runs on its new node", state=KEPT
            )
        await asyncio.to_thread(self._drop, rec)
        return web.json_response(StateAnswer(state="removed"))

    async def brace(self, r: web.Request) -> web.Response:
        """Before a peer freezes: its connections from this workload retransmit at least every
        second while it is away (criuctl.net.rto), so that it is heard from as soon as it is back."""
        body: BraceRequest = await body_json(r)
        try:
            name = workloads.validate_name(r.match_info["name"])
            conns = [
                (str(a), int(p), str(b), int(q))
                for a, p, b, q in netcut.parse(body.get("connections"), "apap")
            ]
            w = await asyncio.to_thread(self.agent.runtimes.resolve, name)
        except (ValueError, TypeError) as exc:
            return fail(400, f"bad brace: {exc}", "use `criuctl migrate`")
        except workloads.BadName as exc:
            return fail(400, exc.what, exc.hint)
        except CriuctlError as exc:
            return self.agent.error_response(exc)
        done = await asyncio.to_thread(self._brace, procinfo.tree_pids(w.root_pid), set(conns))
        log.info("braced", extra={"workload": name, "sockets": done.sockets, "why_not": done.why_not})
        return web.json_response(BraceAnswer(sockets=done.sockets, why_not=done.why_not))

    def _brace(self, pids: list[int], wanted: set[tuple[str, int, str, int]]) -> rto.Braced:
        """`wanted` is as the listing shows them, through this node's kept redirects (a peer that
        moved before: the socket itself still names its first address): each socket matched by
        what it names or by what the listing shows of it."""
        held = [(ino, (*s.local, *s.remote)) for ino, s in peers.held(pids).items() if s.established]
        shown = self.translate([c for _, c in held], self.kept())
        return rto.brace(
            pids, {ino for (ino, c), seen in zip(held, shown, strict=True) if {c, seen} & wanted}
        )

    # ----------------------------------------------------------------------------------- upkeep

    def _drop(self, rec: RedirectRecord) -> None:
        with contextlib.suppress(NamespaceGone):
            netcut.remove(rec.table, rec.where())
        _path(rec.id).unlink(missing_ok=True)

    async def settle(self, rid: str, seconds: float) -> None:
        """The client did not settle it in time: the moved rank's target says what is true."""
        await asyncio.sleep(seconds)
        backoff = Backoff(timeouts().ask_backoff_max)
        while (rec := await asyncio.to_thread(load, rid)) is not None and rec.state == PENDING:
            if rec.ticket is None:
                return  # a pod's: whoever moves its peer keeps or removes it
            state = await asyncio.to_thread(verdicts.ask_state, rec.ticket)
            log.warning("redirect lease expired", extra={"id": rid, "target_state": state})
            if state == TargetState.RUNNING:
                rec.state = KEPT
                await asyncio.to_thread(records.write, _path(rid), rec.to_json())
            elif state in (TargetState.ABORTED, TargetState.FAILED):
                await asyncio.to_thread(self._drop, rec)
            else:
                await backoff.asleep()

    def _of_move(self, move: str, netns: int | None) -> RedirectRecord | None:
        """The redirect that move `move` installed in that network namespace earlier, if any."""
        return next(
            (
                rec
                for _, rec in records.scan(self.folder, "*.json", RedirectRecord.from_json)
                if isinstance(rec, RedirectRecord) and rec.move == move and rec.netns == netns
            ),
            None,
        )

    def pending(self) -> list[str]:
        """At start-up: the redirects a previous agent left unsettled."""
        return [
            rec.id
            for _, rec in records.scan(self.folder, "*.json", RedirectRecord.from_json)
            if isinstance(rec, RedirectRecord) and rec.state == PENDING and rec.ticket is not None
        ]

    def tidy(self) -> None:
        """Kept redirects whose connections are all gone (the job ended) go too."""
        live = {(canonical(c.laddr.ip), c.laddr.port) for c in _tcp() if c.laddr}
        for _, rec in records.scan(self.folder, "*.json", RedirectRecord.from_json):
            if not isinstance(rec, RedirectRecord):
                continue
            if rec.pid is not None:  # a pod's: it goes with the pod's namespace
                try:
                    rec.where()
                except NamespaceGone:
                    _path(rec.id).unlink(missing_ok=True)
                continue
            if rec.state == KEPT and not any((la, lp) in live for la, lp, *_ in rec.rules):
                self._drop(rec)

    def kept(self) -> list[RedirectRecord]:
        """The kept redirects, oldest first (the order their rules act on the way out)."""
        return sorted(
            (
                rec
                for _, rec in records.scan(self.folder, "*.json", RedirectRecord.from_json)
                if isinstance(rec, RedirectRecord) and rec.state == KEPT
            ),
            key=lambda rec: rec.created,
        )

    @staticmethod
    def translate(
        conns: list[tuple[str, int, str, int]], kept: list[RedirectRecord]
    ) -> list[tuple[str, int, str, int]]:
        """Each connection with its remote as the `kept` redirects make it (stacked, oldest first)."""
        out = []
        for la, lp, ra, rp in conns:
            for rec in kept:
                for a, p, old, q, new in rec.rules:
                    if (a, p, old, q) == (la, lp, ra, rp):
                        ra = str(new)
            out.append((la, lp, ra, rp))
        return out


def _tcp() -> list[sconn]:
    with contextlib.suppress(psutil.Error, OSError):
        return psutil.net_connections(kind="tcp")
    return []
