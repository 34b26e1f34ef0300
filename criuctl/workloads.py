"""The node's registry of workloads: one JSON record per workload under the state directory.

`criuctl run` writes a record when it starts a workload; `ps`, `dump` and (later) the agent read it.
Records are replaced atomically (write to a temp file, rename), so a reader never sees half a record.
The state directory is root-only: it holds the bundle signing key.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from criuctl import procinfo
from criuctl.errors import CriuctlError

ENV_STATE_DIR = "CRIUCTL_STATE_DIR"
DEFAULT_STATE_DIR = Path("/var/lib/criuctl")

RUNNING, CHECKPOINTED, MIGRATED, EXITED = "running", "checkpointed", "migrated", "exited"


def state_dir() -> Path:
    return Path(os.environ.get(ENV_STATE_DIR) or DEFAULT_STATE_DIR)


def key_path() -> Path:
    return state_dir() / "bundle.key"


def logs_dir(kind: str = "logs") -> Path:
    """A root-only folder under the state dir: 'logs' (workload output, CRIU logs), 'restores'..."""
    d = state_dir() / kind
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


ENV_SPOOL_DIR = "CRIUCTL_SPOOL_DIR"


def spool_dir(kind: str) -> Path:
    """Where bundles in flight are written (`kind`: 'outgoing', 'incoming'), root-only.

    The state dir by default. A tmpfs here takes the disk out of a migration's path (dump and
    receive run at memory speed) at the cost of holding a bundle — about the job's RSS — in RAM
    until the move is over.
    """
    d = Path(os.environ.get(ENV_SPOOL_DIR) or state_dir()) / kind
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def log_path(name: str) -> Path:
    """Where a workload's stdout and stderr are kept on this node (`criuctl logs NAME`)."""
    return logs_dir() / f"{name}.log"


@dataclass
class Workload:
    name: str
    command: list[str]
    root_pid: int  # host PID of the workload's PID-namespace init (the tree CRIU dumps)
    supervisor_pid: int
    stdio_pipes: dict[str, str]  # "stdout" -> "pipe:[inode]" the workload writes to
    state: str = RUNNING
    started: float = field(default_factory=time.time)
    bundle: str | None = None  # set when checkpointed and stopped
    restored_from: str | None = None
    exit_code: int | None = None
    moved_to: str | None = None  # node it was migrated to
    node: str | None = None  # node whose agent restored it here (None: started here)

    def alive(self) -> bool:
        try:
            return psutil.Process(self.root_pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


class UnknownWorkload(CriuctlError):
    exit_code = 3


def _dir() -> Path:
    d = state_dir() / "workloads"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(state_dir(), 0o700)
    return d


def save(w: Workload) -> None:
    d = _dir()
    fd, tmp = tempfile.mkstemp(dir=d, prefix=f".{w.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(w), f, indent=2)
    os.replace(tmp, d / f"{w.name}.json")


def load(name: str) -> Workload | None:
    try:
        return Workload(**json.loads((_dir() / f"{name}.json").read_text()))
    except FileNotFoundError:
        return None


def all_workloads() -> list[Workload]:
    out = []
    for p in sorted(_dir().glob("*.json")):
        try:
            out.append(Workload(**json.loads(p.read_text())))
        except (ValueError, TypeError):
            continue
    return out


def rows() -> list[dict]:
    """Every record with whether it is alive and its tree's RSS: what `ps` and the agent show."""
    out = []
    for w in all_workloads():
        alive = w.alive()
        rss = procinfo.rss_bytes(w.root_pid) if alive and w.state == RUNNING else None
        out.append({**asdict(w), "alive": alive, "rss_bytes": rss})
    return out


def unique_name(wanted: str) -> str:
    """`wanted`, or `wanted-2`, `-3`… when a live workload already has that name."""
    name, n = wanted, 1
    while (w := load(name)) is not None and w.state == RUNNING and w.alive():
        n += 1
        name = f"{wanted}-{n}"
    return name


def resolve(target: str) -> Workload:
    """A running workload by name, or by any PID of its tree or its supervisor."""
    w = load(target)
    if w is not None and w.state == RUNNING and w.alive():
        return w
    if target.isdigit():
        pid = int(target)
        for w in all_workloads():
            if w.state != RUNNING or not w.alive():
                continue
            if pid in (w.root_pid, w.supervisor_pid) or _descends_from(pid, w.root_pid):
                return w
        if psutil.pid_exists(pid):
            raise UnknownWorkload(
                f"PID {pid} is not part of a criuctl workload",
                "start the job with `criuctl run -- CMD` so it can be checkpointed",
            )
    raise UnknownWorkload(
        f"no running workload named or with PID {target!r} on this host",
        "see `criuctl ps` for the workloads here",
    )


def _descends_from(pid: int, root: int) -> bool:
    try:
        return any(p.pid == root for p in psutil.Process(pid).parents())
    except psutil.NoSuchProcess:
        return False
