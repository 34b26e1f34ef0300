"""The migration protocol as data: modes, each side's states and transitions, events, timeouts, records.

No I/O and no HTTP here: the server, the handoff processes, the client and the unit tests all read
the protocol from this one module, so that what is allowed can be checked without running it.

    source (node a)                                     target (node b)
    FREEZING ─▶ FROZEN ─▶ SENDING ─▶ SENT ──┐            NEW ─▶ RECEIVING ─▶ RECEIVED ─▶ RESTORING
       │           │         │               │                                             │
       ▼           ▼         ▼               │ the target's verdict only                   ▼
    FAILED      THAWED ◀─────┘       ┌───────┴──────┐                 ABORTED ◀──────── RESTORED
                                     ▼              ▼                                      │ commit
                                  THAWED      COMMITTED ─▶ DONE                            ▼
                                (target: dead  (target:                                 RUNNING
                                 or never ran)  running)

The rule that cannot be broken: once the bundle has been sent (SENT), only the target decides
whether the source thaws. Every path out of SENT — the client's commit or abort, the agent's lease,
a handoff whose agent died, a restarted agent — first asks the target, with the upload ticket, and
acts on its answer (`Verdict`). The target answers "aborted" only once its copy is dead or never
ran, and kills its copy only while it has not run, so a source that was told to end never has a
target that aborted.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NotRequired, TypedDict, TypeVar

from criuctl.core import env
from criuctl.core.procinfo import Identity


class Mode(enum.StrEnum):
    STOP_AND_COPY = "stop-and-copy"
    POST_COPY = "post-copy"  # the target runs at once; pages are pulled from the source afterwards
    # (pre-copy — iterative pre-dumps — is not built: it needs soft-dirty tracking, which the
    # kernels here lack, so it is in no list until it can be tested somewhere)


class SourceState(enum.StrEnum):
    FREEZING = "freezing"  # handoff started; CRIU freezing and dumping (hold record written first)
    FROZEN = "frozen"  # tree stopped, bundle sealed (not fsynced: the frozen tree is the copy that counts)
    SENDING = "sending"  # bundle streaming to the target
    SENT = "sent"  # the target has the whole bundle: from here on the target decides
    COMMITTED = "committed"  # the target runs the job; the source tree is being ended
    DONE = "done"  # source tree gone (post-copy: after the last page was pulled)
    THAWED = "thawed"  # the tree runs on here (failure or abort); network lock lifted
    # the tree runs on here (it got its SIGCONT), but a step of its thaw failed — CRIU's network
    # lock still drops its connections, sockets in repair mode, GPU state held: retried until
    # THAWED, reported (`ps`, the migrate line, /metrics), never called success
    THAW_INCOMPLETE = "thaw-incomplete"
    FAILED = "failed"  # nothing was frozen, or the freeze failed and CRIU let the tree go


class TargetState(enum.StrEnum):
    NEW = "new"  # room made, upload ticket minted
    RECEIVING = "receiving"
    RECEIVED = "received"  # verified bundle on disk
    RESTORING = "restoring"  # handoff running CRIU restore
    RESTORED = "restored"  # tree recreated, stopped: it has never run
    RUNNING = "running"  # committed: the job runs here (written before the tree is let go)
    ABORTED = "aborted"  # its copy is dead or never existed
    FAILED = "failed"  # receive or restore failed; no copy exists


_THAW = frozenset({SourceState.THAWED, SourceState.THAW_INCOMPLETE})
SOURCE_TRANSITIONS: dict[SourceState, frozenset[SourceState]] = {
    SourceState.FREEZING: frozenset({SourceState.FROZEN, SourceState.FAILED, *_THAW}),
    # the handoff's record goes FROZEN → SENT directly; SENDING lives only in the agent
    SourceState.FROZEN: frozenset({SourceState.SENDING, SourceState.SENT, *_THAW}),
    SourceState.SENDING: frozenset({SourceState.SENT, *_THAW}),
    SourceState.SENT: frozenset({SourceState.COMMITTED, *_THAW}),  # only on the target's word
    SourceState.COMMITTED: frozenset({SourceState.DONE}),
    SourceState.DONE: frozenset(),
    SourceState.THAWED: frozenset(),
    SourceState.THAW_INCOMPLETE: frozenset({SourceState.THAWED}),  # a retry completed it
    SourceState.FAILED: frozenset(),
}

TARGET_TRANSITIONS: dict[TargetState, frozenset[TargetState]] = {
    TargetState.NEW: frozenset({TargetState.RECEIVING, TargetState.ABORTED}),
    TargetState.RECEIVING: frozenset({TargetState.RECEIVED, TargetState.FAILED, TargetState.ABORTED}),
    TargetState.RECEIVED: frozenset({TargetState.RESTORING, TargetState.ABORTED}),
    TargetState.RESTORING: frozenset({TargetState.RESTORED, TargetState.FAILED, TargetState.ABORTED}),
    TargetState.RESTORED: frozenset({TargetState.RUNNING, TargetState.ABORTED}),
    TargetState.RUNNING: frozenset(),  # never aborted: the source may have been told to end
    TargetState.ABORTED: frozenset(),
    TargetState.FAILED: frozenset({TargetState.ABORTED}),
}

SOURCE_FINAL = frozenset(s for s, nxt in SOURCE_TRANSITIONS.items() if not nxt)
TARGET_FINAL = frozenset({TargetState.RUNNING, TargetState.ABORTED})

S = TypeVar("S", SourceState, TargetState)


class BadTransition(Exception):
    """A bug: a step the protocol table does not allow. Never caught to carry on."""


def check_transition(current: S, new: S) -> S:
    allowed: frozenset[SourceState] | frozenset[TargetState] = (
        SOURCE_TRANSITIONS[current] if isinstance(current, SourceState) else TARGET_TRANSITIONS[current]
    )
    if new != current and new not in allowed:
        raise BadTransition(f"{type(current).__name__}: {current} → {new} is not allowed")
    return new


INCOMPLETE = "incomplete"  # the `thawed` fact of a source that runs again with its thaw not complete


class Verdict(enum.StrEnum):
    """The target's answer to a source asking what to do with its frozen tree."""

    RUNNING = "running"  # the job runs (or ran) on the target: end the source tree
    ABORTED = "aborted"  # the target's copy is dead or never ran: thaw the source
    UNKNOWN = "unknown"  # no answer: stay frozen and ask again


class UploadAnswer(TypedDict):
    """The target's answer to the source agent's `PUT /v1/incoming/ID/bundle`: the bundle is whole."""

    bytes: int
    seconds: float


class Facts(TypedDict, total=False):
    """What a step says besides its state (`Outcome.facts`): the HTTP layer sends them along with
    the state, in the answer and in a refusal alike (`criuctl.agent.messages.StepAnswer`)."""

    # source: True once the tree runs here again; INCOMPLETE when it runs with its thaw not complete
    # (`left` says what is left); "unconfirmed" when it cannot be told
    thawed: bool | str
    left: str | None
    ended: bool  # source, failed freeze: the tree ended on its own meanwhile (nothing runs on)
    downtime_seconds: float | None  # source commit: frozen → the client said the target runs it
    now: bool  # source commit: this very call committed it (dropped before it is answered)
    # source, sent: the bytes and seconds of the stream, the target's answer; on the agent's clock
    # when the freeze started, and how long the stream ran in all (the agent's own use)
    bytes: int
    seconds: float
    target: UploadAnswer
    started: float
    stream_seconds: float
    pid: int  # target restore and commit: the restored tree's PID
    criu_seconds: float  # target restore: CRIU's own time
    phases: dict[str, float]  # target restore: seconds per step (verify, criu_restore, handoff…)


@dataclass
class Outcome:
    """What a step of either side ended in: the HTTP layer renders it; no exception crosses over."""

    state: str
    ok: bool
    what: str = ""
    hint: str = ""
    facts: Facts = field(default_factory=lambda: Facts())


class Event(enum.StrEnum):
    """One JSON line on a handoff's stdout (the agent reads them)."""

    DUMPING = "dumping"  # source: CRIU starts writing the bundle (the agent may stream it already)
    SERVING = "serving"  # dump, post-copy: the bundle is kept without its pages, which CRIU serves
    FROZEN = "frozen"
    SENT = "sent"  # source: SENT is recorded; from now on it settles only with the target
    COMMITTED = "committed"
    DONE = "done"
    THAWED = "thawed"  # source: the tree runs again, every step of its thaw done
    THAW_INCOMPLETE = "thaw-incomplete"  # source: it runs again; a step failed, retried until THAWED
    RESTORED = "restored"
    RUNNING = "running"
    ABORTED = "aborted"
    IN_DOUBT = "in-doubt"  # source: told to settle, but the target did not answer
    REFUSED = "refused"  # source: told to commit, but the target says the job does not run there
    ERROR = "error"


class Command(enum.StrEnum):
    """One line on a handoff's stdin (the agent writes them); EOF is the lease breaking."""

    SENT = "sent"
    COMMIT = "commit"
    ABORT = "abort"
    SETTLE = "settle"  # a person declared the target down: read the order beside the record (`SettleOrder`)


@dataclass(frozen=True)
class Timeouts:
    """Every wait of the protocol, named, in seconds. One place to read and tune them."""

    freeze: float = 1800.0  # CRIU dump of a large tree
    restore: float = 1800.0  # CRIU restore of a large tree
    handoff_settle: float = 120.0  # a handoff answering commit or abort
    target_commit: float = 60.0  # client → target commit
    source_commit: float = 120.0  # client → source commit (it asks the target first)
    in_doubt: float = 30.0  # client asking the target after a lost commit answer
    ask_target: float = 20.0  # one verdict request
    ask_backoff_max: float = 30.0  # between verdict requests while the target is silent
    thaw_retry_max: float = 30.0  # between tries to finish an incomplete thaw
    stall: float = 20.0  # no byte moved on a transfer
    info: float = 10.0  # GET /v1/info and similar small calls
    pages: float = 3600.0  # post-copy: commit until the last page is pulled
    serve: float = 1800.0  # post-copy through a successor: the source serves the pages this long at most
    tombstone: float = 7 * 24 * 3600.0  # final records kept to answer late verdict requests


def timeouts() -> Timeouts:
    """Timeouts with the fields $CRIUCTL_TIMEOUTS names overridden (tests and tuning), read when
    asked; a malformed value, or a name that is not a field, is refused in one line (the CLI checks
    the variable before any verb runs, and the agent asks once as it starts)."""
    return env.overrides(env.TIMEOUTS, Timeouts)


class TicketJson(TypedDict):
    """A `Ticket` as it travels (client → source agent, in records, in a job's `follow`)."""

    url: str
    incoming: str
    secret: str
    node: str
    ca: NotRequired[str | None]
    verify: NotRequired[str | None]


@dataclass(frozen=True)
class Ticket:
    """What the source needs to reach the target's side of one migration (minted by the target)."""

    url: str  # the target agent's base URL
    incoming: str  # the target's migration id
    secret: str  # opens only this migration's upload, status and abort
    node: str  # the target's name, for messages
    ca: str | None = None  # PEM of the CA of the target's TLS certificate
    # the target's public key for this migration (hex Ed25519): checks its verdicts, makes none
    # (`criuctl.agent.tickets`); None in a ticket from before verdicts were signed so
    verify: str | None = None

    @classmethod
    def from_json(cls, raw: object) -> Ticket:
        if not isinstance(raw, dict):
            raise ValueError("ticket must be an object")
        names = {f.name for f in fields(cls)}
        missing = {"url", "incoming", "secret", "node"} - set(raw)
        if missing or set(raw) - names:
            raise ValueError(f"bad ticket fields (missing {sorted(missing)})")
        return cls(**{k: raw[k] for k in names if k in raw})

    def to_json(self) -> TicketJson:
        return {
            "url": self.url,
            "incoming": self.incoming,
            "secret": self.secret,
            "node": self.node,
            "ca": self.ca,
            "verify": self.verify,
        }

    def base(self) -> str:
        return f"{self.url.rstrip('/')}/v1/incoming/{self.incoming}"


@dataclass
class SourceSpec:
    """Everything a source handoff needs, written as one JSON file instead of an argument list."""

    migration: str
    workload: str
    mode: str
    record: str  # path of the hold record (written before CRIU freezes anything)
    parent: str  # folder the bundle is sealed in
    to_node: str
    ticket: Ticket
    lazy_port: int | None = None  # post-copy: serve pages here
    # a rank of a multi-node job: its images' endpoints that move ([[old, port, new], ...],
    # `readdress.EndpointMap`), and whether its trainers are first held at a step boundary
    readdress: list[list[str | int]] | None = None
    boundary: bool = True
    live: bool = True  # stream page images while CRIU writes them (False: only once sealed)
    # stop-and-copy straight into the target's page server (`criu.PagesTo` as JSON: address, port,
    # and the paths of this end's certificate and key and of the target's pinned certificate)
    pages_to: dict[str, Any] | None = None
    # a GPU job: the GPUs the target agent listed (`gpus.GpuInfo` as dicts), checked before the freeze
    target_gpus: list[dict[str, Any]] | None = None
    # post-copy over CRIU's TLS (`criu.PageTls`'s paths): the page server takes the target alone
    lazy_tls: dict[str, str] | None = None

    def to_json(self) -> str:
        d = asdict(self)
        d["ticket"] = self.ticket.to_json()
        return json.dumps(d)

    @classmethod
    def from_json(cls, raw: str) -> SourceSpec:
        d = json.loads(raw)
        d["ticket"] = Ticket.from_json(d["ticket"])
        return cls(**d)


@dataclass
class TargetSpec:
    """Everything a target handoff needs."""

    migration: str | None
    bundle: str
    node: str
    record: str | None = None  # the target's migration record, which the handoff advances
    name: str | None = None
    page_server: str | None = None  # post-copy: HOST:PORT of the source's page server
    digests: dict[str, str] | None = None  # the bundle format's digests, computed as it arrived
    placeholder: str | None = None  # a container's bundle: the placeholder container (ID) to restore into
    runtime: str | None = None  # the runtime endpoint that runs the placeholder
    follow: TicketJson | None = None  # `TargetRecord.follow` as JSON: asked when the lease breaks
    # a job's rank restored into a pod of another address: [[old address, port, new address], ...]
    readdress: list[list[str | int]] | None = None
    vouched: dict[str, Any] | None = None  # `bundle.Vouched` as JSON: pages this node's page server got
    page_tls: dict[str, str] | None = None  # post-copy over TLS: `criu.PageTls`'s paths

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str) -> TargetSpec:
        return cls(**json.loads(raw))


@dataclass
class SourceRecord:
    """The source's durable state of one migration: what a restarted agent needs to settle it."""

    migration: str
    workload: str
    mode: str
    state: SourceState
    ticket: Ticket
    hold_pid: int  # the handoff process
    boot_id: str  # a different boot means every process named here is gone
    root_pid: int | None = None  # the tree's PID-namespace init
    bundle: str | None = None
    netlock_table: str | None = None  # CRIU's network-lock table of this dump: lifted on thaw or end
    updated: float = 0.0
    # start times (clock ticks since boot) of hold_pid and root_pid: with boot_id, they name the
    # processes for good, so that a PID handed out again is never thawed or killed (None: older record)
    hold_start: int | None = None
    root_start: int | None = None
    thaw_left: str | None = None  # THAW_INCOMPLETE: what the thaw could not do yet (retried)
    settled: str | None = None  # thawed on a person's word that the target is down (`SettleOrder.declared`)

    def hold(self) -> Identity:
        return Identity(self.hold_pid, self.hold_start, self.boot_id)

    def tree(self) -> Identity | None:
        return Identity(self.root_pid, self.root_start, self.boot_id) if self.root_pid else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ticket": self.ticket.to_json(), "state": str(self.state)}

    @classmethod
    def from_json(cls, d: object) -> SourceRecord:
        return cls(**_object(d, ticket=Ticket.from_json, state=SourceState))


@dataclass
class TargetRecord:
    """The target's durable state of one migration; kept as a tombstone once final."""

    migration: str
    workload: str
    mode: str
    state: TargetState
    proof_key: str  # `tickets.proof_key` of the ticket's secret: checks the source's proofs
    boot_id: str
    handoff_pid: int | None = None
    root_pid: int | None = None
    updated: float = 0.0
    history: list[str] = field(default_factory=list)
    placeholder: str | None = None  # container ID the client named (None: the target picks one)
    runtime: str | None = None
    placeholder_pid: int | None = None  # host PID of the placeholder's init, once restored into it
    cut: str | None = None  # a job's rank: the nftables table dropping its connections until it runs
    # a job's rank after the first: the first moved rank's migration, whose commit decides this one
    # too (the client commits that one first; a target left undecided follows it, see `verdict`)
    follow: Ticket | None = None
    # start times of handoff_pid, root_pid and placeholder_pid (see SourceRecord.hold_start)
    handoff_start: int | None = None
    root_start: int | None = None
    placeholder_start: int | None = None
    sign_key: str = ""  # the private half of `Ticket.verify`: signs every answer about this migration
    source: str | None = None  # the source agent's address: the name its certificate must carry
    seal_key: str = ""  # `tickets.seal_key` of the ticket's secret (hex): the bundle must carry its signature

    def handoff(self) -> Identity | None:
        return Identity(self.handoff_pid, self.handoff_start, self.boot_id) if self.handoff_pid else None

    def tree(self) -> Identity | None:
        return Identity(self.root_pid, self.root_start, self.boot_id) if self.root_pid else None

    def placeholder_init(self) -> Identity | None:
        pid = self.placeholder_pid
        return Identity(pid, self.placeholder_start, self.boot_id) if pid else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "state": str(self.state)}

    @classmethod
    def from_json(cls, d: object) -> TargetRecord:
        fields_ = _object(d, state=TargetState)
        if "secret_sha256" in fields_:  # made before tickets proved themselves: its keys open nothing
            fields_.pop("secret_sha256")
            fields_.pop("verdict_key", None)
            fields_["proof_key"] = ""
        rec = cls(**fields_)
        if isinstance(rec.follow, dict):
            rec.follow = Ticket.from_json(rec.follow)
        return rec


@dataclass(frozen=True)
class SettleOrder:
    """A person's word that a move's target is down for good, so that its frozen source may thaw
    without the target's verdict: the one way out of SENT the target does not decide.

    It is written beside the source's record before anything acts on it (`settle_order_path`), so
    whichever process holds the tree then — the handoff, a handoff whose agent died, or a restarted
    agent settling a dead handoff's record — finds it and acts the same way: ask the target once
    more (its signed answer wins over any declaration), and thaw only if it stays silent.
    """

    declared: str  # who declared the target down, and how ("node b deleted", "--target-down by …")
    at: float

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: object) -> SettleOrder:
        return cls(**_object(d))


def settle_order_path(record: str | Path) -> Path:
    """Where the settle order of the migration whose source record is `record` lives (not `*.json`:
    a scan of the records never mistakes it for one)."""
    return Path(record).with_suffix(".settle")


def _object(d: object, **convert: Any) -> dict[str, Any]:
    """A record's JSON object with the named fields converted; ValueError for anything else."""
    if not isinstance(d, dict):
        raise ValueError("not an object")
    return {**d, **{k: f(d[k]) for k, f in convert.items()}}


class Point(enum.StrEnum):
    """Named instants of the protocol where a test may stop it (`criuctl.agent.points`)."""

    CONTROLLER_PLACED = "controller.placed"  # PodMigration Placing: the placeholder made, job untouched
    CONTROLLER_UNTRACKED = "controller.untracked"  # Placing, a Job's pod out of its count, not deleted yet
    CLIENT_PREPARED = "client.prepared"  # target NEW; nothing frozen
    CLIENT_SENT = "client.sent"  # source SENT, target RECEIVED
    CLIENT_RESTORED = "client.restored"  # target RESTORED (stopped), source SENT
    CLIENT_TARGET_COMMITTED = "client.target-committed"  # target RUNNING, source SENT
    CLIENT_SOURCE_COMMITTED = "client.source-committed"  # target RUNNING, source COMMITTED
    CLIENT_REDIRECTED = "client.redirected"  # a job's move: every rank sent, redirects PENDING
    SOURCE_HELD = "source.held"  # source handoff: trainers held at a step boundary, nothing frozen
    SOURCE_STREAMING = "source.streaming"  # source agent: FREEZING, CRIU dumping, pages streaming
    SOURCE_FROZEN = "source.frozen"  # source agent: FROZEN, before the rest is streamed
    SOURCE_SENT_RECORDED = "source.sent-recorded"  # source agent: SENT recorded, client not told
    # source agent: a person's settle order is on disk (the target declared down), the tree still frozen
    SOURCE_SETTLE_ORDERED = "source.settle-ordered"
    # target agent: a page session opened (direct: its page server waits for the dump; post-copy:
    # the certificates exchanged, for the pull); nothing frozen
    TARGET_PAGES_OPEN = "target.pages-open"
    TARGET_RECEIVED = "target.received"  # target agent: RECEIVED recorded, source not answered
    TARGET_RUNNING = "target.running"  # target agent: RUNNING, client not answered
    SUCCESSOR_REDIRECTED = "successor.redirected"  # holder agent: a rank's peers redirected, not restored
