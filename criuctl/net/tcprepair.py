"""Take a thawed tree's TCP sockets out of the repair mode CRIU left them in.

To dump an established connection CRIU puts its socket in TCP repair mode (the kernel then neither
sends nor acknowledges anything on it). A dump that *leaves the tree stopped* ends without undoing
that: repair mode is taken off only by a restore, or by CRIU's own leave-running. A tree thawed
instead would find every such socket mute: recv() fails with EPERM, send() with EINVAL or queues
bytes that never leave. So whoever thaws a dumped tree turns repair off on each socket first, as
CRIU's own unlock does (TCP_REPAIR_OFF, which also sends a window probe so the peer resumes), and
puts back the SO_REUSEADDR the repair mode overwrote.

The sockets are reached through pidfd_getfd(2) (Linux >= 5.6): a copy of the process's descriptor in
our own table, closed again at once. Imports nothing of criuctl.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
from pathlib import Path

TCP_REPAIR = 19  # <linux/tcp.h>
TCP_REPAIR_OFF = 0  # off, with a window probe to the peer (what CRIU's libsoccr uses)
_SYS_PIDFD_GETFD = 438  # the same on every architecture (a syscall added after the table unification)
_INET = (socket.AF_INET, socket.AF_INET6)


def _pidfd_getfd(pidfd: int, fd: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    got = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pidfd_getfd: {os.strerror(err)}")
    return got


def _socket_fds(pid: int) -> dict[int, int]:
    """fd -> socket inode for every socket `pid` holds."""
    out = {}
    fd_dir = Path(f"/proc/{pid}/fd")
    with contextlib.suppress(OSError):
        for entry in fd_dir.iterdir():
            with contextlib.suppress(OSError, ValueError):
                target = os.readlink(entry)
                if target.startswith("socket:["):
                    out[int(entry.name)] = int(target[8:-1])
    return out


def leave_repair(pids: list[int], reuseaddr: dict[int, bool] | None = None) -> list[int]:
    """Turn repair mode off on every TCP socket of `pids` that is in it; their inodes.

    `reuseaddr` (socket inode -> SO_REUSEADDR at dump time, from the images) restores that option;
    without it, it stays off (it only matters to a later bind() of the same port).
    """
    released: list[int] = []
    seen: set[int] = set()
    for pid in pids:
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            continue  # gone
        try:
            for fd, inode in _socket_fds(pid).items():
                if inode in seen:
                    continue
                seen.add(inode)
                if _release_one(pidfd, fd, (reuseaddr or {}).get(inode)):
                    released.append(inode)
        finally:
            os.close(pidfd)
    return released


def _release_one(pidfd: int, fd: int, reuse: bool | None) -> bool:
    try:
        local = _pidfd_getfd(pidfd, fd)
    except OSError:
        return False  # closed meanwhile
    s = socket.socket(fileno=local)
    try:
        if s.family not in _INET or s.type != socket.SOCK_STREAM:
            return False
        if s.getsockopt(socket.IPPROTO_TCP, TCP_REPAIR) != 1:
            return False
        s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_OFF)
        if reuse is not None:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
        return True
    finally:
        s.close()  # our copy only: the process keeps its own descriptor


def reuseaddr_from_images(images_dir: Path) -> dict[int, bool]:
    """socket inode -> SO_REUSEADDR of every inet socket in a dump's images ({} if unreadable)."""
    try:
        import pycriu

        with (images_dir / "files.img").open("rb") as f:
            entries = pycriu.images.load(f)["entries"]
    except Exception:  # no pycriu, no file, a torn image: leave the option as repair-off sets it
        return {}
    out = {}
    for e in entries:
        isk = e.get("isk")
        if isk and "ino" in isk:
            out[int(isk["ino"])] = bool(isk.get("opts", {}).get("reuseaddr", False))
    return out
