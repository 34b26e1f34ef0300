"""The locks around a dump: one CRIU dump at a time per host, one dump at a time per workload.

Both are flock(2) locks, so they die with the process that holds them: a `criuctl dump` or a
handoff killed mid-way never leaves a workload locked. Their descriptors are close-on-exec, so
CRIU (forked and exec'ed by pycriu) never inherits one.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from criuctl.core import statedir
from criuctl.core.errors import CriuctlError

HOST_DUMP_LOCK = Path("/run/criuctl-dump.lock")


class WorkloadBusy(CriuctlError):
    """Another process is checkpointing (or holds frozen) this workload."""

    exit_code = 75  # EX_TEMPFAIL: try again once the other dump is over


@contextlib.contextmanager
def host_dump_slot() -> Iterator[None]:
    """Serialise CRIU dumps on this host.

    For a task in its own PID namespace, CRIU's parasite mounts a /proc at `proc.crtools` in the
    task's *working directory*; two dumps of jobs started from one folder at once collide there
    (`Can't create a directory (-17)`), and one fails. Freezing is the short part of a migration;
    transfers and restores still run side by side.
    """
    fd = os.open(HOST_DUMP_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@dataclass
class WorkloadLock:
    """Held from before a workload is frozen until its dump is committed or thawed.

    Why per workload and non-blocking: a second dump of a tree being dumped cannot succeed (the
    tree is already stopped and ptraced, or gone once the first commits); waiting would leave it
    talking to CRIU about a dead tree. It is refused at once, naming the holder.
    """

    name: str
    path: Path
    fd: int | None

    def release(self) -> None:
        """Let another dump of this workload start (idempotent)."""
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock; the file stays, empty of meaning
            self.fd = None


def lock_path(name: str) -> Path:
    return statedir.LOCKS.ensure() / f"{name}.lock"


def lock_workload(name: str, purpose: str) -> WorkloadLock:
    """Take workload `name`'s dump lock, or raise WorkloadBusy naming who holds it.

    `purpose` (e.g. "criuctl dump") is written into the lock file for the loser's message.
    """
    path = lock_path(name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise WorkloadBusy(
            f"workload {name!r} is already being checkpointed by {holder}",
            "wait for that dump or migration to end; this one froze nothing, the workload keeps running",
        ) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "purpose": purpose, "since": time.time()}).encode(), 0)
    return WorkloadLock(name, path, fd)


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
        return f"PID {int(info['pid'])} ({info['purpose']})"
    except (ValueError, KeyError, TypeError, OSError):
        return "another process"  # it has the lock but has not written its name yet
