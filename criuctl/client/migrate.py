"""`criuctl migrate NAME --to NODE`: drive the source and target agents through one migration.

    phase      source agent                 target agent                on failure
    -------    -------------------------    -------------------------   -----------------------------
    prepare                                 POST /incoming (ticket)     nothing frozen yet
    freeze     POST /outgoing: freeze …                                 source thaws, job runs on there
    transfer   … stream to target (ticket)  verify every byte           source thaws
    restore                                 restore, *stopped*          target kills its copy; source
                                                                        asks it, then thaws
    commit                                  let it run                  ask the target; see below
               end the tree (after asking
               the target; post-copy: once
               all pages are pulled)

The client never decides for the source once the bundle was sent: it tells the target, and the
source asks the target before it thaws or ends (`criuctl.agent.protocol`). The only moment the
outcome is unknown to the client is a commit whose answer is lost; then it asks the target for a
while, and if it stays silent says so — the source stays frozen, not lost, not doubled, and its
agent keeps asking the target until it can tell which side should run.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypedDict

from criuctl.agent import points
from criuctl.agent.messages import (
    ErrorAnswer,
    IncomingAnswer,
    IncomingRequest,
    IncomingStatus,
    NodeInfo,
    OutgoingEvent,
    OutgoingRequest,
    OutgoingStatus,
    RestoreRequest,
    Rows,
    StepAnswer,
)
from criuctl.agent.protocol import INCOMPLETE, Mode, Point, Ticket, timeouts
from criuctl.client.agents import AgentClient, AgentError, Node, NodeUnreachable
from criuctl.core import env
from criuctl.core.errors import CriuctlError
from criuctl.core.workloads import BadName, UnknownWorkload

Progress = Callable[..., None]  # progress(phase, **facts)


class MigrationFailed(CriuctlError):
    exit_code = 4
    # the job ended on its own while it was being frozen (WorkloadEnded): it runs nowhere, as
    # its own end decided, and no one may say it keeps running
    ended = False
    # the job runs on the source again, but its thaw did not complete (what is left): its agent
    # retries; the caller says so wherever it reports (an Event on Kubernetes)
    thaw_left: str | None = None


class MigrationInDoubt(CriuctlError):
    exit_code = 5
    # (source outgoing id, target incoming id): where a caller can watch the agents settle it
    ids: tuple[str | None, str] | None = None


STOP_AND_COPY, POST_COPY = Mode.STOP_AND_COPY, Mode.POST_COPY
MODES = tuple(str(m) for m in Mode)


@dataclass
class MigrationResult:
    workload: str
    source: str
    target: str
    mode: str
    # source frozen → running on the target: measured by the source agent, or — when the source did
    # not confirm its commit — by the client, from when the source said it froze to the target's
    # commit answer (`downtime_measured_by`); never the total time
    downtime_seconds: float
    total_seconds: float  # command start → source tree gone (post-copy: last page pulled)
    bytes_moved: int
    freeze_seconds: float
    transfer_seconds: float
    restore_seconds: float
    pages_seconds: float | None = None  # post-copy: commit → last page pulled
    source_confirmed: bool = True  # False: the source agent did not confirm that its copy ended
    # a controller's pod moved through a kept bundle into its recreated pod (criuctl.kube.podmigrate):
    # downtime and total are then the delete → running again, and only the freeze is known apart
    via_successor: bool = False
    # seconds per step inside freeze and restore (criu_dump, seal, verify, criu_restore, handoff…)
    phases: dict[str, float] = field(default_factory=dict)
    downtime_measured_by: str = "source"  # or "client" (the source did not confirm)


def _quiet(_phase: str, **_facts: object) -> None:
    pass


def choose_mode(wanted: str | None, source: NodeInfo, target: NodeInfo) -> str:
    """The mode to use: `wanted`, checked against both kernels, or the fastest both allow."""
    if wanted == POST_COPY or wanted is None:
        ok = source.get("lazy_pages") and target.get("lazy_pages")
        if ok:
            return POST_COPY
        if wanted == POST_COPY:
            lacking = source["node"] if not source.get("lazy_pages") else target["node"]
            raise MigrationFailed(
                f"post-copy needs userfaultfd, which node {lacking}'s kernel lacks",
                "use --mode stop-and-copy",
            )
    if wanted not in (None, *MODES):
        raise MigrationFailed(f"unknown mode {wanted!r}", f"choose one of {', '.join(MODES)}")
    return STOP_AND_COPY


def _check_target(dst: AgentClient) -> NodeInfo:
    info: NodeInfo = dst.get("/v1/info", timeout=10)
    if "criu_error" in info:
        raise MigrationFailed(
            f"node {dst.node.name} cannot restore: {info['criu_error']}",
            "install CRIU there (scripts/install-criu.sh); nothing was frozen",
        )
    return info


class _Measured(TypedDict):
    """What the client measures of one move's phases, on its own clock (and the bytes moved)."""

    bytes: int
    freeze: float
    transfer: float
    restore: float


class Move:
    """One workload's migration in phases: `migrate` runs them in a row; a job's move
    (`criuctl.client.jobmove`) runs each phase for every rank before the next.

    Each phase raises `MigrationFailed`/`MigrationInDoubt` with the hint a user needs; `undo` turns
    a failure after `prepare` into the error to raise once both sides are settled (target first).
    """

    def __init__(
        self,
        name: str,
        source: Node,
        target: Node,
        mode: str | None = None,
        progress: Progress = _quiet,
        into: str | None = None,
        readdress: Rows | None = None,
        boundary: bool = True,
        cut: Rows | None = None,
        follow: Ticket | None = None,
    ) -> None:
        if source.name == target.name:
            raise MigrationFailed(f"{name!r} already runs on node {target.name}", "pick another --to node")
        self.name, self.source, self.target, self.mode = name, source, target, mode
        self.progress, self.into, self.readdress, self.boundary, self.cut = (
            progress,
            into,
            readdress,
            boundary,
            cut,
        )
        self.follow = follow
        self.src, self.dst = AgentClient(source), AgentClient(target)
        self.started = time.monotonic()
        self.inc_id = ""  # the target's migration id, once prepared
        self.target_gpus: list[dict[str, object]] | None = None  # what the target listed, for a GPU job
        self.ticket: Ticket | None = None
        self.og_id: str | None = None
        self.port: int | None = None
        self.facts = _Measured(bytes=0, freeze=0.0, transfer=0.0, restore=0.0)
        self.phases: dict[str, float] = {}
        self.downtime: float | None = None
        self.downtime_by = "source"
        # on the client's clock: when the tree froze (the source's word, less its freeze time) and
        # when the target answered that it runs: a job's downtime spans its ranks' (`jobmove`)
        self.frozen_at: float | None = None
        self.running_at: float | None = None
        self.confirmed = True
        self.pages: float | None = None
        # told (outgoing id, incoming id) as each becomes known, before the next step: a caller
        # that must outlive its own restart records them (criuctl.kube.controller), then asks
        # the agents how the move ended (criuctl.kube.podmigrate.settle)
        self.on_ids: Callable[[str | None, str], None] | None = None

    def _in_doubt(self, exc: MigrationInDoubt) -> MigrationInDoubt:
        exc.ids = (self.og_id, self.inc_id)
        return exc

    def prepare(self) -> None:
        """The target makes room (and, for a job's rank, cuts its connections off); nothing frozen."""
        self.progress("prepare")
        try:
            dst_info = _check_target(self.dst)
            src_info: NodeInfo = self.src.get("/v1/info", timeout=timeouts().info)
            self.mode = choose_mode(self.mode, src_info, dst_info)
            self.target_gpus = dst_info.get("gpus")  # an older agent says nothing: the restore checks
            body = IncomingRequest(workload=self.name, mode=self.mode, into=self.into)
            body["source"] = self.source.host  # whose certificate the ticket opens its routes for
            if self.cut:
                body["cut"] = self.cut
            if self.follow is not None:
                body["follow"] = self.follow.to_json()
            inc: IncomingAnswer = self.dst.post("/v1/incoming", body)
        except CriuctlError as exc:
            raise MigrationFailed(
                exc.what, f"{exc.hint}; nothing was frozen, {self.name!r} runs on {self.source.name}"
            ) from exc
        points.reach(Point.CLIENT_PREPARED)
        self.inc_id = inc["id"]
        if self.on_ids is not None:
            self.on_ids(None, self.inc_id)
        self.ticket = Ticket(
            self.target.url,
            inc["id"],
            inc["ticket"],
            self.target.name,
            self.target.ca_pem(),
            verify=inc.get("verify"),
        )

    def send(self) -> None:
        """Freeze on the source and stream the bundle; the source's word decides until "sent"."""
        assert self.ticket is not None
        phase_started = time.monotonic()
        self.progress("freeze")
        body = OutgoingRequest(workload=self.name, mode=str(self.mode), target=self.ticket.to_json())
        if self.readdress is not None:
            body["readdress"] = self.readdress
        if not self.boundary:
            body["boundary"] = False
        if self.target_gpus is not None:
            body["target_gpus"] = self.target_gpus
        if env.STREAM.get() == "sealed":  # for comparisons: no overlap of dump and transfer
            body["live"] = False
        elif env.STREAM.get() == "direct" and self.mode == Mode.STOP_AND_COPY:
            body["direct"] = True  # memory pages straight into the target's page server
        ev: OutgoingEvent
        for ev in self.src.events("/v1/outgoing", body):
            if ev["event"] == "started":
                self.og_id = ev["id"]
                if self.on_ids is not None:
                    self.on_ids(self.og_id, self.inc_id)
            elif ev["event"] == "frozen":
                self.facts["freeze"], self.port = time.monotonic() - phase_started, ev["page_server_port"]
                self.frozen_at = time.monotonic() - float(ev.get("freeze_seconds") or 0.0)
                self.phases.update(ev.get("phases", {}))
                phase_started = time.monotonic()
                self.progress("transfer", done=0, total=ev["bytes"])
            elif ev["event"] == "transfer":
                self.progress("transfer", done=ev["done"], total=ev["total"])
            elif ev["event"] == "sent":
                self.facts["bytes"], self.facts["transfer"] = ev["bytes"], time.monotonic() - phase_started
                break
            elif ev["event"] == "error":
                if ev.get("thawed", True) is True:
                    failed = MigrationFailed(ev["what"], ev.get("hint", ""))
                    failed.ended = ev.get("ended") is True
                    raise failed
                if ev.get("thawed") == INCOMPLETE:
                    raise _thaw_incomplete(ev["what"], ev.get("left") or "", self.name, self.source.name)
                why = _frozen_hint(self.name, self.source.name, self.target.name, "thawed: unconfirmed")
                raise self._in_doubt(MigrationInDoubt(ev["what"], why))
        else:
            raise NodeUnreachable(
                f"node {self.source.name}'s agent stopped answering mid-migration",
                "its handoff process settles the job with the target by itself",
            )
        points.reach(Point.CLIENT_SENT)

    def restore(self) -> None:
        """The target restores the tree stopped: it has not run yet."""
        phase_started = time.monotonic()
        self.progress("restore")
        body = RestoreRequest(page_server=f"{self.source.host}:{self.port}") if self.mode == POST_COPY else {}
        answer: StepAnswer = self.dst.post(
            f"/v1/incoming/{self.inc_id}/restore", body, timeout=timeouts().restore
        )
        self.facts["restore"] = time.monotonic() - phase_started
        self.phases.update(answer.get("phases", {}) if isinstance(answer, dict) else {})
        points.reach(Point.CLIENT_RESTORED)

    def undo(self, exc: CriuctlError) -> CriuctlError:
        """A phase failed: abort both sides (target first); the error to raise."""
        if isinstance(exc, MigrationInDoubt):
            return self._in_doubt(exc)
        err = abort(self.src, self.dst, self.og_id, self.inc_id, exc, self.name, self.source.name)
        return self._in_doubt(err) if isinstance(err, MigrationInDoubt) else err

    def commit_target(self) -> None:
        """Let the restored tree run: from here on the job runs on the target."""
        self.progress("commit")
        try:
            self.phases.update(
                _commit_target(self.src, self.dst, self.og_id, self.inc_id, self.name, self.source.name)
            )
        except MigrationInDoubt as exc:
            raise self._in_doubt(exc) from None
        self.running_at = time.monotonic()
        points.reach(Point.CLIENT_TARGET_COMMITTED)

    def commit_source(self) -> None:
        """The source ends its tree (it checks with the target first)."""
        try:
            answer: StepAnswer = self.src.post(
                f"/v1/outgoing/{self.og_id}/commit", timeout=timeouts().source_commit
            )
            self.downtime = answer.get("downtime_seconds")
        except CriuctlError:  # the job runs on the target; the source's handoff ends its copy on its word
            self.downtime, self.confirmed = None, False
        if self.downtime is None:  # the source cannot say: what the client saw (an upper bound)
            self.downtime, self.downtime_by = self.client_downtime(), "client"
        points.reach(Point.CLIENT_SOURCE_COMMITTED)

    def client_downtime(self) -> float:
        """Frozen → running as the client saw it: from the source's "frozen" (less its freeze time)
        to the target's commit answer."""
        assert self.running_at is not None
        return self.running_at - (self.frozen_at if self.frozen_at is not None else self.started)

    def wait_pages(self) -> None:
        if self.mode == POST_COPY and self.confirmed:
            self.progress("pages")
            self.pages = _wait_pages(self.src, self.og_id)

    def result(self) -> MigrationResult:
        f = self.facts
        return MigrationResult(
            self.name,
            self.source.name,
            self.target.name,
            str(self.mode),
            self.downtime or 0.0,
            time.monotonic() - self.started,
            f["bytes"],
            f["freeze"],
            f["transfer"],
            f["restore"],
            self.pages,
            self.confirmed,
            phases=self.phases,
            downtime_measured_by=self.downtime_by,
        )


def migrate(
    name: str,
    source: Node,
    target: Node,
    mode: str | None = None,
    progress: Progress = _quiet,
    into: str | None = None,
    target_committed: Callable[[], None] | None = None,
    on_ids: Callable[[str | None, str], None] | None = None,
) -> MigrationResult:
    """Move workload `name`; a container goes `into` that placeholder container on the target
    (default: the target's one empty placeholder for the same pod and container).
    `target_committed` runs once the job runs on the target and before the source's copy ends:
    where something must learn of the move before the source tree dies (Kubernetes deletes the
    source pod there, so that its kubelet does not restart the container it sees die).
    `on_ids(outgoing, incoming)` runs as the agents' migration ids become known (Move.on_ids)."""
    move = Move(name, source, target, mode, progress, into)
    move.on_ids = on_ids
    move.prepare()
    try:
        move.send()
        move.restore()
    except CriuctlError as exc:
        raise move.undo(exc) from exc
    move.commit_target()
    if target_committed is not None:
        target_committed()
    move.commit_source()
    move.wait_pages()
    return move.result()


def _frozen_hint(name: str, source: str, target: str, why: str) -> str:
    return (
        f"{name!r} stays frozen on {source} ({why}) until its agent hears from {target}; "
        f"see `criuctl ps --node {source}` and `criuctl ps --node {target}`"
    )


def _back_on(exc: CriuctlError, name: str, node: str) -> MigrationFailed:
    """A failure after which the job runs on `node` again, as it did before the move (or, when it
    ended on its own while being frozen, nowhere: then no one says it keeps running)."""
    ended = isinstance(exc, MigrationFailed) and exc.ended
    where = "" if ended else f"{name!r} keeps running on {node}"
    err = MigrationFailed(exc.what, "; ".join(filter(None, [exc.hint, where])))
    err.ended = ended
    return err


def _thaw_incomplete(what: str, left: str, name: str, node: str) -> MigrationFailed:
    """A failed migration whose source runs the job again with its thaw not complete: never said
    as "keeps running" alone, since e.g. its connections may still be blocked."""
    err = MigrationFailed(
        what,
        f"{name!r} runs on {node} again, but its thaw did not complete ({left}); node {node}'s agent "
        f"keeps trying (`criuctl ps --node {node}` shows it until done)",
    )
    err.thaw_left = left
    return err


def abort(
    src: AgentClient,
    dst: AgentClient,
    og_id: str | None,
    inc_id: str,
    exc: CriuctlError,
    name: str,
    source: str,
) -> CriuctlError:
    """Undo both sides, target first: the source thaws only once the target's copy is dead."""
    with contextlib.suppress(CriuctlError):  # a dead target agent's handoff kills its copy itself
        dst.delete(f"/v1/incoming/{inc_id}")
    if og_id is None:
        return _back_on(exc, name, source)
    answer: StepAnswer | ErrorAnswer
    try:
        answer = src.delete(f"/v1/outgoing/{og_id}")
    except CriuctlError as err:
        if isinstance(err, AgentError) and err.status == 404:  # failed before "sent": the source thawed
            return _back_on(exc, name, source)
        answer = err.body if isinstance(err, AgentError) and err.body else {"state": "unknown"}
    if answer.get("state") == "thawed" or answer.get("thawed") is True:
        return _back_on(exc, name, source)
    if answer.get("thawed") == INCOMPLETE:
        return _thaw_incomplete(exc.what, answer.get("left") or "", name, source)
    return MigrationInDoubt(exc.what, _frozen_hint(name, source, dst.node.name, "thawed: unconfirmed"))


def _commit_target(
    src: AgentClient, dst: AgentClient, og_id: str | None, inc_id: str, name: str, source: str
) -> dict[str, float]:
    """The target's phases of letting the job run (a GPU job: the driver's restore); none where
    its answer was lost and the move was confirmed by asking again."""
    try:
        answer: StepAnswer = dst.post(f"/v1/incoming/{inc_id}/commit", timeout=timeouts().target_commit)
        return answer.get("phases", {}) if isinstance(answer, dict) else {}
    except CriuctlError as exc:
        first = exc
    deadline = time.monotonic() + timeouts().in_doubt
    while time.monotonic() < deadline:
        try:
            status: IncomingStatus = dst.get(f"/v1/incoming/{inc_id}", timeout=5)
            state = status["state"]
        except NodeUnreachable:
            time.sleep(1)
            continue
        except CriuctlError as exc:
            state = exc.body.get("state", "unknown") if isinstance(exc, AgentError) else "unknown"
        if state == "running":
            return {}
        raise abort(src, dst, og_id, inc_id, first, name, source)
    raise MigrationInDoubt(
        f"node {dst.node.name} did not confirm that {name!r} runs there ({first.what})",
        _frozen_hint(name, source, dst.node.name, "the target's answer was lost"),
    )


def source_downtime(source: Node, og_id: str | None) -> float | None:
    """The downtime the source measured for a committed move (None once it forgot the move, a
    minute after its last page): for an orchestrator that took the move over from one that died."""
    if og_id is None:
        return None
    try:
        st: OutgoingStatus = AgentClient(source, timeout=10).get(f"/v1/outgoing/{og_id}", timeout=10)
    except CriuctlError:
        return None
    return st.get("downtime_seconds")


def _wait_pages(src: AgentClient, og_id: str | None, timeout: float | None = None) -> float | None:
    st = _source_done(src, og_id, timeouts().pages if timeout is None else timeout)
    return st.get("pages_seconds") if st else None


def _source_done(src: AgentClient, og_id: str | None, timeout: float) -> OutgoingStatus | None:
    """The source's status once its tree is gone (`done`); None when it is not within `timeout` or
    its agent does not answer."""
    deadline = time.monotonic() + timeout
    while og_id is not None and time.monotonic() < deadline:
        try:
            st: OutgoingStatus = src.get(f"/v1/outgoing/{og_id}", timeout=10)
        except CriuctlError:
            return None
        if st["state"] == "done":
            return st
        time.sleep(0.1)
    return None


def source_ended(source: Node, og_id: str | None, timeout: float = 60.0) -> bool:
    """Whether the source's copy of a moved job has ended (its tree is gone), waiting up to
    `timeout`: only then may what holds it (a pod) be removed at once."""
    return _source_done(AgentClient(source, timeout=10), og_id, timeout) is not None


class NotSettled(CriuctlError):
    """`settle` refused, or could not act: the move stays as it was (frozen on its source)."""

    exit_code = 5


def settle(source: AgentClient, name: str, declared: str) -> str:
    """Settle the move of `name` frozen on `source` whose target a person declared down
    (`declared`): the source asks the target once more, and thaws only if it stays silent. Returns
    the state it ended in ("thawed"); raises with the agent's line otherwise."""
    t = timeouts()
    hold = 2 * t.handoff_settle + 3 * t.ask_target + 10  # the agent's longest wait, and more
    try:
        answer: StepAnswer = source.post(
            "/v1/outgoing/settle", {"workload": name, "declared": declared}, timeout=hold
        )
    except AgentError as exc:
        if exc.status == 404:
            raise UnknownWorkload(exc.what, exc.hint) from None
        if exc.status == 400:
            raise BadName(exc.what, exc.hint) from None
        raise NotSettled(exc.what, exc.hint or f"{name!r} stays frozen on {source.node.name}") from None
    if answer.get("thawed") == INCOMPLETE:
        return "thawed, its thaw not complete yet (the agent retries)"
    return str(answer.get("state", "thawed"))
