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
from collections.abc import Callable

import psutil

from criuctl.core import env, procinfo
from criuctl.core.errors import CriuctlError
from criuctl.core.retry import Backoff
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
    rss = _rss(users)
    started = time.monotonic()
    cudasteps.suspend(driver, users, timeout_s)  # rolls back what it did before raising
    return bundle.GpuFacts(
        driver=gpus.driver_version() or str(driver.version),
        devices=devices,
        pids=users,
        ns_pids=[procinfo.ns_pid(p) for p in users],
        checkpoint_s=round(time.monotonic() - started, 3),
        device_bytes=max(0, _rss(users) - rss),
    )


def _info(d: bundle.GpuDevice) -> gpus.GpuInfo:
    return gpus.GpuInfo(d.index, d.uuid, d.name, d.memory_total)


def _describe(devices: list[bundle.GpuDevice]) -> str:
    return ", ".join(sorted({d.name for d in devices}))


def _rss(pids: list[int]) -> int:
    """The processes' resident memory: the driver's checkpoint grows it by the device memory it moved."""
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total


def check_target(pids: list[int], target: list[gpus.GpuInfo]) -> None:
    """Before a move touches the job: GpuMismatch in one line if the target's GPUs cannot take it.

    The same pairing the target's restore makes (`plan`: model, count), from the GPUs the target
    agent listed, so a node without a GPU of the job's model is refused while nothing is frozen,
    not after the dump. Free memory is the restore's check: the job's device memory is known only
    once the driver has moved it.
    """
    try:
        driver = cuda.Driver.load()
        users = cudasteps.cuda_processes(driver, pids)
    except cuda.CudaError:
        return  # no driver here, or it cannot tell: `suspend` says what is wrong
    if users:
        used = _facts(users)
        try:
            what = f"the job ({_describe(used)})"
            gpus.plan_gpu_map([_info(d) for d in used], target, what=what, where="the target node")
            if taken := gpus.driver_version():
                gpus.check_driver(taken, gpus.driver_of(target), what="the job", where="the target node")
        except gpus.GpuMismatch as exc:
            exc.hint += "; nothing was frozen, the job keeps running"
            raise


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


def plan(facts: bundle.GpuFacts | None, within: int | None = None) -> dict[str, str]:
    """The old -> new GPU UUID map for this node; GpuMismatch (one line) if its GPUs cannot hold the job.

    `within`: a placeholder container's PID: only the GPUs it was given (its /dev/nvidiaN) count.
    """
    if facts is None:
        return {}
    present, where = gpus.list_gpus(), "this node"
    gpus.check_driver(facts.driver, gpus.driver_of(present))
    visible = gpus.visible_in(within) if within is not None else None
    if visible is not None:
        present = [g for g in present if g.index in visible]
        where = "the placeholder container (its pod's GPUs)"
    per_gpu = facts.device_bytes // max(1, len(facts.devices))
    return gpus.plan_gpu_map([_info(d) for d in facts.devices], present, per_gpu, where=where)


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


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


RESUME_BACKOFF_CAP = 30.0  # seconds between tries of a GPU restore that keeps failing, as for a thaw


def resume_until_done(
    facts: bundle.GpuFacts | None,
    root_pid: int,
    gpu_map: dict[str, str],
    said: Callable[[CriuctlError], None],
) -> float:
    """`resume`, asked again until the driver gives the job its GPU state back (or the job is gone).

    It runs after the target's commit: the job runs here now and its source copy is ending, so
    giving up would lose the job, whose CUDA calls wait on the driver meanwhile. What the driver
    refuses for good was checked before CRIU ran (`plan`: model, count, memory); what is left is
    mostly passing (another process holding the GPU's memory for a while). Each failure is `said`.
    """
    backoff = Backoff(RESUME_BACKOFF_CAP)
    while True:
        try:
            return resume(facts, root_pid, gpu_map)
        except CriuctlError as exc:
            if not _alive(root_pid):
                raise
            said(exc)
            backoff.sleep()


STRANDED_WORTH_SAYING = 512 << 20
CACHE_FIX = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"  # what lets empty_cache() return it


def stranded_cache(m: bundle.Manifest) -> int:
    """Device memory the checkpoint carried that the job was not using: torch's cache, free, but in
    segments that also hold live tensors, so the boundary's empty_cache() could not return it. The
    caching allocator splits a large freed block for the step's gradients; on an H200 a 4 GiB buffer
    freed each step left 4.26 GiB reserved, and the checkpoint took 3x longer than with
    `expandable_segments:True`, which let empty_cache() unmap it (docs/benchmarks.md). 0 when there
    is too little of it to be worth saying (under 512 MiB, or a quarter of what was reserved)."""
    b = m.boundary
    if m.gpu is None or b is None or b.held == 0:
        return 0
    idle = b.cuda_reserved - b.cuda_bytes
    return idle if idle >= max(STRANDED_WORTH_SAYING, b.cuda_reserved // 4) else 0
