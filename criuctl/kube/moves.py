"""Pending moves of controller-owned pods: one ConfigMap per pod in criuctl's namespace.

A pod whose controller recreates it under the same name (a StatefulSet's ordinal, a PyTorchJob's
rank) keeps its identity by being recreated *as the placeholder* (docs/kubernetes.md,
"Controller-owned pods"). Between the source pod's end and the restore into its successor the job
exists only as a kept, verified bundle; this record is what every party reads to know where:

    requested  `criuctl migrate` chose the target and is about to delete the pod
    dumping    the pod's preStop is checkpointing it into bundle `bundle` on the source node
    kept       the bundle is kept (verified) on `holder`; the next pod of this name is pinned there
               as a placeholder, and holder's agent restores the bundle into it
    pulling    (post-copy) the job runs in its successor on `holder`, which pulls its memory pages
               from the source's page server (`pages`); the job lives on both nodes until the last
               page is in: then the record goes, as after a stop-and-copy restore
    failed     nothing more will be tried: `note` says why and where the bundle is

Post-copy (`mode`, the default where both nodes have userfaultfd): the bundle holds everything but
the memory pages, which the source's dump keeps serving from its page pipes once the tree has
ended (criuctl.agent.pageserving); a restore, on the target or back on the source, pulls them.

The record lives in the API server (etcd), not on a node: it survives any agent, the CLI and
either node. It is written before each step whose crash it must explain, and updated with the
ConfigMap's resourceVersion, so two writers never both think they advanced it.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import time
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from typing import Any

from criuctl.kube.cluster import SYSTEM_NS, Cluster, NotFound, call

LABEL = "criuctl.io/move"  # on every record: they are listed by it

# the successor path's steps, each stamped when it ended (`Move.stamp`): the preStop began; the
# job was dumped (frozen from inside `checkpoint`); its pod was deleted; the bundle was kept on the
# holder; the holder's loop saw the successor's placeholder run; the restored job runs; (post-copy)
# its last memory page is in
STEPS = ("prestop", "checkpoint", "deleted", "kept", "successor", "running", "pages")

# bundles whose preStop is at work in this process: the moves loop leaves their records alone
# (a record `dumping` whose pod is gone is otherwise one whose preStop died: its loop finishes it)
AT_WORK: set[str] = set()


class Phase(StrEnum):
    REQUESTED = "requested"
    DUMPING = "dumping"
    KEPT = "kept"
    PULLING = "pulling"
    FAILED = "failed"


@dataclass
class Move:
    namespace: str
    pod: str  # its identity (criuctl.kube.owners.identity): the name, or an Indexed Job pod's HOST.SUBDOMAIN
    uid: str  # the source pod's UID: its successor has another
    source: str  # node
    container: str
    phase: Phase
    target: str = ""  # the node asked for; empty until one is chosen
    holder: str = ""  # the node keeping the verified bundle (kept)
    bundle: str = ""  # the bundle's id (32 hex digits), chosen before the dump
    since: float = 0.0  # when the record was first written (time.time())
    size: int = 0  # the bundle's bytes, once kept
    freeze: float = 0.0  # seconds the dump held the job frozen, once kept
    note: str = ""
    # a job's rank (a worker with TCP connections to its peers, criuctl.kube.jobmoves): the pod's
    # address when it was dumped, and its connections then, as JSON (`criuctl.net.peers.Endpoints`)
    address: str = ""
    tcp: str = ""
    # [[old, port, new], ...] as JSON: peers that moved before it, whose address its sockets still
    # hold (its pod's redirects sent them on); its restore re-addresses them too
    rewired: str = ""
    # a rank's place in the order its job's moving ranks dump in (criuctl.kube.prestop.take_turn):
    # 0 while it is being chosen, then one more than any other record's when it was chosen
    turn: int = 0
    source_pod: str = ""  # the source pod's own name (a JobSet's pod's is not `pod`)
    selector: str = (
        ""  # an Indexed Job pod's: the labels of its index (mutate.same_index), to find its pods by
    )
    # {step: time.time()} as JSON: when each step of the successor path ended (`STEPS`)
    stamps: str = ""
    braced: int = 0  # the staying peers' sockets whose backoff was bounded (criuctl.net.rto)
    mode: str = ""  # post-copy or stop-and-copy ("" as asked: post-copy where both nodes can)
    # post-copy: HOST:PORT of the page server on the source, and its certificate (PEM, pinned)
    pages: str = ""
    page_cert: str = ""
    memory: int = 0  # the job's memory (RSS) when it was dumped: what a post-copy restore pulls
    pulled: int = 0  # post-copy: how much of it is on the holder so far (the restored job's RSS)
    version: str = ""  # the ConfigMap's resourceVersion this was read at ("" for a new one)

    @property
    def name(self) -> str:
        """The source pod's name (a record written before `source_pod` existed: `pod`)."""
        return self.source_pod or self.pod

    @property
    def key(self) -> str:
        return record_name(self.namespace, self.pod)

    def stamp(self, step: str, at: float | None = None) -> None:
        """Note that `step` (one of `STEPS`) ended now (or `at`, a time.time() another process took);
        saved with the record's next write."""
        self.stamps = json.dumps({**json.loads(self.stamps or "{}"), step: at or time.time()})

    def breakdown(self) -> list[tuple[str, float]]:
        """Seconds each step of the successor path took, in order, for those stamped: what the job's
        stall is made of (`docs/kubernetes.md`, "The successor path's stall")."""
        at = json.loads(self.stamps or "{}")
        done = [(step, at[step]) for step in STEPS if step in at]
        return [(step, t - prev) for (_, prev), (step, t) in itertools.pairwise(done)]

    def downtime(self) -> float | None:
        """Seconds the job was stopped: from its freeze (inside the checkpoint step) until it ran
        again in the successor; None until it runs."""
        at = json.loads(self.stamps or "{}")
        if "running" not in at or "checkpoint" not in at:
            return None
        return float(at["running"] - (at["checkpoint"] - self.freeze))

    def copies(self) -> list[str]:
        """The nodes that may hold the bundle: the holder first, then the source's own copy."""
        return list(dict.fromkeys(n for n in (self.holder, self.source) if n))


def record_name(namespace: str, pod: str) -> str:
    """`move.NAMESPACE.POD` (POD: the pod's identity): unambiguous (a namespace has no dots),
    hashed when too long."""
    name = f"move.{namespace}.{pod}"
    return name if len(name) <= 253 else "move." + hashlib.sha256(name.encode()).hexdigest()


def _from(cm) -> Move:
    return _parse(dict(cm.data or {}), cm.metadata.resource_version)


def _parse(data: dict[str, str], version: str | None) -> Move:
    kw: dict[str, Any] = {f.name: data[f.name] for f in fields(Move) if f.name in data}
    kw["phase"] = Phase(kw["phase"])
    kw["since"] = float(kw.get("since") or 0)
    kw["size"] = int(kw.get("size") or 0)
    kw["freeze"] = float(kw.get("freeze") or 0)
    kw["braced"] = int(kw.get("braced") or 0)
    kw["turn"] = int(kw.get("turn") or 0)
    kw["memory"] = int(kw.get("memory") or 0)
    kw["pulled"] = int(kw.get("pulled") or 0)
    kw["version"] = version or ""
    return Move(**kw)


def is_record(labels: dict[str, str] | None) -> bool:
    """Whether a ConfigMap of criuctl's namespace is a move record: labelled as criuctl writes them.
    One without the label is not (the webhook that judges every write selects records by it)."""
    return (labels or {}).get(LABEL) == "true"


def from_object(obj: dict[str, Any] | None) -> Move | None:
    """The record a ConfigMap of criuctl's namespace (as JSON: an AdmissionReview's object) holds;
    None if it is none.
    ValueError, KeyError or TypeError for one labelled a record but not as criuctl writes them."""
    meta = (obj or {}).get("metadata") or {}
    if obj is None or not is_record(meta.get("labels")):
        return None
    return _parse(dict(obj.get("data") or {}), meta.get("resourceVersion"))


def read(c: Cluster, namespace: str, pod: str) -> Move | None:
    try:
        cm = call("a move record", c.core.read_namespaced_config_map, record_name(namespace, pod), SYSTEM_NS)
    except NotFound:
        return None
    return _from(cm) if is_record(cm.metadata.labels) else None


def every(c: Cluster) -> list[Move]:
    cms = call("the move records", c.core.list_namespaced_config_map, SYSTEM_NS, label_selector=LABEL)
    return [_from(cm) for cm in cms.items if is_record(cm.metadata.labels)]


def save(c: Cluster, m: Move) -> Move:
    """Create (m.version empty) or update the record at the version it was read; a concurrent
    writer makes this raise (409) rather than be overwritten."""
    from kubernetes import client

    data = {k: str(v) for k, v in asdict(m).items() if k != "version"}
    data["since"] = repr(m.since or time.time())
    meta = client.V1ObjectMeta(
        name=m.key, namespace=SYSTEM_NS, labels={LABEL: "true"}, resource_version=m.version or None
    )
    body = client.V1ConfigMap(metadata=meta, data=data)
    if m.version:
        cm = call("a move record", c.core.replace_namespaced_config_map, m.key, SYSTEM_NS, body)
    else:
        cm = call("a move record", c.core.create_namespaced_config_map, SYSTEM_NS, body)
    return _from(cm)


def forget(c: Cluster, m: Move) -> None:
    from kubernetes import client

    opts = client.V1DeleteOptions(preconditions=client.V1Preconditions(resource_version=m.version or None))
    with contextlib.suppress(NotFound):
        call("a move record", c.core.delete_namespaced_config_map, m.key, SYSTEM_NS, body=opts)
