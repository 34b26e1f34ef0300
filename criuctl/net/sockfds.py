"""Another process's sockets, reached without stopping it: its descriptors, and a borrowed copy.

`/proc/PID/fd` says which descriptors are sockets (and their inodes, which the socket tables and
CRIU's images name them by); pidfd_getfd(2) (Linux ≥ 5.6) puts a copy of one in our own table: the
same socket, on which options can be read and set, closed again at once. The process keeps its
own descriptor and never notices. Imports nothing of criuctl.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
from collections.abc import Iterator

_SYS_PIDFD_GETFD = 438  # the same on every architecture (a syscall added after the table unification)


def of(pid: int) -> list[tuple[int, int]]:
    """(descriptor, socket inode) of every socket process `pid` holds; none when it is gone or not
    ours to read."""
    out: list[tuple[int, int]] = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        with contextlib.suppress(OSError, ValueError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                out.append((int(fd), int(link[8:-1])))
    return out


@contextlib.contextmanager
def borrowed(pidfd: int, fd: int) -> Iterator[socket.socket]:
    """Process `pidfd`'s descriptor `fd` as a socket of ours, for the `with` block; OSError when it
    is closed meanwhile (EBADF) or not ours to take (EPERM)."""
    libc = ctypes.CDLL(None, use_errno=True)
    got = libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0)
    if got < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"pidfd_getfd: {os.strerror(err)}")
    s = socket.socket(fileno=got)
    try:
        yield s
    finally:
        s.close()  # our copy only


@contextlib.contextmanager
def pidfd(pid: int) -> Iterator[int]:
    """A pidfd of `pid` for the `with` block; OSError (ESRCH) when it is gone."""
    fd = os.pidfd_open(pid)
    try:
        yield fd
    finally:
        os.close(fd)
