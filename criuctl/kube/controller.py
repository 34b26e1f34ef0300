"""The migration controller (`criuctl controller`, manifests/controller.yaml): carries out every
`PodMigration` (criuctl.kube.podmigrations) with the orchestration `criuctl migrate POD NODE` ran
in the client before (criuctl.kube.podplan, criuctl.kube.podmigrate), from inside the cluster, so
that users need the API server and RBAC on `podmigrations` only: the agents' token and the nodes'
addresses never leave the cluster.

Built on kopf (the operator framework this code base's style notes follow): kopf watches the
objects, runs one handler at a time per object, retries a handler that raised, and keeps the
finalizer that makes a deletion wait for the move. What kopf does not do is elect a leader — its
"peering" pauses operators by priority, with no lease — so one active replica is chosen the
Kubernetes way, through a `coordination.k8s.io` Lease held with the official client's
`leaderelection` (its LeaseLock, given criuctl's bounded API object: criuctl.kube.api). A replica
starts kopf only once it holds the Lease and ends its process the moment it cannot renew it (as
client-go's controllers do): the renew deadline is shorter than the lease, so a deposed leader has
stopped before another can take over.

Every phase is written into the object's status before the step it names (podmigrations'
table); a controller that starts takes each unfinished object up where its status says (`carry`):

    Pending, Checking        nothing was changed: the checks run (again)
    Placing                  the placeholder may exist, the job was not touched: it is deleted and
                             the move fails ("nothing moved"); a controller's pod: its move record
                             and delete are made (again) and followed
    Migrating, InDoubt       the agents settle it by themselves (docs/architecture.md): asked with
                             the recorded ids where the job runs, the move is handed over or undone
    HandingOver              the source pod is deleted (again), the new one stamped: Succeeded
"""

from __future__ import annotations

import contextlib
import datetime
import http.server
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from criuctl.agent import grants
from criuctl.client import migrate as agent_migrate
from criuctl.client.agents import Node, granted
from criuctl.core import env, statedir, tokens
from criuctl.core.errors import CriuctlError
from criuctl.kube import events, identity, movemetrics, moves, owners, podmigrate, podmigrations, podplan
from criuctl.kube.cluster import SYSTEM_NS, Cluster, Conflict, NotFound, agent_for, agent_of, call, connect
from criuctl.kube.movemetrics import METRICS
from criuctl.kube.podmigrations import COMMITTED, Phase

log = logging.getLogger("criuctl.controller")

FINALIZER = "criuctl.io/podmigration"
PROGRESS_EVERY = 0.5  # seconds between two writes of the transfer's progress into a status
IN_DOUBT_RETRY = 15  # seconds before a move the agents have not settled yet is asked about again


@dataclass(frozen=True)
class Options:
    kubeconfig: str | None = None
    lease: str = "criuctl-controller"
    lease_namespace: str = SYSTEM_NS
    identity: str = field(default_factory=lambda: f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}")
    # client-go's defaults: a replica that cannot renew within 10 s stops; another takes over after 15
    lease_seconds: int = 15
    renew_seconds: int = 10
    retry_seconds: int = 2
    health: str = "0.0.0.0:8081"  # /healthz: "leading" or "standby"; /metrics
    metrics_token_file: Path | None = None  # the scrape credential /metrics asks for (None: open)
    tls_from_cluster: bool = False  # its certificate from criuctl's signer: what it shows the agents


class _Latest(threading.Thread):
    """The newest progress of one move, written by a thread of its own, at most every
    PROGRESS_EVERY: the migration never waits on it (a status write in the job's downtime, between
    its freeze and its restore, would lengthen it by an API call)."""

    def __init__(self, write: Callable[[dict[str, Any]], object]) -> None:
        super().__init__(daemon=True, name="progress")
        self.write = write
        self.cv = threading.Condition()
        self.pending: dict[str, Any] | None = None
        self.closed = False

    def put(self, facts: dict[str, Any]) -> None:
        with self.cv:
            self.pending = facts
            self.cv.notify()

    def run(self) -> None:
        while True:
            with self.cv:
                while self.pending is None and not self.closed:
                    self.cv.wait()
                if self.closed:
                    return
                facts, self.pending = self.pending, None
            with contextlib.suppress(CriuctlError, Deposed):  # a courtesy; the phase is the record
                self.write(facts)
            time.sleep(PROGRESS_EVERY)

    def close(self) -> None:
        """No more writes: one under way ends first (it may not land after the final status)."""
        with self.cv:
            self.closed = True
            self.cv.notify()
        if self.is_alive():
            self.join(timeout=40)


def progress_text(step: str, done: int | None, total: int | None) -> str:
    """The PROGRESS column: the step, and how far in bytes when it has a size (post-copy's pages,
    a transfer)."""
    if done is None or not total:
        return step
    unit, div = ("GiB", 1 << 30) if total >= 1 << 30 else ("MiB", 1 << 20)
    return f"{step} {done / div:.1f}/{total / div:.1f} {unit} ({100 * done // total}%)"


TTL_EVERY = 10.0  # s between the leader's sweeps for finished PodMigrations past their TTL


class Deposed(Exception):
    """This replica's status write found the object changed by another and the Lease held by
    another (or run out): it no longer leads, and stops before it acts again."""


@dataclass(frozen=True)
class Fence:
    """Who this replica is, and the Lease that makes it the leader. Leader election alone does not
    keep a deposed leader from writing: a replica paused (a stopped VM, a long GC, SIGSTOP) past its
    Lease runs on, for a moment, as if it still led. So every status write is conditional on the
    resourceVersion its writer read (`Journal.write`); one that finds the object changed asks the
    Lease: held by another or run out, the write is dropped and the replica stops (`Deposed`)."""

    me: str
    lease: str = ""  # "" (the unit tests): no Lease to ask, the writer leads
    namespace: str = SYSTEM_NS
    seconds: int = 15

    def holds(self, c: Cluster) -> bool:
        if not self.lease:
            return True
        got = call(
            f"lease {self.namespace}/{self.lease}",
            c.coordination.read_namespaced_lease,
            self.lease,
            self.namespace,
        )
        spec = got.spec
        if spec is None or spec.holder_identity != self.me or spec.renew_time is None:
            return False
        renewed = spec.renew_time
        if renewed.tzinfo is None:  # a MicroTime is UTC; a client that parsed it naive still means UTC
            renewed = renewed.replace(tzinfo=datetime.UTC)
        age = (datetime.datetime.now(datetime.UTC) - renewed).total_seconds()
        return age < (spec.lease_duration_seconds or self.seconds)


class Journal:
    """A PodMigration's status, written before each step: the phase, with the facts known by then."""

    def __init__(self, c: Cluster, obj: dict, fence: Fence) -> None:
        self.c, self.obj, self.fence = c, obj, fence
        self.ns, self.name = obj["metadata"]["namespace"], obj["metadata"]["name"]
        self.lock = threading.Lock()  # the progress thread's writes and the phases', one at a time
        self.latest = _Latest(self.write)

    @property
    def me(self) -> str:
        return self.fence.me

    @property
    def status(self) -> dict[str, Any]:
        return self.obj.get("status") or {}

    def write(self, status: dict[str, Any]) -> None:
        """Merge `status`, conditional on the object as last read or written here (`Fence`). A
        conflict while this replica holds the Lease is another writer's annotation (a cancel,
        kopf's bookkeeping): read again and write on what is there."""
        with self.lock:
            for _ in range(3):
                version = (self.obj.get("metadata") or {}).get("resourceVersion")
                try:
                    self.obj = podmigrations.patch_status(self.c, self.ns, self.name, status, version=version)
                    return
                except Conflict:
                    if not self.fence.holds(self.c):
                        raise Deposed(
                            f"podmigration {self.ns}/{self.name} changed and the Lease is not {self.me}'s: "
                            "another replica leads"
                        ) from None
                    self.obj = podmigrations.read(self.c, self.ns, self.name)
            raise Conflict(f"podmigration {self.ns}/{self.name} kept changing under its writes", "retried")

    def seen(self) -> dict[str, Any]:
        """`observedGeneration`: the spec this status is about (one generation per PodMigration:
        its spec does not change once it is taken up)."""
        gen = podmigrations.generation(self.obj)
        return {} if gen is None else {"observedGeneration": gen}

    def __call__(self, phase: Phase, **facts: Any) -> None:
        """Phase `phase` begins (or goes on with `facts` learnt): recorded, with an Event on entry."""
        entered = podmigrations.phase_of(self.obj) != phase
        status: dict[str, Any] = {"phase": str(phase), "controller": self.me, **self.seen(), **facts}
        if phase == Phase.HANDING_OVER and entered:
            status["conditions"] = podmigrations.condition(
                self.obj, COMMITTED, "TargetRunning", f"the job runs on node {self.status.get('target')}"
            )
        self.write(status)
        if entered:
            METRICS.phases.labels(str(phase)).inc()
            log.info("phase", extra={"podmigration": f"{self.ns}/{self.name}", "phase": str(phase)})
            events.record(self.c, self.obj, events.Reason.PHASE, f"{phase}")

    def scope(self) -> grants.Scope | None:
        """What this move's grant covers, as the status says once the move is planned: the pod
        (by its UID) and the nodes it involves; None before (no agent call but reads needs one)."""
        st = self.status
        uid, pod = st.get("sourceUID"), st.get("pod")
        nodes = tuple(n for n in (st.get("source"), st.get("target")) if n)
        return (self.ns, pod, uid, nodes) if uid and pod and nodes else None

    def progress(self, step: str, done: int | None = None, total: int | None = None) -> None:
        """The orchestration's progress (render.migration_progress's steps), for `criuctl migrate`
        to show; never waited on (_Latest)."""
        if not self.latest.is_alive() and not self.latest.closed:
            self.latest.start()
        self.latest.put(
            {"step": step, "stepDone": done, "stepTotal": total, "progress": progress_text(step, done, total)}
        )

    def close(self) -> None:
        self.latest.close()

    def ended(
        self, phase: Phase, reason: str, hint: str = "", code: int = 0, word: str = "", **facts: Any
    ) -> None:
        """`word`: the condition's reason (default: from `code`, `_reason_word`)."""
        self.close()
        kind = podmigrations.SUCCEEDED if phase == Phase.SUCCEEDED else podmigrations.FAILED
        why = "Moved" if phase == Phase.SUCCEEDED else word or _reason_word(code)
        self.write(
            {
                "phase": str(phase),
                "controller": self.me,
                **self.seen(),
                "conditions": podmigrations.condition(self.obj, kind, why, reason),
                "reason": reason[:1000],
                "hint": hint[:1000],
                "exitCode": code,
                "finishedAt": podmigrations.now(),
                "window": "",  # a move that ended depends on one node only
                **facts,
            }
        )
        METRICS.ended.labels(str(phase)).inc()
        kind = events.Reason.MIGRATED if phase == Phase.SUCCEEDED else events.Reason.FAILED
        events.record(self.c, self.obj, kind, reason)

    def succeeded(
        self, result: agent_migrate.MigrationResult | None, reason: str, downtime: float | None = None
    ) -> None:
        facts: dict[str, Any] = {"step": "done", "progress": "done"}
        if downtime is not None:  # taken over: what the source's agent measured
            facts.update(downtimeSeconds=downtime, downtime=podmigrations.downtime_text(downtime))
        if result is not None:
            facts.update(
                result=asdict(result),
                mode=result.mode,
                downtimeSeconds=result.downtime_seconds,
                downtime=podmigrations.downtime_text(result.downtime_seconds),
                bytesMoved=result.bytes_moved,
            )
            METRICS.bytes.inc(result.bytes_moved)
        if facts.get("downtimeSeconds") is not None:
            METRICS.downtime.observe(facts["downtimeSeconds"])
        self.ended(Phase.SUCCEEDED, reason, **facts)

    def failed(self, exc: CriuctlError) -> None:
        self.ended(Phase.FAILED, exc.what, exc.hint, exc.exit_code, getattr(exc, "reason_word", ""))


def _reason_word(code: int) -> str:
    """A Failed condition's reason, CamelCase as Kubernetes' are, from `criuctl migrate`'s exit code
    (README, "Exit codes"): what kind of failure, for a selector or an alert."""
    words = {2: "NotMigratable", 3: "NotFound", 4: "MoveFailed", 5: "InDoubt", 65: "NotCheckpointable"}
    return words.get(code, "MoveFailed")


class Retry(Exception):
    """The move is in doubt: the controller asks the agents again after `delay` seconds."""

    def __init__(self, what: str, delay: float = IN_DOUBT_RETRY) -> None:
        super().__init__(what)
        self.delay = delay


def _moved_to(j: Journal, result: agent_migrate.MigrationResult) -> str:
    st = j.status
    return (
        f"pod {st.get('pod') or j.obj['spec']['pod']} runs as pod {st.get('newPod')} on node {result.target}"
    )


def _others_moving(c: Cluster, obj: dict) -> list[str]:
    """Other PodMigrations of the same pod that a controller has taken up and not finished."""
    ns, pod = obj["metadata"]["namespace"], obj["spec"]["pod"]
    return [
        o["metadata"]["name"]
        for o in podmigrations.every(c, ns)
        if o["metadata"]["name"] != obj["metadata"]["name"]
        and (o.get("spec") or {}).get("pod") == pod
        and podmigrations.phase_of(o) not in (Phase.PENDING, Phase.SUCCEEDED, Phase.FAILED)
    ]


def _prestop(c: Cluster, j: Journal) -> None:
    """A move a pod's preStop started (a drain): followed, never acted on (the agents carry it).
    Only one the record shows: the annotation alone (anyone who may create PodMigrations can write
    it) must not make the controller report a move that never happened."""
    notes = j.obj["metadata"].get("annotations") or {}
    pod, source, uid = (
        j.obj["spec"]["pod"],
        notes.get(podmigrations.SOURCE_NODE, ""),
        notes.get(podmigrations.SOURCE_UID),
    )
    ident = notes.get(podmigrations.SOURCE_IDENTITY) or pod
    m = moves.read(c, j.ns, ident)
    live = owners.current(c, j.ns, ident, not_uid=uid or "") or {}
    came = (live.get("metadata", {}).get("annotations") or {}).get(events.MIGRATED_FROM)
    if (m is None or m.uid != uid) and came != f"{j.ns}/{pod}@{source}":
        raise podplan.NotMigratable(
            f"no move of pod {pod} by a preStop hook is recorded: this PodMigration was not made by one",
            "to move the pod, create a PodMigration without the criuctl.io/origin annotation",
        )
    j(
        Phase.MIGRATING,
        pod=pod,
        target=j.obj["spec"]["node"],
        source=source,
        sourceUID=uid or "",
        identity=ident,
        via="successor",
        startedAt=j.obj["metadata"].get("creationTimestamp") or podmigrations.now(),
    )
    _resume_owned(c, j, Phase.MIGRATING)


def _fresh(c: Cluster, j: Journal) -> None:
    spec = j.obj["spec"]
    ns = j.ns
    if (j.obj["metadata"].get("annotations") or {}).get(podmigrations.ORIGIN) == podmigrations.PRESTOP:
        _prestop(c, j)
        return
    j(Phase.CHECKING, pod=spec["pod"], target=spec["node"], startedAt=podmigrations.now())
    others = _others_moving(c, j.obj)
    if others:
        raise podplan.NotMigratable(
            f"pod {spec['pod']} is being moved by podmigration {others[0]}",
            f"wait for it: `kubectl -n {ns} get podmigration {others[0]}`",
        )
    p = podplan.plan(c, ns, spec["pod"], spec["node"])
    via = "successor" if p.owner else "placeholder"
    checked = podmigrations.condition(
        j.obj, podmigrations.CHECKED, "ChecksPassed", f"{via}, {p.memory_needed >> 20} MiB"
    )
    j(
        Phase.CHECKING,
        source=p.source,
        target=p.target,
        container=p.container,
        workload=p.workload,
        newPod=p.placeholder_name,
        via=via,
        owner=p.owner,
        identity=p.identity or p.pod,
        sourceUID=p.source_pod["metadata"]["uid"],
        conditions=checked,
    )
    if spec.get("dryRun"):
        how = f"through its successor ({p.owner} recreates it)" if p.owner else f"as pod {p.placeholder_name}"
        said = (
            f"would move pod {ns}/{p.pod} ({p.workload}) from node {p.source} to node {p.target} {how}; "
            f"{p.memory_needed >> 20} MiB of {p.memory_free >> 20} MiB free there; nothing was changed"
        )
        j.ended(Phase.SUCCEEDED, said, plan=p.summary())
        return
    if p.owner:
        result = podmigrate.execute_owned(c, p, j.progress, j, spec.get("mode"))
    else:
        result = podmigrate.execute(c, p, spec.get("mode"), j.progress, j)
    j.succeeded(result, _moved_to(j, result))


def _resume_owned(c: Cluster, j: Journal, phase: Phase) -> None:
    st = j.status
    pod = podmigrate.read_pod(c, j.ns, st["pod"])
    mine = pod is not None and pod["metadata"]["uid"] == st.get("sourceUID")
    if phase == Phase.PLACING and mine and not pod["metadata"].get("deletionTimestamp"):
        p = podplan.plan(c, j.ns, st["pod"], st["target"])  # not deleted yet: plan and ask again
        podmigrate.request_owned(c, p, j)
    started = time.time()
    with contextlib.suppress(ValueError, KeyError):
        import datetime

        started = datetime.datetime.fromisoformat(st["startedAt"].replace("Z", "+00:00")).timestamp()
    result = podmigrate.follow_owned(
        c,
        j.ns,
        st.get("identity") or st["pod"],
        st.get("sourceUID", ""),
        st.get("workload", ""),
        st.get("source", ""),
        j.progress,
        j,
        started,
    )
    j.succeeded(result, _moved_to(j, result))


def _agent_of(c: Cluster, node: str) -> Node | None:
    """The agent of node `node`; None when there is none to ask (the caller then knows less)."""
    with contextlib.suppress(CriuctlError):
        return agent_of(c, node)
    return None


class Cancelled(agent_migrate.MigrationFailed):
    """A person cancelled the move, and it ended with the job where it was (Failed, Cancelled)."""

    reason_word = "Cancelled"


def _where_it_runs(c: Cluster, j: Journal) -> tuple[str | None, str]:
    """Where the job of a move taken up mid-way runs (`podmigrate.take_up`), and, for a cancelled
    one whose target is fenced (deleted, or tainted out-of-service) and silent, why the source
    settled it. None while nobody can tell yet: a node or agent that cannot be reached is asked
    again, never taken for a failure (the job may be frozen on the source all that while)."""
    st = j.status
    source, target = st["source"], st["target"]
    ids = (st.get("outgoingId") or None, st["incomingId"])
    try:
        src = agent_of(c, source)
        try:
            target_node: dict | None = c.serialize(call(f"node {target}", c.core.read_node, target))
        except NotFound:
            target_node = None
    except CriuctlError as exc:  # the source's Node or agent away: its job may be frozen there
        log.warning("in doubt", extra={"podmigration": f"{j.ns}/{j.name}", "error": exc.what})
        return None, ""
    who, fenced = podmigrations.cancelled(j.obj), podmigrate.fence(target_node, target)
    if who is not None and fenced is not None:  # first: the source asks the target once more itself
        declared = f"{fenced}; podmigration {j.ns}/{j.name} cancelled by {who}"
        with contextlib.suppress(CriuctlError):
            if podmigrate.settle_fenced(src, st.get("workload", ""), declared) == source:
                return source, fenced
    with contextlib.suppress(CriuctlError):
        if target_node is not None:
            return podmigrate.take_up(src, agent_for(c, target_node), ids, st.get("workload", "")), ""
        # no target to ask: the source may have settled it with the target before it went
        return podmigrate.source_settled(src, ids[0]), ""
    return None, ""


def _resume_placeholder(c: Cluster, j: Journal, phase: Phase) -> None:
    st = j.status
    ns, pod, new, source, target = j.ns, st["pod"], st.get("newPod", ""), st["source"], st["target"]
    if phase == Phase.PLACING or (phase == Phase.MIGRATING and not st.get("incomingId")):
        why = "the controller restarted before the job was frozen: nothing moved"
        podmigrate.undo_placing(c, ns, pod, new, source, why)
        raise agent_migrate.MigrationFailed(
            why, f"pod {pod} keeps running on {source}; create the PodMigration again"
        )
    if phase in (Phase.MIGRATING, Phase.IN_DOUBT):
        where, fenced = _where_it_runs(c, j)
        if where is None:
            why = "the agents have not settled yet where the job runs"
            if podmigrations.cancelled(j.obj):
                why = (
                    f"cancelled, but node {target} neither answers nor is declared down; once it is off "
                    f"for good, delete its Node or taint it {podmigrate.OUT_OF_SERVICE}:NoExecute and "
                    f"the job runs on node {source} again"
                )
            j(Phase.IN_DOUBT, reason=why)
            raise Retry(f"podmigration {j.ns}/{j.name}: the agents have not settled it yet")
        if where == source:
            why = (
                f"cancelled: {fenced}, and the job runs on node {source} again"
                if fenced
                else "the controller restarted mid-move; the agents settled it"
            )
            podmigrate.undo_placing(c, ns, pod, new, source, why)
            err = (Cancelled if fenced else agent_migrate.MigrationFailed)(
                why, f"pod {pod} keeps running on {source}; the placeholder was deleted"
            )
            raise err
        j(Phase.HANDING_OVER)
    # what the source's agent measured; none if it cannot say (its agent away, the move forgotten):
    # the status then shows no downtime rather than a guess
    og = st.get("outgoingId") or None
    src_agent = _agent_of(c, source)
    downtime = None if src_agent is None else agent_migrate.source_downtime(src_agent, og)
    how = "" if downtime is None else f" (downtime {downtime:.2f} s)"
    podmigrate.hand_over(c, ns, pod, new, source, target, how, None if src_agent is None else (src_agent, og))
    reason = f"pod {pod} runs as pod {new} on node {target} (taken over after a controller restart)"
    j.succeeded(None, reason, downtime)


def carry(c: Cluster, obj: dict, fence: Fence, deleting: bool = False, mine: Path | None = None) -> None:
    """Carry PodMigration `obj` to its end from the phase its status records. Raises Retry while
    the agents have not settled a move in doubt; every other outcome ends in the status. `mine`:
    the controller's identity file, whose key signs the move's grant each agent call shows."""
    obj = podmigrations.read(c, obj["metadata"]["namespace"], obj["metadata"]["name"])  # its latest status
    phase = podmigrations.phase_of(obj)
    if phase.final:
        return
    j = Journal(c, obj, fence)
    try:
        with granted(None if mine is None else grants.Granter(j.scope, lambda: grants.Signing.load(mine))):
            _carry(c, j, phase, deleting)
    finally:
        j.close()


def _carry(c: Cluster, j: Journal, phase: Phase, deleting: bool) -> None:
    try:
        if phase in (Phase.PENDING, Phase.CHECKING):
            if deleting:
                j.ended(Phase.FAILED, "deleted before its move began: nothing was changed", code=4)
                return
            if who := podmigrations.cancelled(j.obj):
                said = f"cancelled by {who} before its move began: nothing was changed"
                j.ended(Phase.FAILED, said, code=4, word=Cancelled.reason_word)
                return
            _fresh(c, j)
        elif j.status.get("via") == "successor":
            _resume_owned(c, j, phase)
        else:
            _resume_placeholder(c, j, phase)
    except agent_migrate.MigrationInDoubt as exc:
        j.write(
            {
                "phase": str(Phase.IN_DOUBT),
                "controller": j.me,
                "reason": exc.what,
                "hint": exc.hint,
                "exitCode": exc.exit_code,
            }
        )
        raise Retry(exc.what) from exc
    except Retry:
        raise
    except CriuctlError as exc:
        j.failed(exc)


# ---- kopf and the Lease


def _handlers(c: Cluster, fence: Fence, mine: Path | None = None) -> Any:
    """The kopf registry of this controller's handlers."""
    import kopf

    registry = kopf.OperatorRegistry()
    resource = (podmigrations.GROUP, podmigrations.VERSION, podmigrations.PLURAL)

    def handle(body: Any, deleting: bool = False) -> None:
        try:
            carry(c, dict(body), fence, deleting, mine)
        except Retry as exc:
            raise kopf.TemporaryError(str(exc), delay=exc.delay) from exc
        except Deposed as exc:
            log.error("deposed: stopping", extra={"why": str(exc)})
            os._exit(1)  # as on a lost Lease (`_elect`): nothing more of this replica may act

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        t = c.core.timeouts
        settings.posting.enabled = False  # criuctl's own Events say what happened, in its words
        settings.persistence.finalizer = FINALIZER
        settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.criuctl.io")
        settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="kopf.criuctl.io")
        settings.networking.connect_timeout = t.connect
        settings.networking.request_timeout = t.read
        settings.watching.server_timeout = 120
        settings.watching.client_timeout = 150
        settings.execution.max_workers = 32  # moves of different pods run side by side
        # the one resource is known: no watch of every CRD (which would need RBAC on them all)
        settings.scanning.disabled = True

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> Any:
        return _connection(c)

    @kopf.on.create(*resource, id="carry", registry=registry)
    def created(body: Any, **_: Any) -> None:
        handle(body)

    @kopf.on.resume(*resource, id="resume", registry=registry)
    def resumed(body: Any, **_: Any) -> None:
        handle(body)

    @kopf.on.delete(*resource, id="settle", registry=registry)
    def deleted(body: Any, **_: Any) -> None:
        handle(body, deleting=True)

    return registry


def _expire_forever(c: Cluster) -> None:
    """The leader's TTL sweep: every TTL_EVERY, one list of the PodMigrations, and each that ended
    more than its `ttlSecondsAfterFinished` ago deleted (as the TTL controller does a Job). A kopf
    timer filtered on the status never fired on the real controller (CI): a plain loop does."""
    while True:
        time.sleep(TTL_EVERY)
        try:
            for obj in podmigrations.every(c):
                if podmigrations.expired(obj, time.time()):
                    meta = obj["metadata"]
                    log.info("ttl: deleting", extra={"podmigration": f"{meta['namespace']}/{meta['name']}"})
                    podmigrations.delete(c, meta["namespace"], meta["name"])
        except CriuctlError as exc:  # the API server away a moment: the next sweep asks again
            log.warning("ttl sweep", extra={"error": exc.what})


def _connection(c: Cluster) -> Any:
    """kopf's credentials from the official client's configuration (criuctl.kube.api): one source
    for both. kopf's own in-cluster login names the API server `kubernetes.default.svc`, which needs
    cluster DNS; the official client uses the address the kubelet gives every pod. Asked again on a
    401, so a service-account token the kubelet rotated is read anew."""
    import kopf

    cfg = c.core.api_client.configuration
    if cfg.refresh_api_key_hook is not None:
        cfg.refresh_api_key_hook(cfg)
    keys = cfg.api_key or {}
    auth = keys.get("BearerToken") or keys.get("authorization") or ""
    token = auth.split(" ", 1)[1].strip() if auth.lower().startswith("bearer ") else auth or None
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        token=token,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        default_namespace=c.namespace,
    )


class _Health(http.server.BaseHTTPRequestHandler):
    """/healthz ("leading" or "standby") and /metrics (movemetrics, behind the scrape token)."""

    leading = threading.Event()
    metrics_token: str | None = None
    waiting = ""  # why a standby cannot lead yet (no certificate from criuctl's signer), for /healthz

    def do_GET(self) -> None:
        status, kind = 200, "text/plain; charset=utf-8"
        if self.path == "/metrics":
            if movemetrics.authorized(self.headers.get("Authorization", ""), self.metrics_token):
                body, kind = METRICS.page(), METRICS.content_type
            else:
                status, body = 401, b"the scrape token (--metrics-token-file) is needed\n"
        else:
            said = "leading" if self.leading.is_set() else f"standby{self.waiting and ': ' + self.waiting}"
            body = f"{said}\n".encode()
            status = 200 if self.path == "/healthz" else 404
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


def _serve_health(listen: str, metrics_token: str | None = None) -> http.server.ThreadingHTTPServer:
    host, _, port = listen.rpartition(":")
    _Health.metrics_token = metrics_token
    srv = http.server.ThreadingHTTPServer((host or "0.0.0.0", int(port)), _Health)
    threading.Thread(target=srv.serve_forever, daemon=True, name="health").start()
    return srv


def _elect(c: Cluster, o: Options, leading: threading.Event) -> None:
    """Hold the Lease (the official client's leader election); end the process when it is lost."""
    from kubernetes.leaderelection import electionconfig, leaderelection
    from kubernetes.leaderelection.resourcelock.leaselock import LeaseLock

    lock = LeaseLock(o.lease, o.lease_namespace, o.identity)
    lock.api_instance = c.coordination  # criuctl's bounded API object, not the client's default one

    def lost() -> None:
        log.error("lost the lease: stopping", extra={"lease": f"{o.lease_namespace}/{o.lease}"})
        os._exit(1)  # kopf's handlers stop mid-step; the next leader takes them up from their status

    cfg = electionconfig.Config(lock, o.lease_seconds, o.renew_seconds, o.retry_seconds, leading.set, lost)
    leaderelection.LeaderElection(cfg).run()
    lost()


def check(o: Options) -> None:
    """Options the election would refuse by exiting (the client's Config calls sys.exit): one line."""
    podplan.check_name("lease", o.lease)
    podplan.check_name("namespace", o.lease_namespace)
    if not (o.retry_seconds >= 1 and o.retry_seconds * 1.2 < o.renew_seconds < o.lease_seconds):
        raise CriuctlError(
            f"lease {o.lease_seconds} s, renew {o.renew_seconds} s, retry {o.retry_seconds} s do not fit",
            "need 1 <= retry, retry * 1.2 < renew < lease (the defaults: 2, 10, 15)",
        )
    port = o.health.rpartition(":")[2]
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise CriuctlError(f"--health {o.health!r} is not HOST:PORT", "e.g. --health 0.0.0.0:8081")
    if o.metrics_token_file:
        tokens.read_token(o.metrics_token_file)


def _identity(o: Options) -> Path:
    """This replica's certificate from criuctl's signer, before it may lead: what it shows the
    agents (they take no token: criuctl.agent.callers) and signs grants with. Until the signer
    answers (it may start after this pod) the replica stays a standby, saying why each minute."""
    path = statedir.KUBE.ensure() / identity.CONTROLLER_FILE
    said = 0.0
    while identity.Identity(path).due():
        try:
            identity.issue_controller(o.kubeconfig, path)
        except CriuctlError as exc:
            _Health.waiting = f"no certificate from criuctl's signer yet ({exc.what})"
            if time.monotonic() - said > 60:
                said = time.monotonic()
                log.warning("no certificate from criuctl's signer yet", extra={"error": exc.line()})
            time.sleep(2)
    _Health.waiting = ""
    env.AGENT_IDENTITY.export(f"{path}:{path}")
    threading.Thread(
        target=identity.controller_renewal, args=(o.kubeconfig, path), daemon=True, name="identity"
    ).start()
    return path


def run(o: Options) -> None:
    """Serve /healthz, wait for the Lease, then carry out PodMigrations until the process ends."""
    import asyncio

    import kopf

    if o.kubeconfig:
        os.environ["KUBECONFIG"] = o.kubeconfig  # kopf's login reads it from there
    # kopf names itself after the user (getpass), which a container's numeric user has no name for
    os.environ.setdefault("USER", "criuctl-controller")
    logging.getLogger("leaderelection").setLevel(logging.WARNING)  # a line per try otherwise
    c = connect(o.kubeconfig)
    call("the API server", c.core.get_api_resources)  # one line now if it cannot be reached
    _serve_health(o.health, o.metrics_token_file and tokens.read_token(o.metrics_token_file))
    leading = _Health.leading
    mine = _identity(o) if o.tls_from_cluster else None
    threading.Thread(target=_elect, args=(c, o, leading), daemon=True, name="lease").start()
    log.info(
        "waiting for the lease", extra={"lease": f"{o.lease_namespace}/{o.lease}", "identity": o.identity}
    )
    leading.wait()
    log.info("leading", extra={"identity": o.identity})
    threading.Thread(target=_expire_forever, args=(c,), daemon=True, name="ttl").start()
    fence = Fence(o.identity, o.lease, o.lease_namespace, o.lease_seconds)
    asyncio.run(kopf.operator(registry=_handlers(c, fence, mine), standalone=True, clusterwide=True))
