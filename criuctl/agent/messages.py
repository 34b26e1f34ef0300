"""The JSON of the agent's HTTP API, as types: what each route takes, and what it answers.

The agent's routes build these, and the clients (`criuctl.client`, `criuctl.kube`, the CLI) read
them, both sides annotated with the same type: a field renamed on one side is a type error on the
other (`make lint` runs mypy). They are TypedDicts, plain dicts at run time, so the JSON on the wire
is what it always was: a field that only some agents send is `NotRequired`, and a reader takes it
with `.get`. A request is typed as the client sends it; the agent still checks each of its fields,
since anything may call. The records of a migration and the outcome of its steps are in
`criuctl.agent.protocol`; a row of GET /v1/workloads is a `criuctl.core.workloads.WorkloadRow`.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, Required, TypedDict

from criuctl.agent.protocol import Facts, TicketJson, UploadAnswer
from criuctl.agent.tickets import SignedState

# rows of addresses and ports as they travel: [[address, port, ...], ...] (`criuctl.net.netcut.parse`)
Rows = list[list[str | int]]


class Refusal(Facts, total=False):
    """What an error answer may say besides its line: where it is about a migration, its state
    and the step's facts; DELETE /v1/incoming/ID of a migration that runs: its `SignedState`."""

    state: str
    migration: str
    boot: str
    nonce: str
    sig: str


class ErrorAnswer(Refusal, total=False):
    """Every answer with an HTTP error status (`httpjson.fail`): the client's one line."""

    what: Required[str]
    hint: str


class LogChunk(TypedDict):
    """GET /v1/workloads/NAME/logs?from=OFFSET: the log from there on (criuctl.core.worklogs)."""

    text: str
    end: int
    state: str
    moved_to: str | None
    exit_code: int | None


class Healthz(TypedDict):
    """GET /healthz (no token)."""

    ok: bool
    node: str


class NodeInfo(TypedDict):
    """GET /v1/info: what this node's kernel and CRIU allow."""

    node: str
    tls: bool
    criu: NotRequired[str]  # CRIU's version, when it is usable
    lazy_pages: NotRequired[bool]  # userfaultfd: post-copy possible
    criu_error: NotRequired[str]  # why CRIU is not usable (then neither of the two above)
    gpus: NotRequired[list[dict[str, Any]]]  # NVIDIA GPUs (`gpus.GpuInfo`); absent where NVML cannot say


# ----------------------------------------------------------------------------------- a migration


class IncomingRequest(TypedDict):
    """POST /v1/incoming (client → target): make room for `workload`."""

    workload: str
    mode: str
    into: str | None  # the placeholder container to restore into (None: the target's choice)
    cut: NotRequired[Rows]  # a job's rank: its connections in their new form, dropped until it runs
    follow: NotRequired[TicketJson]  # a job's later rank: the first moved rank's migration decides
    # the source agent's address as the client dials it: a ticket's proofs are taken only from a
    # caller whose certificate names it (mutual TLS, `Incoming.peer_refusal`)
    source: NotRequired[str]


class IncomingAnswer(TypedDict):
    """POST /v1/incoming: the migration's id, the secret of the ticket the source proves itself
    with, and the public key that checks what the target says about it (`criuctl.agent.tickets`)."""

    id: str
    ticket: str
    verify: str


class PagesRequest(TypedDict):
    """POST /v1/incoming/ID/pages (the source agent, with the ticket): its certificate for this migration."""

    cert: str  # PEM


class PagesAnswer(TypedDict):
    """Where the target's page server waits for this migration's dump (0: post-copy, whose pages
    the target pulls), the certificate this end shows, signed with the migration's key over the
    question's nonce (`tickets.signed_cert`)."""

    port: int
    cert: str  # PEM
    sig: str


class IncomingStatus(SignedState):
    """GET /v1/incoming/ID: the migration's signed state, and its workload."""

    workload: str


class RestoreRequest(TypedDict, total=False):
    """POST /v1/incoming/ID/restore: post-copy names the source's page server."""

    page_server: str  # HOST:PORT


class StepAnswer(Facts, total=False):
    """A step's answer (`httpjson.outcome_response`): POST /v1/incoming/ID/restore and /commit,
    POST /v1/outgoing/ID/commit, DELETE /v1/outgoing/ID; its state and the step's facts."""

    state: Required[str]


class StateAnswer(TypedDict):
    """DELETE /v1/incoming/ID/cut, POST /v1/redirects/ID/keep, DELETE /v1/redirects/ID."""

    state: str


class OutgoingRequest(TypedDict):
    """POST /v1/outgoing (client → source): freeze `workload` and stream it to the ticket's target."""

    workload: str
    mode: str
    target: TicketJson
    readdress: NotRequired[Rows]  # a job's rank: [[old address, port, new address], ...]
    boundary: NotRequired[bool]  # False: no step boundary first (a job's rank)
    live: NotRequired[bool]  # False: stream only once the bundle is sealed
    direct: NotRequired[bool]  # stop-and-copy: memory pages straight into the target's page server
    target_gpus: NotRequired[list[dict[str, Any]]]  # the target's GPUs (its /v1/info): a GPU job's check


class SettleRequest(TypedDict):
    """POST /v1/outgoing/settle (a person, through `criuctl settle`): the move of `workload` whose
    target is down for good, as `declared` says (who declared it, and how); the source thaws it if
    the target stays silent once more."""

    workload: str
    declared: str


class Started(TypedDict):
    """The first line of POST /v1/outgoing's stream: the source's migration id."""

    event: Literal["started"]
    id: str


class Frozen(TypedDict):
    """The tree is frozen and its bundle sealed; the transfer starts (or goes on)."""

    event: Literal["frozen"]
    freeze_seconds: float
    bytes: int
    page_server_port: int | None  # post-copy: where the target's lazy-pages daemon asks for pages
    phases: dict[str, float]
    streamed: int  # bytes already sent while CRIU wrote them


class Transferring(TypedDict):
    """Progress of the transfer (about four times a second)."""

    event: Literal["transfer"]
    done: int
    total: int


class Sent(TypedDict):
    """The target has the whole bundle: from here on the target decides (the last line)."""

    event: Literal["sent"]
    bytes: int
    seconds: float
    target: UploadAnswer


class Failed(TypedDict):
    """The migration failed before "sent" (the last line): where the tree is left."""

    event: Literal["error"]
    what: str
    hint: str
    thawed: bool | str  # True, `protocol.INCOMPLETE` (with `left`), or "unconfirmed"
    left: str | None
    ended: bool  # the workload ended on its own while it was being frozen: nothing runs on


OutgoingEvent = Started | Frozen | Transferring | Sent | Failed


class OutgoingStatus(TypedDict):
    """GET /v1/outgoing/ID."""

    state: str
    pages_seconds: float | None  # post-copy: commit → the last page pulled, once done
    downtime_seconds: float | None  # frozen → the target runs it, once a caller's commit said so (a
    # controller that took the move over reads it here: the commit's answer went to its predecessor;
    # None after the lease's commit, which knows only an upper bound)


class RedirectRequest(TypedDict, total=False):
    """POST /v1/redirects: a staying rank's connections re-pointed, following the moved rank's
    migration (its ticket); or, for a pod's rank (`workload`: a container here), in the pod's own
    network namespace, kept or removed by whoever moves its peer (criuctl.kube.jobmoves)."""

    rules: Rows  # [[local, port, old remote, port, new remote], ...]
    ticket: TicketJson
    workload: str
    # a pod's: the move it follows (its bundle id). Asked again for the same move and pod (the
    # holder's agent restarted between its redirects and its restore), the same redirect answers
    move: str


class RedirectAnswer(TypedDict):
    id: str


class BraceRequest(TypedDict):
    """POST /v1/workloads/NAME/brace: a staying rank's connections to a peer about to move, whose
    retransmission backoff is bounded before that peer freezes (criuctl.net.rto)."""

    connections: Rows  # [[local, port, remote, port], ...] as the rank's namespace shows them


class BraceAnswer(TypedDict):
    sockets: int  # how many were bounded
    why_not: str  # why none could be, where so ("" otherwise)


# ----------------------------------------------------------------------------------- kept bundles


class CheckpointRequest(TypedDict, total=False):
    """POST /v1/workloads/NAME/checkpoint: the bundle's id (a caller that recorded it first can tell
    a dump that happened from one that did not), and whether the job runs on."""

    id: str
    leave_running: bool
    # a job's rank on Kubernetes: its established TCP connections are dumped as they are (its
    # successor's restore re-addresses them: criuctl.kube.jobmoves) instead of refused
    connections: bool
    # post-copy: the bundle is kept without its memory pages, which this node serves until a
    # restore has pulled them all (criuctl.agent.pageserving); the page-client certificates
    # (PEM) of the nodes that may restore it
    lazy: LazyRequest


class LazyRequest(TypedDict):
    clients: list[str]


class PagesServed(TypedDict):
    """Where a post-copy bundle's pages are served: the port on the serving node, and the page
    server's certificate (PEM), which a restore pins."""

    port: int
    cert: str


class CheckpointAnswer(TypedDict):
    id: str
    bytes: int
    freeze_seconds: float
    thaw_incomplete: NotRequired[str]  # leave_running: the job runs, but its thaw has this left
    pages: NotRequired[PagesServed]  # post-copy: where its pages are served


class PageClient(TypedDict):
    """POST /v1/bundles/ID/page-client: this node's page-client certificate (PEM) for bundle ID."""

    cert: str


SEAL_HEADER = "Criuctl-Seal"  # GET /v1/bundles/ID: sign the manifest with this key (hex) for its receiver


class BundleExpected(TypedDict):
    """POST /v1/bundles/ID/expect: the key this node checks that one copy of bundle ID with (its
    sender signs the manifest with it: `SEAL_HEADER`); good for one PUT, for `seconds`."""

    seal: str
    seconds: float


class BundleKept(TypedDict):
    """PUT /v1/bundles/ID: verified and kept."""

    id: str
    bytes: int


class BundleRestoreRequest(TypedDict, total=False):
    name: str  # the restored workload's name (default: the bundle's)
    into: str  # a placeholder container's ID
    # a job's rank: its sockets' new addresses, [[old address, port, new address], ...]
    # (`criuctl.net.readdress.EndpointMap`), applied to a copy of the verified images
    readdress: Rows
    # a post-copy bundle: HOST:PORT of the node that serves its pages, and its page server's
    # certificate (PEM, pinned)
    page_server: str
    page_cert: str


class BundleRestored(TypedDict):
    pid: int
    criu_seconds: float


class BundleDeleted(TypedDict):
    deleted: str
