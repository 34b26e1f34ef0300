"""The state dir: where criuctl keeps its state on this node, every file and folder in it, and the
check that it can be a folder there.

One home for the layout: each file or folder is a `Place` below, named for what it holds, with who
writes it; a module that keeps something here asks its `Place` for the path (`path()`), or for the
folder made root-only (`ensure()`), never joins names onto `state_dir()` itself. README.md ("The
state dir") lists the same table; tests/test_env.py keeps the two in step. The names are those of
every earlier version: a node upgraded in place finds its records where it left them.

Standard library only: `criuctl` checks the state dir before any verb runs, and some verbs must
still be able to say "needs root" on a machine without criuctl's dependencies.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from criuctl.core import env
from criuctl.core.errors import CriuctlError

DEFAULT_STATE_DIR = env.STATE_DIR.default


def state_dir() -> Path:
    return env.STATE_DIR.get()


class StateDirError(CriuctlError):
    """The state dir cannot be a folder: it, or a folder above it, is a file; or it is not ours
    to write."""


def check_state_dir() -> None:
    """Refuse a state dir that names a file (or lies under one) before any verb touches it."""
    d = state_dir()
    for p in (d, *d.parents):
        try:
            mode = os.stat(p).st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet (it is created), or under a file (found further up)
        except OSError:
            return  # cannot look (not root): the verb itself says what it needs
        if not stat.S_ISDIR(mode):
            where = "is a file" if p == d else f"lies under {p}, which is a file"
            raise StateDirError(
                f"the state dir {d} {where}",
                f"pass --state-dir a folder (it is created if missing), or set {env.STATE_DIR}",
            )
        return


def ensure(d: Path) -> Path:
    """`d` as a root-only folder; one error line when it cannot be."""
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise StateDirError(
            f"cannot create {d}: {exc.strerror}",
            f"pass --state-dir (or {env.STATE_DIR}) a folder root can write",
        ) from exc
    return d


def ensure_state_dir() -> Path:
    """The state dir itself, root-only (before a file is kept at its top: the node list)."""
    return ensure(state_dir())


@dataclass(frozen=True)
class Place:
    """One file or folder of the state dir: its name there, what it holds, and who writes it.

    `spooled` places are under $CRIUCTL_SPOOL_DIR when that is set (bundles in flight, which a
    tmpfs may hold), else in the state dir like the rest."""

    name: str
    holds: str
    writer: str
    folder: bool = True
    spooled: bool = False

    def path(self) -> Path:
        """Where it is; nothing is created."""
        root = (env.SPOOL_DIR.get() or state_dir()) if self.spooled else state_dir()
        return root / self.name

    def ensure(self) -> Path:
        """The folder, created root-only if missing; one error line when it cannot be."""
        return ensure(self.path())


WORKLOADS = Place(
    "workloads",
    "the node's registry: `NAME.json`, one record per workload (`criuctl ps`)",
    "`criuctl run`, `restore`, the agent (criuctl.core.workloads)",
)
LOGS = Place(
    "logs",
    "`NAME.log`, a workload's stdout and stderr (`criuctl logs`); `dump-NAME-TIME.log`, the CRIU log "
    "of a dump that failed",
    "the workload's supervisor (criuctl.local.supervisor), criuctl.local.checkpoint",
)
HANDOFF_LOGS = Place(
    "handoffs",
    "the agent's handoff processes: `source-ID.log`, `target-ID.log`, `restore-ID.log`, and a "
    "folder per kept-bundle dump (`ID/handoff.log`)",
    "the agent (criuctl.agent.outgoing, incoming, bundles)",
)
RESTORES = Place(
    "restores",
    "`restore-NAME-*/`: CRIU's work folder (its log) of each restore",
    "criuctl.local.restoring (`restore`, the agent's handoffs)",
)
LOCKS = Place(
    "locks",
    "`NAME.lock`: one dump of a workload at a time, and who holds it",
    "criuctl.local.locks (`dump`, `migrate`'s source)",
)
CONTROL = Place(
    "control",
    "`NAME/`: the step boundary's requests and the hook's answers (shared with the workload)",
    "criuctl.local.stepboundary, the workload's hook",
)
BUNDLES = Place(
    "bundles",
    "`ID/`: bundles the agent keeps outside any migration (`POST /v1/workloads/NAME/checkpoint`)",
    "the agent (criuctl.agent.bundles)",
)
PAGES = Place(
    "pages",
    "`ID/`: a kept post-copy bundle's page-server TLS (this node's key pair for it, the peers' "
    "certificates) and, on the node that serves its pages, `serving.json`: the handoff serving them",
    "the agent and its dump handoffs (criuctl.agent.pageserving)",
)
IMPORTS = Place(
    "imports",
    "`import-*/`: a kubelet/CRI checkpoint archive imported as a bundle while it is read, then removed",
    "`criuctl inspect`, `restore` of an archive (criuctl.container.runtime.archive)",
)
OUTGOING = Place(
    "outgoing",
    "`ID.json`: the records of migrations leaving this node (on disk: they settle a migration after "
    "a reboot)",
    "the agent (criuctl.agent.outgoing) and its source handoffs",
)
INCOMING = Place(
    "incoming",
    "`ID.json`: the records and tombstones of migrations arriving here",
    "the agent (criuctl.agent.incoming) and its target handoffs",
)
REDIRECTS = Place(
    "redirects",
    "`ID.json`: the records of the traffic redirects a multi-node job's move installed here",
    "the agent (criuctl.agent.redirects)",
)
OUTGOING_SPOOL = Place(
    "outgoing",
    "`ID/`: the bundles of migrations leaving (in the state dir's `outgoing/` without a spool)",
    "the agent's source handoffs",
    spooled=True,
)
INCOMING_SPOOL = Place(
    "incoming",
    "`ID/`: the bundles of migrations arriving (in the state dir's `incoming/` without a spool)",
    "the agent's target handoffs",
    spooled=True,
)
BUNDLE_KEY = Place(
    "bundle.key",
    f"the node's bundle signing key, 0600 (unless ${env.BUNDLE_KEY} names another file)",
    "created on first use (criuctl.format.bundle.load_key)",
    folder=False,
)
IDENTITY = Place(
    "identity.pem",
    "on Kubernetes, the node's TLS certificate and its key (one file, 0600), issued by criuctl's controller",
    "the agent with --tls-from-cluster (criuctl.kube.identity)",
    folder=False,
)
NODES = Place(
    "nodes.json",
    "the client's node list: each agent's URL, token file, CA (`criuctl node add`)",
    "`criuctl node add`, `node rm` (criuctl.client.agents)",
    folder=False,
)
NODES_LOCK = Place(
    ".nodes.lock",
    "one editor of the node list at a time",
    "`criuctl node add`, `node rm` (criuctl.client.agents)",
    folder=False,
)
KUBE = Place(
    "kube",
    "`ca.crt`: the agents' CA, read from the cluster's Secret; `controller.pem`: the controller's "
    "client certificate and key (0600), made from that CA",
    "the client on Kubernetes (criuctl.kube.cluster)",
)

LAYOUT: tuple[Place, ...] = tuple(p for p in list(globals().values()) if isinstance(p, Place))


def key_path() -> Path:
    """This node's own signing key: the file $CRIUCTL_BUNDLE_KEY names, else `bundle.key` in the
    state dir. It never leaves the node: bundles cross nodes with a key of their one move or copy."""
    return env.BUNDLE_KEY.get() or BUNDLE_KEY.path()
