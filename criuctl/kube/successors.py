"""Each node agent's loop over the pending moves (criuctl.kube.moves): restore a kept bundle into
the successor pod its controller recreated, which the webhook pinned here as a placeholder.

Level-triggered, every few seconds, from the records alone, so that an agent restarted at any
instant picks up where the last one was. For a record whose bundle this node holds:

    no successor yet           wait (the old pod is still going, or the controller is slow);
                               after GIVE_UP with none, the move is failed and the bundle kept
    successor not a placeholder   created without criuctl's webhook: it started the job over.
                               The bundle must never run beside it: the move fails, bundle kept
    placeholder on another node   (pinned before the holder changed) deleted while empty, so the
                               controller recreates it and the webhook pins it here
    placeholder here, running  (its container found through this node's runtime by the pod's UID,
                               its init listening: not the kubelet's status, a relist later)
                               restore the bundle into it (the agent uses the bundle up before
                               the copy may run: it never restores twice); done: provenance on
                               the pod, Events, the other copy deleted, the record forgotten
    post-copy                  the restore pulls the memory pages from the source's page server
                               (`pulling`): the record stays, its progress the restored job's
                               RSS, until the last page is in (then done, as above, and the
                               source's server ends by itself); a pull that failed ended the job
                               (its memory was incomplete): the move fails, the source's server
                               is stopped, and the successor starts over
    restore failed             the other copy (the source's) becomes the holder, the empty
                               placeholder is deleted: the job comes back on the source node
                               (post-copy: its restore pulls the pages from its own node)
A record stuck in `dumping` whose preStop's agent died mid-way is settled by the source node: its
bundle there means the dump committed (copied on, kept), none once the pod is gone means the job
ended with its pod (failed; the successor starts over). A pod still there with its bundle sealed
runs nothing any more: it is deleted at once, as its preStop would have done next, so that its
successor does not wait for its kubelet (a preStop call its dead agent never answered holds the
kill for the whole grace period, and Kubernetes 1.20's kubelet retries a failed kill a minute later).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import time

from criuctl.agent import points
from criuctl.agent.messages import BundleRestoreRequest, PagesServed
from criuctl.agent.protocol import Mode, Point
from criuctl.client.agents import AgentClient, AgentError
from criuctl.core import workloads
from criuctl.core.errors import CriuctlError
from criuctl.kube import events, jobmoves, moves, mutate, owners, prestop
from criuctl.kube.cluster import Cluster, agent_of, call, container_id, delete_now, workload_row

log = logging.getLogger("criuctl.kube")

GIVE_UP = 3600.0  # a kept bundle whose pod never came back: failed, bundle kept for `criuctl restore`
FORGET_FAILED = 24 * 3600.0  # a failed move's record is kept this long for `kubectl get cm`
RESTORE_TIMEOUT = 900.0


def _agent(c: Cluster, node: str) -> AgentClient:
    return AgentClient(agent_of(c, node), timeout=30)


def _holds_job(c: Cluster, node: str, cid: str) -> bool:
    """Whether container `cid` on `node` runs a job (restored into it), not an empty placeholder."""
    row = workload_row(_agent(c, node).node, cid)
    return row is not None and row.get("state") == "running" and not row.get("why_not")


def _pod(c: Cluster, m: moves.Move) -> dict | None:
    """The pod of the move's identity: its successor once there is one, else the source pod."""
    return owners.current(c, m.namespace, m.pod, not_uid=m.uid, selector=m.selector)


def _fail(c: Cluster, m: moves.Move, why: str, pod: dict | None) -> None:
    """Nothing more will be tried. A successor left an empty placeholder is deleted, so that its
    controller makes an ordinary pod (the webhook ignores a failed move) and the job starts over:
    progress lost, but never a pod waiting forever for a restore that will not come. A post-copy
    bundle's pages stop being served: nothing will pull them now."""
    m.phase, m.note = moves.Phase.FAILED, why
    moves.save(c, m)
    if m.pages:
        with contextlib.suppress(CriuctlError):
            _agent(c, m.source).delete(f"/v1/bundles/{m.bundle}")
    if pod is not None:
        events.record(c, pod, events.Reason.FAILED, why)
        if mutate.is_placeholder(pod) and pod["metadata"]["uid"] != m.uid:
            ctr = next((x for x in pod["spec"]["containers"] if mutate.is_wrapped(x)), None)
            cid = container_id(pod, ctr["name"]) if ctr else None
            node = pod["spec"].get("nodeName")
            if cid is None or not node or not _holds_job(c, node, cid):
                delete_now(c, pod)
    log.warning("move failed", extra={"pod": f"{m.namespace}/{m.pod}", "why": why})


def _finish(c: Cluster, m: moves.Move, pod: dict, node: str) -> None:
    stamp = {
        "metadata": {
            "annotations": {
                events.MIGRATED_FROM: f"{m.namespace}/{m.name}@{m.source}",
                events.MIGRATED_AT: events.now(),
            }
        }
    }
    call("the new pod", c.core.patch_namespaced_pod, pod["metadata"]["name"], m.namespace, stamp)
    steps = m.breakdown()
    took = "; ".join(f"{step} {seconds:.2f} s" for step, seconds in steps)
    said = f"restored on node {node} from node {m.source} (bundle {m.bundle}){f': {took}' if took else ''}"
    if m.braced:
        said += f"; {m.braced} of the staying ranks' connections to it retransmitted at least every second"
    if m.note:  # stop-and-copy where post-copy could not run; a job that ended before its pull
        said += f"; {m.note}"
    events.record(c, pod, events.Reason.MIGRATED, said)
    for other in {m.source, m.target} - {node, ""}:
        # a copy left on a node that is down stays there, root-only
        with contextlib.suppress(CriuctlError):
            _agent(c, other).delete(f"/v1/bundles/{m.bundle}")
    moves.forget(c, m)
    log.info(
        "restored",
        extra={"pod": f"{m.namespace}/{m.pod}", "bundle": m.bundle, "node": node, "steps": dict(steps)},
    )


def _settle_dumping(c: Cluster, m: moves.Move, node: str) -> None:
    if m.bundle in moves.AT_WORK:
        return  # its preStop, in this process, deleted the pod and copies the bundle
    found = owners.pods_of(c, m.namespace, m.pod, m.selector)
    dumped = next((p for p in found if p["metadata"]["uid"] == m.uid), None)
    if dumped is not None and not dumped["metadata"].get("deletionTimestamp"):
        return  # not yet deleted: its preStop has not begun
    src = _agent(c, node)
    try:
        src.get(f"/v1/bundles/{m.bundle}/manifest")
        has = True
    except CriuctlError as exc:
        if not (isinstance(exc, AgentError) and exc.status == 404):
            return
        has = False
    if dumped is not None:
        if not has:
            return  # its dump goes on (a handoff outside the agent), or it fails and the pod ends
        delete_now(c, dumped)  # sealed: its tree has ended; its successor is made meanwhile
        found = owners.pods_of(c, m.namespace, m.pod, m.selector)
    pod = next((p for p in found if p["metadata"]["uid"] != m.uid), None)
    if not has:
        _fail(c, m, "the pod ended during its checkpoint: the job started over", pod)
        return
    if not m.pages:  # a post-copy dump that committed before its preStop recorded where it serves
        with contextlib.suppress(CriuctlError):
            served: PagesServed = src.get(f"/v1/bundles/{m.bundle}/pages")
            m.pages, m.page_cert = prestop.host_port(src.node.host, served["port"]), served["cert"]
            m.mode = Mode.POST_COPY
    try:
        src.copy_bundle(m.bundle, _agent(c, m.target))
        m.holder = m.target
    except CriuctlError:
        m.holder = node
    m.phase = moves.Phase.KEPT
    moves.save(c, m)


def _job_containers(pod: dict, name: str) -> tuple[list[str], bool]:
    """The IDs the pod's container `name` has had (now, and the one before a restart), and whether
    it restarted (the job restored into it ended)."""
    for st in pod.get("status", {}).get("containerStatuses") or []:
        if st["name"] == name:
            ended = (st.get("lastState") or {}).get("terminated") or {}
            ids = [st.get("containerID") or "", ended.get("containerID") or ""]
            return [i.partition("://")[2] for i in ids if i], int(st.get("restartCount") or 0) > 0
    return [], False


def _pulling(c: Cluster, m: moves.Move, node: str) -> None:
    """Post-copy: the job runs here and pulls its memory; done once the last page is in (or the
    job ended: a daemon whose processes are gone has nothing left to pull)."""
    pod = _pod(c, m)
    ctr = next((x for x in pod["spec"]["containers"] if mutate.is_wrapped(x)), None) if pod else None
    if pod is None or ctr is None:
        _fail(c, m, f"the successor of pod {m.pod} went away while its memory was pulled", pod)
        return
    cids, restarted = _job_containers(pod, ctr["name"])
    agent = _agent(c, node).node
    row = next((r for cid in cids if (r := workload_row(agent, cid)) is not None), None)
    pages = row.get("pages") if row else None
    if row is None and restarted:
        _fail(c, m, f"the successor of pod {m.pod} restarted while its memory was pulled", pod)
        return
    if row is not None and pages in (workloads.PULLING, workloads.ENDED) and not row.get("alive"):
        # the job ended here before its last page came (it finished sooner than its pull, or
        # failed by itself): nothing is left to pull, and it ran once, here
        code = row.get("exit_code")
        m.note = f"the job ended (exit {'?' if code is None else code}) before its last page came"
        m.stamp("pages", row.get("pages_done"))
        _finish(c, m, pod, node)
        return
    if row is None or pages == workloads.PULLING:
        got = int(row.get("rss_bytes") or 0) if row else m.pulled
        if abs(got - m.pulled) >= max(m.memory // 50, 1 << 20):  # progress, in ~2 % steps
            m.pulled = got
            moves.save(c, m)
        return
    if pages == workloads.PULLED:
        m.stamp("pages", row.get("pages_done"))  # when the keeper saw the last page in
        _finish(c, m, pod, node)
        return
    why = f"its memory could not be pulled from node {m.source} ({pages or 'not restored by post-copy'})"
    _fail(c, m, f"{why}: the job ended, and its pod starts over", pod)


def _successor_row(c: Cluster, node: str, pod: dict, container: str) -> workloads.WorkloadRow | None:
    """`pod`'s container `container` once it runs on this node, as the runtime lists it through
    this node's agent: found by the pod's UID, not read from the pod's status, which the kubelet
    writes only after its next relist (up to a second later, all of it inside the job's stall)."""
    uid, said = pod["metadata"]["uid"], container_id(pod, container)
    rows: list[workloads.WorkloadRow] = _agent(c, node).get("/v1/containers")
    for r in rows:
        ours = r.get("pod_uid") == uid and r.get("container_name") == container
        if r.get("alive") and (ours or (said is not None and r.get("container") == said)):
            return r
    return None


def _pod_ip(m: moves.Move, pod: dict, row: workloads.WorkloadRow) -> str:
    """The successor's address, which a rank's sockets are re-addressed to: the kubelet's word, or,
    before it wrote it, the one address of the old address's family in the placeholder's network
    namespace ("" when there is none or more than one: `step` waits for the kubelet then)."""
    if said := pod["status"].get("podIP"):
        return str(said)
    if not m.address:
        return ""
    family = ipaddress.ip_address(m.address).version
    mine = [a for a in row.get("pod_ips") or [] if ipaddress.ip_address(a).version == family]
    return mine[0] if len(mine) == 1 else ""


def step(c: Cluster, m: moves.Move, node: str) -> None:
    """Advance one record as far as this node can, now."""
    age = time.time() - m.since
    if m.phase == moves.Phase.FAILED:
        if age > FORGET_FAILED and m.source == node:
            moves.forget(c, m)
        return
    if m.phase == moves.Phase.DUMPING and m.source == node:
        _settle_dumping(c, m, node)
        return
    if m.phase == moves.Phase.PULLING and m.holder == node:
        _pulling(c, m, node)
        return
    if m.phase != moves.Phase.KEPT or m.holder != node:
        return
    pod = _pod(c, m)
    if pod is None or pod["metadata"]["uid"] == m.uid:
        if age > GIVE_UP:
            why = f"no successor pod came within {GIVE_UP:.0f} s; bundle {m.bundle} is kept on node {node}"
            _fail(c, m, why, None)
        return
    if not mutate.is_placeholder(pod):
        _fail(
            c,
            m,
            f"pod {m.pod} was recreated without criuctl's webhook and started its job over; "
            f"bundle {m.bundle} is kept on node {node}",
            pod,
        )
        return
    ctr = next((x for x in pod["spec"]["containers"] if mutate.is_wrapped(x)), None)
    if pod["spec"].get("nodeName") != node:
        cid = container_id(pod, ctr["name"]) if ctr else None
        if cid is None or not _holds_job(c, pod["spec"]["nodeName"], cid):
            delete_now(c, pod)  # empty: its controller recreates it, pinned here by the webhook
        return
    row = _successor_row(c, node, pod, ctr["name"]) if ctr else None
    if row is None:
        return  # not started yet
    cid = str(row.get("container"))
    held = _holds_job(c, node, cid)
    if not held and not row.get("placeholder_ready"):
        return  # its init does not listen for the restore yet: next tick
    address = _pod_ip(m, pod, row)
    if not held and m.tcp and m.address and not address:
        return  # a rank, and its new address not known yet: next tick
    m.stamp("successor")
    if held:  # restored before this agent restarted
        if m.pages:
            _ran(c, m, pod, node)
        else:
            _finish(c, m, pod, node)
        return
    here = _agent(c, node)
    rewire, pid = None, None
    try:
        restore = BundleRestoreRequest(into=cid)
        if m.pages:
            restore["page_server"], restore["page_cert"] = m.pages, m.page_cert
        rewire = jobmoves.plan(c, m, address)
        if rewire is not None:  # a job's rank: its connections follow it (criuctl.kube.jobmoves)
            pid = jobmoves.container_pid(here, cid)
            if pid is None:
                return  # the agent does not list the placeholder yet: next tick
            jobmoves.prepare(c, rewire, m.bundle, pid)
            points.reach(Point.SUCCESSOR_REDIRECTED)
            restore["readdress"] = rewire.readdress
            if rewire.foreign:
                said = f"connections to {', '.join(rewire.foreign)} cannot follow it: they will be reset"
                events.record(c, pod, events.Reason.FAILED, said)
        AgentClient(here.node, timeout=RESTORE_TIMEOUT).post(f"/v1/bundles/{m.bundle}/restore", restore)
    except CriuctlError as exc:
        if rewire is not None:
            jobmoves.undo(c, rewire, m.bundle, pid)
        others = [n for n in m.copies() if n != node]
        why = f"the restore on node {node} failed ({exc.what})"
        if (isinstance(exc, AgentError) and exc.status == 409) or not others:
            _fail(c, m, f"{why}; bundle {m.bundle} is kept on node {node}", pod)
            return
        m.holder, m.note = others[0], why
        moves.save(c, m)
        events.record(c, pod, events.Reason.FAILED, f"{why}: it is restored on node {others[0]} instead")
        delete_now(c, pod)
        return
    m.stamp("running")
    if rewire is not None and pid is not None:
        jobmoves.commit(c, rewire, m.bundle, pid)
    if m.pages:
        _ran(c, m, pod, node)
    else:
        _finish(c, m, pod, node)


def _ran(c: Cluster, m: moves.Move, pod: dict, node: str) -> None:
    """Post-copy: the job runs here; its memory is pulled from the source from now on."""
    m.phase, m.holder = moves.Phase.PULLING, node
    moves.save(c, m)
    downtime = m.downtime()
    said = f"running on node {node}" + (f" after {downtime:.2f} s stopped" if downtime is not None else "")
    said += f"; pulling its memory ({m.memory >> 20} MiB) from node {m.source}"
    events.record(c, pod, events.Reason.STARTED, said)


def tick(c: Cluster, node: str) -> bool:
    """Advance every record this node can; True while one this node will restore is under way
    (its loop then looks again at once: each second it waits is a second of the job's stall)."""
    busy = False
    for m in moves.every(c):
        try:
            step(c, m, node)
        except CriuctlError as exc:  # a Conflict: another writer advanced it; read again next tick
            log.info("move not advanced", extra={"pod": f"{m.namespace}/{m.pod}", "why": exc.line()})
        # a pull is followed at the loop's pace: it decides nothing the job waits for
        busy |= m.phase in (moves.Phase.DUMPING, moves.Phase.KEPT) and (m.holder or m.target) == node
    return busy
