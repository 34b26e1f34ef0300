"""Cgroups as the node lays them out: which layout and driver, and moving a process between them so
that it lives as long as the right thing.

Why move: a runtime ends a container by killing every process in its cgroups. The agent's helpers
are started in the agent's container, and a DaemonSet update, an eviction or a crash of the agent's
pod would kill them mid-way with it: the keeper of a restored job (which must live exactly as long
as the placeholder container it keeps) and a checkpoint the kubelet's preStop asked for (which must
run to its end: killed between CRIU's dump and its commit, it leaves the job's tree stopped, the
pod Terminating for its whole grace period, and the job lost with it).

Why the node's cgroup namespace: with cgroup v2 a container gets a cgroup namespace of its own
(runc's default there), in which `/proc/PID/cgroup` is relative to the container's cgroup
("0::/../../kubepods.slice/…") while `/sys/fs/cgroup` (manifests/daemonset.yaml mounts the
node's) is the whole tree; and with `nsdelegate` (systemd mounts cgroup2 so) the kernel moves no
process out of the writer's namespace (cgroup_procs_write_permission). A handoff therefore enters
the node's cgroup namespace first (`enter_node_namespace`, while it has one thread: the
namespace is a thread's), so that every path it reads, the cgroup roots it gives CRIU (its child)
and every move it makes are the node's. Best effort: a hierarchy that refuses is left as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import os
from dataclasses import dataclass
from pathlib import Path

from criuctl.container import mounts

ROOT = Path("/sys/fs/cgroup")
_CLONE_NEWCGROUP = 0x02000000
UNIFIED = ""  # the key of cgroup v2's one hierarchy in `roots_of` (its /proc/PID/cgroup line: "0::/…")


class Version(enum.Enum):
    V1 = "v1"  # a hierarchy per controller, no unified one
    HYBRID = "hybrid"  # v1 controllers, the unified hierarchy beside them (/sys/fs/cgroup/unified)
    V2 = "v2"  # the unified hierarchy only (/sys/fs/cgroup is cgroup2)


class Driver(enum.Enum):
    """How the node's runtime names pods' cgroups (the kubelet's and runc's `cgroupDriver`)."""

    SYSTEMD = "systemd"  # kubepods.slice/…/cri-containerd-ID.scope: systemd owns them
    CGROUPFS = "cgroupfs"  # kubepods/…/pod-UID/ID: the runtime writes them itself
    NONE = "none"  # no pods' cgroups on this node (a host without Kubernetes)


@dataclass(frozen=True)
class Layout:
    version: Version
    driver: Driver
    nsdelegate: bool  # cgroup2 mounted with nsdelegate: no move out of a cgroup namespace
    own_namespace: bool  # this process is in a cgroup namespace other than the node's
    can_enter: bool  # and it may enter the node's (CAP_SYS_ADMIN, the node's processes in view)

    def describe(self) -> str:
        """One line for `criuctl doctor`: what was found, and how criuctl works there."""
        found = f"cgroup {self.version.value}" + (" (nsdelegate)" if self.nsdelegate else "")
        found += f", {self.driver.value} driver" if self.driver is not Driver.NONE else ", no pods' cgroups"
        if not self.own_namespace:
            how = "the node's cgroup namespace: handoffs read and move cgroups as the node does"
        elif self.can_enter:
            how = "a cgroup namespace of its own: handoffs enter the node's before they read or move cgroups"
        else:
            how = "a cgroup namespace of its own, and the node's cannot be entered from here"
        return f"{found}; {how}"

    @property
    def ok(self) -> bool:
        return not self.own_namespace or self.can_enter


def layout(proc: Path = Path("/proc"), root: Path = ROOT) -> Layout:
    """The layout this process sees (`proc` and `root` elsewhere in tests)."""
    found = mounts.parse((proc / "self" / "mountinfo").read_text())
    points = {m.point: m for m in found if m.fstype in mounts.CGROUP_TYPES}
    top = points.get(str(root))
    unified = top if top is not None and top.fstype == "cgroup2" else points.get(str(root / "unified"))
    if top is not None and top.fstype == "cgroup2":
        version = Version.V2
    else:
        version = Version.HYBRID if unified is not None else Version.V1
    where = [root] if version is Version.V2 else [p for p in root.iterdir() if p.is_dir()]
    driver = Driver.NONE
    for tree in where:  # at the top, or under a kubelet's --cgroup-root one level down
        for pattern in ("kubepods.slice", "*/kubepods.slice", "kubepods", "*/kubepods"):
            if any(p.is_dir() for p in tree.glob(pattern)):
                driver = Driver.SYSTEMD if pattern.endswith(".slice") else Driver.CGROUPFS
                break
        if driver is not Driver.NONE:
            break
    own = _in_own_namespace(proc) is True
    can = own and os.access(proc / node_process(proc) / "ns" / "cgroup", os.R_OK) and _may_enter()
    return Layout(version, driver, unified is not None and "nsdelegate" in unified.super_options, own, can)


def _may_enter() -> bool:
    """CAP_SYS_ADMIN in the effective set: what setns into another cgroup namespace needs."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 21 & 1)
    return False


def node_process(proc: Path = Path("/proc")) -> str:
    """A process in the node's cgroup namespace: the kernel's kthreadd where it is PID 2 (this
    process sees the node's PID namespace, as the agent does; always in the initial namespaces,
    and its links readable where an init hides its own: this machine's PID 1), else PID 1."""
    with contextlib.suppress(OSError, IndexError):
        stat = (proc / "2" / "stat").read_text()
        if stat.startswith("2 (kthreadd) ") and stat.rpartition(")")[2].split()[1] == "0":
            return "2"
    return "1"


def _in_own_namespace(proc: Path = Path("/proc")) -> bool | None:
    """Whether this process's cgroup namespace is another than the node's; None when unreadable."""
    try:
        return os.readlink(proc / "self" / "ns" / "cgroup") != os.readlink(
            proc / node_process(proc) / "ns" / "cgroup"
        )
    except OSError:
        return None


def enter_node_namespace() -> bool:
    """Enter the node's cgroup namespace (`node_process`'s). Call it while the process has one
    thread: a namespace is a thread's, and the threads and children made after it inherit it.
    True when this process is in it now."""
    own = _in_own_namespace()
    if own is not True:
        return own is False
    try:
        fd = os.open(f"/proc/{node_process()}/ns/cgroup", os.O_RDONLY)
    except OSError:
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWCGROUP) == 0
    finally:
        os.close(fd)


def _lines(pid: int | str, proc: Path = Path("/proc")) -> list[tuple[str, str]]:
    """(controllers, path) for each line of /proc/PID/cgroup; controllers "" for the unified one."""
    out = []
    for line in (proc / str(pid) / "cgroup").read_text().splitlines():
        ctrl, _, path = line.partition(":")[2].partition(":")
        out.append((ctrl, path))
    return out


def unified_path(pid: int | str) -> str:
    """The process's cgroup in the unified hierarchy (its only one on v2); "" where it has none or
    is gone."""
    try:
        return next((path for ctrl, path in _lines(pid) if not ctrl), "")
    except OSError:
        return ""


def _hierarchies(pid: int | str) -> list[tuple[Path, str]]:
    """(the hierarchy's mount, the process's path in it) for each line of /proc/PID/cgroup."""
    out = []
    for ctrl, path in _lines(pid):
        mount = ROOT / ("unified" if not ctrl else ctrl.removeprefix("name="))
        if not ctrl and not mount.exists():
            mount = ROOT  # cgroup v2 only: the unified hierarchy is the mount itself
        out.append((mount, path.lstrip("/")))
    return out


def roots_of(pid: int | str, proc: Path = Path("/proc")) -> dict[str, str]:
    """Process `pid`'s cgroup in each hierarchy, as CRIU's restore takes them for the roots of the
    tree it restores (`cg_root`): a path per v1 controller; on a v2-only node the unified one, under
    the key `UNIFIED` (CRIU's root for every controller). In a hybrid layout the unified hierarchy is
    left to CRIU: it holds no controller."""
    lines = _lines(pid, proc)
    v1 = {ctrl: path for ctrl, path in lines if ctrl}
    unified = [path for ctrl, path in lines if not ctrl]
    return v1 if v1 or not unified else {UNIFIED: unified[0]}


def _join(procs: Path, pid: int | None = None) -> bool:
    try:
        fd = os.open(procs, os.O_WRONLY)  # never O_CREAT: /sys/fs/cgroup itself may be a tmpfs
    except OSError:
        return False
    try:
        os.write(fd, str(pid or os.getpid()).encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def join_of(pid: int, *others: int) -> None:
    """Move this process, and the processes `others` (its helpers: a post-copy restore's lazy-pages
    daemon), into the cgroups of process `pid` (a placeholder's init): they then live exactly as
    long as that container, and count against its limits."""
    for mount, path in _hierarchies(pid):
        for who in (None, *others):
            _join(mount / path / "cgroup.procs", who)


def leave_container() -> bool:
    """Move this process into the root cgroup of each of its hierarchies: no container's end
    kills it, and no container's limit counts it, as for CRIU run by hand on the node. True when
    every hierarchy took it; False in a cgroup namespace of its own that it could not leave
    (`enter_node_namespace`), whose root is the container's cgroup and out of which the kernel
    moves nothing."""
    if _in_own_namespace():  # None, unreadable: try, and let the kernel say
        return False
    return all([_join(mount / "cgroup.procs") for mount, path in _hierarchies("self") if path])


if __name__ == "__main__":  # what a node without criuctl's dependencies says (scripts/guest-check.sh)
    print(layout().describe())
