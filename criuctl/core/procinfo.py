"""Facts about a live process tree, read through psutil and /proc, for the manifest and `ps`."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import psutil


@dataclass
class ProcessInfo:
    """One process of a tree as a bundle's manifest records it (and `ps` shows it)."""

    pid: int  # host PID at checkpoint time
    ns_pid: int  # PID inside the workload's PID namespace (what CRIU restores)
    ppid: int
    name: str
    cmdline: list[str]
    cwd: str
    rss_bytes: int
    threads: int


def boot_id() -> str:
    """This boot's id: a record from another boot names processes that no longer exist."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "unknown"


def start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/PID/stat field 22); None if it is gone.

    A PID alone does not name a process: after the process ends (or the node reboots) the kernel
    hands the same number to another one. The start time, with the boot id, does name it.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command, which may hold spaces and ")"
    return int(fields[19])  # field 22 of the whole line: the third after ")" is field 3


@dataclass(frozen=True)
class Identity:
    """One process, for as long as it lives, whatever its PID is reused for later: (PID, start time,
    boot id). Every record that names a process it may later signal, kill or thaw keeps this, and
    acts only while the process it names is still the one it recorded."""

    pid: int
    start: int | None  # None: a record written before identities were kept
    boot: str
    # with no start: when the record was written (wall clock); its process started before that,
    # so one that started later is another process (a coarser test, for older records)
    born_by: float | None = None

    @classmethod
    def of(cls, pid: int) -> Identity:
        """The identity of live process `pid` now (start None if it is already gone)."""
        return cls(pid, start_ticks(pid), boot_id())

    def _same(self, now: int) -> bool:
        """Whether the process holding the PID now, started at `now` ticks, is the one recorded."""
        if self.boot != boot_id():
            return False
        if self.start is not None:
            return now == self.start
        if self.born_by is not None:
            with contextlib.suppress(psutil.Error):
                return psutil.Process(self.pid).create_time() <= self.born_by + 1.0
        return True

    def alive(self) -> bool:
        """The very process recorded still exists (a zombie does not count)."""
        now = start_ticks(self.pid)
        if now is None or not self._same(now):
            return False
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def recycled(self) -> bool:
        """The PID now names another process (it ended, and the number was handed out again)."""
        now = start_ticks(self.pid)
        return now is not None and not self._same(now)


def tree_pids(root_pid: int) -> list[int]:
    """The root and all its descendants, root first; [] when the root is gone."""
    try:
        root = psutil.Process(root_pid)
        return [root_pid, *(p.pid for p in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def kill_tree(root_pid: int, wait: float = 0.0) -> None:
    """SIGKILL a workload's tree: its root, then every descendant.

    Killing the root suffices when it is PID 1 of the tree's namespace; a tree started without one
    (`criuctl run` on a GPU node) would leave its children running beside their copy.
    """
    pids = tree_pids(root_pid) or [root_pid]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in pids):
        time.sleep(0.01)  # until reaped: a restore on this node needs these PIDs free


def ns_pid(pid: int) -> int:
    """The PID as seen in the process's innermost PID namespace (last field of NSpid)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return int(line.split()[-1])
    return pid


def describe(root_pid: int) -> list[ProcessInfo]:
    out: list[ProcessInfo] = []
    for pid in tree_pids(root_pid):
        try:
            p = psutil.Process(pid)
            with p.oneshot():
                out.append(
                    ProcessInfo(
                        pid=pid,
                        ns_pid=ns_pid(pid),
                        ppid=p.ppid(),
                        name=p.name(),
                        cmdline=p.cmdline(),
                        cwd=p.cwd(),
                        rss_bytes=p.memory_info().rss,
                        threads=p.num_threads(),
                    )
                )
        except (psutil.NoSuchProcess, FileNotFoundError):
            continue
    return out


def rss_bytes(root_pid: int) -> int:
    total = 0
    for pid in tree_pids(root_pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += psutil.Process(pid).memory_info().rss
    return total


def send_signal(pid: int, sig: int) -> None:
    """Signal a process that may already be gone. Never a process group: 0 and -1 are refused."""
    if pid <= 0:
        raise ValueError(f"refusing to signal PID {pid} (a process group)")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def open_files(pids: list[int]) -> list[str]:
    """Every path the tree holds open (regular files, devices, sockets, pipes), deduplicated."""
    seen: set[str] = set()
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            entries = list(fd_dir.iterdir())
        except OSError:
            continue
        for fd in entries:
            try:
                seen.add(str(fd.readlink()))
            except OSError:
                continue
    return sorted(seen)


def uses_gpu(pids: list[int]) -> bool:
    """True when any process maps the CUDA driver or holds an NVIDIA device open."""
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        if "libcuda.so" in maps or "/dev/nvidia" in maps:
            return True
    return any(f.startswith("/dev/nvidia") for f in open_files(pids))


def is_stopped(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_STOPPED
    except psutil.NoSuchProcess:
        return False


# Kernel objects CRIU cannot checkpoint, as /proc/PID/fd shows them, with what to do about each.
UNSUPPORTED_FDS = {
    "anon_inode:[io_uring]": (
        "an io_uring",
        "run it under `criuctl run` without --allow-io-uring (or set sysctl kernel.io_uring_disabled=2)",
    ),
    "anon_inode:[perf_event]": ("a perf event", "stop profiling the job before checkpointing it"),
    "anon_inode:[userfaultfd]": ("a userfaultfd", "checkpoint the job when it does not use userfaultfd"),
}


def unsupported_resources(pids: list[int]) -> list[tuple[int, int, str, str]]:
    """(pid, fd, what, fix) for every open file CRIU is known to refuse; checked before freezing."""
    found = []
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = str(fd.readlink())
            except OSError:
                continue
            if target in UNSUPPORTED_FDS:
                found.append((pid, int(fd.name), *UNSUPPORTED_FDS[target]))
    return found
