"""Who may write which move record (criuctl.kube.moves), judged on the API server's word on the writer.

The records are ConfigMaps in criuctl's namespace, and every agent's ServiceAccount may write them
(an agent records the move its preStop starts). Without this, a node whose root is taken could
write one naming itself: its own node as a target the next delete of a pod on another node sends
the job's memory to, or as the holder its successor (with its Secrets) is pinned to. criuctl's
webhook judges each write (`records.criuctl.io`, failurePolicy Fail: no write is unjudged), with
the writer's identity as the API server authenticated it, an agent's node read from the pod its
bound token names (criuctl.kube.identity.agent_node):

    the controller      creates and rewrites `requested` records (its choice of target), and
                        deletes any (a move it ended or gave up)
    the agent of node N creates a record, or turns a `requested` one into `dumping`, only as its
                        source: N is `source`, and the pod it names (name, UID) is being deleted
                        on N, at the address it claims; the `requested` target is kept. Later
                        writes leave the move's identity (`IDENTITY`) as it is, come from a node
                        it names (source, target or holder) and name as holder one of its two
                        nodes. It deletes a record that names it, or a `requested` or `failed`
                        one whose pod is gone (a predecessor's)
    anyone else         as RBAC allows (a cluster's administrators)

Each bundle id is one move's: a record may not take an id another names. So a stolen node reaches
what the moves of its own pods need, and of others' only what a move the controller or their own
source started names it for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from criuctl.kube import moves
from criuctl.kube.identity import AGENT_USER, CONTROLLER_USER

# what a record is the move of: fixed by its source (or the controller's request) when written
IDENTITY = ("namespace", "pod", "uid", "source", "target", "bundle", "source_pod", "selector", "address")


class Operation(StrEnum):
    CREATE = "CREATE"
    UPDATE = "UPDATE"
    DELETE = "DELETE"


@dataclass(frozen=True)
class Writer:
    """Who writes: the controller, an agent (with its node), or someone RBAC alone judges."""

    user: str
    node: str = ""  # an agent's

    @property
    def is_agent(self) -> bool:
        return self.user == AGENT_USER

    @property
    def is_controller(self) -> bool:
        return self.user == CONTROLLER_USER


# (namespace, pod name) → the pod as the API server has it, or None
PodLookup = Callable[[str, str], dict[str, Any] | None]
Records = Callable[[], list[moves.Move]]  # every record, read when a write needs them


def judge(
    op: Operation,
    who: Writer,
    old: moves.Move | None,
    new: moves.Move | None,
    pod_of: PodLookup,
    others: Records,
) -> str | None:
    """Why `who` may not make this write (None: it may). `old` is None for a creation (or a
    ConfigMap of that name that is no record), `new` None for a deletion."""
    if not (who.is_agent or who.is_controller):
        return None
    if who.is_controller:
        if new is None or new.phase == moves.Phase.REQUESTED:
            return None
        return f"the controller writes only {moves.Phase.REQUESTED} records, not {new.phase}"
    node = who.node
    if new is None:
        assert old is not None
        if node in _nodes(old):
            return None
        if old.phase in (moves.Phase.REQUESTED, moves.Phase.FAILED) and not _there(old, pod_of):
            return None  # a predecessor's, left by a move that never ran or ended
        return f"node {node}'s agent may delete no record of a move it is not part of ({_of(old)})"
    if old is None or old.phase == moves.Phase.REQUESTED:
        return _begun(node, old, new, pod_of, others)
    changed = [f for f in IDENTITY if getattr(old, f) != getattr(new, f)]
    if changed:
        return f"node {node}'s agent may not change {', '.join(changed)} of {_of(old)}"
    if node not in _nodes(old):
        return f"node {node}'s agent may not write {_of(old)}: the move names nodes {_names(old)}"
    if new.holder not in ("", new.source, new.target):
        return _held(new)
    return None


def _begun(
    node: str, old: moves.Move | None, new: moves.Move, pod_of: PodLookup, others: Records
) -> str | None:
    """A record created, or a `requested` one taken up, by node `node`'s agent: as its source."""
    if new.source != node or (old is not None and old.source != node):
        return f"node {node}'s agent may begin only a move from its own node, not {_of(new)}"
    asked = ("namespace", "pod", "uid", "target")
    if old is not None and any(getattr(old, f) != getattr(new, f) for f in asked):
        return f"node {node}'s agent may not change the pod or the target asked for ({_of(old)})"
    pod = pod_of(new.namespace, new.name)
    meta = (pod or {}).get("metadata") or {}
    if (
        pod is None
        or meta.get("uid") != new.uid
        or (pod.get("spec") or {}).get("nodeName") != node
        or not meta.get("deletionTimestamp")
    ):
        return f"pod {new.namespace}/{new.name} (UID {new.uid}) is not being deleted on node {node}"
    addresses = {a.get("ip") for a in (pod.get("status") or {}).get("podIPs") or []}
    addresses.add((pod.get("status") or {}).get("podIP"))
    if new.address and new.address not in addresses:
        return f"pod {new.namespace}/{new.name} has no address {new.address}"
    if new.holder not in ("", new.source, new.target):
        return _held(new)
    if new.bundle and any(o.bundle == new.bundle and o.key != new.key for o in others()):
        return f"bundle {new.bundle} is another move's"
    return None


def _held(m: moves.Move) -> str:
    return f"{_of(m)} may be held by node {m.source} or {m.target} alone, not node {m.holder}"


def _there(m: moves.Move, pod_of: PodLookup) -> bool:
    pod = pod_of(m.namespace, m.name)
    return pod is not None and ((pod.get("metadata") or {}).get("uid")) == m.uid


def _nodes(m: moves.Move) -> set[str]:
    return {m.source, m.target, m.holder} - {""}


def _names(m: moves.Move) -> str:
    return "/".join(sorted(_nodes(m))) or "(none)"


def _of(m: moves.Move) -> str:
    return f"the move of pod {m.namespace}/{m.name} from node {m.source}"
