"""The fallback backend: containers found without their runtime, by ID in /proc/*/cgroup.

Every runtime puts a container's processes in a cgroup whose path ends in (or contains) the
container's ID (`/k8s.io/ID`, `/kubepods/…/cri-containerd-ID.scope`, `crio-ID.scope`). The
container's PID 1 is the process of that cgroup whose parent is outside it. Nothing here knows
pod names or log paths: only a runtime does.
"""

from __future__ import annotations

import re
from pathlib import Path

from criuctl.container.runtime import Container, pick
from criuctl.core import env

_ID = re.compile(r"(?:^|[/:-])([0-9a-f]{64})(?:\.scope)?$")


def _container_id(pid: int) -> str | None:
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if m := _ID.search(line.rpartition(":")[2]):
            return m.group(1)
    return None


def _ppid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rpartition(")")[2].split()[1])


class ProcfsRuntime:
    endpoint = "procfs"

    def containers(self) -> list[Container]:
        members: dict[str, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (cid := _container_id(int(entry.name))):
                members.setdefault(cid, []).append(int(entry.name))
        out = []
        for cid, pids in members.items():
            inside = set(pids)
            roots = sorted(p for p in pids if _ppid(p) not in inside)
            if roots:
                out.append(Container(id=cid, pid=roots[0], state="running", runtime="procfs"))
        return out

    def container(self, ident: str) -> Container:
        return pick(ident, self.containers())

    def checkpoint(self, ident: str, location: str, timeout: float = 300.0) -> None:
        from criuctl.container.runtime import Unsupported

        raise Unsupported(
            "without a runtime socket there is no runtime checkpoint",
            f"set {env.RUNTIME_ENDPOINT} to the runtime's CRI socket",
        )
