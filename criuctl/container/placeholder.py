"""Restoring a container's tree into a placeholder container, from the host.

A placeholder is a container the runtime started on the target node from the same image and pod
spec, whose PID 1 is criuctl's init waiting (`nsinit --placeholder`). The runtime owns it: its
rootfs, namespaces, cgroup and the pipes its log is read from. The agent restores the job's tree
*into* it, with CRIU run from the host:

    rootfs            the placeholder's (writable-layer changes and emptyDirs unpacked first)
    uts, ipc, net     the placeholder's, joined (the network as CRIU's external one when the pod had its own)
    mounts            each external mount of the dump mapped to the same mount of the placeholder,
                      found where the node sees it (criuctl.container.nodeview: the agent's own namespace
                      lacks a hostPath under /var/tmp); volumes' files first (criuctl.container.volumes)
    stdio             the placeholder's stdout/stderr pipes (`--inherit-fd`): the runtime's log goes on
    cgroups           the placeholder's (CRIU's soft mode): its limits and OOM apply to the job

The restored tree gets a PID namespace of its own (CRIU cannot join one), so the placeholder's init
cannot wait for it: the restorer (`keep`) does, as the tree's parent, and tells the init through a
FIFO in the placeholder (`/run/criuctl/ctl`: "restoring", "running", "aborted …", "exit N"). The init
forwards the signals it gets (a pod's SIGTERM) through another (`/run/criuctl/signals`). If the
placeholder dies, the keeper kills the tree: the job lives and dies with its container.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from criuctl.container import cdi, cgroups, mounts, rootfsdiff, volumes
from criuctl.container.containers import is_placeholder, placeholder_ready, runs_criuctl_init
from criuctl.container.nodeview import NodeView
from criuctl.container.runtime import Container, Runtime
from criuctl.core.errors import CriuctlError
from criuctl.core.nsinit import CONTROL_DIR, exit_code
from criuctl.format.bundle import ContainerFacts


class NotAPlaceholder(CriuctlError):
    exit_code = 65


@dataclass
class Placeholder:
    container: Container
    rootfs: Path  # the placeholder's root, as the host sees it
    inside: list[mounts.Mount]  # its mounts, as it sees them
    view: NodeView  # the node's mounts, and the ones attached here for CRIU (released by `close_fds`)
    fds: list[int] = field(default_factory=list)  # opened for CRIU; closed by `close_fds`

    @property
    def pid(self) -> int:
        return self.container.pid

    def control(self, name: str) -> str:
        return f"/proc/{self.pid}/root/{CONTROL_DIR.strip('/')}/{name}"

    def tell(self, line: str) -> bool:
        """One line to the placeholder's init; False when it is gone or not listening."""
        return tell_pid(self.pid, line)

    def alive(self) -> bool:
        return is_placeholder(self.pid)

    def close_fds(self) -> None:
        """Let go of what was opened or mounted for CRIU: the restored tree holds its own now."""
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
        self.view.detach()

    def mount(self, point: str) -> mounts.Mount | None:
        """The placeholder's mount at `point` (the last one mounted there)."""
        return mounts.by_point(self.inside).get(point)


def tell_pid(pid: int, line: str) -> bool:
    """One line to the placeholder whose init is host PID `pid`; False when it is gone or deaf."""
    if not is_placeholder(pid):
        return False
    try:
        fd = os.open(f"/proc/{pid}/root/{CONTROL_DIR.strip('/')}/ctl", os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        os.write(fd, (line.replace("\n", " ") + "\n").encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def find(rt: Runtime, ident: str) -> Placeholder:
    """Container `ident` as an empty placeholder, or NotAPlaceholder saying what it is instead."""
    c = rt.container(ident)
    if c.state != "running" or not c.pid:
        raise NotAPlaceholder(
            f"placeholder container {c.short_id} is {c.state}, not running",
            "start the placeholder again (its command: criuctl's init with --placeholder)",
        )
    if not is_placeholder(c.pid):
        what = "a running job" if runs_criuctl_init(c.pid) else "not criuctl's init"
        raise NotAPlaceholder(
            f"container {c.short_id} is not an empty placeholder (its PID 1 is {what})",
            "restore into a container started with criuctl's init and --placeholder (docs/containers.md)",
        )
    if not placeholder_ready(c.pid):
        raise NotAPlaceholder(
            f"placeholder {c.short_id} is not ready (no {CONTROL_DIR}/ctl in it)",
            "wait until its log says 'placeholder ready', then try again",
        )
    inside, view = mounts.of(c.pid), NodeView.of_runtime(rt.endpoint)
    root = view.attach(mounts.root_mount(inside))
    if root is None:
        raise NotAPlaceholder(
            f"cannot find placeholder {c.short_id}'s root filesystem on the node",
            "criuctl's agent needs the host's PID namespace and privileges (manifests/daemonset.yaml)",
        )
    return Placeholder(c, Path(root), inside, view)


def match(rt: Runtime, facts: ContainerFacts) -> Placeholder:
    """The one empty placeholder for the job in `facts`: same pod namespace, pod and container name
    (a restore target pod keeps its name, as a PyTorchJob worker does). NotAPlaceholder otherwise."""
    found = [c for c in rt.containers() if c.state == "running" and c.pid and is_placeholder(c.pid)]
    same = [
        c
        for c in found
        if (c.pod_namespace, c.pod_name, c.name) == (facts.pod_namespace, facts.pod_name, facts.name)
    ]
    if len(same) == 1:
        return find(rt, same[0].id)
    job = f"{facts.pod_namespace}/{facts.pod_name}/{facts.name}"
    if not same:
        waiting = (
            ", ".join(f"{c.short_id} ({c.pod_namespace}/{c.pod_name}/{c.name})" for c in found) or "none"
        )
        raise NotAPlaceholder(
            f"no empty placeholder for {job} on this node (placeholders waiting: {waiting})",
            "start one from the job's pod spec (docs/containers.md), or name one with --into CONTAINER",
        )
    raise NotAPlaceholder(
        f"{len(same)} placeholders wait for {job} on this node", "name one with --into CONTAINER"
    )


def prepare(ph: Placeholder, bundle_dir: Path, facts: ContainerFacts) -> None:
    """Put the job's files in place: the writable layer into the rootfs, what the dump carried of
    its volumes into the placeholder's (a file already there with the same content is left alone);
    refuse a ConfigMap or Secret whose files differ from those the job saw, or a placeholder that
    lacks a kind of CDI device the job had (criuctl.container.cdi)."""
    given = cdi.devices(ph.container.annotations)
    if lacking := cdi.missing(facts.cdi_devices, given):
        kinds = sorted({cdi.kind(d) for d in lacking})
        raise NotAPlaceholder(
            f"placeholder {ph.container.short_id} was given {len(given)} CDI device(s) "
            f"({', '.join(given) or 'none'}); the job had {len(facts.cdi_devices)} "
            f"({', '.join(facts.cdi_devices)}): no {' or '.join(kinds)} for {', '.join(lacking)}",
            "request the same devices in the placeholder's pod (its resources, as the job's pod did)",
        )
    for point, want in sorted(facts.volume_digests.items()):
        _reach(ph, point)  # it has the volume at all
        m = ph.mount(point)
        v = volumes.classify(m, ph.view.paths(m)) if m is not None else None
        label = v.label() if v else "the volume"
        if volumes.seen_digest(ph.pid, point, label) != want:
            raise NotAPlaceholder(
                f"{label} at {point} holds other files on this node than the "
                "job saw: it was changed since the job's pod started",
                "put back what the job saw, or restart the job to take the new content",
            )
    diff = bundle_dir / facts.rootfs_diff if facts.rootfs_diff else None
    if diff is not None or facts.deleted:
        rootfsdiff.apply(diff, facts.deleted, ph.rootfs)
    for point, tar in sorted(facts.volumes.items()):
        rootfsdiff.apply(bundle_dir / tar, [], Path(_reach(ph, point)), keep_equal=True)


def _reach(ph: Placeholder, point: str) -> str:
    """Where this process reads and writes the placeholder's volume at `point`."""
    m = ph.mount(point)
    path = ph.view.reach(m) if m is not None else None
    if path is None:
        raise NotAPlaceholder(
            f"the placeholder has no volume at {point}, which the job used",
            "give the placeholder the same volumes as the job's container",
        )
    return path


def restore_options(ph: Placeholder, facts: ContainerFacts, stdio_pipes: dict[str, str]) -> dict:
    """The `criu.RestoreOptions` fields that put the tree into the placeholder (opens fds: see `fds`)."""
    ext: dict[str, str] = {}
    for point in dict.fromkeys(facts.external_mounts):
        m = ph.mount(point)
        path = ph.view.attach(m) if m else None
        if path is None:
            raise NotAPlaceholder(
                f"the placeholder has no mount at {point}, which the job's container had",
                "start the placeholder from the same pod spec (volumes and mounts) as the job",
            )
        ext[point] = path
    inherit: dict[str, int] = {}
    for key, fd_no in (("stdout", 1), ("stderr", 2)):
        pipe = stdio_pipes.get(key)
        if pipe and pipe not in inherit:  # one fd per pipe: CRIU refuses the same key twice
            fd = os.open(f"/proc/{ph.pid}/fd/{fd_no}", os.O_WRONLY)
            ph.fds.append(fd)
            inherit[pipe] = fd
    join = {"uts": f"/proc/{ph.pid}/ns/uts", "ipc": f"/proc/{ph.pid}/ns/ipc"}
    if facts.netns_external:  # the dump left the pod's network out: it is the placeholder's now
        fd = os.open(f"/proc/{ph.pid}/ns/net", os.O_RDONLY)
        ph.fds.append(fd)
        inherit["extRootNetNS"] = fd
    else:  # the job had its node's network: on this node, that is the placeholder's
        join["net"] = f"/proc/{ph.pid}/ns/net"
    return {
        "root": str(ph.rootfs),
        "join_ns": join,
        "ext_mount_map": ext,
        "inherit_fds": inherit,
        "cgroup_roots": cgroups.roots_of(ph.pid),
    }


def keep(ph: Placeholder, root_pid: int, join_cgroups: bool = False, helpers: tuple[int, ...] = ()) -> int:
    """Stand by a running restored tree (our child) until it ends; return its exit status.

    Signals the placeholder's init forwards go to the tree's init (which forwards them to the
    job); if the placeholder dies (its container was killed), the tree is killed with it. The
    caller records the end, then tells the placeholder (`tell(f"exit {code}")`): after that the
    runtime may kill whatever is left in the container's cgroups — this process too, if it joined
    them (`join_cgroups`, which the agent's keeper does to outlive the agent's own container), with
    its `helpers` (a post-copy restore's lazy-pages daemon: the job's memory comes through it, and an
    agent's end must not end it).
    """
    if join_cgroups:
        cgroups.join_of(ph.pid, *helpers)
    sig_fd = _open_signals(ph)
    try:
        pidfd = os.pidfd_open(ph.pid)
    except OSError:
        pidfd = None
    try:
        while True:
            pid, status = os.waitpid(root_pid, os.WNOHANG)
            if pid:
                return exit_code(status)
            watch = [fd for fd in (sig_fd, pidfd) if fd is not None]
            ready, _, _ = select.select(watch, [], [], 0.5)
            if pidfd is not None and pidfd in ready:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(root_pid, signal.SIGKILL)  # its container is gone: so is the job
                _, status = os.waitpid(root_pid, 0)
                return exit_code(status)
            if sig_fd is not None and sig_fd in ready:
                for n in _read_signals(sig_fd):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(root_pid, n)
    finally:
        for fd in (sig_fd, pidfd):
            if fd is not None:
                os.close(fd)


def _open_signals(ph: Placeholder) -> int | None:
    """The FIFO the placeholder's init writes forwarded signals to (read-write: never EOF)."""
    for _ in range(50):
        try:
            return os.open(ph.control("signals"), os.O_RDWR | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                return None
            time.sleep(0.1)
    return None


def _read_signals(fd: int) -> list[int]:
    try:
        data = os.read(fd, 4096).decode(errors="replace")
    except BlockingIOError:
        return []
    out = []
    for word in data.split():
        if word.isdigit() and 0 < int(word) < 65:
            out.append(int(word))
    return out
