"""Suspending a job's CUDA processes and undoing it, over the driver calls of `criuctl.gpu.cuda`.

All of a job's processes are locked before any is checkpointed (as CRIU's CUDA plugin does: no
process can start GPU work that waits on one whose memory is already gone), and every failure is
rolled back so the job keeps running: the driver's state machine is RUNNING -> LOCKED ->
CHECKPOINTED -> (restore) LOCKED -> (unlock) RUNNING, and each function here reads a process's
state first, so a retry skips what is done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from criuctl.gpu.cuda import CudaError, CUresult, Driver, ProcessState


@dataclass
class Undone:
    """What undoing a suspension did, pid by pid; one pid's failure does not stop the others."""

    restored: list[int] = field(default_factory=list)
    unlocked: list[int] = field(default_factory=list)
    already_running: list[int] = field(default_factory=list)
    errors: list[CudaError] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def suspend(driver: Driver, pids: list[int], timeout_s: float) -> list[int]:
    """Lock every pid, then checkpoint every pid, in order; on any failure undo it all and raise.

    All are locked before any is checkpointed, as CRIU's CUDA plugin does: no rank can start new GPU work
    that waits on a rank whose memory is already gone. The rollback (`release`) leaves the job running.
    """
    touched: list[int] = []
    try:
        for pid in pids:
            try:
                driver.lock(pid, timeout_s)
            except CudaError as exc:
                # the driver may have locked it as the timeout struck; ILLEGAL_STATE: another tool's lock
                if exc.code != CUresult.ILLEGAL_STATE and _state_or_none(driver, pid) is ProcessState.LOCKED:
                    touched.append(pid)
                raise
            touched.append(pid)
        for pid in pids:
            driver.checkpoint(pid)
    except CudaError as exc:
        exc.rollback = undo_suspend(driver, touched)
        if exc.rollback.ok:
            exc.hint = "; ".join(filter(None, [exc.hint, "the job was left running"]))
        else:
            stuck = ", ".join(sorted({str(e.pid) for e in exc.rollback.errors if e.pid is not None}))
            exc.hint = f"rolling back failed too: pids {stuck or '?'} may stay frozen on the GPU"
            exc.detail = "\n".join(e.line() for e in exc.rollback.errors)
        raise
    return list(pids)


def cuda_processes(driver: Driver, pids: list[int]) -> list[int]:
    """The pids the driver holds CUDA state for, in order: the ones `suspend` may be given.

    /dev/nvidia* in a process's maps is not enough: a child forked after CUDA started (a DataLoader
    worker) inherits the mappings, and the driver answers NOT_INITIALIZED for a process without CUDA.
    """
    out = []
    for pid in pids:
        try:
            driver.state(pid)
        except CudaError as exc:
            if exc.code in (CUresult.NOT_INITIALIZED, CUresult.OPERATING_SYSTEM, CUresult.INVALID_VALUE):
                continue
            raise
        out.append(pid)
    return out


def _state_or_none(driver: Driver, pid: int) -> ProcessState | None:
    try:
        return driver.state(pid)
    except CudaError:
        return None


def resume(driver: Driver, pids: list[int], gpu_map: dict[str, str] | None = None) -> None:
    """Restore every checkpointed pid (onto gpu_map's GPUs), then unlock each; a retry skips what is done."""
    states = {pid: driver.state(pid) for pid in pids}
    for pid in pids:
        if states[pid] is ProcessState.FAILED:
            raise CudaError(
                f"pid {pid} is in CUDA state FAILED",
                "the driver cannot resume it",
                function="resume",
                pid=pid,
            )
    for pid in pids:
        if states[pid] is ProcessState.CHECKPOINTED:
            driver.restore(pid, gpu_map)
            states[pid] = ProcessState.LOCKED
    for pid in pids:
        if states[pid] is ProcessState.LOCKED:
            driver.unlock(pid)


def _attempt(
    errors: list[CudaError], pid: int, call: Callable[[int], object], done: list[int] | None = None
) -> bool:
    """One driver call on an error path: its failure is collected, not raised; True if it worked."""
    try:
        call(pid)
    except CudaError as exc:
        errors.append(exc)
        return False
    if done is not None:
        done.append(pid)
    return True


def undo_suspend(driver: Driver, pids: list[int]) -> Undone:
    """Undo `suspend` on the source (a later step such as the CRIU dump failed): restore, then unlock.

    Goes in reverse order, restores every checkpointed pid before unlocking any, skips pids already
    RUNNING, and never raises: it runs on an error path whose own error must reach the user.
    """
    out = Undone()
    states: dict[int, ProcessState] = {}
    for pid in reversed(pids):
        _attempt(out.errors, pid, lambda p: states.__setitem__(p, driver.state(p)))
    for pid, state in states.items():
        if state is ProcessState.CHECKPOINTED and _attempt(out.errors, pid, driver.restore, out.restored):
            states[pid] = ProcessState.LOCKED
    for pid, state in states.items():
        if state is ProcessState.LOCKED:
            _attempt(out.errors, pid, driver.unlock, out.unlocked)
        elif state is ProcessState.RUNNING:
            out.already_running.append(pid)
        elif state is ProcessState.FAILED:
            out.errors.append(
                CudaError(f"pid {pid} is in CUDA state FAILED", function="undo_suspend", pid=pid)
            )
    return out
