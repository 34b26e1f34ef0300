"""A workload's log on this node, read as `criuctl logs` shows it: the last lines, or from an
offset on with the workload's state, for `logs -f` (here, or through a node's agent).

A job's stdout and stderr go to `STATE_DIR/logs/NAME.log` on the node where it runs; a job moved
away keeps writing on its new node, so following it here ends with where it went.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from criuctl.core import workloads

CHUNK = 1 << 20  # a follower's read: a log growing faster is read again at once


@dataclass(frozen=True)
class Chunk:
    """Bytes of the log from an offset, the offset after them, and whether more may come."""

    text: bytes
    end: int
    state: str  # the workload's state now ("running" only while its very tree runs here)
    moved_to: str | None = None
    exit_code: int | None = None

    @property
    def ended(self) -> bool:
        return self.state != workloads.RUNNING


def tail(path: Path, lines: int, chunk: int = 1 << 16) -> tuple[bytes, int]:
    """The last `lines` lines of a file (all of it for 0), read backwards from its end (a log may
    be gigabytes), and its size then."""
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        end = pos = f.tell()
        if not lines:
            f.seek(0)
            return f.read(end), end
        data = b""
        while pos > 0 and data.count(b"\n") <= lines:
            pos = max(0, pos - chunk)
            f.seek(pos)
            data = f.read(end - pos)
    return b"\n".join(data.splitlines()[-lines:]) + b"\n" if data else b"", end


def state(name: str) -> tuple[str, str | None, int | None]:
    """The workload's state, where it moved, its exit code: "running" only while its tree runs."""
    w = workloads.load(name)
    if w is None:
        return workloads.EXITED, None, None
    running = w.state == workloads.RUNNING and w.alive()
    return (w.state if w.state != workloads.RUNNING or running else workloads.EXITED), w.moved_to, w.exit_code


def read(name: str, offset: int | None, lines: int = 0) -> Chunk:
    """From `offset` on (at most CHUNK), or, for None, the last `lines` lines (all for 0). The
    state is read first: a workload that ends meanwhile has its last bytes in this read or the next
    one, which says it ended."""
    path = workloads.log_path(name)
    if not path.exists():
        raise workloads.UnknownWorkload(f"no logs for {name!r} on this node", "see `criuctl ps -a`")
    now, moved_to, code = state(name)
    if offset is None:
        text, end = tail(path, lines)
    else:
        with path.open("rb") as f:
            f.seek(offset)
            text = f.read(CHUNK)
        end = offset + len(text)
    return Chunk(text, end, now, moved_to, code)
