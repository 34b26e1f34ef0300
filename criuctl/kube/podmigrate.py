"""`criuctl migrate POD NODE`: move a pod's container to another node with the agents.

    check       pod, node, agents, memory, the container         nothing changed on any refusal
    placeholder a pod pinned to NODE, from the pod's own spec,  on failure: deleted; the source
                its command criuctl's init in placeholder mode   pod never stopped running
    migrate     the agents' migration (criuctl.client.migrate)    before the target commits: the
                into the placeholder's container                 placeholder is deleted, the
                                                                 source thaws and keeps running
    hand over   after the target commits and before the source   the job runs in the new pod; the
                tree ends: the source pod is deleted, so its     source tree ends by the agents'
                kubelet never restarts the container it sees die protocol either way
    record      Events on both pods, provenance annotations

A pod whose controller recreates it under its name (StatefulSet, PyTorchJob) moves through its
successor instead (`execute_owned`; docs/kubernetes.md, "Controller-owned pods"):

    request     a move record naming NODE (criuctl.kube.moves)      the pod runs on, untouched
    delete      the pod; its preStop hook checkpoints the job into  a failed checkpoint: the job
                a bundle kept on NODE's agent (criuctl.kube.prestop) ends with its pod and starts over
    successor   its controller recreates it; the webhook pins it to the bundle's node as a placeholder
    restore     NODE's agent restores the bundle into it              failed: back on the source node
                (criuctl.kube.successors); the record goes
"""

from __future__ import annotations

import contextlib
import copy
import time

from criuctl.agent.messages import IncomingStatus, OutgoingStatus
from criuctl.client import migrate as agent_migrate
from criuctl.client.agents import AgentClient, AgentError
from criuctl.core.errors import CriuctlError
from criuctl.kube import events, moves
from criuctl.kube.cluster import Cluster, NotFound, call
from criuctl.kube.podplan import PodPlan, plan

__all__ = ["execute", "execute_owned", "plan", "settle"]

PHASES = {moves.Phase.DUMPING: "checkpoint", moves.Phase.KEPT: "restore"}  # as the progress shows them
OWNED_TIMEOUT = 900.0  # delete → restored: the grace period's checkpoint, the controller, the restore


def _wait_placeholder(c: Cluster, p: PodPlan, timeout: float = 120) -> str:
    """The placeholder's container ID once it runs (its init waits for the restore)."""
    deadline = time.monotonic() + timeout
    last = "Pending"
    while time.monotonic() < deadline:
        pod = c.serialize(
            call("the placeholder pod", c.core.read_namespaced_pod, p.placeholder_name, p.namespace)
        )
        for s in pod["status"].get("containerStatuses", []):
            if s["name"] == p.container and "running" in (s.get("state") or {}):
                return s["containerID"].partition("://")[2]
            waiting = (s.get("state") or {}).get("waiting") or {}
            last = waiting.get("reason", last)
        time.sleep(0.3)
    raise CriuctlError(
        f"the placeholder pod {p.placeholder_name} did not start on node {p.target} "
        f"within {timeout:.0f}s ({last})",
        f"see `kubectl -n {p.namespace} describe pod {p.placeholder_name}`",
    )


def _delete(c: Cluster, namespace: str, name: str, grace: int | None = None) -> None:
    from kubernetes import client

    opts = client.V1DeleteOptions(grace_period_seconds=grace)
    with contextlib.suppress(NotFound):
        call(f"pod {namespace}/{name}", c.core.delete_namespaced_pod, name, namespace, body=opts)


def settle(p: PodPlan, exc: agent_migrate.MigrationInDoubt, timeout: float = 300) -> str | None:
    """Where the job runs once the agents settled a migration in doubt (they always do, once they
    hear each other: docs/architecture.md), the source's or the target's node; None if they have not
    within `timeout`. Deciding for the pods needs it: an empty placeholder is deleted, a used one is
    the job's pod now."""
    if exc.ids is None:
        return None
    og, inc = exc.ids
    src, dst = AgentClient(p.src, timeout=10), AgentClient(p.dst, timeout=10)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        target_state = source_state = None
        with contextlib.suppress(CriuctlError, KeyError):
            incoming: IncomingStatus = dst.get(f"/v1/incoming/{inc}", timeout=10)
            target_state = incoming["state"]
        if target_state == "running":
            return p.target
        try:
            outgoing: OutgoingStatus | None = src.get(f"/v1/outgoing/{og}", timeout=10) if og else None
            source_state = outgoing["state"] if outgoing is not None else "gone"
        except CriuctlError as err:  # 404: settled and forgotten, or left to its orphan settler
            source_state = "gone" if isinstance(err, AgentError) and err.status == 404 else None
        except KeyError:
            pass
        if source_state == "thawed":
            return p.source
        if source_state in ("committed", "done"):
            return p.target
        # the target's copy is dead or never ran: the source thaws on hearing it (it may be asking)
        if source_state == "gone" and target_state in ("aborted", "failed"):
            return p.source
        time.sleep(2)
    return None


def execute(c: Cluster, p: PodPlan, mode: str | None, progress) -> agent_migrate.MigrationResult:
    src_pod = p.source_pod
    events.record(c, src_pod, events.Reason.STARTED, f"moving to node {p.target} as pod {p.placeholder_name}")
    progress("placeholder")
    created = call(
        "the placeholder pod", c.core.create_namespaced_pod, p.namespace, copy.deepcopy(p.placeholder)
    )
    new_pod = c.serialize(created)
    events.record(c, new_pod, events.Reason.STARTED, f"placeholder for pod {p.pod} from node {p.source}")
    handed_over: list[str] = []

    def hand_over() -> None:
        """The job runs in the new pod: the source pod goes before its tree ends (see the table)."""
        try:
            _delete(c, p.namespace, p.pod)
            handed_over.append(p.pod)
        except CriuctlError:
            pass  # the source agent still ends the tree; its kubelet may restart a fresh copy

    try:
        into = _wait_placeholder(c, p)
        result = agent_migrate.migrate(
            p.workload, p.src, p.dst, mode, progress, into=into, target_committed=hand_over
        )
    except agent_migrate.MigrationInDoubt as exc:
        where = settle(p, exc)
        if where == p.target:  # the job runs in the new pod: the hand-over as after a commit
            hand_over()
        if where != p.source:
            events.record(c, src_pod, events.Reason.FAILED, f"in doubt: {exc.what}")
            raise
        _delete(c, p.namespace, p.placeholder_name, grace=0)
        events.record(
            c, src_pod, events.Reason.FAILED, f"{exc.what}; the agents settled it: it runs on {p.source}"
        )
        raise agent_migrate.MigrationFailed(
            exc.what,
            f"the agents settled it: pod {p.pod} keeps running on {p.source}; the placeholder was deleted",
        ) from exc
    except CriuctlError as exc:
        with contextlib.suppress(CriuctlError):  # the migration's own error is the one to say
            _delete(c, p.namespace, p.placeholder_name, grace=0)
        left = getattr(exc, "thaw_left", None)
        if left:  # it runs on the source again, not whole yet: said as such, never "keeps running"
            events.record(
                c,
                src_pod,
                events.Reason.THAW_INCOMPLETE,
                f"{exc.what}; it runs on {p.source} again, but its thaw did not complete: {left}; "
                f"the agent on {p.source} keeps trying",
            )
        else:
            events.record(c, src_pod, events.Reason.FAILED, f"{exc.what}; it keeps running on {p.source}")
        events.record(c, new_pod, events.Reason.FAILED, f"{exc.what}; this placeholder is deleted")
        raise
    # the job runs in the new pod: what follows is bookkeeping, and its failure must not turn a move
    # that happened into an error (the source's agent marks its pod moved; the stamp is a courtesy)
    with contextlib.suppress(CriuctlError):
        if not handed_over:
            _delete(c, p.namespace, p.pod)
        stamp = {"metadata": {"annotations": {events.MIGRATED_AT: events.now()}}}
        call("the new pod", c.core.patch_namespaced_pod, p.placeholder_name, p.namespace, stamp)
    msg = f"from pod {p.pod} on node {p.source} ({result.mode}, downtime {result.downtime_seconds:.2f} s)"
    events.record(c, new_pod, events.Reason.MIGRATED, msg)
    events.record(c, src_pod, events.Reason.MIGRATED, f"to pod {p.placeholder_name} on node {p.target}")
    return result


def _owned_result(
    p: PodPlan, m: moves.Move | None, where: str, started: float
) -> agent_migrate.MigrationResult:
    took = time.monotonic() - started
    size, freeze = (m.size, m.freeze) if m else (0, 0.0)
    return agent_migrate.MigrationResult(
        p.workload,
        p.source,
        where,
        "through its successor",
        took,
        took,
        size,
        freeze,
        0.0,
        0.0,
        via_successor=True,
    )


def execute_owned(c: Cluster, p: PodPlan, progress) -> agent_migrate.MigrationResult:
    """Record the move, delete the pod, and follow the record until the successor runs the job."""
    uid = p.source_pod["metadata"]["uid"]
    stale = moves.read(c, p.namespace, p.pod)
    if stale is not None:
        moves.forget(c, stale)  # a requested or failed move of an earlier pod (plan refused live ones)
    moves.save(
        c,
        moves.Move(
            p.namespace,
            p.pod,
            uid,
            p.source,
            p.container,
            moves.Phase.REQUESTED,
            target=p.target,
            since=time.time(),
        ),
    )
    said = f"moving to node {p.target}: checkpointed on delete, restored into its successor"
    events.record(c, p.source_pod, events.Reason.STARTED, said)
    started = time.monotonic()
    progress("checkpoint")
    _delete(c, p.namespace, p.pod)
    seen: moves.Move | None = None
    phase = moves.Phase.REQUESTED
    deadline = started + OWNED_TIMEOUT
    while time.monotonic() < deadline:
        m = moves.read(c, p.namespace, p.pod)
        try:
            pod = c.serialize(call(f"pod {p.pod}", c.core.read_namespaced_pod, p.pod, p.namespace))
        except NotFound:
            pod = None
        successor = pod if pod is not None and pod["metadata"]["uid"] != uid else None
        if m is not None and m.phase != phase:
            phase, seen = m.phase, m
            progress(
                {moves.Phase.DUMPING: "checkpoint", moves.Phase.KEPT: "restore"}.get(m.phase, str(m.phase))
            )
        if m is None and successor is not None:  # a pod made after our delete, restored
            notes = successor["metadata"].get("annotations") or {}
            if events.MIGRATED_AT in notes:
                return _owned_result(p, seen, successor["spec"]["nodeName"], started)
        if m is not None and m.phase == moves.Phase.FAILED:
            raise agent_migrate.MigrationFailed(m.note, f"see `kubectl -n {p.namespace} get events`")
        if m is not None and m.phase == moves.Phase.REQUESTED and successor is not None:
            moves.forget(c, m)
            raise agent_migrate.MigrationFailed(
                f"pod {p.pod} was deleted but its preStop hook did not checkpoint it: it started over",
                "is the agent's --prestop-port set on node " + p.source + "? (manifests/daemonset.yaml)",
            )
        time.sleep(0.5)
    raise agent_migrate.MigrationInDoubt(
        f"pod {p.pod} has not come back within {OWNED_TIMEOUT:.0f} s",
        f"its move goes on without this command: `kubectl -n {moves.SYSTEM_NS} get cm "
        f"{moves.record_name(p.namespace, p.pod)} -o yaml` says where it is",
    )
