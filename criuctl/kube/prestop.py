"""A migratable pod is being deleted: checkpoint its job and keep the bundle where its successor
will run (drain, eviction, and `criuctl migrate` of a controller's pod all come through here).

The kubelet calls this from the pod's preStop hook (criuctl.kube.mutate.prestop_hook) on the node
agent's loopback port, before it sends the container SIGTERM. The call carries no credentials
(Kubernetes 1.20's kubelet sends none), so it is authorised by the API server's own word: the pod
exists, on this node, and is being deleted. Checkpointing it then does nothing its deletion would
not do, except keep the job.

    requested?  `criuctl migrate` left a record naming the target: use it. Otherwise only a pod
                whose controller wants it back under its name is kept (owners.py), on the Ready,
                schedulable node with an agent and the most free memory.
    dumping     record first (with the bundle's id), then the source agent checkpoints the
                container into that bundle: the tree ends, the job now lives in the bundle
    kept        the bundle is copied to the target's agent, which verifies it; on failure the
                source's own copy is the one kept. Both copies stay until a restore commits.

Anything refused or failed before the dump commits leaves the job to end with its pod, as it would
without criuctl: its controller starts it over; nothing runs twice.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import time
import uuid

from criuctl.agent.messages import CheckpointAnswer, CheckpointRequest
from criuctl.client.agents import AgentClient
from criuctl.core.errors import CriuctlError
from criuctl.kube import events, moves, mutate, owners, podmigrations, podplan, podvolumes
from criuctl.kube.cluster import Cluster, NotFound, agent_for, call, container_id, delete_now, workload_row
from criuctl.net import peers

log = logging.getLogger("criuctl.kube")

CHECKPOINT_TIMEOUT = 600.0  # the agent's own freeze timeout is shorter: this only bounds a dead link


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


def leaving(c: Cluster, namespace: str, name: str, node: str) -> str:
    """What became of the job of pod NAMESPACE/NAME, being deleted on `node` (this agent's)."""
    for kind, value in (("pod", name), ("namespace", namespace)):
        podplan.check_name(kind, value)
    try:
        pod = c.serialize(call(f"pod {namespace}/{name}", c.core.read_namespaced_pod, name, namespace))
    except NotFound:
        return "the pod is gone: nothing to keep"
    meta = pod["metadata"]
    if pod["spec"].get("nodeName") != node or not meta.get("deletionTimestamp"):
        raise Refused(
            f"pod {namespace}/{name} is not being deleted on node {node}",
            "only its kubelet's preStop hook calls this",
        )
    wrapped = [ctr for ctr in pod["spec"]["containers"] if mutate.is_wrapped(ctr)]
    if len(wrapped) != 1:
        return "no single container under criuctl's init: it ends with its pod"
    move = moves.read(c, namespace, name)
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
    src = agent_for(c, c.serialize(call(f"node {node}", c.core.read_node, node)))
    row = workload_row(src, cid)
    if row is None or row.get("why_not"):
        why_not = row.get("why_not") if row is not None else None
        return f"nothing to checkpoint ({why_not or 'no job in the container'})"
    needed = max(podplan.pod_memory(pod), int(row.get("rss_bytes") or 0))
    tcp = peers.Endpoints.from_json(row.get("tcp"))  # a job's rank: re-addressed where it is restored
    ranked = any(not ipaddress.ip_address(c[2]).is_loopback for c in tcp.connections)
    target = requested.target if requested else _target(c, pod, node, needed)
    dst = agent_for(c, c.serialize(call(f"node {target}", c.core.read_node, target)))
    m = moves.Move(
        namespace,
        name,
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
    )
    m = moves.save(c, m)  # before the dump: a crash after it leaves the bundle's id on record
    if requested is None:  # a drain or an eviction: listed with every other move (a courtesy)
        try:
            podmigrations.record_drain(c, namespace, name, meta["uid"], node, target)
        except CriuctlError as exc:
            log.warning("no PodMigration recorded", extra={"pod": f"{namespace}/{name}", "why": exc.what})
    events.record(c, pod, events.Reason.STARTED, f"deleted: checkpointing its job for node {target}")
    source = AgentClient(src, timeout=CHECKPOINT_TIMEOUT)
    try:
        out: CheckpointAnswer = source.post(
            f"/v1/workloads/{row['name']}/checkpoint", CheckpointRequest(id=m.bundle, connections=ranked)
        )
    except CriuctlError as exc:
        m.phase, m.note = (
            moves.Phase.FAILED,
            f"the checkpoint failed ({exc.what}); the job ended with its pod",
        )
        moves.save(c, m)
        events.record(c, pod, events.Reason.FAILED, m.note)
        raise
    try:
        size = source.copy_bundle(m.bundle, AgentClient(dst, timeout=CHECKPOINT_TIMEOUT))
        m.holder, m.size, m.freeze = target, size, float(out["freeze_seconds"])
    except CriuctlError as exc:
        m.holder, m.note = node, f"not copied to node {target} ({exc.what}): restored on node {node}"
        events.record(c, pod, events.Reason.FAILED, m.note)
    m.phase = moves.Phase.KEPT
    moves.save(c, m)
    log.info("kept", extra={"pod": f"{namespace}/{name}", "bundle": m.bundle, "holder": m.holder})
    # Its job's tree has ended: nothing runs in the pod. Kubernetes 1.20's kubelet, finding the
    # container gone when its preStop returns, fails the kill and retries a minute later; the pod
    # would stay Terminating, its successor waiting, all that time.
    delete_now(c, pod)
    return f"checkpointed into bundle {m.bundle}, kept on node {m.holder}"
