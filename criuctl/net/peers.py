"""The TCP endpoints of a workload's tree: what makes several workloads one distributed job.

A rank of a multi-node job holds established connections to the other ranks (the rendezvous
store, gloo's pairs) and listens for them. An agent reports both for each workload; the client
joins the reports of every node into jobs (`criuctl.client.jobs`): two workloads are ranks of one
job when a connection of one ends at an endpoint of the other. Read through psutil, in the caller's
network namespace (an agent shares its node's with the workloads it runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psutil

from criuctl.core import procinfo
from criuctl.core.workloads import EndpointsJson
from criuctl.net.readdress import canonical

if TYPE_CHECKING:
    from psutil._ntuples import pconn  # psutil's connection tuple (types-psutil names it)


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


def sockets(pids: list[int]) -> Iterator[pconn]:
    """psutil's view of every TCP socket `pids` hold (a process gone meanwhile holds none)."""
    for pid in pids:
        try:
            yield from psutil.Process(pid).net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


def of_tree(root_pid: int) -> Endpoints:
    """Every TCP endpoint the processes of `root_pid`'s tree hold (each socket once)."""
    out = Endpoints()
    for c in sockets(procinfo.tree_pids(root_pid)):
        if c.status == psutil.CONN_LISTEN and c.laddr:
            out.listening.append((canonical(c.laddr.ip), c.laddr.port))
        elif c.status == psutil.CONN_ESTABLISHED and c.laddr and c.raddr:
            out.connections.append((canonical(c.laddr.ip), c.laddr.port, canonical(c.raddr.ip), c.raddr.port))
    out.listening = sorted(set(out.listening))
    out.connections = sorted(set(out.connections))
    return out
