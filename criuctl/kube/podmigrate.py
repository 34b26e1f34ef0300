"""`criuctl migrate POD NODE`: move a pod's container to another node with the agents.

    check       pod, node, agents, memory, the container         nothing changed on any refusal
    placeholder a pod pinned to NODE, from the pod's own spec,  on failure: deleted; the source
                its command criuctl's init in placeholder mode   pod never stopped running
    migrate     the agents' migration (criuctl.agent.migrate)    before the target commits: the
                into the placeholder's container                 placeholder is deleted, the
                                                                 source thaws and keeps running
    hand over   after the target commits and before the source   the job runs in the new pod; the
                tree ends: the source pod is deleted, so its     source tree ends by the agents'
                kubelet never restarts the container it sees die protocol either way
    record      Events on both pods, provenance annotations

A pod a controller owns is not moved this way: its controller would recreate it under the same name
on any node. Such a pod keeps its identity only when the recreated pod becomes the placeholder
(docs/kubernetes.md, "Controller-owned pods"), which is not on main yet: `migrate` refuses it.
"""

from __future__ import annotations

import contextlib
import copy
import time

from criuctl.agent import migrate as agent_migrate
from criuctl.agent.client import AgentClient
from criuctl.errors import CriuctlError
from criuctl.kube import events
from criuctl.kube.cluster import Cluster, NotFound, call
from criuctl.kube.podplan import PodPlan, plan

__all__ = ["execute", "plan", "settle"]


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
            target_state = dst.get(f"/v1/incoming/{inc}", timeout=10)["state"]
        if target_state == "running":
            return p.target
        try:
            source_state = src.get(f"/v1/outgoing/{og}", timeout=10)["state"] if og else "gone"
        except CriuctlError as err:  # 404: settled and forgotten, or left to its orphan settler
            source_state = "gone" if getattr(err, "status", None) == 404 else None
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
        result = agent_migrate.migrate(p.workload, p.src, p.dst, mode, progress, into=into,
                                       target_committed=hand_over)  # fmt: skip
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
        _delete(c, p.namespace, p.placeholder_name, grace=0)
        events.record(c, src_pod, events.Reason.FAILED, f"{exc.what}; it keeps running on {p.source}")
        events.record(c, new_pod, events.Reason.FAILED, f"{exc.what}; this placeholder is deleted")
        raise
    if not handed_over:
        _delete(c, p.namespace, p.pod)
    stamp = {"metadata": {"annotations": {events.MIGRATED_AT: events.now()}}}
    call("the new pod", c.core.patch_namespaced_pod, p.placeholder_name, p.namespace, stamp)
    msg = f"from pod {p.pod} on node {p.source} ({result.mode}, downtime {result.downtime_seconds:.2f} s)"
    events.record(c, new_pod, events.Reason.MIGRATED, msg)
    events.record(c, src_pod, events.Reason.MIGRATED, f"to pod {p.placeholder_name} on node {p.target}")
    return result
