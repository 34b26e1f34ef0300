"""Containers as workloads: which ones criuctl can checkpoint, and what a dump of one must add.

A container the runtime started is checkpointable when its PID 1 is criuctl's namespace init
(`nsinit`, delivered by a read-only volume: docs/containers.md): that init is the root of the tree
CRIU dumps, forwards signals, and keeps io_uring out. Such a container is registered as a workload
named `ctr-<first 12 hex digits of its ID>`, so `ps`, `dump`, `migrate` and the agent treat it like a
`criuctl run` job. What differs is in `plan`: mounts CRIU must leave external, the writable layer and
emptyDir volumes to carry, and refusals that must come before anything is frozen.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from criuctl.container import cdi, cgroups, mounts, runtime, volumes
from criuctl.container.nodeview import NodeView, NodeViewError
from criuctl.container.runtime import Container, Runtime
from criuctl.core import nsinit, procinfo, workloads
from criuctl.core.errors import CriuctlError
from criuctl.format.bundle import ContainerFacts
from criuctl.net import netns, peers
from criuctl_hook import durable

NAME_PREFIX = "ctr-"
# Devices a checkpoint can hold open: CRIU reopens them by path on the target.
KNOWN_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")
PLACEHOLDER_FLAG = nsinit.PLACEHOLDER


class NotCheckpointable(CriuctlError):
    """Refused before anything was frozen: the container keeps running untouched."""

    exit_code = 65  # EX_DATAERR


def name_of(container_id: str) -> str:
    return f"{NAME_PREFIX}{container_id[:12]}"


def normalize(target: str) -> str:
    """`ctr-<12 hex>` for a container ID given whole (or 12+ digits of it); anything else unchanged."""
    if 12 <= len(target) <= 64 and not target.strip("0123456789abcdef") and not target.isdigit():
        return name_of(target)
    return target


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def runs_criuctl_init(pid: int) -> bool:
    """PID `pid` is criuctl's namespace init: `python -I …/nsinit.py -- CMD` or `-m criuctl.core.nsinit`
    (or `-m criuctl.nsinit`: a job started, or restored from a bundle, before the package was
    regrouped keeps the argv it started with)."""
    argv = cmdline(pid)
    return any(
        a.endswith(nsinit.INJECT_NAME) or a in ("criuctl.core.nsinit", "criuctl.nsinit") for a in argv[:4]
    )


def is_placeholder(pid: int) -> bool:
    return runs_criuctl_init(pid) and PLACEHOLDER_FLAG in cmdline(pid)[:6]


def placeholder_ready(pid: int) -> bool:
    """An empty placeholder whose init listens for the restorer (nsinit.placeholder made its `ctl`):
    a restore into it any sooner fails, and a move that fails there goes back to its source."""
    return is_placeholder(pid) and os.path.exists(f"/proc/{pid}/root/{nsinit.CONTROL_DIR.strip('/')}/ctl")


def why_not(c: Container) -> str | None:
    """Why container `c` cannot be checkpointed, in one line; None when it can (as far as we see)."""
    if c.state != "running" or not c.pid:
        return f"container {c.short_id} is {c.state}, not running"
    if not runs_criuctl_init(c.pid):
        argv = cmdline(c.pid)
        return (
            f"container {c.short_id}'s PID 1 is {' '.join(argv[:3])[:60]!r}, not criuctl's init: "
            "start its command under criuctl's init (docs/containers.md)"
        )
    if is_placeholder(c.pid):
        return f"container {c.short_id} is an empty placeholder waiting for a restore"
    return None


def control_dir(pid: int) -> str:
    """The step boundary's control directory of the container whose init is host PID `pid`, as the
    node reaches it (criuctl.local.stepboundary opens what is below the container's root safely)."""
    return f"/proc/{pid}/root{nsinit.BOUNDARY_DIR}"


def workload(c: Container, runtime_endpoint: str) -> workloads.Workload:
    """The workload record for a checkpointable container (written so `resolve` finds it)."""
    w = workloads.load(name_of(c.id))
    if w is None or w.root_pid != c.pid or w.state != workloads.RUNNING or not w.alive():
        trainer = psutil.Process(c.pid).children()  # the job the init runs, for `ps`
        command = cmdline(trainer[0].pid) if trainer else cmdline(c.pid)
        w = workloads.Workload.of_tree(
            c.pid,
            name=name_of(c.id),
            command=command,
            supervisor_pid=0,  # the runtime's shim owns the container
            stdio_pipes=stdio_pipes(c.pid),
            container=c.id,
            runtime=runtime_endpoint,
            pod=f"{c.pod_namespace}/{c.pod_name}/{c.name}" if c.pod_name else None,
            pod_uid=c.pod_uid or None,
            control=control_dir(c.pid),
        )
        workloads.save(w)
    return w


def register(rt: Runtime, ident: str) -> workloads.Workload:
    """Container `ident` (ID or prefix) as a workload; NotCheckpointable saying why it cannot be."""
    c = rt.container(ident)
    if reason := why_not(c):
        raise NotCheckpointable(reason, "nothing was frozen; the container keeps running")
    return workload(c, rt.endpoint)


def resolve(target: str, endpoint: str | None = None) -> workloads.Workload:
    """A workload by name or PID, or a container by `ctr-<id>` or (a prefix of) its ID, which is
    registered as a workload on the way (`workloads.resolve` then finds it)."""
    try:
        return workloads.resolve(target)
    except workloads.UnknownWorkload:
        ident = target.removeprefix(NAME_PREFIX)
        if not (target.startswith(NAME_PREFIX) or len(ident) >= 12) or ident.strip("0123456789abcdef"):
            raise
    from criuctl.container import runtime

    return register(runtime.connect(endpoint), ident)


def unsupported_rows(rt: Runtime) -> list[workloads.WorkloadRow]:
    """Register every checkpointable container; the others as rows that say why they are not
    workloads (`GET /v1/workloads`, so `ps --node` and `migrate` can tell the user)."""
    out = []
    for r in rows(rt):
        if r["checkpointable"] or r["state"] != "running" or is_placeholder(r["root_pid"]):
            continue
        r["state"], r["command"] = "unsupported", cmdline(r["root_pid"])
        out.append(r)
    return out


def rows(rt: Runtime) -> list[workloads.WorkloadRow]:
    """Every container on the node, with whether criuctl can checkpoint it (for `ps --node`)."""
    out = []
    for c in rt.containers():
        reason = why_not(c)
        row: workloads.WorkloadRow = {
            "name": name_of(c.id),
            "container": c.id,
            "pod": f"{c.pod_namespace}/{c.pod_name}" if c.pod_name else "",
            "container_name": c.name,
            "image": c.image,
            "root_pid": c.pid,
            "state": c.state,
            "alive": c.state == "running",
            "checkpointable": reason is None,
            "why_not": reason,
            "rss_bytes": procinfo.rss_bytes(c.pid) if c.state == "running" and c.pid else None,
            "runtime": c.runtime,
            "pod_uid": c.pod_uid or None,
            "placeholder_ready": c.state == "running" and bool(c.pid) and placeholder_ready(c.pid),
        }
        if row["placeholder_ready"]:  # what a rank restored into it is re-addressed to
            row["pod_ips"] = netns.addresses(c.pid)
        if reason is None:
            workload(c, rt.endpoint)
        out.append(row)
    return out


def stdio_pipes(pid: int) -> dict[str, str]:
    """CRIU's names of the pipes the container writes its output to (the runtime's shim reads them)."""
    out = {}
    for fd, key in ((1, "stdout"), (2, "stderr")):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("pipe:["):
                out[key] = target
    return out


@dataclass
class DumpPlan:
    """What a dump of a container adds to a plain tree dump, decided before freezing."""

    external: list[str]  # CRIU --external entries
    facts: ContainerFacts
    upperdir: str | None
    root_pid: int
    view: NodeView  # the node's mounts (criuctl.container.nodeview)
    inside: list[mounts.Mount]  # the container's
    volumes: list[volumes.Volume]  # its external mounts that are volumes

    def carry_volumes(self, bundle_dir: Path, folder: str) -> None:
        """While the tree is frozen: what goes with the job from its volumes (criuctl.container.volumes)."""
        pids = procinfo.tree_pids(self.root_pid)
        volumes.carry(self.volumes, self.view, self.inside, pids, bundle_dir, folder, self.facts)


def _netns(pid: int | str) -> int:
    return os.stat(f"/proc/{pid}/ns/net").st_ino


def plan(w: workloads.Workload, pids: list[int], connections: bool = False) -> DumpPlan:
    """The container-specific half of a dump, or NotCheckpointable before anything is frozen.
    `connections`: its TCP connections to other hosts go into the images as they are (a job's rank,
    re-addressed where it is restored) instead of being refused."""
    pid = w.root_pid
    _refuse_unknown_devices(pids)
    if not connections:
        _refuse_remote_tcp(pids)
    # the node's view, not ours: the agent's container lacks most of the node's folders
    inside, view = mounts.of(pid), NodeView.of_runtime(w.runtime)
    points = view.externals(inside)
    _refuse_replaced_mounts(inside, points, view)
    external = [f"mnt[{p}]:{p}" for p in points]
    netns_external = _netns(pid) != _netns("self")
    if netns_external:
        external.append(f"net[{_netns(pid)}]:extRootNetNS")
    root = mounts.root_mount(inside)
    upper = root.super_options.get("upperdir") if root.fstype == "overlay" else None
    cgroup = cgroups.unified_path(pid)
    pod = (w.pod or "").split("/")
    facts = ContainerFacts(
        id=w.container or "",
        name=pod[2] if len(pod) == 3 else "",
        pod_name=pod[1] if len(pod) == 3 else "",
        pod_namespace=pod[0] if len(pod) == 3 else "",
        runtime=w.runtime or "",
        external_mounts=points,
        netns_external=netns_external,
        cgroup=cgroup,
        cdi_devices=_cdi_devices(w),
    )
    return DumpPlan(external, facts, upper, pid, view, inside, volumes.of_container(inside, view))


def _cdi_devices(w: workloads.Workload) -> list[str]:
    """The CDI devices the runtime gave the container; none known where it cannot say (the procfs
    backend, a runtime down: the dump does not need it, and the GPU path checks GPUs itself)."""
    try:
        return cdi.devices(runtime.connect(w.runtime).container(w.container or "").annotations)
    except CriuctlError:
        return []


def _refuse_unknown_devices(pids: list[int]) -> None:
    for pid in pids:
        for fd in _fds(pid):
            target = _readlink(f"/proc/{pid}/fd/{fd}")
            if not target.startswith("/dev/") or target.startswith(("/dev/pts/", "/dev/shm/")):
                continue
            if target not in KNOWN_DEVICES:
                raise NotCheckpointable(
                    f"PID {pid} holds device {target} open (fd {fd}), which criuctl cannot move",
                    "nothing was frozen; close the device (or use the GPU path for /dev/nvidia*)",
                )


def _refuse_replaced_mounts(inside: list[mounts.Mount], points: list[str], view: NodeView) -> None:
    """A volume's file mounted by itself (a kubelet subPath) whose file the node has since replaced:
    an edited ConfigMap or Secret, which the kubelet swaps in a new folder and never re-mounts into
    a running container. The job still sees the old file, deleted; CRIU records the mount as
    deleted and, restoring, tries to make that file again where the restorer's new mount already
    is, and fails after the freeze ('Can't re-create deleted file … File exists'). Refused here,
    before anything is frozen, instead."""
    for m in mounts.by_point(inside).values():
        if m.point in points and m.root.endswith(mounts.DELETED):
            v = volumes.classify(m, view.paths(m))
            what = v.label() if v is not None else m.point
            raise NotCheckpointable(
                f"{what} at {m.point}: the node replaced its file since the container started (an edited "
                "ConfigMap or Secret mounted by subPath, which the kubelet never updates), and a "
                "restore cannot put the old one back",
                "nothing was frozen; restart the pod to mount the new file, then move it",
            )


def _refuse_remote_tcp(pids: list[int]) -> None:
    """A container moves to another node's address: a connection to another host cannot follow."""
    for s in peers.sockets(pids):
        if s.established and not _loopback(s.remote[0]):
            raise NotCheckpointable(
                f"the container has an open TCP connection to {s.remote[0]}:{s.remote[1]}, which "
                "cannot follow it to another node",
                "nothing was frozen; multi-node jobs move rank by rank (not yet supported "
                "for containers), or close the connection first",
            )


def _loopback(ip: str) -> bool:
    try:
        a = ipaddress.ip_address(ip.split("%")[0])
    except ValueError:
        return False
    return a.is_loopback or (a.version == 6 and a.ipv4_mapped is not None and a.ipv4_mapped.is_loopback)


def _fds(pid: int) -> list[str]:
    try:
        return os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []


def _readlink(path: str) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


INJECT_DIR = Path("/var/lib/criuctl-inject")  # world-readable: containers mount it read-only


def mark_moved(w: workloads.Workload, node: str) -> bool:
    """Before a container's frozen job ends on its old node: mark its pod's job as moved, in the
    inject dir the container mounts (criuctl.core.nsinit.moved_to). The kubelet restarts a container it
    sees die unless its pod is being deleted; a restarted one then waits instead of running the job
    again from its first step. Best effort, and harmless when no kubelet is involved."""
    if not w.container or not w.pod_uid or "/" in w.pod_uid:
        return False
    try:
        init = next(a for a in cmdline(w.root_pid) if a.endswith(f"/{nsinit.INJECT_NAME}"))
        seen = mounts.by_point(mounts.of(w.root_pid)).get(os.path.dirname(init))
        # the node's inject dir, or the pod's own emptyDir (the webhook's init container filled it),
        # which only the node's mount namespace may show
        dest = NodeView.of_runtime(w.runtime).reach(seen) if seen else None
        if dest is None:
            return False
        moved = Path(dest) / nsinit.MOVED_DIR
        moved.mkdir(mode=0o755, exist_ok=True)
        durable.replace(moved / w.pod_uid, (node + "\n").encode(), 0o644)
        return True
    except (OSError, StopIteration, NodeViewError):
        return False


def _stamped(stamp: Path, digest: str) -> bool:
    """Whether the inject dir holds these files; another agent may be swapping it this instant
    (its stamp gone between a look and a read: CI, eight writers at once)."""
    try:
        return stamp.read_text() == digest
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return False


def write_inject_dir(dest: Path = INJECT_DIR) -> Path:
    """The files a checkpointable container mounts read-only (docs/containers.md): criuctl's init
    (`nsinit.py`, standard library only) and the in-process hook. Replaced atomically, so a
    container starting meanwhile sees the old set or the new one; left alone when it already holds
    this criuctl's files (several agents on one host start at once in tests)."""
    import hashlib
    import shutil
    import tempfile

    from criuctl_hook.contract import HOOKS_DIR

    sources = [
        Path(nsinit.__file__),
        *sorted(p for p in HOOKS_DIR.rglob("*.py") if "__pycache__" not in p.parts),
    ]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()
    stamp = dest / ".criuctl-files"
    if _stamped(stamp, digest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    # A hostPath volume (the agent's DaemonSet) is a mount point: it cannot be renamed, so its
    # entries are swapped one by one (the stamp last) from a staging folder on the same mount.
    in_place = os.path.ismount(dest)
    home = dest if in_place else dest.parent
    # Writers on one host (agents starting together) take turns on a lock of the folder the swap
    # happens in: a look-then-rename without it lets one writer move away what another just saw.
    held = os.open(home, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        if _stamped(stamp, digest):
            return dest
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=home))
        try:
            shutil.copy2(nsinit.__file__, staging / "nsinit.py")
            shutil.copytree(HOOKS_DIR, staging / "hooks", ignore=shutil.ignore_patterns("__pycache__"))
            (staging / ".criuctl-files").write_text(digest)
            for p in [staging, *staging.rglob("*")]:
                p.chmod(0o755 if p.is_dir() else 0o644)
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old.", dir=home))
            try:
                swaps = [(staging / n, dest / n) for n in ("hooks", "nsinit.py", ".criuctl-files")]
                for new, live in swaps if in_place else [(staging, dest)]:
                    if live.exists():
                        durable.move(live, old / live.name)
                    durable.move(new, live)
            finally:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    finally:
        os.close(held)
    return dest
