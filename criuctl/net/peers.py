"""The TCP endpoints of a workload's tree: what makes several workloads one distributed job.

A rank of a multi-node job holds established connections to the other ranks (the rendezvous
store, gloo's pairs) and listens for them. An agent reports both for each workload; the client
joins the reports of every node into jobs (`criuctl.client.jobs`): two workloads are ranks of one
job when a connection of one ends at an endpoint of the other.

Read from `/proc/PID/net/tcp{,6}`, the socket table of the *process's* network namespace, matched
against the sockets its descriptors hold. psutil reads `/proc/net/tcp`, the caller's namespace: an
agent in its node's namespace would see no socket of a pod, which has its own.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from criuctl.core import procinfo
from criuctl.core.workloads import EndpointsJson
from criuctl.net import sockfds
from criuctl.net.readdress import canonical

ESTABLISHED, LISTEN = 0x01, 0x0A  # include/net/tcp_states.h


@dataclass
class Endpoints:
    """A tree's listening endpoints and established connections (addresses in IPv4 form)."""

    listening: list[tuple[str, int]] = field(default_factory=list)
    connections: list[tuple[str, int, str, int]] = field(default_factory=list)  # local, remote

    def to_json(self) -> EndpointsJson:
        return {
            "listening": [list(e) for e in self.listening],
            "connections": [list(c) for c in self.connections],
        }

    @classmethod
    def from_json(cls, d: EndpointsJson | None) -> Endpoints:
        d = d or EndpointsJson(listening=[], connections=[])
        return cls(
            [(str(a), int(p)) for a, p in d.get("listening", [])],
            [(str(a), int(p), str(b), int(q)) for a, p, b, q in d.get("connections", [])],
        )


@dataclass(frozen=True)
class Socket:
    """One TCP socket as the kernel's table shows it (addresses canonical: v4-mapped as IPv4)."""

    local: tuple[str, int]
    remote: tuple[str, int]
    state: int

    @property
    def established(self) -> bool:
        return self.state == ESTABLISHED


def _address(text: str) -> tuple[str, int]:
    """`0100007F:1F90` (IPv4) or 32 hex digits (IPv6), each 32-bit word in host byte order."""
    addr, _, port = text.partition(":")
    raw = bytes.fromhex(addr)
    words = struct.unpack(f"={len(raw) // 4}I", raw)
    packed = struct.pack(f"!{len(words)}I", *words)
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    return canonical(socket.inet_ntop(family, packed)), int(port, 16)


def table(pid: int) -> Iterator[tuple[int, Socket]]:
    """(inode, socket) for every TCP socket of `pid`'s network namespace."""
    for name in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9:
                yield int(f[9]), Socket(_address(f[1]), _address(f[2]), int(f[3], 16))


def held(pids: Iterable[int]) -> dict[int, Socket]:
    """Every TCP socket `pids` hold, by inode (a process gone meanwhile holds none), read once per
    network namespace, in each process's own."""
    by_ns: dict[str, set[int]] = {}  # a namespace → the sockets of all its processes here
    first: dict[str, int] = {}  # a namespace → a pid in it, to read its table through
    for pid in pids:
        try:
            ns = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            continue
        first.setdefault(ns, pid)
        by_ns.setdefault(ns, set()).update(ino for _, ino in sockfds.of(pid))
    found: dict[int, Socket] = {}
    for ns, inodes in by_ns.items():
        found.update((ino, s) for ino, s in table(first[ns]) if ino in inodes and ino)
    return found


def sockets(pids: Iterable[int]) -> list[Socket]:
    """Every TCP socket `pids` hold, each once (`held`)."""
    return list(held(pids).values())


def of_tree(root_pid: int) -> Endpoints:
    """Every TCP endpoint the processes of `root_pid`'s tree hold (each socket once)."""
    out = Endpoints()
    for s in sockets(procinfo.tree_pids(root_pid)):
        if s.state == LISTEN:
            out.listening.append(s.local)
        elif s.established:
            out.connections.append((*s.local, *s.remote))
    out.listening = sorted(set(out.listening))
    out.connections = sorted(set(out.connections))
    return out
