"""Moving a process between cgroups, so that it lives as long as the right thing.

Why: a runtime ends a container by killing every process in its cgroups. The agent's helpers
are started in the agent's container, and a DaemonSet update, an eviction or a crash of the agent's
pod would kill them mid-way with it: the keeper of a restored job (which must live exactly as long
as the placeholder container it keeps) and a checkpoint the kubelet's preStop asked for (which must
run to its end: killed between CRIU's dump and its commit, it leaves the job's tree stopped, the
pod Terminating for its whole grace period, and the job lost with it).

Paths are those of `/proc/PID/cgroup` under the agent's `/sys/fs/cgroup`, the node's whole tree
(manifests/daemonset.yaml mounts it). Best effort: a hierarchy that refuses is left as it was.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


def _hierarchies(pid: int | str) -> list[tuple[Path, str]]:
    """(the hierarchy's mount, the process's path in it) for each line of /proc/PID/cgroup."""
    out = []
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrl, path = line.split(":", 2)
        mount = ROOT / ("unified" if not ctrl else ctrl.removeprefix("name="))
        if not ctrl and not mount.exists():
            mount = ROOT  # cgroup v2 only: the unified hierarchy is the mount itself
        out.append((mount, path.lstrip("/")))
    return out


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
    every hierarchy took it; False in a cgroup namespace of its own (cgroup v2's containers),
    whose root is the container's cgroup and out of which the kernel moves nothing."""
    with contextlib.suppress(OSError):  # unreadable: try, and let the kernel say
        if os.readlink("/proc/self/ns/cgroup") != os.readlink("/proc/1/ns/cgroup"):
            return False  # PID 1 is the node's init: the agent runs in the node's PID namespace
    return all([_join(mount / "cgroup.procs") for mount, path in _hierarchies("self") if path])
