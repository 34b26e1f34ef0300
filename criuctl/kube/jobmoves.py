"""A rank of a multi-worker job moved through its successor pod: its TCP connections follow it.

A PyTorchJob's worker holds connections to every other rank (the rendezvous store, gloo's pairs).
Its successor pod gets a new address on its new node, so when the worker's bundle is restored
there, every connection must be re-pointed on both ends without either end seeing a reset, and
without stopping the ranks that stay (criuctl.client.jobmove does the same for ranks on hosts):

    dump        (the preStop, criuctl.kube.prestop) the pod's address and connections go into the
                move record; the connections are dumped established. CRIU's network lock holds
                them in the old pod's namespace until it ends with the pod: no reset from there
    cut         in the successor's network namespace, before anything else: every packet of the
                connections in their new form is dropped, so a peer's retransmission never meets
                a kernel without the socket (which would answer with a reset)
    redirect    in each staying peer pod's namespace (through its node's agent): a stateless
                translation of the old address to the new one, out and back (criuctl.net.netcut)
    restore     the bundle, its socket image re-addressed to the successor's address (a copy,
                after the signature was checked: criuctl.local.restoring)
    run         the cut lifts, the redirects are kept for the job's life (they end with the pods)
    on failure  the redirects go and the cut lifts; the restore falls back to the other copy
                (criuctl.kube.successors), which does all this again for its own address

The ranks that stay are never stopped: their TCP retransmits into the gap and reaches the new pod
once the redirect is in place. A connection whose far end is no pod of the cluster (a database
outside) cannot follow: it is reset when the moved rank sends on it, and said in an Event.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import time
from dataclasses import dataclass, field

from criuctl.agent.messages import BraceAnswer, BraceRequest, RedirectAnswer, RedirectRequest, Rows
from criuctl.client.agents import AgentClient, AgentError
from criuctl.core.errors import CriuctlError
from criuctl.core.retry import Backoff
from criuctl.kube import moves, mutate
from criuctl.kube.cluster import Cluster, agent_of, call, container_id, workload_row
from criuctl.net import netcut
from criuctl.net.peers import Endpoints

log = logging.getLogger("criuctl.kube")

PEER_AGENT_WAIT = 120.0  # a staying peer's agent silent this long leaves its redirect's record as it was


@dataclass
class PeerRedirect:
    pod: str  # NAMESPACE/POD of the rank that stays
    node: str
    workload: str  # a workload of that pod on its node's agent: its network namespace
    rules: Rows = field(default_factory=list)  # [[local, port, old remote, port, new remote], ...]
    id: str = ""  # the agent's redirect, once installed


@dataclass
class Rewire:
    """What the restore of a job's rank at `new` needs: its images' new addresses, its cut, its
    peers' redirects; and the connections no pod holds the far end of."""

    old: str
    new: str
    readdress: Rows  # [[old address, port, new address], ...]
    cut: list[tuple[str, int, str, int]]
    peers: list[PeerRedirect]
    foreign: list[str]  # "ADDRESS:PORT" of connections that cannot follow


def _loopback(addr: str) -> bool:
    return ipaddress.ip_address(addr).is_loopback


def plan(c: Cluster, m: moves.Move, new: str) -> Rewire | None:
    """The rewiring of move `m`'s rank into a pod at address `new`; None for a pod with no
    connection to another pod (it moves as any pod)."""
    if not m.tcp or not m.address:
        return None
    ends = Endpoints.from_json(json.loads(m.tcp))
    old = m.address
    local = {(la, lp) for la, lp, _, _ in ends.connections} | set(ends.listening)
    readdress: Rows = [[a, p, new] for a, p in sorted(local) if a == old]
    readdress += json.loads(m.rewired or "[]")  # peers moved before it: as its redirects had them
    by_ip: dict[str, dict] = {}
    for p in call(
        "the pods", c.core.list_pod_for_all_namespaces, field_selector="status.phase=Running"
    ).items:
        pod = c.serialize(p)
        ip = pod["status"].get("podIP")
        # a peer being deleted still runs (its preStop waits for this move: criuctl.kube.prestop)
        if (
            ip
            and not pod["spec"].get("hostNetwork")
            and (ip not in by_ip or not pod["metadata"].get("deletionTimestamp"))
        ):
            by_ip[ip] = pod
    cut: list[tuple[str, int, str, int]] = []
    peers: dict[str, PeerRedirect] = {}
    foreign: list[str] = []
    for la, lp, ra, rp in ends.connections:
        if _loopback(ra):
            continue
        cut.append((new if la == old else la, lp, ra, rp))
        peer = by_ip.get(ra)
        if peer is None:
            foreign.append(f"{ra}:{rp}")
            continue
        key = f"{peer['metadata']['namespace']}/{peer['metadata']['name']}"
        if key not in peers:
            ctr = next((x for x in peer["spec"]["containers"] if mutate.is_wrapped(x)), None)
            ctr = ctr or peer["spec"]["containers"][0]
            cid = container_id(peer, ctr["name"])
            node = peer["spec"]["nodeName"]
            row = workload_row(_agent(c, node).node, cid) if cid else None
            if row is None:
                foreign.append(f"{ra}:{rp} (pod {key}: its agent does not list it)")
                continue
            peers[key] = PeerRedirect(key, node, row["name"])
        peers[key].rules.append([ra, rp, old, lp, new])
    return Rewire(old, new, readdress, cut, list(peers.values()), foreign)


def brace(c: Cluster, m: moves.Move) -> int:
    """Before the rank freezes: each staying peer's connections to it retransmit at least every
    second while it is away (criuctl.net.rto), so that the rank restored is heard from at once
    instead of at the peers' next doubled try. Best effort: a peer not reached (its agent, a
    kernel without the option) only resumes later. The sockets bounded."""
    try:
        rw = plan(c, m, m.address)
    except CriuctlError as exc:  # never a reason to stop the move: it only resumes later
        log.warning("peers not braced", extra={"pod": f"{m.namespace}/{m.pod}", "why": exc.line()})
        return 0
    done = 0
    for pr in rw.peers if rw else []:
        body = BraceRequest(connections=[r[:4] for r in pr.rules])
        try:
            answer: BraceAnswer = _agent(c, pr.node).post(f"/v1/workloads/{pr.workload}/brace", body)
        except CriuctlError as exc:
            log.warning("peer not braced", extra={"pod": pr.pod, "node": pr.node, "why": exc.line()})
            continue
        if answer.get("why_not"):
            log.info("peer not braced", extra={"pod": pr.pod, "node": pr.node, "why": answer["why_not"]})
        done += int(answer.get("sockets") or 0)
    return done


def container_pid(agent: AgentClient, cid: str) -> int | None:
    """The PID of container `cid` as its node's agent sees it (an empty placeholder too, which is
    no workload): a process in the pod's network namespace."""
    rows = agent.get("/v1/containers")
    return next((int(r["root_pid"]) for r in rows if r.get("container") == cid and r.get("root_pid")), None)


def prepare(c: Cluster, rw: Rewire, ident: str, pid: int) -> None:
    """The cut in the successor's namespace (process `pid`'s), then every peer's redirect. On any
    failure what was done is undone and the error raised: the restore must not go on. Done again
    for the same move (`ident`; the holder's agent restarted before its restore), the cut gets the
    same rules and each peer's agent answers with the redirect it installed the first time."""
    netcut.cut(ident, rw.cut, pid)
    try:
        for pr in rw.peers:
            answer: RedirectAnswer = _agent(c, pr.node).post(
                "/v1/redirects", RedirectRequest(rules=pr.rules, workload=pr.workload, move=ident)
            )
            pr.id = answer["id"]
    except CriuctlError:
        undo(c, rw, ident, pid)
        raise


def _agent(c: Cluster, node: str) -> AgentClient:
    return AgentClient(agent_of(c, node), timeout=30)


def undo(c: Cluster, rw: Rewire, ident: str, pid: int | None) -> None:
    """The restore failed: the peers' redirects go (their packets go back to the old address,
    where the rank comes back), and the cut lifts."""
    for pr in rw.peers:
        if pr.id:
            _peer_answers(c, pr, "delete", f"/v1/redirects/{pr.id}")
            pr.id = ""
    if pid is not None:
        with contextlib.suppress(CriuctlError, ValueError):
            netcut.remove(netcut.CUT + ident, pid)


def commit(c: Cluster, rw: Rewire, ident: str, pid: int) -> None:
    """The rank runs in its successor: its peers' redirects are kept, its cut lifts."""
    with contextlib.suppress(CriuctlError):
        netcut.remove(netcut.CUT + ident, pid)
    for pr in rw.peers:
        _peer_answers(c, pr, "post", f"/v1/redirects/{pr.id}/keep")


def _peer_answers(c: Cluster, pr: PeerRedirect, method: str, path: str) -> bool:
    """Keep or remove a staying peer's redirect, asking again while its agent does not answer.

    The rules live in the peer pod's namespace whatever its agent does, but only the agent's record
    says what they are: a redirect left pending is missing from the job's listing and from the next
    move's re-addressing (that rank's connection would then point at an address nobody has), and the
    rules of a failed move must be gone before the rank comes back at its old address. A restarting
    agent (its DaemonSet's pod killed) answers again within seconds. An answer that refuses (the
    pod and its redirect are gone: 404) settles it too. False, logged, when it stays silent."""
    deadline, backoff = time.monotonic() + PEER_AGENT_WAIT, Backoff(cap=5.0, first=0.5)
    while True:
        try:
            getattr(_agent(c, pr.node), method)(path)
            return True
        except AgentError as exc:
            if exc.status < 500:
                return False
            err: CriuctlError = exc
        except CriuctlError as exc:
            err = exc
        if time.monotonic() > deadline:
            log.warning(
                "peer's redirect not settled",
                extra={"pod": pr.pod, "node": pr.node, "redirect": pr.id, "why": err.line()},
            )
            return False
        backoff.sleep()
