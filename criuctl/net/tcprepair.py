"""Take a thawed tree's TCP sockets out of the repair mode CRIU left them in.

To dump an established connection CRIU puts its socket in TCP repair mode (the kernel then neither
sends nor acknowledges anything on it). A dump that *leaves the tree stopped* ends without undoing
that: repair mode is taken off only by a restore, or by CRIU's own leave-running. A tree thawed
instead would find every such socket mute: recv() fails with EPERM, send() with EINVAL or queues
bytes that never leave. So whoever thaws a dumped tree turns repair off on each socket first, as
CRIU's own unlock does (TCP_REPAIR_OFF, which also sends a window probe so the peer resumes), and
puts back the SO_REUSEADDR the repair mode overwrote.

The sockets are reached through pidfd_getfd(2) (`criuctl.net.sockfds`).
"""

from __future__ import annotations

import socket
from pathlib import Path

from criuctl.net import sockfds

TCP_REPAIR = 19  # <linux/tcp.h>
TCP_REPAIR_OFF = 0  # off, with a window probe to the peer (what CRIU's libsoccr uses)
_INET = (socket.AF_INET, socket.AF_INET6)


def leave_repair(pids: list[int], reuseaddr: dict[int, bool] | None = None) -> list[int]:
    """Turn repair mode off on every TCP socket of `pids` that is in it; their inodes.

    `reuseaddr` (socket inode -> SO_REUSEADDR at dump time, from the images) restores that option;
    without it, it stays off (it only matters to a later bind() of the same port).
    """
    released: list[int] = []
    seen: set[int] = set()
    for pid in pids:
        try:
            with sockfds.pidfd(pid) as pidfd:
                for fd, inode in sockfds.of(pid):
                    if inode in seen:
                        continue
                    seen.add(inode)
                    if _release_one(pidfd, fd, (reuseaddr or {}).get(inode)):
                        released.append(inode)
        except OSError:
            continue  # gone
    return released


def _release_one(pidfd: int, fd: int, reuse: bool | None) -> bool:
    try:
        with sockfds.borrowed(pidfd, fd) as s:
            if s.family not in _INET or s.type != socket.SOCK_STREAM:
                return False
            if s.getsockopt(socket.IPPROTO_TCP, TCP_REPAIR) != 1:
                return False
            s.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, TCP_REPAIR_OFF)
            if reuse is not None:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, int(reuse))
            return True
    except OSError:
        return False  # closed meanwhile


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
