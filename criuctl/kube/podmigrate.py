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
    remove      once the source says its tree is gone: the      not gone in 60 s: the pod's
                source pod again, without a grace period         own grace period ends it
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
import json
import time
from collections.abc import Callable

from criuctl.agent import points
from criuctl.agent.messages import IncomingStatus, OutgoingStatus
from criuctl.agent.protocol import Point
from criuctl.client import migrate as agent_migrate
from criuctl.client.agents import AgentClient, AgentError, Node, running_here
from criuctl.core.errors import CriuctlError
from criuctl.core.workloads import UnknownWorkload
from criuctl.kube import events, jobfailures, moves, mutate, owners
from criuctl.kube.cluster import Cluster, NotFound, call, delete_now
from criuctl.kube.podmigrations import Phase, downtime_text
from criuctl.kube.podplan import NotMigratable, PodPlan, plan

__all__ = [
    "execute",
    "execute_owned",
    "follow_owned",
    "hand_over",
    "heard",
    "plan",
    "request_owned",
    "settle",
]

# journal(phase, **status fields): the caller's durable record of the step about to be taken
# (criuctl.kube.controller writes it into the PodMigration's status before the step runs)
Journal = Callable[..., None]


def _unrecorded(_phase: Phase, **_fields: object) -> None:
    pass


# as the progress shows them
PHASES = {moves.Phase.DUMPING: "checkpoint", moves.Phase.KEPT: "restore", moves.Phase.PULLING: "pages"}
HOOK_WAIT = 30.0  # for the agent's preStop listener in a pod just started (nodeside.HOOKS_EVERY, a few times)
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


def _delete(c: Cluster, namespace: str, name: str, grace: int | None = None, uid: str | None = None) -> None:
    """Delete pod NAME (only the one of `uid`, when given: never a successor of the same name)."""
    from kubernetes import client

    only = client.V1Preconditions(uid=uid) if uid else None
    opts = client.V1DeleteOptions(grace_period_seconds=grace, preconditions=only)
    with contextlib.suppress(NotFound):
        call(f"pod {namespace}/{name}", c.core.delete_namespaced_pod, name, namespace, body=opts)


def settle(
    source: Node, target: Node, ids: tuple[str | None, str] | None, timeout: float = 300
) -> str | None:
    """Where the job runs once the agents settled a migration in doubt (they always do, once they
    hear each other: docs/architecture.md), the source's or the target's node; None if they have not
    within `timeout`. Deciding for the pods needs it: an empty placeholder is deleted, a used one is
    the job's pod now. `ids`: (source's outgoing id, target's incoming id); the target's alone
    decides once it ended (the source asks it before it thaws or ends)."""
    if ids is None:
        return None
    og, inc = ids
    src, dst = AgentClient(source, timeout=10), AgentClient(target, timeout=10)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        target_state = source_state = None
        with contextlib.suppress(CriuctlError, KeyError):
            incoming: IncomingStatus = dst.get(f"/v1/incoming/{inc}", timeout=10)
            target_state = incoming["state"]
        if target_state == "running":
            return target.name
        try:
            outgoing: OutgoingStatus | None = src.get(f"/v1/outgoing/{og}", timeout=10) if og else None
            source_state = outgoing["state"] if outgoing is not None else "gone"
        except CriuctlError as err:  # 404: settled and forgotten, or left to its orphan settler
            source_state = "gone" if isinstance(err, AgentError) and err.status == 404 else None
        except KeyError:
            pass
        if source_state == "thawed":
            return source.name
        if source_state in ("committed", "done"):
            return target.name
        # the target's copy is dead or never ran: the source thaws on hearing it (it may be asking)
        if target_state in ("aborted", "failed") and (source_state == "gone" or og is None):
            return source.name
        time.sleep(2)
    return None


def take_up(source: Node, target: Node, ids: tuple[str | None, str], workload: str) -> str | None:
    """Where the job runs, for a move whose orchestrator died mid-way (a controller that restarted):
    the target's node if its copy runs; else the move is undone as a failed step is (target first:
    criuctl.client.migrate.abort) and it is the source's. None while the agents cannot tell yet."""
    og, inc = ids
    dst = AgentClient(target, timeout=10)
    try:
        incoming: IncomingStatus = dst.get(f"/v1/incoming/{inc}", timeout=10)
        state = incoming["state"]
    except (CriuctlError, KeyError):  # unreachable, or forgotten: ask both until they tell
        return settle(source, target, ids, timeout=60)
    if state == "running":
        return target.name
    why = CriuctlError("the controller restarted mid-move", "")
    err = agent_migrate.abort(AgentClient(source, timeout=30), dst, og, inc, why, workload, source.name)
    if isinstance(err, agent_migrate.MigrationInDoubt):
        return settle(source, target, ids, timeout=60)
    return source.name


OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"  # Kubernetes' "this node is shut down" taint


def fence(node: dict | None, name: str) -> str | None:
    """Why node `name` can no longer run a job, as Kubernetes is told it (the Node deleted, or
    tainted out-of-service by a person or a shutdown manager); None while it may still run one."""
    if node is None:
        return f"node {name} is deleted"
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("key") == OUT_OF_SERVICE:
            return f"node {name} is tainted {OUT_OF_SERVICE}"
    return None


def settle_fenced(source: Node, workload: str, declared: str) -> str | None:
    """A move in doubt whose target is fenced (`fence`): the source's agent asks the target once
    more and thaws on its silence (`criuctl.client.migrate.settle`). The source's node once the job
    runs there again; None while it cannot be said (the target answered after all: the agents
    settle it between them)."""
    src = AgentClient(source, timeout=30)
    try:
        agent_migrate.settle(src, workload, declared)
        return source.name
    except agent_migrate.NotSettled:
        return None
    except UnknownWorkload:  # nothing waits there any more: it settled, one way or the other
        rows = src.get("/v1/workloads")
        return source.name if running_here(rows, workload) else None


def source_settled(source: Node, outgoing: str | None) -> str | None:
    """The source's node if its agent thawed the move (it heard the target before the target's
    Node went); None while it holds the job frozen, or cannot say."""
    if outgoing is None:
        return None
    with contextlib.suppress(CriuctlError, KeyError, TypeError):
        status: OutgoingStatus = AgentClient(source, timeout=10).get(f"/v1/outgoing/{outgoing}", timeout=10)
        if status["state"] == "thawed":
            return source.name
    return None


def read_pod(c: Cluster, namespace: str, name: str) -> dict | None:
    try:
        return c.serialize(call(f"pod {namespace}/{name}", c.core.read_namespaced_pod, name, namespace))
    except NotFound:
        return None


def hand_over(
    c: Cluster,
    namespace: str,
    pod: str,
    new_pod: str,
    source: str,
    target: str,
    how: str = "",
    ended: tuple[Node, str | None] | None = None,
) -> None:
    """The job runs in `new_pod` on `target`: the source pod goes (before its tree ends, where the
    caller can: see the table), the new pod gets its provenance stamp, both get their Event. Each
    step may be done again (a controller that restarted mid-way does it all again). `ended`: the
    source's agent and outgoing id, to remove the source pod at once when its tree ended."""
    src = read_pod(c, namespace, pod)
    with contextlib.suppress(CriuctlError):  # the source's agent ends the tree either way
        _delete(c, namespace, pod)
    # the job runs in the new pod: what follows is bookkeeping, and its failure must not turn a move
    # that happened into an error (the source's agent marks its pod moved; the stamp is a courtesy)
    with contextlib.suppress(CriuctlError):
        stamp = {"metadata": {"annotations": {events.MIGRATED_AT: events.now()}}}
        call("the new pod", c.core.patch_namespaced_pod, new_pod, namespace, stamp)
    new = read_pod(c, namespace, new_pod)
    if new is not None:
        events.record(c, new, events.Reason.MIGRATED, f"from pod {pod} on node {source}{how}")
    if src is not None:
        events.record(c, src, events.Reason.MIGRATED, f"to pod {new_pod} on node {target}")
    # Its tree gone, nothing runs in the source pod: Kubernetes 1.20's kubelet, finding the
    # container gone when its preStop returns, fails the kill and retries a minute later, the pod
    # Terminating all the while. Deleted now (this very pod, by UID), as the preStop path does.
    if src is not None and ended is not None and agent_migrate.source_ended(*ended):
        with contextlib.suppress(CriuctlError):
            delete_now(c, src)


def undo_placing(c: Cluster, namespace: str, pod: str, new_pod: str, source: str, why: str) -> None:
    """The job never left (or came back to) `source`: the placeholder goes, Events say so."""
    with contextlib.suppress(CriuctlError):
        _delete(c, namespace, new_pod, grace=0)
    src = read_pod(c, namespace, pod)
    if src is not None:
        events.record(c, src, events.Reason.FAILED, f"{why}; it keeps running on {source}")


def execute(
    c: Cluster, p: PodPlan, mode: str | None, progress, journal: Journal = _unrecorded
) -> agent_migrate.MigrationResult:
    src_pod = p.source_pod
    journal(Phase.PLACING, newPod=p.placeholder_name)
    events.record(c, src_pod, events.Reason.STARTED, f"moving to node {p.target} as pod {p.placeholder_name}")
    progress("placeholder")
    created = call(
        "the placeholder pod", c.core.create_namespaced_pod, p.namespace, copy.deepcopy(p.placeholder)
    )
    new_pod = c.serialize(created)
    events.record(c, new_pod, events.Reason.STARTED, f"placeholder for pod {p.pod} from node {p.source}")
    points.reach(Point.CONTROLLER_PLACED)

    def committed() -> None:
        """The job runs in the new pod: the source pod goes before its tree ends (see the table)."""
        journal(Phase.HANDING_OVER)
        with contextlib.suppress(CriuctlError):  # the source agent still ends the tree; its kubelet
            _delete(c, p.namespace, p.pod)  # may restart a fresh copy (whose init then waits)

    outgoing: list[str | None] = [None]

    def ids(og: str | None, inc: str) -> None:
        outgoing[0] = og
        journal(Phase.MIGRATING, outgoingId=og or "", incomingId=inc)

    try:
        into = _wait_placeholder(c, p)
        journal(Phase.MIGRATING)
        result = agent_migrate.migrate(
            p.workload, p.src, p.dst, mode, progress, into=into, target_committed=committed, on_ids=ids
        )
    except agent_migrate.MigrationInDoubt as exc:
        where = settle(p.src, p.dst, exc.ids)
        if where == p.target:  # the job runs in the new pod: the hand-over as after a commit
            committed()
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
    how = f" ({result.mode}, downtime {result.downtime_seconds:.2f} s)"
    hand_over(c, p.namespace, p.pod, p.placeholder_name, p.source, p.target, how, (p.src, outgoing[0]))
    return result


def _owned_result(
    workload: str, source: str, m: moves.Move | None, where: str, started: float
) -> agent_migrate.MigrationResult:
    """What the move took: the downtime from the record's stamps (the freeze until it ran in the
    successor) where it has them, else the whole delete → done."""
    took = time.time() - started
    size, freeze = (m.size, m.freeze) if m else (0, 0.0)
    downtime = m.downtime() if m else None
    ran = json.loads(m.stamps or "{}").get("running") if m else None
    post_copy = m is not None and bool(m.pages)
    return agent_migrate.MigrationResult(
        workload,
        source,
        where,
        f"{'post-copy' if post_copy else 'stop-and-copy'} through its successor",
        downtime if downtime is not None else took,
        took,
        size + (m.memory if post_copy and m else 0),
        freeze,
        0.0,
        0.0,
        pages_seconds=time.time() - ran if post_copy and ran else None,
        via_successor=True,
    )


def request_owned(c: Cluster, p: PodPlan, journal: Journal = _unrecorded, mode: str | None = None) -> None:
    """Record the move (naming the target, and the mode if one was asked) and delete the pod: its
    preStop checkpoints the job."""
    uid = p.source_pod["metadata"]["uid"]
    heard(c, p)
    journal(Phase.PLACING, sourceUID=uid)
    stale = moves.read(c, p.namespace, p.identity)
    if stale is not None and (
        stale.uid != uid or stale.phase != moves.Phase.REQUESTED or stale.target != p.target
    ):
        moves.forget(c, stale)  # a requested or failed move of an earlier pod (plan refused live ones)
        stale = None
    if stale is None:
        moves.save(
            c,
            moves.Move(
                p.namespace,
                p.identity,
                uid,
                p.source,
                p.container,
                moves.Phase.REQUESTED,
                target=p.target,
                since=time.time(),
                source_pod=p.pod,
                mode=mode or "",
            ),
        )
    _untrack(c, p)
    points.reach(Point.CONTROLLER_UNTRACKED)
    said = f"moving to node {p.target}: checkpointed on delete, restored into its successor"
    events.record(c, p.source_pod, events.Reason.STARTED, said)
    journal(Phase.MIGRATING)
    try:
        _delete(c, p.namespace, p.pod, uid=uid)
    except CriuctlError:  # not deleted: its Job judges it again (else the agents' loop does it)
        with contextlib.suppress(CriuctlError):
            if (pod := read_pod(c, p.namespace, p.pod)) is not None and pod["metadata"]["uid"] == uid:
                jobfailures.retrack(c, pod)
        raise


def heard(c: Cluster, p: PodPlan, wait: float = HOOK_WAIT) -> None:
    """Until the pod's preStop hook reaches its agent (mutate.unheard): a pod deleted before would
    end and start over, not move. Refused after `wait` s, with nothing changed."""
    deadline = time.monotonic() + wait
    while True:
        pod = read_pod(c, p.namespace, p.pod)
        if pod is None or pod["metadata"]["uid"] != p.source_pod["metadata"]["uid"]:
            raise NotMigratable(f"pod {p.pod} is gone", "nothing was changed")
        if (unheard := mutate.unheard(pod, p.container)) is None:
            return
        why, lasting = unheard
        if lasting or time.monotonic() >= deadline:
            raise NotMigratable(
                f"pod {p.pod} cannot be checkpointed on delete yet: {why}",
                f"is criuctl's agent running on node {p.source}? (`kubectl -n {moves.SYSTEM_NS} get pods -o "
                "wide`); it makes the listener within seconds of the container's start; nothing was changed",
            )
        time.sleep(0.5)


def _untrack(c: Cluster, p: PodPlan) -> None:
    """A Job's pod leaves its Job's count before it is deleted (criuctl.kube.jobfailures); where it
    cannot and the count would fail the Job, the move is refused here, before anything is frozen."""
    if jobfailures.untrack(c, p.source_pod):
        return
    job = jobfailures.job_of(c, p.source_pod)
    why = jobfailures.refusal(job) if job is not None else None
    if why is not None:
        with contextlib.suppress(CriuctlError):
            if (m := moves.read(c, p.namespace, p.identity)) is not None and m.phase == moves.Phase.REQUESTED:
                moves.forget(c, m)
        raise NotMigratable(f"pod {p.pod}: {why}", jobfailures.HINT)


def follow_owned(
    c: Cluster,
    namespace: str,
    pod: str,
    uid: str,
    workload: str,
    source: str,
    progress,
    journal: Journal = _unrecorded,
    started: float | None = None,
) -> agent_migrate.MigrationResult:
    """Follow the move record of pod `pod` (its identity, criuctl.kube.owners; of `uid`, deleted)
    until its successor runs the job. Level-triggered: it reads only the record and the pods, so
    it is taken up again as is."""
    started = started or time.time()
    seen: moves.Move | None = None
    phase: moves.Phase | None = None
    pulled = -1
    deadline = started + OWNED_TIMEOUT
    while time.time() < deadline:
        m = moves.read(c, namespace, pod)
        live = owners.current(c, namespace, pod, not_uid=uid)
        successor = live if live is not None and live["metadata"]["uid"] != uid else None
        seen = m or seen  # its latest word: a failed restore on the target leaves its note
        if m is not None and m.phase != phase:
            phase = m.phase
            progress(PHASES.get(m.phase, str(m.phase)))
            if m.phase == moves.Phase.KEPT:
                journal(Phase.HANDING_OVER, bytesMoved=m.size)
            if m.phase == moves.Phase.PULLING:
                down = m.downtime()
                journal(
                    Phase.HANDING_OVER,
                    downtimeSeconds=down,
                    downtime=downtime_text(down),
                    window=f"the job runs on node {m.holder}; until its last memory page is pulled from "
                    f"node {m.source}, it needs node {m.source} too (post-copy's window)",
                )
        if m is not None and m.phase == moves.Phase.PULLING and m.pulled != pulled:
            pulled = m.pulled  # post-copy: how much of its memory the successor has
            progress(PHASES[m.phase], min(m.pulled, m.memory), m.memory)
        if m is None and successor is not None:  # a pod made after our delete, restored
            notes = successor["metadata"].get("annotations") or {}
            if events.MIGRATED_AT in notes:
                new, node = successor["metadata"]["name"], successor["spec"]["nodeName"]
                journal(Phase.HANDING_OVER, newPod=new)
                if seen is not None and seen.target and node != seen.target:
                    # whole, but not where it was asked to go: said as the failure it is
                    raise agent_migrate.MigrationFailed(
                        f"pod {pod} was not moved to node {seen.target}: "
                        f"{seen.note or 'it was restored elsewhere'}; it runs as pod {new} on node {node}",
                        f"see `kubectl -n {namespace} get events --field-selector involvedObject.name={new}`",
                    )
                return _owned_result(workload, source, seen, node, started)
        if m is not None and m.phase == moves.Phase.FAILED:
            raise agent_migrate.MigrationFailed(m.note, f"see `kubectl -n {namespace} get events`")
        if m is not None and m.phase == moves.Phase.REQUESTED and successor is not None:
            moves.forget(c, m)
            raise agent_migrate.MigrationFailed(
                f"pod {pod} was deleted but its preStop hook did not checkpoint it: it started over",
                "is the agent's --prestop-port set on node " + source + "? (manifests/daemonset.yaml)",
            )
        if (
            m is None
            and live is not None
            and successor is None
            and not live["metadata"].get("deletionTimestamp")
        ):
            raise agent_migrate.MigrationFailed(
                f"the move of pod {pod} was not recorded and the pod was not deleted: nothing moved",
                "create the PodMigration again",
            )
        time.sleep(0.5)
    raise agent_migrate.MigrationInDoubt(
        f"pod {pod} has not come back within {OWNED_TIMEOUT:.0f} s",
        f"its move goes on without this command: `kubectl -n {moves.SYSTEM_NS} get cm "
        f"{moves.record_name(namespace, pod)} -o yaml` says where it is",
    )


def execute_owned(
    c: Cluster, p: PodPlan, progress, journal: Journal = _unrecorded, mode: str | None = None
) -> agent_migrate.MigrationResult:
    """Record the move, delete the pod, and follow the record until the successor runs the job."""
    started = time.time()
    progress("checkpoint")
    request_owned(c, p, journal, mode)
    uid = p.source_pod["metadata"]["uid"]
    return follow_owned(c, p.namespace, p.identity, uid, p.workload, p.source, progress, journal, started)
