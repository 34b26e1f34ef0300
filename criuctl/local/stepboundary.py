"""criuctl's side of the step boundary: ask the in-process hook to stop, wait for it, let it go.

The hook (`hooks/criuctl_hook/boundary.py`) registers every process that runs optimizer steps in
the workload's control directory. Before a dump, `reach` writes a request there and waits until
each live trainer reports from its step boundary: CUDA synchronised, the caching allocator
emptied, what it holds on the GPU. A workload with no trainer (not PyTorch, or no step yet) is
dumped at once, and so is one whose step does not end within the timeout: CRIU's image is exact
anywhere, the boundary only makes it tidier (and is required by the state pre-dump, `SAVE`).

Several trainers (DDP ranks in one workload) do not stop at the same step on their own: the first
to stop holds the others in their next collective. So once one has stopped, the rest get a short
grace, and the dump goes on with those that did not stop caught inside their step.

A container's trainers keep their control directory in the container's own filesystem
(`nsinit.BOUNDARY_DIR`, which criuctl's init names to the hook), reached from the node through
`/proc/PID/root` (`containers.control_dir`). Everything in it is the job's to change, and an
absolute symlink there would resolve on the node: so every name below the container's root is
opened without following a symlink (`_opened`, `dir_fd` operations), and a file read must be a
small regular file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from criuctl.core import env, procinfo, statedir, workloads
from criuctl.format import bundle
from criuctl_hook import contract, durable

PEER_GRACE = 2.0  # once one trainer stopped, seconds for the others


@dataclass
class Reached:
    """What `reach` found; goes into the manifest (`bundle.Manifest.boundary`)."""

    request_id: str
    trainers: int  # processes that had run optimizer steps
    held: int  # of them, those stopped at a step boundary
    step: int | None  # the first trainer's optimizer step count there
    waited_s: float
    cuda_bytes: int  # device memory still allocated by the held trainers after emptying the cache
    why: str = ""  # why not every trainer stopped
    saved: dict[str, str] = field(default_factory=dict)  # rank -> state file (SAVE)
    state_bytes: int = 0
    beating: threading.Event = field(default_factory=threading.Event, repr=False)  # cleared by release
    reports: list[dict] = field(default_factory=list, repr=False)  # each held trainer's own report

    def facts(self) -> bundle.StepBoundary:
        """What the manifest keeps of it."""
        suspended = sum(
            int(r["nccl_suspend"].get("suspended", 0))
            for r in self.reports
            if isinstance(r.get("nccl_suspend"), dict)
        )
        return bundle.StepBoundary(
            self.request_id,
            self.trainers,
            self.held,
            self.step,
            self.waited_s,
            self.cuda_bytes,
            self.why,
            nccl_suspended=suspended,
            cuda_reserved=sum(int(r.get("cuda_reserved") or 0) for r in self.reports),
        )

    @property
    def complete(self) -> bool:
        return self.trainers > 0 and self.held == self.trainers


def control_dir(name: str) -> Path:
    return statedir.CONTROL.path() / workloads.validate_name(name)


def prepare(path: Path) -> None:
    """A fresh control directory: no request left from an earlier holder of the path."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, mode=0o700)


def timeout() -> float:
    """Seconds for a trainer's step to end ($CRIUCTL_BOUNDARY_TIMEOUT)."""
    return env.BOUNDARY_TIMEOUT.get()


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_IN_CONTAINER = re.compile(r"^(/proc/\d+/root)((?:/[^/]+)*)/?$")
_MOST = 1 << 20  # a report or a request is a few hundred bytes


@contextlib.contextmanager
def _opened(control: str, *sub: str, create: bool = False) -> Iterator[int]:
    """A descriptor of the control directory (or of `sub` in it), no component below a container's
    root followed if it is a symlink; `create`: made where missing (a restored container's /run
    may not have it yet). OSError when it is not there (or not a plain directory)."""
    m = _IN_CONTAINER.match(control)
    base, below = (m.group(1), m.group(2)) if m else (control, "")
    if create and not m:  # criuctl's own state dir on this node
        os.makedirs(base, 0o700, exist_ok=True)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [*filter(None, below.split("/")), *sub]:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
            fd, old = os.open(part, _DIR, dir_fd=fd), fd
            os.close(old)
        yield fd
    finally:
        os.close(fd)


def _read(control: str, *path: str) -> bytes:
    """A small regular file of the control directory; OSError if it is anything else."""
    *sub, name = path
    with _opened(control, *sub) as d:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=d)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size > _MOST:
                raise OSError(f"{name} is not a small regular file")
            return os.read(fd, _MOST)
        finally:
            os.close(fd)


def _write_request(control: str, data: bytes) -> None:
    """Replace the request in one rename (`durable`: the hook never reads half of one), inside the
    directory as opened: its descriptor's /proc/self/fd path names it without a lookup by name."""
    with _opened(control) as d:
        durable.replace(Path(f"/proc/self/fd/{d}") / contract.REQUEST, data, 0o644, sync=False)


def _live_trainers(control: str, root_pid: int) -> dict[str, int]:
    """Registered trainers still in the tree: the PID they see (namespace) -> host PID."""
    by_ns = {str(procinfo.ns_pid(p)): p for p in procinfo.tree_pids(root_pid)}
    try:
        with _opened(control, contract.TRAINERS) as d:
            return {name: by_ns[name] for name in os.listdir(d) if name in by_ns}
    except OSError:
        return {}


def _present(control: str) -> bool:
    try:
        with _opened(control):
            return True
    except OSError:
        return False


def _report(control: str, ns_pid: str, request_id: str) -> dict | None:
    try:
        held = json.loads(_read(control, contract.HELD, ns_pid))
    except (OSError, ValueError):
        return None
    return held if isinstance(held, dict) and held.get("id") == request_id else None


def reach(
    w: workloads.Workload, mode: str = contract.HOLD, out: Path | None = None, wait: float | None = None
) -> Reached:
    """Ask every trainer of `w` to stop at its next step boundary (and, for SAVE, to write its state)."""
    rid = uuid.uuid4().hex
    started = time.monotonic()
    control = w.control or ""
    trainers = _live_trainers(control, w.root_pid) if control else {}
    if not trainers:
        why = "no process of it has run an optimizer step under criuctl's hook"
        if control and not _present(control):  # the job took it away: trainers may have run
            why = "its control directory is gone (the job removed it?), so no trainer could be asked"
        return Reached(rid, 0, 0, None, 0.0, 0, why)
    request = {"id": rid, "mode": mode, **({"out": str(out)} if out else {})}
    try:
        _write_request(control, json.dumps(request).encode())
    except OSError as exc:  # the job took its control directory away: dump it without a boundary
        return Reached(rid, len(trainers), 0, None, 0.0, 0, f"cannot ask its trainers ({exc})")
    beating = threading.Event()
    beating.set()
    threading.Thread(target=_heartbeat, args=(control, beating), daemon=True).start()
    deadline = started + (timeout() if wait is None else wait)
    reports: dict[str, dict] = {}
    first_seen: float | None = None
    while True:
        for ns in trainers:
            if ns not in reports and (r := _report(control, ns, rid)) is not None:
                reports[ns] = r
        now = time.monotonic()
        if reports and first_seen is None:
            first_seen = now
        alive = [pid for pid in trainers.values() if psutil.pid_exists(pid)]
        if len(reports) >= len(alive) or now >= deadline:
            break
        if first_seen is not None and now >= first_seen + PEER_GRACE:
            break
        time.sleep(0.01)
    first = next(iter(reports.values()), {})
    why = "" if len(reports) == len(trainers) else _why_not(len(trainers) - len(reports), now >= deadline)
    return Reached(
        rid,
        len(trainers),
        len(reports),
        first.get("step"),
        round(time.monotonic() - started, 3),
        sum(int(r.get("cuda_allocated", 0)) for r in reports.values()),
        why,
        {r["rank"]: r["saved"] for r in reports.values() if "saved" in r},
        sum(int(r.get("bytes", 0)) for r in reports.values()),
        beating,
        list(reports.values()),
    )


def _heartbeat(control: str, beating: threading.Event) -> None:
    """Touch the request while this process holds the trainers: if it dies, they go on by themselves
    once the request is older than the hook's STALE_AFTER (a held job is never left held)."""
    while beating.is_set():
        try:
            with _opened(control) as d:
                os.utime(contract.REQUEST, dir_fd=d, follow_symlinks=False)
        except OSError:
            return
        time.sleep(contract.HEARTBEAT)


def _why_not(missing: int, timed_out: bool) -> str:
    if timed_out:
        return (
            f"{missing} trainer(s) did not end their step within {timeout():.0f} s ({env.BOUNDARY_TIMEOUT})"
        )
    return f"{missing} trainer(s) were held inside their step by a stopped peer"


def let_go(w: workloads.Workload, reached: Reached | None) -> None:
    """Let the held trainers go on (the dump failed, or thawed): remove the request."""
    if reached is None or not w.control:
        return
    reached.beating.clear()
    with contextlib.suppress(OSError, ValueError):
        req = json.loads(_read(w.control, contract.REQUEST))
        if req.get("id") == reached.request_id:
            with _opened(w.control) as d:
                os.unlink(contract.REQUEST, dir_fd=d)


def let_go_on_target(control: str, request_id: str) -> None:
    """On the node that restored a held copy: tell it to go on (the request may still be visible)."""
    if not control or not request_id:
        return
    with contextlib.suppress(OSError), _opened(control, contract.RELEASED, create=True) as d:
        os.close(
            os.open(request_id, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=d)
        )
