"""What a container's mounts are, seen from the host: which CRIU must treat as external, and where.

A container's mount namespace holds two kinds of mounts. Some are its own — /proc, the /dev tmpfs,
devpts, mqueue, sysfs — and CRIU recreates them. The rest are windows onto something that lives on
the host or in the pod: bind mounts of volumes, /etc/hosts and friends, the pod's /dev/shm, each
cgroup hierarchy. CRIU can neither dump nor recreate those, so a dump marks each *external* (keyed
by its mount point) and a restore maps each key to the host path of the same mount in the
placeholder. The test for "lives elsewhere" is the kernel's own: the mount's device also appears in
the host's mount table (bind mounts and the pod's shm do; a container's private tmpfs does not).
Nothing here asks the runtime: it works the same under containerd and CRI-O.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# Filesystems a container gets fresh from its runtime: CRIU dumps and recreates them itself.
OWN_TYPES = frozenset({"proc", "sysfs", "devpts", "mqueue"})
CGROUP_TYPES = frozenset({"cgroup", "cgroup2"})


@dataclass(frozen=True)
class Mount:
    """One line of /proc/PID/mountinfo (only what we use)."""

    mount_id: int
    parent_id: int
    device: str  # "major:minor"
    root: str  # the path inside the filesystem that is mounted here
    point: str  # the mount point, in the reader's namespace
    fstype: str
    source: str
    super_options: dict[str, str]


# how mountinfo ends the root of a mount whose file or folder was deleted (the kernel's
# show_mountinfo: "//deleted"; d_path's " (deleted)" where a path is printed otherwise)
DELETED = ("//deleted", " (deleted)")


def _unescape(field: str) -> str:
    """mountinfo escapes space, tab, newline and backslash as octal (\\040)."""
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse(text: str) -> list[Mount]:
    mounts = []
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) < 5 or len(r) < 2:
            continue
        opts = {}
        for o in r[2].split(",") if len(r) > 2 else []:
            k, _, v = o.partition("=")
            opts[k] = v
        mounts.append(
            Mount(int(f[0]), int(f[1]), f[2], _unescape(f[3]), _unescape(f[4]), r[0], _unescape(r[1]), opts)
        )
    return mounts


def of(pid: int | str) -> list[Mount]:
    """The mounts process `pid` sees ("self" for ours)."""
    return parse(Path(f"/proc/{pid}/mountinfo").read_text())


def root_mount(mounts: list[Mount]) -> Mount:
    """The mount at "/" (the last one wins, as the kernel's lookup does)."""
    return [m for m in mounts if m.point == "/"][-1]


def is_external(m: Mount, host: list[Mount]) -> bool:
    """True when CRIU must leave mount `m` of a container to the restorer (see the module docstring)."""
    if m.point == "/":
        return False  # the root: the restorer gives CRIU a new one with --root
    if m.fstype in CGROUP_TYPES:
        return True
    if m.fstype in OWN_TYPES:
        return False
    return any(h.device == m.device for h in host)


def externals(container: list[Mount], host: list[Mount]) -> list[str]:
    """Mount points of `container` that a dump marks external, parents before children."""
    return [m.point for m in container if is_external(m, host)]


def _covers(h: Mount, m: Mount) -> bool:
    """Host mount `h` shows the folder mounted at `m`: same device, and `h`'s root holds `m`'s."""
    return h.device == m.device and (
        h.root == "/" or m.root == h.root or m.root.startswith(h.root.rstrip("/") + "/")
    )


def _through(h: Mount, m: Mount) -> str:
    """The path at which host mount `h` (which covers `m`) shows `m`'s root."""
    rest = m.root[len(h.root) :].lstrip("/") if h.root != "/" else m.root.lstrip("/")
    return str(Path(h.point) / rest) if rest else h.point


def host_paths(m: Mount, host: list[Mount]) -> list[str]:
    """Every path at which the host sees what is mounted at `m`, the most direct first (the mount
    whose root is longest: a kubelet's subPath bind before the volume it is cut from, before the
    disk's root). One folder often shows in several places; which kind of volume it is can be read
    from any of them (criuctl.container.volumes)."""
    ranked = sorted((h for h in host if _covers(h, m)), key=lambda h: -len(h.root))
    return list(dict.fromkeys(_through(h, m) for h in ranked))


def host_path(m: Mount, host: list[Mount]) -> str | None:
    """Where the host sees what is mounted at `m`: a host mount of the same device whose root
    contains `m`'s root, plus the rest of the path. None when the host has no such view."""
    paths = host_paths(m, host)
    return paths[0] if paths else None


def by_point(mounts: list[Mount]) -> dict[str, Mount]:
    """Mount point → the mount visible there (the last mounted wins)."""
    return {m.point: m for m in mounts}
