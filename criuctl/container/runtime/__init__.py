"""Container runtimes, behind one small interface: find a container's processes and facts, take a
runtime checkpoint where the runtime can.

criuctl never asks a runtime to restore (restore-through-create is off by default since the 2026
CVEs, and it cannot restore into a container that already runs): the agent restores into a
placeholder container itself. So a runtime here is read-mostly:

    containers()        every container on this node, as `Container`s
    container(id)       one, by ID or unique ID prefix (UnknownContainer otherwise)
    checkpoint(id, to)  the CRI CheckpointContainer call (containerd >= 2.0, CRI-O), or Unsupported

Backends: `cri` (containerd and CRI-O over the CRI gRPC API, stubs generated at install time) and
`procfs` (no runtime socket: containers found by their ID in /proc/*/cgroup, facts from /proc).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Protocol

from criuctl.core import env
from criuctl.core.errors import CriuctlError

# Where the common runtimes listen, in the order a node agent tries them.
DEFAULT_ENDPOINTS = ("unix:///run/containerd/containerd.sock", "unix:///var/run/crio/crio.sock")


class RuntimeUnavailable(CriuctlError):
    """The runtime's socket is missing or does not answer."""

    exit_code = 69  # EX_UNAVAILABLE


class UnknownContainer(CriuctlError):
    exit_code = 3


class Unsupported(CriuctlError):
    """The runtime does not implement a call (CheckpointContainer before containerd 2.0)."""

    exit_code = 69


@dataclass
class Container:
    """What criuctl needs to know about a running container, from the runtime (and /proc)."""

    id: str
    pid: int  # host PID of the container's PID 1 (0 when not running)
    state: str  # "running", "exited", "created", "unknown"
    name: str = ""  # the container's name in its pod
    pod_name: str = ""
    pod_namespace: str = ""
    pod_uid: str = ""
    sandbox_id: str = ""
    image: str = ""
    log_path: str = ""  # the runtime's log file for this container (what `kubectl logs` reads)
    runtime: str = ""  # "containerd 1.6.20", "procfs"
    labels: dict[str, str] = field(default_factory=dict)
    # the runtime's record of the container's annotations: a device plugin's CDI devices among them
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def short_id(self) -> str:
        return self.id[:12]


class Runtime(Protocol):
    endpoint: str

    def containers(self) -> list[Container]: ...

    def container(self, ident: str) -> Container: ...

    def checkpoint(self, ident: str, location: str, timeout: float = 300.0) -> None: ...


def check_id(ident: str) -> str:
    """`ident` if it can be (a prefix of) a container ID: 1-64 hex digits; UnknownContainer if not."""
    if not ident or len(ident) > 64 or any(c not in "0123456789abcdef" for c in ident.lower()):
        raise UnknownContainer(
            f"{ident[:80]!r} is not a container ID (hex digits)",
            "see `criuctl ps --node` for the containers on this node",
        )
    return ident.lower()


def pick(ident: str, found: list[Container]) -> Container:
    """The one container whose ID is `ident` or starts with it; UnknownContainer saying why not."""
    check_id(ident)
    hits = [c for c in found if c.id.startswith(ident.lower())]
    if len(hits) == 1:
        return hits[0]
    if not hits:
        raise UnknownContainer(
            f"no container {ident!r} on this node",
            "see `criuctl ps --node` for the containers on this node",
        )
    raise UnknownContainer(f"{ident!r} matches {len(hits)} containers", "give more of the ID")


def endpoint() -> str:
    """The runtime socket to use: $CRIUCTL_RUNTIME_ENDPOINT, else the first default that exists."""
    if configured := env.RUNTIME_ENDPOINT.get():
        return configured
    for ep in DEFAULT_ENDPOINTS:
        if os.path.exists(ep.removeprefix("unix://")):
            return ep
    return DEFAULT_ENDPOINTS[0]


def connect(where: str | None = None) -> Runtime:
    """The runtime at `where` (a CRI endpoint, or "procfs"), default `endpoint()`."""
    where = where or endpoint()
    if where == "procfs":
        from criuctl.container.runtime.procfs import ProcfsRuntime

        return ProcfsRuntime()
    from criuctl.container.runtime.cri import CRIRuntime

    return CRIRuntime(where)
