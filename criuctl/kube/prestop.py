"""A migratable pod is being deleted: checkpoint its job and keep the bundle where its successor
will run (drain, eviction, and `criuctl migrate` of a controller's pod all come through here).

The kubelet calls this from the pod's preStop hook (criuctl.kube.mutate.prestop_hook) at the pod's
IP, where the node agent listens (criuctl.kube.nodeside.PodHooks), or on the agent's loopback
port, before it sends the container SIGTERM. The call carries no credentials
(Kubernetes 1.20's kubelet sends none), so it is authorised by the API server's own word: the pod
exists, on this node, and is being deleted. Checkpointing it then does nothing its deletion would
not do, except keep the job.

    requested?  `criuctl migrate` left a record naming the target: use it. Otherwise only a pod
                whose controller wants it back under its name is kept (owners.py), on the Ready,
                schedulable node with an agent and the most free memory.
    dumping     record first (with the bundle's id), then the source agent checkpoints the
                container into that bundle: the tree ends, the job now lives in the bundle.
                Post-copy (the default where both nodes have userfaultfd): the bundle holds all
                but the memory pages, which the dump goes on serving from this node, over TLS to
                the target's (and this node's own) page client only (criuctl.agent.pageserving)
    kept        the bundle is copied to the target's agent, which verifies it; on failure the
                source's own copy is the one kept. Both copies stay until a restore commits
                (post-copy: until its last page is in).

Anything refused or failed before the dump commits leaves the job to end with its pod, as it would
without criuctl: its controller starts it over; nothing runs twice.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import platform
import time
import uuid

from criuctl.agent.messages import CheckpointAnswer, CheckpointRequest, LazyRequest, NodeInfo, PageClient
from criuctl.agent.protocol import Mode
from criuctl.client.agents import AgentClient, AgentError, Node
from criuctl.core.errors import CriuctlError
from criuctl.kube import (
    events,
    jobfailures,
    jobmoves,
    moves,
    mutate,
    owners,
    podmigrations,
    podplan,
    podvolumes,
)
from criuctl.kube.cluster import Cluster, agent_for, agent_of, call, container_id, delete_now, workload_row
from criuctl.local import exitwrites
from criuctl.net import peers

log = logging.getLogger("criuctl.kube")

CHECKPOINT_TIMEOUT = 600.0  # the agent's own freeze timeout is shorter: this only bounds a dead link
PEER_WAIT = 180.0  # of the preStop's 300 s (mutate.PRESTOP_GRACE), for the peers moving before it
INFO_TIMEOUT = 10.0  # an agent's /v1/info, a page-client certificate


class Refused(CriuctlError):
    """The call is not the kubelet's for a pod being deleted on this node."""


def _target(c: Cluster, pod: dict, source: str, needed: int) -> str:
    """The node the job goes to when nobody chose one: Ready, schedulable, its volumes reach it
    (criuctl.kube.podvolumes), an agent, room."""
    best: tuple[int, str] | None = None
    claims, pvs = podvolumes.fetch(c, pod)
    for n in call("the nodes", c.core.list_node).items:
        node = c.serialize(n)
        name = node["metadata"]["name"]
        if name == source or node["spec"].get("unschedulable") or not podplan.ready(node):
            continue
        if podvolumes.check(pod, node, claims, pvs) is not None:
            continue
        free = podplan.free_memory(c, node)
        if free < needed:
            continue
        try:
            agent_for(c, node)
        except CriuctlError:
            continue
        if best is None or free > best[0]:
            best = (free, name)
    if best is None:
        raise CriuctlError(
            f"no node can take pod {pod['metadata']['name']}",
            "none is Ready, schedulable, reached by its volumes, with an agent and the memory",
        )
    return best[1]


def _remotes(row: dict) -> set[str]:
    """The peer addresses of a rank's connections, as its sockets hold them and as redirected."""
    tcp = peers.Endpoints.from_json(row.get("tcp"))
    return {ra for _, _, ra, _ in tcp.connections} | {str(r[0]) for r in row.get("redirected") or []}


def take_turn(m: moves.Move, others: list[moves.Move]) -> int:
    """A rank's turn among the moves on record (its own written first with turn 0, "choosing"):
    one more than any other's. Chosen from what was read after its own record was written, so of
    two ranks moving at once, the later to read sees the other, and takes a later turn or waits
    for it to choose: a bakery (Lamport's), where a clock ("since") let both go first when one's
    record was written after the other's check (`test_two_ranks_moving_at_once_never_dump_together`)."""
    return 1 + max((o.turn for o in others if o.key != m.key), default=0)


def ahead(m: moves.Move, others: list[moves.Move], remotes: set[str]) -> list[moves.Move]:
    """The moves of `m`'s peers (their addresses among its connections' remotes) that dump before
    it: those still choosing their turn, and those with an earlier one (then the bundle's id)."""
    return [
        o
        for o in others
        if o.key != m.key
        and o.phase in (moves.Phase.DUMPING, moves.Phase.KEPT)
        and o.address in remotes
        and (o.turn == 0 or (o.turn, o.bundle) < (m.turn, m.bundle))
    ]


def _after_peers(c: Cluster, m: moves.Move, src: Node, cid: str, row: dict) -> moves.Move:
    """One rank of a job after another: a rank whose peer is moving (a drain evicts every pod of a
    node at once) waits until that peer runs again, in the order of their turns (`take_turn`),
    then reads its connections again. Its peer's move has redirected them by then
    (criuctl.kube.jobmoves), so its own move re-points them to where the peer is now; two peers
    moved at once would each re-point the other's old address, and their connection breaks. The
    rank runs all the while: only the order of the dumps changes. `row` is its agent's row as `m`
    was written from (with turn 0); `m` comes back with its turn."""
    m.turn = take_turn(m, moves.every(c))
    m = moves.save(c, m)
    deadline = time.monotonic() + PEER_WAIT
    waited = False
    while True:
        first = ahead(m, moves.every(c), _remotes(row))
        if not first or time.monotonic() > deadline:
            break
        log.info("waiting for a peer's move", extra={"pod": m.name, "peer": first[0].name})
        time.sleep(1)
        row, waited = workload_row(src, cid) or {}, True
    if not waited:
        return m
    if first:
        log.warning("a peer's move did not end in time", extra={"pod": m.name, "peer": first[0].name})
    m.tcp = json.dumps(peers.Endpoints.from_json(row.get("tcp")).to_json())
    m.rewired = json.dumps(row.get("redirected") or [])
    return moves.save(c, m)


def leaving(c: Cluster, namespace: str, ident: str, node: str) -> str:
    """What became of the job of pod NAMESPACE/IDENT (its identity, criuctl.kube.owners: its name,
    or a JobSet pod's HOSTNAME.SUBDOMAIN), being deleted on `node` (this agent's)."""
    began = time.time()
    for kind, value in (("pod", ident), ("namespace", namespace)):
        podplan.check_name(kind, value)
    found = owners.pods_of(c, namespace, ident)
    if not found:
        return "the pod is gone: nothing to keep"
    mine = [p for p in found if p["spec"].get("nodeName") == node and p["metadata"].get("deletionTimestamp")]
    if len(mine) != 1:
        raise Refused(
            f"pod {namespace}/{ident} is not being deleted on node {node}",
            "only its kubelet's preStop hook calls this",
        )
    pod = mine[0]
    meta, name = pod["metadata"], pod["metadata"]["name"]
    wrapped = [ctr for ctr in pod["spec"]["containers"] if mutate.is_wrapped(ctr)]
    if len(wrapped) != 1:
        return "no single container under criuctl's init: it ends with its pod"
    move = moves.read(c, namespace, ident)
    if move is not None and move.uid != meta["uid"]:
        if move.phase in (moves.Phase.DUMPING, moves.Phase.KEPT):
            return f"this pod's predecessor's move is pending (bundle {move.bundle}): left alone"
        moves.forget(c, move)  # a finished or failed move of a predecessor
        move = None
    requested = move if move is not None and move.phase == moves.Phase.REQUESTED else None
    if move is not None and requested is None:
        return f"its move is already {move.phase}"
    if requested is None:
        o = owners.owner(c, pod)
        if o is None:
            return "no controller recreates it under its name: it ends with its pod"
        if not o.wants_back:
            return f"{o.why}: it ends with its pod"
    cid = container_id(pod, wrapped[0]["name"])
    if cid is None:
        return "its container does not run: nothing to keep"
    src = agent_of(c, node)
    row = workload_row(src, cid)
    if row is None or row.get("why_not"):
        why_not = row.get("why_not") if row is not None else None
        return f"nothing to checkpoint ({why_not or 'no job in the container'})"
    # a Job's pod out of its Job's count (a plain delete: before the Job looks, at best); where that
    # failed, marked for a podFailurePolicy that ignores it (criuctl.kube.jobfailures)
    if not jobfailures.untrack(c, pod):
        jobfailures.mark_moving(c, pod)
    needed = max(podplan.pod_memory(pod), int(row.get("rss_bytes") or 0))
    tcp = peers.Endpoints.from_json(row.get("tcp"))  # a job's rank: re-addressed where it is restored
    ranked = any(not ipaddress.ip_address(c[2]).is_loopback for c in tcp.connections)
    target = requested.target if requested else _target(c, pod, node, needed)
    dst = agent_of(c, target)
    m = moves.Move(
        namespace,
        ident,
        meta["uid"],
        node,
        wrapped[0]["name"],
        moves.Phase.DUMPING,
        target=target,
        bundle=uuid.uuid4().hex,
        since=requested.since if requested else time.time(),
        version=requested.version if requested else "",
        address=pod["status"].get("podIP") or "" if ranked else "",
        tcp=json.dumps(tcp.to_json()) if ranked else "",
        rewired=json.dumps(row.get("redirected") or []) if ranked else "",
        source_pod=name,
        selector=mutate.same_index(pod) if mutate.indexed(pod) else "",
        mode=requested.mode if requested else "",
        memory=int(row.get("rss_bytes") or 0),
    )
    m.stamps = json.dumps({"prestop": began})
    # Post-copy or not, asked of both agents before the record says `dumping`: an agent killed
    # from here until the dump's handoff starts ends the job with its pod (module docstring), so
    # nothing slow stands between the record and the dump.
    lazy = _lazy(c, m, pod, src, dst)
    m = moves.save(c, m)  # before the dump: a crash after it leaves the bundle's id on record
    if requested is None:  # a drain or an eviction: listed with every other move (a courtesy)
        try:
            podmigrations.record_drain(c, namespace, name, meta["uid"], node, target, ident)
        except CriuctlError as exc:
            log.warning("no PodMigration recorded", extra={"pod": f"{namespace}/{name}", "why": exc.what})
    events.record(c, pod, events.Reason.STARTED, f"deleted: checkpointing its job for node {target}")
    if ranked:
        m = _after_peers(c, m, src, cid, dict(row))
        m.braced = jobmoves.brace(c, m)
    moves.AT_WORK.add(m.bundle)
    try:
        return _checkpoint(c, m, pod, row, ranked, src, dst, lazy)
    finally:
        moves.AT_WORK.discard(m.bundle)


def _lazy(c: Cluster, m: moves.Move, pod: dict, src: Node, dst: Node) -> LazyRequest | None:
    """Post-copy, unless the move asked for stop-and-copy or a node cannot (no userfaultfd, or the
    target's agent does not answer): then stop-and-copy, said in the record and an Event. For
    post-copy, the target's page-client certificate for this bundle: the only one, with the
    source's own, that its page server will take."""
    if m.mode == Mode.STOP_AND_COPY:
        return None
    try:
        if not exitwrites.supported():
            raise CriuctlError(f"a served tree's exit cannot be disarmed on {platform.machine()} yet")
        for node in (src, dst):
            info: NodeInfo = AgentClient(node, timeout=INFO_TIMEOUT).get("/v1/info")
            if not info.get("lazy_pages"):
                raise CriuctlError(f"node {node.name} has no userfaultfd for CRIU's lazy pages")
        target = AgentClient(dst, timeout=INFO_TIMEOUT)
        me: PageClient = target.post(f"/v1/bundles/{m.bundle}/page-client", {})
        m.mode = Mode.POST_COPY
        return LazyRequest(clients=[me["cert"]])
    except CriuctlError as exc:
        m.mode, m.note = Mode.STOP_AND_COPY, f"post-copy could not run ({exc.what}): moved by stop-and-copy"
        events.record(c, pod, events.Reason.STARTED, m.note)
        return None


def _answers(node: Node) -> bool:
    try:
        AgentClient(node, timeout=INFO_TIMEOUT).get("/healthz")
    except CriuctlError:
        return False
    return True


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _checkpoint(
    c: Cluster,
    m: moves.Move,
    pod: dict,
    row: dict,
    ranked: bool,
    src: Node,
    dst: Node,
    lazy: LazyRequest | None,
) -> str:
    """Dump the job, delete its pod at once (its successor is made while the bundle is copied),
    copy the bundle to the target: `kept`. Post-copy: the bundle without its memory pages, which
    the source's dump goes on serving.

    A checkpoint that got no answer (this agent shut down under it, a link cut) is not a failure
    on record: its dump is a handoff outside the agent and may go on. The record stays `dumping`
    for the agent's loop (criuctl.kube.successors), which carries the bundle on if it was sealed
    and fails the move if the pod ended without one."""
    namespace, name, target = m.namespace, m.name, m.target
    source = AgentClient(src, timeout=CHECKPOINT_TIMEOUT)
    asked = CheckpointRequest(id=m.bundle, connections=ranked)
    if lazy is not None:
        asked["lazy"] = lazy
    try:
        try:
            out: CheckpointAnswer = source.post(f"/v1/workloads/{row['name']}/checkpoint", asked)
        except CriuctlError as exc:
            now = workload_row(src, str(row.get("container") or row["name"])) if lazy else None
            if now is None or now.get("state") != "running" or not now.get("alive"):
                raise
            # post-copy failed with the job whole and running (thawed): stop-and-copy, said so
            m.mode, m.note = Mode.STOP_AND_COPY, f"post-copy failed ({exc.what}): moved by stop-and-copy"
            events.record(c, pod, events.Reason.STARTED, m.note)
            asked.pop("lazy", None)
            out = source.post(f"/v1/workloads/{row['name']}/checkpoint", asked)
    except AgentError as exc:
        m.phase, m.note = (
            moves.Phase.FAILED,
            f"the checkpoint failed ({exc.what}); the job ended with its pod",
        )
        moves.save(c, m)
        events.record(c, pod, events.Reason.FAILED, m.note)
        raise
    except CriuctlError as exc:
        log.warning("checkpoint not answered", extra={"pod": f"{namespace}/{name}", "why": exc.line()})
        raise
    m.stamp("checkpoint")
    if "pages" in out:
        m.pages, m.page_cert = host_port(src.host, out["pages"]["port"]), out["pages"]["cert"]
    # Its job's tree has ended: nothing runs in the pod. Kubernetes 1.20's kubelet, finding the
    # container gone when its preStop returns, fails the kill and retries a minute later; the pod
    # would stay Terminating, its successor waiting, all that time. Deleted now, before the copy:
    # its controller makes the successor (pinned to the target while the record is `dumping`)
    # while the bundle travels.
    try:
        delete_now(c, pod)
        m.stamp("deleted")
    except CriuctlError as exc:  # its kubelet ends it, a minute later: so does the successor come
        why = exc.line()
        log.warning("pod not deleted before the copy", extra={"pod": f"{namespace}/{name}", "why": why})
    m.freeze = float(out["freeze_seconds"])
    try:
        m.size = source.copy_bundle(m.bundle, AgentClient(dst, timeout=CHECKPOINT_TIMEOUT))
        m.holder = target
    except CriuctlError as exc:
        if not _answers(src):  # this node's agent went away under the copy (a restart, a rollout):
            # the record stays `dumping`, and the restarted agent's loop carries the bundle on
            # (criuctl.kube.successors); keeping it here would give up a move nothing stops
            log.warning(
                "copy cut by the agent's end", extra={"pod": f"{namespace}/{name}", "why": exc.line()}
            )
            raise
        m.holder = m.source
        m.note = f"not copied to node {target} ({exc.what}): restored on node {m.source}"
        events.record(c, pod, events.Reason.FAILED, m.note)
    m.phase = moves.Phase.KEPT
    m.stamp("kept")
    moves.save(c, m)
    log.info("kept", extra={"pod": f"{namespace}/{name}", "bundle": m.bundle, "holder": m.holder})
    return f"checkpointed into bundle {m.bundle}, kept on node {m.holder}"
