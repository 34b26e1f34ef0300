"""A handoff process started before it is needed: Python up, criuctl imported, waiting for its job.

Starting `python -m criuctl.agent.handoff` costs ~0.1–0.2 s (the interpreter, then criuctl's
modules), and a post-copy migration's target waits for exactly that inside its downtime. So the
agent keeps one handoff started ahead (`handoffs.Handoff.spawn` takes it and starts the next): it
imports everything, then reads one line from its stdin: its role, spec and log (`job_line`). From
there it is the same handoff as a cold one, leased through the same stdin. An agent that dies
before using it closes that stdin, and the waiting process exits.

Its command line is rewritten to the cold one's (`… criuctl.agent.handoff ROLE SPEC`) once it has
its job, so that `ps` — and whoever looks for a migration's handoff by its spec — sees what it is.
The warm process starts with a blank argument long enough for that; the kernel shows whatever is
in the argv area, which CPython copied at start and never reads again.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

WARM = "warm"
ROOM = 1024  # bytes of blank argv the warm process starts with, for its later command line


def blank() -> str:
    return " " * ROOM


def job_line(role: str, spec: Path, log: Path) -> bytes:
    """What the agent writes to a warm handoff: one JSON line (paths may hold spaces)."""
    return json.dumps([role, str(spec), str(log)]).encode() + b"\n"


def take_job() -> tuple[str, Path, Path] | None:
    """Wait for `job_line` on stdin; None when the agent closed it first (it died or stopped)."""
    try:
        job = json.loads(sys.stdin.readline() or "null")
    except (OSError, ValueError):
        return None
    if not (isinstance(job, list) and len(job) == 3 and all(isinstance(x, str) for x in job)):
        return None
    role, spec, log = job
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for std in (1, 2):  # from here on the handoff writes to its migration's log, as a cold one would
        os.dup2(fd, std)
    os.close(fd)
    _retitle(["-m", "criuctl.agent.handoff", role, spec])
    return role, Path(spec), Path(log)


def _retitle(args: list[str]) -> None:
    """Show `python ARGS` as this process's command line (best effort: only ps/tests read it)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48 and 49)
    except (OSError, ValueError, IndexError):
        return
    new = b"\0".join(a.encode() for a in [sys.executable, *args]) + b"\0"
    if len(new) <= end - start:
        ctypes.memmove(start, new + bytes(end - start - len(new)), end - start)
