"""`criuctl migrate` of ranks of a multi-node job: the moved ranks go, their connections follow.

A rank that moves gets its new node's address. Its peers must reach it there without a reset and
without a new rendezvous, so the move is one plan (`plan`) executed in phases across all moved
ranks (`execute`), each rank going through the same exactly-once migration as a single workload
(`criuctl.client.migrate.Move`):

    phase      moved rank (its source and target)           ranks that stay (their nodes)
    -------    ------------------------------------------   ------------------------------------
    prepare    target: make room, *cut* the rank's          bound the backoff of their connections
               connections in their new form off            to it (`criuctl.net.rto`)
    send       freeze without a step boundary; every        keep running (TCP retransmits into
               endpoint of a moved rank re-addressed in     the gap: the source's network lock
               the images; stream                           and the cut drop it, nobody resets)
    redirect   —                                            redirect each connection to a moved
                                                            rank to its new address (follows that
                                                            rank's migration: `redirects`)
    restore    target: restore stopped, behind the cut      —
    commit     every target runs, then every cut lifts,     redirects kept for the job's life
               every source ends
    on failure before commit: every target aborts (its copy dies behind its cut), every source
    thaws, every redirect goes, every cut lifts: the whole job runs on its old nodes.

Ranks that stay are never frozen or dumped: only their peer's address changes, which a stateless
translation on their node does (`criuctl.net.netcut`), so the job's downtime is the moved ranks'.
"""

from __future__ import annotations

import contextlib
import ipaddress
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from criuctl.agent import points
from criuctl.agent.messages import BraceRequest, RedirectAnswer, RedirectRequest, Rows
from criuctl.agent.protocol import Point
from criuctl.client.agents import AgentClient, Node, get_node
from criuctl.client.jobs import Job, Rank
from criuctl.client.migrate import STOP_AND_COPY, MigrationFailed, MigrationInDoubt, MigrationResult, Move
from criuctl.core.errors import CriuctlError
from criuctl.net.readdress import EndpointMap

Progress = Callable[..., None]


@dataclass
class RankMove:
    rank: Rank
    source: Node
    target: Node
    old: str  # the rank's address on its node
    new: str  # its address on the target
    cut: Rows = field(default_factory=list)  # its connections as the target will see them


@dataclass
class Redirect:
    node: Node
    rank: str  # the moved rank the rules follow
    rules: Rows  # [[local, port, old remote, port, new remote], ...]


@dataclass
class Brace:
    """A staying rank's connections to the moving ranks, their backoff bounded before the freeze
    (criuctl.net.rto: the rank restored is heard from within a second, not at TCP's next try)."""

    node: Node
    workload: str
    connections: Rows  # [[local, port, remote, port], ...]


@dataclass
class JobPlan:
    job: Job
    moves: list[RankMove]
    endpoints: EndpointMap
    redirects: list[Redirect]
    braces: list[Brace] = field(default_factory=list)


@dataclass
class JobMoveResult:
    job: str
    ranks: list[MigrationResult]
    # the first moved rank frozen → the last running on its new node, on the client's clock: the
    # ranks that stay wait for the moved ones in their collectives from the first freeze on
    downtime_seconds: float
    total_seconds: float
    redirects: int  # redirect rule sets installed on nodes of ranks that stay


def _node_local(addr: str) -> bool:
    """A specific address of a node (not loopback, not a wildcard): it cannot stay behind when a
    rank leaves the node."""
    ip = ipaddress.ip_address(addr)
    return not (ip.is_loopback or ip.is_unspecified)


def _address(rank: Rank) -> str:
    """The address a rank's connections leave from (its node's): one, or the plan cannot be made."""
    found = {la for la, _, _, _ in rank.tcp.connections if not ipaddress.ip_address(la).is_loopback}
    if len(found) != 1:
        raise MigrationFailed(
            f"rank {rank.label} talks from {len(found)} addresses ({', '.join(sorted(found)) or 'none'})",
            "criuctl moves a rank whose connections leave from one IPv4 address; nothing was frozen",
        )
    addr = found.pop()
    if ipaddress.ip_address(addr).version != 4:
        raise MigrationFailed(
            f"rank {rank.label} talks over IPv6 ({addr})", "only IPv4 jobs move for now; nothing was frozen"
        )
    return addr


def plan(job: Job, wanted: dict[str, str], silent: Collection[str] = ()) -> JobPlan:
    """Check a move of `wanted` (rank workload → node) and work out every rule it needs. `silent`:
    the nodes that did not answer the survey a moment ago (a target among them fails at once
    rather than after each step's own connect timeout)."""
    for link in job.foreign:
        la, lp, ra, rp = link.conn
        raise MigrationFailed(
            f"rank {link.rank.label} has a connection to {ra}:{rp}, which is not a criuctl workload",
            "its far end would not follow the move; end that connection, or run that peer under "
            "`criuctl run` too; nothing was frozen",
        )
    moves: list[RankMove] = []
    for name, node in wanted.items():
        rank = job.rank(name)
        if rank is None:
            raise MigrationFailed(
                f"{name!r} is not a rank of job {job.name} (ranks: {', '.join(r.label for r in job.ranks)})",
                "name a rank as NAME=NODE; nothing was frozen",
            )
        target = get_node(node)
        if target.name in silent:
            raise MigrationFailed(
                f"node {node} ({target.url}) did not answer when the job's nodes were asked a moment ago",
                "check that its agent runs and the network between here and there; nothing was frozen",
            )
        if target.name == rank.node:
            raise MigrationFailed(f"rank {name!r} already runs on node {node}", "pick another node")
        new = target.host
        try:
            ipaddress.IPv4Address(new)
        except ValueError:
            raise MigrationFailed(
                f"node {node}'s agent address {new!r} is not an IPv4 address",
                "add the node by the IPv4 address its workloads use (criuctl node add NAME URL)",
            ) from None
        moves.append(RankMove(rank, get_node(rank.node), target, _address(rank), new))
    moving = {m.rank.workload: m for m in moves}
    for link in job.links:  # a loopback connection cannot stretch across nodes
        if ipaddress.ip_address(link.conn[2]).is_loopback and link.peer is not link.rank:
            a, b = link.rank.workload, link.peer.workload if link.peer else ""
            if (a in moving) != (b in moving) or (a in moving and moving[a].target != moving[b].target):
                raise MigrationFailed(
                    f"ranks {a} and {b} talk over loopback on node {link.rank.node}",
                    "move them together to one node, or have them use the node's address; nothing was frozen",
                )
    # Every endpoint of a moving rank on its node moves with it: its connections (all from `old`)
    # and what it listens on, on `old` or on another address of that node (a rank moved once keeps
    # its connections' first address, and may then listen on its new node's own)
    endpoints = EndpointMap(
        {
            (la, lp): m.new
            for m in moves
            for la, lp in [*(c[:2] for c in m.rank.tcp.connections), *m.rank.tcp.listening]
            if _node_local(la)
        }
    )
    for m in moves:
        for la, lp, ra, rp in m.rank.tcp.connections:
            if not ipaddress.ip_address(ra).is_loopback:
                m.cut.append([endpoints.moves.get((la, lp), la), lp, endpoints.moves.get((ra, rp), ra), rp])
    redirects: dict[tuple[str, str], Redirect] = {}
    braces: dict[tuple[str, str], Brace] = {}
    for link in job.links:
        if link.rank.workload in moving or link.peer is None or link.peer.workload not in moving:
            continue
        la, lp, ra, rp = link.conn
        braces.setdefault(
            (link.rank.node, link.rank.workload), Brace(get_node(link.rank.node), link.rank.workload, [])
        ).connections.append([la, lp, ra, rp])
        m = moving[link.peer.workload]
        r = redirects.setdefault(
            (link.rank.node, m.rank.workload), Redirect(get_node(link.rank.node), m.rank.workload, [])
        )
        if (ra, rp) not in endpoints.moves:  # the nodes answered at different moments
            raise MigrationFailed(
                f"rank {link.rank.workload} reaches rank {m.rank.workload} at {ra}:{rp}, which is not an "
                f"endpoint that moves with it (its connections leave from {m.old})",
                "run the move again (the nodes answer a moment apart; a connection may have come or gone); "
                "nothing was frozen",
            )
        r.rules.append([la, lp, ra, rp, endpoints.moves[(ra, rp)]])
    return JobPlan(job, moves, endpoints, list(redirects.values()), list(braces.values()))


def _quiet(_phase: str, **_facts: object) -> None:
    pass


def _for_rank(progress: Progress, rank: str) -> Progress:
    return lambda phase, **facts: progress(phase, rank=rank, **facts)


def _each(fn: Callable[[Move], None], moves: list[Move]) -> dict[str, CriuctlError]:
    """Run one phase for every rank at once; the ranks it failed for, with why."""

    def one(m: Move) -> CriuctlError | None:
        try:
            fn(m)
        except CriuctlError as exc:
            return exc
        return None

    with ThreadPoolExecutor(max_workers=len(moves)) as pool:
        errors = list(pool.map(one, moves))
    return {m.name: e for m, e in zip(moves, errors, strict=True) if e is not None}


def execute(p: JobPlan, progress: Progress = _quiet, mode: str | None = STOP_AND_COPY) -> JobMoveResult:
    """Move every rank of the plan, or none: on any failure before the commit the job runs on as before."""
    started = time.monotonic()
    table = p.endpoints.to_json()
    moves: list[Move] = []
    installed: list[tuple[Redirect, str]] = []
    for rm in p.moves:  # prepare: nothing is frozen yet
        name = rm.rank.workload
        leader = moves[0].ticket if moves else None  # committed first: it decides for the others
        m = Move(
            name,
            rm.source,
            rm.target,
            mode,
            _for_rank(progress, name),
            readdress=table,
            boundary=False,
            cut=rm.cut,
            follow=leader,
        )
        try:
            m.prepare()
        except CriuctlError as exc:
            raise _roll_back(p, moves, [], {f"rank {name}": exc}) from exc
        moves.append(m)
    for b in p.braces:  # best effort: a staying rank not braced only resumes later
        with contextlib.suppress(CriuctlError):
            AgentClient(b.node).post(
                f"/v1/workloads/{b.workload}/brace", BraceRequest(connections=b.connections)
            )
    try:
        failed = {f"rank {k}": v for k, v in _each(Move.send, moves).items()}
        if not failed:
            for r in p.redirects:
                m = next(m for m in moves if m.name == r.rank)
                assert m.ticket is not None
                body = RedirectRequest(rules=r.rules, ticket=m.ticket.to_json())
                answer: RedirectAnswer = AgentClient(r.node).post("/v1/redirects", body)
                installed.append((r, answer["id"]))
            points.reach(Point.CLIENT_REDIRECTED)
            failed = {f"rank {k}": v for k, v in _each(Move.restore, moves).items()}
    except CriuctlError as exc:  # a redirect could not be installed
        failed = {"the redirect of a rank that stays": exc}
    if failed:
        raise _roll_back(p, moves, installed, failed)
    for m in moves:  # every rank has been restored, stopped: now they run, the first one first
        m.commit_target()
    for m in moves:
        with contextlib.suppress(CriuctlError):  # its target lifted it on commit; this is a retry
            m.dst.delete(f"/v1/incoming/{m.inc_id}/cut")
    for r, rid in installed:
        with contextlib.suppress(CriuctlError):  # unkept, it settles with the rank's target itself
            AgentClient(r.node).post(f"/v1/redirects/{rid}/keep")
    for m in moves:
        m.commit_source()
    results = [m.result() for m in moves]
    first_frozen = min(m.frozen_at if m.frozen_at is not None else m.started for m in moves)
    last_running = max(m.running_at for m in moves if m.running_at is not None)
    return JobMoveResult(
        p.job.name, results, last_running - first_frozen, time.monotonic() - started, len(installed)
    )


def _roll_back(
    p: JobPlan, moves: list[Move], installed: list[tuple[Redirect, str]], failed: dict[str, CriuctlError]
) -> CriuctlError:
    """Every moved rank back where it was (targets first), then the redirects, then the cuts."""
    doubt: list[str] = []
    for m in moves:
        err = m.undo(failed.get(f"rank {m.name}") or CriuctlError("another rank failed"))
        if isinstance(err, MigrationInDoubt):
            doubt.append(m.name)
    pointed = False  # a redirect may still send a staying rank's packets to a moved rank's new node
    for r, rid in installed:
        try:
            AgentClient(r.node).delete(f"/v1/redirects/{rid}")
        except CriuctlError:  # its agent removes it once it hears the target aborted
            pointed = True
    for m in moves if not pointed else ():  # else the cut stays (2 leases) so nothing answers a reset
        with contextlib.suppress(CriuctlError):
            m.dst.delete(f"/v1/incoming/{m.inc_id}/cut")
    where, exc = next(iter(failed.items()))
    if doubt:
        return MigrationInDoubt(
            f"{where}: {exc.what}",
            f"ranks {', '.join(doubt)} stay frozen until their agents hear from the targets; "
            f"see `criuctl ps`",
        )
    back = f"every rank of job {p.job.name} runs on its old node"
    return MigrationFailed(f"{where}: {exc.what}", f"{exc.hint}; {back}" if exc.hint else back)
