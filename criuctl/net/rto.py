"""A staying rank's connections to a peer about to move: their retransmission backoff bounded.

While a peer is frozen, dumped, carried and restored, the ranks that stay keep retransmitting into
the gap, and TCP doubles its wait after every unanswered try (0.2 s, 0.4, 0.8, 1.6, 3.2, 6.4 s,
...). A peer back after 7.8 s is heard from at the next try, at 12.6 s: on the local cluster that
was 4.8 s of a 13.4 s stall spent waiting on TCP's clock, not on criuctl (docs/kubernetes.md,
"The successor path's stall"). Linux ≥ 6.15 lets a socket bound that wait (`TCP_RTO_MAX_MS`, at
least 1 s): set on the staying ranks' sockets to the peer before it freezes, the rank that comes
back is heard from within a second.

A socket's give-up time on a silent peer is otherwise counted in retransmissions (tcp_retries2),
which a shorter wait would make come sooner: `TCP_USER_TIMEOUT` is set too, to 10 minutes, where
the job left it unset, so that a move taking long never costs a connection.

The sockets are reached with `pidfd_getfd` (`criuctl.net.sockfds`): the options are set on a
borrowed copy of the rank's descriptor. The rank is neither stopped nor otherwise touched, and a
kernel without the option is said, not an error: the move works as before, only slower to resume.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from criuctl.net import sockfds

TCP_RTO_MAX_MS = 44  # include/uapi/linux/tcp.h, Linux 6.15
RTO_MAX_MS = 1000  # the least the kernel takes
USER_TIMEOUT_MS = 600_000


@dataclass
class Braced:
    """What `brace` did: the sockets bounded, and why none could be where that is so."""

    sockets: int = 0
    why_not: str = ""


def brace(pids: Iterable[int], inodes: set[int]) -> Braced:
    """Bound the retransmission backoff of the sockets `inodes` (`peers.held`) that `pids` hold.
    Each socket once, whichever process holds it."""
    out, done = Braced(), set[int]()
    for pid in pids:
        todo = [(fd, ino) for fd, ino in sockfds.of(pid) if ino in inodes - done]
        if not todo:
            continue
        try:
            with sockfds.pidfd(pid) as pidfd:
                for fd, ino in todo:
                    try:
                        _bound(pidfd, fd)
                    except OSError as exc:
                        if exc.errno not in (errno.EBADF, errno.ENOENT):  # not merely closed meanwhile
                            raise
                        continue
                    done.add(ino)
                    out.sockets += 1
        except OSError as exc:
            if exc.errno in (errno.ENOPROTOOPT, errno.EINVAL):  # a kernel before 6.15
                kernel = os.uname().release
                out.why_not = f"this kernel ({kernel}) cannot bound TCP's backoff (Linux ≥ 6.15)"
                return out
            if exc.errno in (errno.EPERM, errno.ENOSYS):
                out.why_not = f"cannot reach process {pid}'s sockets: {exc.strerror}"
                return out
            continue  # the process ended meanwhile (ESRCH)
    return out


def _bound(pidfd: int, fd: int) -> None:
    with sockfds.borrowed(pidfd, fd) as s:
        s.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS, RTO_MAX_MS)
        if s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 0:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, USER_TIMEOUT_MS)
