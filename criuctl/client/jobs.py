"""Which workloads are ranks of one distributed job: joined by their TCP connections, across nodes.

Every agent lists its workloads with their TCP endpoints (`criuctl.net.peers`, each connection's
remote as the node's kept redirects make it). Two workloads are ranks of one job when a connection
of one ends at an endpoint of the other; the job is the connected set. A connection that ends
nowhere criuctl runs (a database, a parameter server outside) is *foreign*: a rank holding one
cannot move, since the far end would not follow. Loopback endpoints are told apart by node.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from criuctl.client.agents import Node, all_nodes, list_everywhere
from criuctl.core.workloads import WorkloadRow
from criuctl.net.peers import Endpoints

Conn = tuple[str, int, str, int]


@dataclass
class Rank:
    node: str
    workload: str
    tcp: Endpoints
    pod: str = ""  # NAMESPACE/POD of a container's workload: what its user knows it by

    @property
    def shown(self) -> str:
        """The pod's name for a container (ctr-<id> means nothing to its user), else the workload's."""
        return self.pod.partition("/")[2] or self.workload

    @property
    def label(self) -> str:
        return f"{self.shown}@{self.node}"


@dataclass
class Link:
    """One connection of `rank`, and the rank at its far end (None: foreign)."""

    rank: Rank
    conn: Conn
    peer: Rank | None


@dataclass
class Job:
    ranks: list[Rank]
    links: list[Link] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The ranks' common name prefix ("ddp" for ddp-0, ddp-1; for pods ddp-master-0 and
        ddp-worker-0, their pods' names), else the first rank's name."""
        names = sorted(r.shown for r in self.ranks)
        prefix = ""
        for chars in zip(*names, strict=False):
            if len(set(chars)) > 1:
                break
            prefix += chars[0]
        prefix = prefix.rstrip("-_.")
        return prefix if len(self.ranks) > 1 and prefix else names[0]

    @property
    def foreign(self) -> list[Link]:
        return [link for link in self.links if link.peer is None]

    def rank(self, workload: str) -> Rank | None:
        return next((r for r in self.ranks if r.workload == workload), None)


def _key(node: str, addr: str, port: int) -> tuple[str, str, int]:
    """An endpoint's identity: a loopback address means something only on its own node."""
    return (node if ipaddress.ip_address(addr).is_loopback else "", addr, port)


def group(ranks: list[Rank]) -> list[Job]:
    """Join ranks into jobs by their connections; a workload with no connection is a job of one."""
    owner: dict[tuple[str, str, int], Rank] = {}
    for r in ranks:
        for la, lp, _, _ in r.tcp.connections:
            owner[_key(r.node, la, lp)] = r
        for la, lp in r.tcp.listening:
            if not ipaddress.ip_address(la).is_unspecified:
                owner.setdefault(_key(r.node, la, lp), r)
    parent = {id(r): r for r in ranks}

    def find(r: Rank) -> Rank:
        while parent[id(r)] is not r:
            r = parent[id(r)]
        return r

    links: list[Link] = []
    for r in ranks:
        for conn in r.tcp.connections:
            peer = owner.get(_key(r.node, conn[2], conn[3]))
            links.append(Link(r, conn, peer))
            if peer is not None:
                parent[id(find(peer))] = find(r)
    jobs: dict[int, Job] = {}
    for r in ranks:
        jobs.setdefault(id(find(r)), Job([])).ranks.append(r)
    for link in links:
        jobs[id(find(link.rank))].links.append(link)
    return list(jobs.values())


@dataclass
class JobSurvey:
    jobs: list[Job]
    silent: list[str]  # nodes that did not answer: a job may have ranks there too


def _pod(where: str | None) -> str:
    """NAMESPACE/POD of a container's row (the agent writes NAMESPACE/POD/CONTAINER)."""
    parts = (where or "").split("/")
    return "/".join(parts[:2]) if len(parts) == 3 else ""


def survey(nodes: list[Node] | None = None, wanted: str | None = None) -> JobSurvey:
    """Every running workload of every node, joined into jobs (all nodes asked at once). With
    `wanted` (before a move), a node silent at first is asked again, longer, when the job named so
    is not found or has a connection to no answering node's rank: a rank on the silent node would
    be left out of it (`agents.list_everywhere`). A listing (`ps --jobs`) does not wait."""
    nodes = list(all_nodes().values()) if nodes is None else nodes

    def joined(answers: list[list[WorkloadRow] | None]) -> list[Job]:
        return group(
            [
                Rank(node.name, row["name"], Endpoints.from_json(row["tcp"]), _pod(row.get("pod")))
                for node, rows in zip(nodes, answers, strict=True)
                for row in rows or []
                if row.get("state") == "running" and row.get("alive") and isinstance(row.get("tcp"), dict)
            ]
        )

    def incomplete(answers: list[list[WorkloadRow] | None]) -> bool:
        if wanted is None:
            return False
        job = job_of(JobSurvey(joined(answers), []), wanted)
        return job is None or bool(job.foreign)

    answers = list_everywhere(nodes, again=incomplete)
    silent = [n.name for n, a in zip(nodes, answers, strict=True) if a is None]
    return JobSurvey(joined(answers), silent)


def job_of(found: JobSurvey, name: str) -> Job | None:
    """The job named `name`, or the job one of whose ranks is workload (or pod) `name`."""
    return next((j for j in found.jobs if j.name == name and len(j.ranks) > 1), None) or next(
        (j for j in found.jobs if j.rank(name) is not None or any(r.shown == name for r in j.ranks)), None
    )
