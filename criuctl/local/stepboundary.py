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
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from criuctl.core import durable, env, procinfo, statedir, workloads
from criuctl.format import bundle
from criuctl_hook import contract

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
            int((r.get("nccl_suspend") or {}).get("suspended", 0))
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


def _live_trainers(control: Path, root_pid: int) -> dict[str, int]:
    """Registered trainers still in the tree: the PID they see (namespace) -> host PID."""
    by_ns = {str(procinfo.ns_pid(p)): p for p in procinfo.tree_pids(root_pid)}
    with contextlib.suppress(FileNotFoundError):
        return {p.name: by_ns[p.name] for p in (control / contract.TRAINERS).iterdir() if p.name in by_ns}
    return {}


def _report(control: Path, ns_pid: str, request_id: str) -> dict | None:
    try:
        held = json.loads((control / contract.HELD / ns_pid).read_text())
    except (OSError, ValueError):
        return None
    return held if isinstance(held, dict) and held.get("id") == request_id else None


def reach(
    w: workloads.Workload, mode: str = contract.HOLD, out: Path | None = None, wait: float | None = None
) -> Reached:
    """Ask every trainer of `w` to stop at its next step boundary (and, for SAVE, to write its state)."""
    rid = uuid.uuid4().hex
    started = time.monotonic()
    control = Path(w.control) if w.control else None
    trainers = _live_trainers(control, w.root_pid) if control else {}
    if not trainers:
        why = "no process of it has run an optimizer step under criuctl's hook"
        return Reached(rid, 0, 0, None, 0.0, 0, why)
    request = {"id": rid, "mode": mode, **({"out": str(out)} if out else {})}
    durable.replace(control / contract.REQUEST, json.dumps(request).encode(), 0o644, sync=False)
    beating = threading.Event()
    beating.set()
    threading.Thread(target=_heartbeat, args=(control / contract.REQUEST, beating), daemon=True).start()
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


def _heartbeat(request: Path, beating: threading.Event) -> None:
    """Touch the request while this process holds the trainers: if it dies, they go on by themselves
    once the request is older than the hook's STALE_AFTER (a held job is never left held)."""
    while beating.is_set():
        try:
            os.utime(request)
        except FileNotFoundError:
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
    with contextlib.suppress(FileNotFoundError):
        req = json.loads((Path(w.control) / contract.REQUEST).read_text())
        if req.get("id") == reached.request_id:
            (Path(w.control) / contract.REQUEST).unlink()


def let_go_on_target(control: str, request_id: str) -> None:
    """On the node that restored a held copy: tell it to go on (the request may still be visible)."""
    if not control or not request_id:
        return
    d = Path(control) / contract.RELEASED
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    (d / request_id).touch()
