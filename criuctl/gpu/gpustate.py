"""A GPU job's device state around a CRIU dump and restore, through the driver's checkpoint API.

CRIU cannot dump a process that holds a CUDA context. The driver can move that context's device
memory into the process's host memory and close its device handles (lock, checkpoint), after
which CRIU dumps an ordinary process; on the target, after CRIU's restore, the driver puts the
memory back on a GPU (restore, with old -> new GPU UUIDs from r580) and lets CUDA calls run again
(unlock). Every step that fails puts the source back the way it was: restore + unlock, so the job
keeps training there.
"""

from __future__ import annotations

import time

from criuctl.core import env, procinfo
from criuctl.core.errors import CriuctlError
from criuctl.format import bundle
from criuctl.gpu import cuda, cudasteps, gpus


def _driver() -> cuda.Driver:
    try:
        return cuda.Driver.load()
    except cuda.CudaError as exc:
        raise CriuctlError(
            f"this job uses a GPU but the CUDA driver's checkpoint API is not usable here: {exc}",
            "upgrade the driver to r570+ or move it with `criuctl dump --state` (the hook's host copy); "
            "nothing was frozen, the job keeps running",
        ) from exc


def _facts(pids: list[int]) -> list[bundle.GpuDevice]:
    """The GPUs the job's processes hold open (the driver refuses a restore pair for another one)."""
    used = gpus.used_gpus(pids, gpus.list_gpus())
    return [bundle.GpuDevice(g.index, g.uuid, g.name, g.memory_total) for g in used]


def suspend(pids: list[int], timeout_s: float) -> bundle.GpuFacts | None:
    """Move the CUDA state of every GPU process in `pids` to host memory; None if none uses a GPU.

    The driver is asked about every process, not only those mapping /dev/nvidia*: a forked
    DataLoader worker maps them without a context, and a process a dead dumper left checkpointed
    maps none. Such leftovers (no other dump can run: the caller holds the workload's lock) are
    given their GPU state back first.
    """
    mapped = gpus.gpu_pids(pids)
    try:
        driver = cuda.Driver.load()
    except cuda.CudaError:
        if mapped:
            _driver()  # raises the one-line refusal
        return None
    try:
        users = cudasteps.cuda_processes(driver, pids)
    except cuda.CudaError:
        if mapped:
            raise
        return None  # a driver without a GPU (a toolkit-only node): no process can hold CUDA state
    if not users:
        return None
    if stale := [p for p in users if driver.state(p) != cuda.ProcessState.RUNNING]:
        cudasteps.undo_suspend(driver, stale)
    devices = _facts(users)  # before the checkpoint closes their device files
    started = time.monotonic()
    cudasteps.suspend(driver, users, timeout_s)  # rolls back what it did before raising
    return bundle.GpuFacts(
        driver=gpus.driver_version() or str(driver.version),
        devices=devices,
        pids=users,
        ns_pids=[procinfo.ns_pid(p) for p in users],
        checkpoint_s=round(time.monotonic() - started, 3),
    )


def give_back_tree(pids: list[int]) -> None:
    """A thawed tree's processes get back the CUDA state the driver holds for them (restore + unlock).

    Asks the driver itself, not a record: whoever locked them may have died between the lock and
    CRIU (the agent's recovery thaws such a tree). A node without the driver has nothing to undo.
    """
    try:
        driver = cuda.Driver.load()
        held = [
            p for p in cudasteps.cuda_processes(driver, pids) if driver.state(p) != cuda.ProcessState.RUNNING
        ]
    except cuda.CudaError:
        return  # no driver here, or a process gone meanwhile: nothing this thaw can do
    if held:
        cudasteps.undo_suspend(driver, held)


def plan(facts: bundle.GpuFacts | None) -> dict[str, str]:
    """The old -> new GPU UUID map for this node; GpuMismatch (one line) if its GPUs cannot hold the job."""
    if facts is None:
        return {}
    recorded = [gpus.GpuInfo(d.index, d.uuid, d.name, d.memory_total) for d in facts.devices]
    return gpus.plan_gpu_map(recorded, gpus.list_gpus())


def resume(facts: bundle.GpuFacts | None, root_pid: int, gpu_map: dict[str, str]) -> float:
    """After CRIU's restore: the restored processes (by namespace PID) get their GPU state back."""
    if facts is None:
        return 0.0
    started = time.monotonic()
    by_ns = {procinfo.ns_pid(p): p for p in procinfo.tree_pids(root_pid)}
    missing = [n for n in facts.ns_pids if n not in by_ns]
    if missing:
        raise CriuctlError(
            f"the restored job has no process with namespace PID {missing[0]}, "
            "whose GPU state the bundle holds",
            "the bundle does not match its images; dump the job again",
        )
    # r580+ takes the pairs for every checkpointed GPU, moved or not; CRIUCTL_CUDA_REMAP=0 passes
    # none (the same GPUs), which tests/gpu/check.sh uses to try both paths of the driver
    pairs = gpu_map if env.CUDA_REMAP.get() else {}
    cudasteps.resume(_driver(), [by_ns[n] for n in facts.ns_pids], pairs or None)
    return round(time.monotonic() - started, 3)
