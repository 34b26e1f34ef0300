"""The node's registry of workloads: one JSON record per workload under the state directory.

`criuctl run` writes a record when it starts a workload; `ps`, `dump` and (later) the agent read it.
Records are replaced atomically (write to a temp file, rename), so a reader never sees half a record.
The state directory is root-only: it holds the bundle signing key.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, NotRequired, TypedDict, cast

import psutil

from criuctl.core import procinfo, statedir
from criuctl.core.errors import CriuctlError
from criuctl.core.statedir import state_dir
from criuctl_hook import durable

RUNNING, CHECKPOINTED, MIGRATED, EXITED = "running", "checkpointed", "migrated", "exited"
# `Workload.pages`: post-copy's pull on the way, done, or moot (the job ended before it, on this
# node: nothing was left to pull); anything else there says how the pull failed
PULLING, PULLED, ENDED = "pulling", "pulled", "ended"

NAME_MAX = 63  # a DNS label's length: a name may become a pod or a metric label
NAME_RULE = (
    f"a workload name is 1-{NAME_MAX} characters of letters, digits, '_', '.' and '-', "
    "starting with a letter or digit, without '..'"
)
_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{NAME_MAX - 1}}}")
_NOT_NAME_CHAR = re.compile(r"[^A-Za-z0-9_.-]")


class BadName(CriuctlError):
    """A workload name that could leave the state dir, or break a URL path or a table.

    Names become file names (`workloads/NAME.json`, `logs/NAME.log`) and URL path segments, so
    every boundary that takes one (CLI, HTTP path and body, registry) checks it with
    `validate_name` before building anything from it.
    """

    exit_code = 2


def validate_name(name: str) -> str:
    """`name` if it is a safe workload name; BadName saying what is wrong and what is allowed."""
    if not isinstance(name, str):
        raise BadName(f"a workload name must be a string, not {type(name).__name__}", NAME_RULE)
    if _NAME.fullmatch(name) and ".." not in name:
        return name
    shown = repr(name if len(name) <= 40 else name[:40] + "…")
    if not name:
        what = "a workload name cannot be empty"
    elif len(name) > NAME_MAX:
        what = f"workload name {shown} is {len(name)} characters long"
    elif ".." in name:
        what = f"workload name {shown} contains '..'"
    elif bad := _NOT_NAME_CHAR.search(name):
        what = f"workload name {shown} contains {bad.group()!r}"
    else:
        what = f"workload name {shown} starts with {name[0]!r}"
    raise BadName(what, NAME_RULE)


def name_for(program: str) -> str:
    """A valid default name for a workload started as `program` (its file name, made safe)."""
    base = _NOT_NAME_CHAR.sub("-", Path(program).name)
    base = re.sub(r"\.{2,}", ".", base).lstrip("_.-")[:NAME_MAX]
    return base or "job"


def log_path(name: str) -> Path:
    """Where a workload's stdout and stderr are kept on this node (`criuctl logs NAME`)."""
    return statedir.LOGS.ensure() / f"{validate_name(name)}.log"


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
    container: str | None = None  # the runtime's container ID when the workload is a container
    pod_uid: str | None = None  # its pod's UID (Kubernetes), for the moved marker (containers.mark_moved)
    runtime: str | None = None  # the runtime endpoint that runs that container
    pod: str | None = None  # "namespace/pod/container" when the runtime's labels name them
    control: str | None = (
        None  # the hook's control directory (criuctl.local.stepboundary), as the job's env names it
    )
    # the root's start time and the boot: with root_pid, what names the process for good (a PID
    # alone may name another process after a reboot or once the job ended); None in older records
    root_start: int | None = None
    boot_id: str = ""
    # a thaw of this workload that did not complete (what is left undone): it runs, but e.g. its
    # TCP connections stay blocked until that is done (criuctl.local.checkpoint.thaw_tree)
    thaw_incomplete: str | None = None
    # restored by post-copy: its memory's pull from the source, "pulling" until every page is here,
    # then "pulled"; "lost: why" when it failed (the job was ended: its memory was incomplete)
    pages: str | None = None
    pages_done: float | None = None  # when its pull ended (time.time())

    @classmethod
    def of_tree(cls, root_pid: int, **facts: Any) -> Workload:
        """A new record for the live tree rooted at `root_pid`, its identity taken now."""
        me = procinfo.Identity.of(root_pid)
        return cls(root_pid=root_pid, root_start=me.start, boot_id=me.boot, **facts)

    @property
    def identity(self) -> procinfo.Identity:
        boot = self.boot_id or procinfo.boot_id()  # older records: this boot (no PID outlives one)
        return procinfo.Identity(self.root_pid, self.root_start, boot, born_by=self.started)

    def alive(self) -> bool:
        """Its very tree runs here: the PID exists *and* is the process this record was made for."""
        return self.identity.alive()

    def stale(self) -> str | None:
        """Why this record no longer names its process, when its PID now names another one."""
        if self.state == RUNNING and self.identity.recycled():
            return (
                f"workload {self.name!r} was PID {self.root_pid}, which is now another process "
                "(the workload ended, or the node rebooted)"
            )
        return None


class UnknownWorkload(CriuctlError):
    exit_code = 3


def _dir() -> Path:
    d = statedir.WORKLOADS.ensure()
    os.chmod(state_dir(), 0o700)
    return d


def save(w: Workload) -> None:
    validate_name(w.name)
    durable.replace_json(_dir() / f"{w.name}.json", asdict(w))


_FIELDS = frozenset(f.name for f in fields(Workload))


def _parse(raw: str) -> Workload:
    d = json.loads(raw)
    if not isinstance(d, dict):
        raise ValueError("a workload record is a JSON object")
    return Workload(**{k: v for k, v in d.items() if k in _FIELDS})  # a newer version's extra fields


def load(name: str) -> Workload | None:
    validate_name(name)
    try:
        return _parse((_dir() / f"{name}.json").read_text())
    except FileNotFoundError:
        return None


def all_workloads() -> list[Workload]:
    out = []
    for p in sorted(_dir().glob("*.json")):
        try:
            out.append(_parse(p.read_text()))
        except (ValueError, TypeError, OSError):
            continue
    return out


class EndpointsJson(TypedDict):
    """A tree's TCP endpoints as an agent lists them (`criuctl.net.peers.Endpoints`):
    [[address, port], ...] and [[local, port, remote, port], ...]."""

    listening: list[list[str | int]]
    connections: list[list[str | int]]


class WorkloadRow(TypedDict):
    """A row of `ps` and of the agent's `GET /v1/workloads`: a record (every field of `Workload`),
    whether its tree is alive, and its RSS. A container the runtime runs but criuctl cannot
    checkpoint has a row too (`criuctl.container.containers.rows`): fewer of the record's fields,
    and what the runtime says of it. The agent adds a running `criuctl run` job's TCP endpoints
    (`tcp`: what joins ranks into jobs)."""

    name: str
    state: str
    root_pid: int
    alive: bool
    rss_bytes: int | None
    command: NotRequired[list[str]]
    supervisor_pid: NotRequired[int]
    stdio_pipes: NotRequired[dict[str, str]]
    started: NotRequired[float]
    bundle: NotRequired[str | None]
    restored_from: NotRequired[str | None]
    exit_code: NotRequired[int | None]
    moved_to: NotRequired[str | None]
    node: NotRequired[str | None]
    container: NotRequired[str | None]
    pod_uid: NotRequired[str | None]
    runtime: NotRequired[str | None]
    pod: NotRequired[str | None]
    control: NotRequired[str | None]
    root_start: NotRequired[int | None]
    boot_id: NotRequired[str]
    thaw_incomplete: NotRequired[str | None]
    pages: NotRequired[str | None]
    pages_done: NotRequired[float | None]
    # a container, as the runtime lists it
    container_name: NotRequired[str]
    image: NotRequired[str]
    checkpointable: NotRequired[bool]
    why_not: NotRequired[str | None]  # why criuctl cannot checkpoint it (None: it can)
    placeholder_ready: NotRequired[bool]  # an empty placeholder whose init listens for a restore
    pod_ips: NotRequired[list[str]]  # a ready placeholder's: its network namespace's addresses
    tcp: NotRequired[EndpointsJson]
    # [[remote as the tree's sockets hold it, port, remote the node's kept redirects send it to], ...]:
    # a peer that moved since (its connections are listed as `tcp` with the redirected address)
    redirected: NotRequired[list[list[str | int]]]


def row(w: Workload) -> WorkloadRow:
    """The record with whether it is alive and its tree's RSS."""
    alive = w.alive()
    rss = procinfo.rss_bytes(w.root_pid) if alive and w.state == RUNNING else None
    # `asdict` is untyped: WorkloadRow names every field of Workload (tests/test_agent_units.py
    # checks the rows the agent really sends against it)
    return cast(WorkloadRow, {**asdict(w), "alive": alive, "rss_bytes": rss})


def rows() -> list[WorkloadRow]:
    """Every record with whether it is alive and its tree's RSS: what `ps` and the agent show."""
    return [row(w) for w in all_workloads()]


def unique_name(wanted: str) -> str:
    """`wanted`, or `wanted-2`, `-3`… when a live workload already has that name."""
    name, n = validate_name(wanted), 1
    while (w := load(name)) is not None and w.state == RUNNING and w.alive():
        n += 1
        suffix = f"-{n}"
        name = wanted[: NAME_MAX - len(suffix)] + suffix
    return name


def resolve(target: str) -> Workload:
    """A running workload by name, or by any PID of its tree or its supervisor."""
    if not target.isdigit():
        validate_name(target)
    w = load(target) if len(target) <= NAME_MAX else None  # a PID is digits: always a valid name
    if w is not None and w.state == RUNNING and w.alive():
        return w
    if w is not None and (why := w.stale()):  # never act on whatever now holds its PID
        raise UnknownWorkload(why, "see `criuctl ps --all`; nothing was touched")
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
