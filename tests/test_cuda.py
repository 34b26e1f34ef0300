"""criuctl.gpu.cuda and criuctl.gpu.gpus against compiled stand-ins for libcuda and NVML (tests/fakes/*.c).

The stand-ins keep the driver's per-process state machine in files and log every call, so these tests
check the ctypes binding's struct layouts, the order of driver calls, the error lines, and the rollback,
on hosts without a GPU. Real child processes give the PIDs: the stand-in refuses PIDs that do not exist.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from criuctl.cli import doctor
from criuctl.core.env import LIBCUDA, LIBNVML
from criuctl.gpu import cuda, cudasteps, gpus
from criuctl.gpu.cuda import CudaError, ProcessState
from criuctl.gpu.gpus import GpuInfo, GpuMismatch
from tests.conftest import needs_criu
from tests.jobs import CRIUCTL, Job, criuctl, workload_cmd
from tests.requirements import GPU_RECORD, require
from tests.standin_gpu import H100, H200, Gpu, StandinGpus, compile_standins

A = "GPU-aaaaaaaa-0000-1111-2222-000000000001"
B = "GPU-bbbbbbbb-0000-1111-2222-000000000002"
C = "GPU-cccccccc-0000-1111-2222-000000000003"
MUTATING = ("lock", "checkpoint", "restore", "unlock")
ILLEGAL = "CUDA_ERROR_ILLEGAL_STATE: the operation cannot be performed in the present state"


@pytest.fixture(scope="session")
def fake_libs(tmp_path_factory) -> dict[str, Path]:
    """The stand-ins, compiled once per session with the host's C compiler."""
    return compile_standins(tmp_path_factory.mktemp("fakes"))


class Fake:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir

    def calls(self, kinds: tuple[str, ...] = MUTATING) -> list[str]:
        log = self.dir / "calls.log"
        lines = log.read_text().splitlines() if log.exists() else []
        return [line for line in lines if line.split()[0] in kinds]


@pytest.fixture
def fake(fake_libs, tmp_path, monkeypatch) -> Fake:
    for var in [v for v in os.environ if v.startswith(("FAKE_CUDA_", "FAKE_NVML_"))]:
        monkeypatch.delenv(var)
    state = tmp_path / "fake-cuda"
    state.mkdir()
    monkeypatch.setenv("FAKE_CUDA_STATE_DIR", str(state))
    monkeypatch.setenv(LIBCUDA, str(fake_libs["cuda"]))
    monkeypatch.setenv(LIBNVML, str(fake_libs["nvml"]))
    return Fake(state)


@pytest.fixture
def driver(fake) -> cuda.Driver:
    return cuda.Driver.load()


@pytest.fixture
def spawn():
    """spawn(n): n live PIDs (sleep processes), killed after the test."""
    procs: list[subprocess.Popen] = []

    def start(n: int = 1) -> list[int]:
        new = [subprocess.Popen(["sleep", "60"]) for _ in range(n)]
        procs.extend(new)
        return [p.pid for p in new]

    yield start
    for p in procs:
        p.kill()
        p.wait()


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_struct_layouts_match_cuda_h():
    """Sizes and offsets from cuda.h: a wrong one has the real driver write past criuctl's buffer."""
    assert ctypes.sizeof(cuda.CUuuid) == 16
    assert ctypes.sizeof(cuda.CUcheckpointLockArgs) == 64
    assert ctypes.sizeof(cuda.CUcheckpointCheckpointArgs) == 64
    assert ctypes.sizeof(cuda.CUcheckpointUnlockArgs) == 64
    assert ctypes.sizeof(cuda.CUcheckpointGpuPair) == 32
    assert ctypes.sizeof(cuda.CUcheckpointRestoreArgs) == 64
    assert cuda.CUcheckpointLockArgs.timeoutMs.offset == 0
    assert cuda.CUcheckpointLockArgs.reserved1.offset == 8
    assert cuda.CUcheckpointGpuPair.newUuid.offset == 16
    assert cuda.CUcheckpointRestoreArgs.gpuPairs.offset == 0
    assert cuda.CUcheckpointRestoreArgs.gpuPairsCount.offset == ctypes.sizeof(ctypes.c_void_p)
    assert cuda.CUcheckpointRestoreArgs.reserved1.offset == 56
    assert [s.value for s in ProcessState] == [0, 1, 2, 3]


def test_uuid_round_trip():
    assert cuda.uuid_text(cuda.uuid_bytes(A)) == A
    with pytest.raises(CudaError, match="not a GPU UUID: 'GPU-1234'"):
        cuda.uuid_bytes("GPU-1234")


def test_full_cycle_in_driver_order(driver, fake, spawn, monkeypatch):
    (pid,) = spawn()
    monkeypatch.setenv("FAKE_CUDA_DEVICES", A)
    monkeypatch.setenv("FAKE_CUDA_PRESENT", B)
    assert driver.version == 13000 and driver.supports_remap
    assert driver.restore_thread_id(pid) == pid
    assert driver.state(pid) is ProcessState.RUNNING
    driver.lock(pid, 2.5)
    assert driver.state(pid) is ProcessState.LOCKED
    driver.checkpoint(pid)
    assert driver.state(pid) is ProcessState.CHECKPOINTED
    driver.restore(pid, {A: B})
    assert driver.state(pid) is ProcessState.LOCKED
    driver.unlock(pid)
    assert driver.state(pid) is ProcessState.RUNNING
    assert fake.calls() == [
        f"lock {pid} timeout=2500",
        f"checkpoint {pid}",
        f"restore {pid} pairs={A}>{B}",
        f"unlock {pid}",
    ]


def _bring(driver: cuda.Driver, pid: int, state: ProcessState) -> None:
    steps = {ProcessState.LOCKED: 1, ProcessState.CHECKPOINTED: 2}.get(state, 0)
    for step in [lambda: driver.lock(pid, 1), lambda: driver.checkpoint(pid)][:steps]:
        step()


@pytest.mark.parametrize(
    "state, op",
    [
        (ProcessState.RUNNING, "checkpoint"),
        (ProcessState.RUNNING, "restore"),
        (ProcessState.RUNNING, "unlock"),
        (ProcessState.LOCKED, "lock"),
        (ProcessState.LOCKED, "restore"),
        (ProcessState.CHECKPOINTED, "lock"),
        (ProcessState.CHECKPOINTED, "checkpoint"),
        (ProcessState.CHECKPOINTED, "unlock"),
    ],
)
def test_wrong_state_is_the_drivers_error(driver, spawn, state, op):
    (pid,) = spawn()
    _bring(driver, pid, state)
    call = {"lock": lambda: driver.lock(pid, 1)}.get(op, lambda: getattr(driver, op)(pid))
    with pytest.raises(CudaError) as err:
        call()
    function = f"cuCheckpointProcess{op.capitalize()}"
    assert err.value.what == f"{function}(pid {pid}): {ILLEGAL}"
    assert (err.value.function, err.value.pid, err.value.code) == (function, pid, 401)
    assert "not in the CUDA state" in err.value.hint
    assert driver.state(pid) is state


@pytest.mark.parametrize("op", ["lock", "checkpoint", "restore", "unlock", "state", "restore_thread_id"])
def test_a_vanished_pid_is_an_os_error(driver, op):
    """What r580 (580.159) answered for a PID that does not exist."""
    pid = dead_pid()
    call = {"lock": lambda: driver.lock(pid, 1)}.get(op, lambda: getattr(driver, op)(pid))
    with pytest.raises(CudaError) as err:
        call()
    assert err.value.what.endswith(
        f"(pid {pid}): CUDA_ERROR_OPERATING_SYSTEM: OS call failed or operation not supported on this OS"
    )
    assert err.value.hint == "the process is gone, or the driver cannot reach it"


def test_a_process_without_cuda_is_not_initialized_and_filtered_out(driver, spawn, monkeypatch):
    """r580 answers NOT_INITIALIZED for a live process that never started CUDA (a forked worker)."""
    cuda_pid, plain = spawn(2)
    monkeypatch.setenv("FAKE_CUDA_PIDS", str(cuda_pid))
    with pytest.raises(CudaError) as err:
        driver.lock(plain, 1)
    assert (
        err.value.what
        == f"cuCheckpointProcessLock(pid {plain}): CUDA_ERROR_NOT_INITIALIZED: initialization error"
    )
    assert err.value.hint == "the process has not started CUDA, so it has no GPU state to move"
    assert cudasteps.cuda_processes(driver, [plain, cuda_pid, dead_pid()]) == [cuda_pid]


def test_lock_timeout_leaves_the_process_running(driver, fake, spawn, monkeypatch):
    (pid,) = spawn()
    monkeypatch.setenv("FAKE_CUDA_LOCK_DELAY_MS", "10000")
    start = time.monotonic()
    with pytest.raises(CudaError) as err:
        driver.lock(pid, 0.05)
    assert 0.04 < time.monotonic() - start < 2
    assert err.value.what == f"cuCheckpointProcessLock(pid {pid}): CUDA_ERROR_NOT_READY: device not ready"
    assert err.value.timed_out and "longer timeout" in err.value.hint
    assert driver.state(pid) is ProcessState.RUNNING
    monkeypatch.setenv("FAKE_CUDA_LOCK_DELAY_MS", "20")
    driver.lock(pid, 1)
    assert fake.calls() == [f"lock {pid} timeout=50", f"lock {pid} timeout=1000"]


def test_an_unknown_code_is_named_by_number(driver, spawn, monkeypatch):
    (pid,) = spawn()
    monkeypatch.setenv("FAKE_CUDA_FAIL", "lock:12345")
    with pytest.raises(CudaError, match=rf"^cuCheckpointProcessLock\(pid {pid}\): CUresult 12345$"):
        driver.lock(pid, 1)


def test_suspend_checkpoints_every_pid(driver, fake, spawn):
    pids = spawn(2)
    assert cudasteps.suspend(driver, pids, 5) == pids
    assert [driver.state(p) for p in pids] == [ProcessState.CHECKPOINTED] * 2
    p1, p2 = pids
    assert fake.calls() == [
        f"lock {p1} timeout=5000",
        f"lock {p2} timeout=5000",
        f"checkpoint {p1}",
        f"checkpoint {p2}",
    ]


def test_suspend_rolls_back_when_the_second_checkpoint_fails(driver, fake, spawn, monkeypatch):
    p1, p2, p3 = pids = spawn(3)
    monkeypatch.setenv("FAKE_CUDA_FAIL", f"checkpoint@{p2}")
    with pytest.raises(CudaError) as err:
        cudasteps.suspend(driver, pids, 5)
    assert err.value.what == f"cuCheckpointProcessCheckpoint(pid {p2}): CUDA_ERROR_UNKNOWN: unknown error"
    assert err.value.pid == p2 and err.value.hint == "the job was left running"
    assert [driver.state(p) for p in pids] == [ProcessState.RUNNING] * 3
    assert err.value.rollback is not None and err.value.rollback.ok
    assert (err.value.rollback.restored, err.value.rollback.unlocked) == ([p1], [p3, p2, p1])
    assert fake.calls() == [
        *(f"lock {p} timeout=5000" for p in pids),
        f"checkpoint {p1}",
        f"checkpoint {p2}",
        f"restore {p1} pairs=",
        f"unlock {p3}",
        f"unlock {p2}",
        f"unlock {p1}",
    ]


def test_suspend_unlocks_what_it_locked_when_a_lock_times_out(driver, fake, spawn, monkeypatch):
    p1, p2, _ = pids = spawn(3)
    monkeypatch.setenv("FAKE_CUDA_FAIL", f"lock@{p2}:600")
    with pytest.raises(CudaError) as err:
        cudasteps.suspend(driver, pids, 5)
    assert err.value.timed_out and err.value.pid == p2
    assert err.value.line().endswith("retry, or allow a longer timeout; the job was left running")
    assert [driver.state(p) for p in pids] == [ProcessState.RUNNING] * 3
    assert fake.calls() == [f"lock {p1} timeout=5000", f"lock {p2} timeout=5000", f"unlock {p1}"]


def test_suspend_says_so_when_the_rollback_fails_too(driver, spawn, monkeypatch):
    p1, p2 = pids = spawn(2)
    monkeypatch.setenv("FAKE_CUDA_FAIL", f"checkpoint@{p2},restore@{p1}")
    with pytest.raises(CudaError) as err:
        cudasteps.suspend(driver, pids, 5)
    assert err.value.pid == p2
    assert err.value.hint == f"rolling back failed too: pids {p1} may stay frozen on the GPU"
    assert f"cuCheckpointProcessRestore(pid {p1}): CUDA_ERROR_UNKNOWN" in err.value.detail
    assert driver.state(p1) is ProcessState.CHECKPOINTED and driver.state(p2) is ProcessState.RUNNING


def test_release_after_a_failed_dump_restores_and_unlocks(driver, fake, spawn):
    p1, p2 = pids = spawn(2)
    cudasteps.suspend(driver, pids, 5)
    done = cudasteps.undo_suspend(driver, pids)  # as if CRIU's dump failed next
    assert done.ok and (done.restored, done.unlocked, done.already_running) == ([p2, p1], [p2, p1], [])
    assert [driver.state(p) for p in pids] == [ProcessState.RUNNING] * 2
    assert fake.calls()[-4:] == [
        f"restore {p2} pairs=",
        f"restore {p1} pairs=",
        f"unlock {p2}",
        f"unlock {p1}",
    ]
    again = cudasteps.undo_suspend(driver, pids)
    assert again.ok and again.already_running == [p2, p1] and len(fake.calls()) == 8


def test_release_goes_on_past_a_vanished_pid(driver, spawn):
    p1, p2 = spawn(2)
    gone = dead_pid()
    cudasteps.suspend(driver, [p1, p2], 5)
    done = cudasteps.undo_suspend(driver, [p1, gone, p2])
    assert not done.ok and [e.pid for e in done.errors] == [gone]
    assert done.unlocked == [p2, p1] and driver.state(p1) is ProcessState.RUNNING


def test_resume_in_another_process_with_a_gpu_map(driver, fake, spawn, monkeypatch):
    """The dump and the restore run in different criuctl processes: the state must carry over."""
    p1, p2 = pids = spawn(2)
    monkeypatch.setenv("FAKE_CUDA_DEVICES", f"{A},{B}")
    cudasteps.suspend(driver, pids, 5)
    monkeypatch.setenv("FAKE_CUDA_PRESENT", f"{B},{C}")
    gpu_map = {A: B, B: C}
    script = (
        "from criuctl.gpu import cuda, cudasteps; "
        f"cudasteps.resume(cuda.Driver.load(), {pids!r}, {gpu_map!r})"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=Path(__file__).parent.parent)
    assert [driver.state(p) for p in pids] == [ProcessState.RUNNING] * 2
    pairs = f"pairs={A}>{B},{B}>{C}"
    assert fake.calls()[-4:] == [
        f"restore {p1} {pairs}",
        f"restore {p2} {pairs}",
        f"unlock {p1}",
        f"unlock {p2}",
    ]
    cudasteps.resume(driver, pids, {A: B, B: C})  # a retry finds nothing left to do
    assert len(fake.calls()) == 8


def test_resume_refuses_a_map_that_misses_a_gpu(driver, spawn, monkeypatch):
    (pid,) = spawn()
    monkeypatch.setenv("FAKE_CUDA_DEVICES", f"{A},{B}")
    cudasteps.suspend(driver, [pid], 5)
    monkeypatch.setenv("FAKE_CUDA_PRESENT", f"{B},{C}")
    # a GPU left out, a target not on this node, a GPU the process did not use, none (A is not here)
    for gpu_map in ({A: C}, {A: C, B: A}, {A: C, B: B, C: B}, None):
        with pytest.raises(CudaError) as err:
            cudasteps.resume(driver, [pid], gpu_map)
        assert err.value.what.endswith("CUDA_ERROR_INVALID_VALUE: invalid argument")
        assert err.value.hint.startswith("the GPU map is wrong")
    assert driver.state(pid) is ProcessState.CHECKPOINTED


def test_remap_needs_r580(driver, fake, spawn, monkeypatch):
    (pid,) = spawn()
    monkeypatch.setenv("FAKE_CUDA_VERSION", "12080")
    old = cuda.Driver.load()
    assert old.version == 12080 and not old.supports_remap
    _bring(old, pid, ProcessState.CHECKPOINTED)
    with pytest.raises(
        CudaError, match=r"needs NVIDIA driver r580\+ \(CUDA 13.0\); this driver is CUDA 12.8"
    ):
        old.restore(pid, {A: B})
    old.restore(pid, {A: A})  # the same GPUs: nothing to remap, so no pairs for the old layout
    assert fake.calls()[-1] == f"restore {pid} pairs="


def test_a_driver_without_the_api_names_the_version_needed(fake_libs, fake, spawn):
    (pid,) = spawn()
    old = cuda.Driver.load(str(fake_libs["cuda_r550"]))
    with pytest.raises(CudaError) as err:
        old.lock(pid, 1)
    assert err.value.what == f"{fake_libs['cuda_r550']} has no cuCheckpointProcessLock"
    assert (
        err.value.hint
        == "checkpointing GPU jobs needs the NVIDIA driver r570+ (CUDA 12.8); this one is CUDA 13.0"
    )
    info = cuda.probe(str(fake_libs["cuda_r550"]))
    assert info.loaded and not info.has_checkpoint_api and info.checkpoint_symbols == ()


def test_no_driver_at_all(tmp_path):
    with pytest.raises(CudaError, match=r"^cannot load the CUDA driver .*/libcuda\.so\.1$"):
        cuda.Driver.load(str(tmp_path / "libcuda.so.1"))
    assert not cuda.probe(str(tmp_path / "libcuda.so.1")).loaded


def test_doctor_reports_version_api_and_remap(fake_libs, fake, monkeypatch):
    monkeypatch.setenv("FAKE_NVML_GPUS", f"{H200}={A}")
    check = doctor._cuda()
    assert check.ok and check.detail == (
        "driver 580.95.05 (CUDA 13.0) exports cuCheckpointProcess*; "
        "restore onto other GPUs (UUID remap) available"
    )
    monkeypatch.setenv("FAKE_CUDA_VERSION", "12090")
    assert doctor._cuda().detail.endswith(
        "restore only onto the same GPUs: remapping them needs driver r580+ (CUDA 13.0)"
    )
    monkeypatch.setenv(LIBCUDA, str(fake_libs["cuda_r550"]))
    check = doctor._cuda()
    assert not check.ok and check.detail.startswith(
        "driver 580.95.05 (CUDA 12.9) lacks cuCheckpointProcessLock, "
    )
    monkeypatch.setenv(LIBCUDA, "/nonexistent/libcuda.so.1")
    assert doctor._cuda().detail == "no CUDA driver (/nonexistent/libcuda.so.1) on this host"


def gpu(index: int, uuid: str, name: str = H200) -> GpuInfo:
    return GpuInfo(index, uuid, name, 150_754_820_096)


def test_plan_keeps_gpus_that_are_still_there():
    assert gpus.plan_gpu_map([gpu(0, A), gpu(1, B)], [gpu(0, B), gpu(1, A)]) == {A: A, B: B}


def test_plan_pairs_other_gpus_by_model_in_index_order():
    recorded = [gpu(0, A), gpu(1, B, H100)]
    present = [gpu(2, C, H200), gpu(0, "GPU-0", H100), gpu(1, "GPU-1", H200)]
    assert gpus.plan_gpu_map(recorded, present) == {A: "GPU-1", B: "GPU-0"}
    assert gpus.plan_gpu_map([gpu(0, A), gpu(1, B)], [gpu(0, B), gpu(1, C)]) == {A: C, B: B}


@pytest.mark.parametrize(
    "present, has",
    [([gpu(0, C, H100)], f"1 × {H100}"), ([gpu(0, C)], f"1 × {H200}"), ([], "no GPU")],
)
def test_plan_refuses_other_models_or_fewer_gpus(present, has):
    with pytest.raises(GpuMismatch) as err:
        gpus.plan_gpu_map([gpu(0, A), gpu(1, B)], present)
    assert err.value.line() == (
        f"the bundle needs 2 × {H200} but this node has {has}: "
        "restore it on a node with the same GPU model and at least as many GPUs"
    )


def test_plan_passes_over_gpus_without_room_for_the_jobs_device_memory():
    """A GPU of the model whose free memory (NVML) is short of the job's is skipped; none left: one line."""
    busy, idle = GpuInfo(0, B, H200, 100 * 2**30, 10 * 2**30), GpuInfo(1, C, H200, 100 * 2**30, 90 * 2**30)
    assert gpus.plan_gpu_map([gpu(0, A)], [busy, idle], need_bytes=40 * 2**30) == {A: C}
    assert gpus.plan_gpu_map([gpu(0, A)], [busy, gpu(1, C)], need_bytes=40 * 2**30) == {A: C}  # not known
    with pytest.raises(GpuMismatch) as err:
        gpus.plan_gpu_map([gpu(0, A)], [busy], need_bytes=40 * 2**30)
    assert err.value.line() == (
        f"the bundle needs 40.0 GiB free on each {H200} but those of this node have 10.0 GiB free: "
        "restore it on a node whose GPUs are free, or free them here first"
    )


def test_list_gpus_and_driver_version_through_nvml(fake, monkeypatch):
    monkeypatch.setenv("FAKE_NVML_GPUS", f"{H200}={A},{H200}={B}:1000:400")
    found = gpus.list_gpus()
    assert found == [
        GpuInfo(0, A, H200, 150_754_820_096, 150_754_820_096, "580.95.05"),
        GpuInfo(1, B, H200, 1000, 400, "580.95.05"),
    ]
    assert [GpuInfo.from_dict(g.to_dict()) for g in found] == found
    assert gpus.driver_version() == "580.95.05"
    with pytest.raises(ValueError, match="not a GPU record"):
        GpuInfo.from_dict({**found[0].to_dict(), "index": True})
    with pytest.raises(ValueError, match="not a GPU record"):
        GpuInfo.from_dict({**found[0].to_dict(), "driver": 580})
    older = {k: v for k, v in found[0].to_dict().items() if k != "driver"}  # an older agent's record
    assert GpuInfo.from_dict(older).driver == ""
    # one environment for a DaemonSet's agents, each node its own GPUs (the stand-in's FAKE_NODE)
    monkeypatch.setenv("FAKE_NVML_GPUS_b", f"{H100}={C}")
    monkeypatch.setenv("FAKE_NODE", "b")
    assert [(g.uuid, g.name) for g in gpus.list_gpus()] == [(C, H100)]
    monkeypatch.setenv("FAKE_NODE", "a")  # a node with no list of its own has the common one
    assert gpus.list_gpus() == found
    monkeypatch.delenv("FAKE_NODE")
    monkeypatch.delenv("FAKE_NVML_GPUS")  # NVML refuses to start, as without the driver
    assert gpus.list_gpus() == [] and gpus.driver_version() is None
    monkeypatch.setenv(LIBNVML, "/nonexistent/libnvidia-ml.so.1")
    assert gpus.list_gpus() == []


def test_gpu_pids_reads_maps_and_tolerates_vanished_pids(spawn):
    (pid,) = spawn()
    assert gpus.gpu_pids([pid, dead_pid(), os.getpid()]) == []
    maps = (
        "7f0000000000-7f0000001000 rw-s 00000000 00:05 1038 /dev/nvidiactl\n"
        "7f0000002000-7f0000003000 r--p 00000000 08:01 42 /usr/lib/libc.so.6\n"
    )
    assert gpus.maps_use_gpu(maps)
    assert not gpus.maps_use_gpu(maps.splitlines()[1] + "\n7f00-7f01 rw-p 00000000 00:00 0 \n")


def test_a_thawed_tree_gets_its_gpu_state_back_whoever_locked_it(driver, fake, spawn):
    """The dumping process died between the driver's checkpoint and CRIU (its agent thaws the tree
    from its record): the thaw asks the driver which processes it holds and gives them back."""
    from criuctl.gpu import gpustate

    pids = spawn(2)
    cudasteps.suspend(driver, pids, 5)  # ... and the process that did this is gone
    gpustate.give_back_tree(pids)
    assert [driver.state(p) for p in pids] == [ProcessState.RUNNING] * 2
    gpustate.give_back_tree(pids)  # a second thaw finds nothing to do
    assert len(fake.calls(("restore",))) == 2 and len(fake.calls(("unlock",))) == 2


def test_no_driver_means_nothing_to_give_back(monkeypatch, tmp_path, spawn):
    from criuctl.gpu import gpustate

    monkeypatch.setenv(LIBCUDA, str(tmp_path / "no-libcuda.so.1"))
    gpustate.give_back_tree(spawn(1))  # returns quietly: a CPU node's thaw is unchanged


def test_gpustate_suspends_what_the_driver_holds_and_undoes_a_dead_dumpers_lock(
    driver, fake, spawn, monkeypatch
):
    """`gpustate.suspend` asks the driver about every process of the tree (a process without CUDA
    is left out), first gives back a lock a dead dumper left, records the node's GPUs."""
    from criuctl.gpu import gpustate

    monkeypatch.setenv("FAKE_NVML_GPUS", f"NVIDIA H200={A}")
    cpu_only, locked, fresh = spawn(3)
    monkeypatch.setenv("FAKE_CUDA_PIDS", f"{locked},{fresh}")
    driver.lock(locked, 5)  # ... by a dumper that died before CRIU
    facts = gpustate.suspend([cpu_only, locked, fresh], 5)
    assert facts is not None and facts.pids == [locked, fresh]
    assert [d.uuid for d in facts.devices] == [A]
    assert [driver.state(p) for p in (locked, fresh)] == [ProcessState.CHECKPOINTED] * 2
    assert fake.calls(("unlock",)) == [f"unlock {locked}"]  # the leftover lock was undone first
    gpustate.give_back_tree([cpu_only, locked, fresh])
    assert [driver.state(p) for p in (locked, fresh)] == [ProcessState.RUNNING] * 2


_CONTEXT_JOB = """
import os, sys, time
sys.path.insert(0, sys.argv[1])
import _standin_cuda
ctx = _standin_cuda.from_environment()
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print("child", child, flush=True)
n = 0
while True:
    ctx.call()
    n += 1
    print("call", n, flush=True)
    time.sleep(0.01)
"""


def test_a_standin_context_keeps_its_state_in_the_jobs_memory(fake_libs, tmp_path, monkeypatch):
    """FAKE_CUDA_CONTEXTS mode: the state is the job's own (so CRIU carries it), a lock blocks the
    job's CUDA calls until the unlock, a restore onto new GPUs is what the job then runs on, and a
    child forked after CUDA started has no CUDA (NOT_INITIALIZED, as on r580)."""
    for var in [v for v in os.environ if v.startswith(("FAKE_CUDA_", "FAKE_NVML_"))]:
        monkeypatch.delenv(var)
    gpus = StandinGpus(fake_libs, tmp_path)
    for key, value in gpus.node_env(Gpu(H200, B)).items():
        monkeypatch.setenv(key, value)
    job = subprocess.Popen(
        [sys.executable, "-c", _CONTEXT_JOB, str(Path(__file__).parent / "workloads")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **gpus.job_env(Gpu(H200, A))},
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(job.stdout.readline, "")), daemon=True).start()

    def until(what: str, after: int = 0) -> int:
        deadline = time.monotonic() + 10
        while not any(x.startswith(what) for x in lines[after:]):
            assert time.monotonic() < deadline, f"the job never printed {what!r}: {lines[-5:]}"
            time.sleep(0.01)
        return next(i for i, x in enumerate(lines) if i >= after and x.startswith(what))

    try:
        assert lines[until("gpu ")] == f"gpu {A}\n"
        child = int(lines[until("child ")].split()[1])
        driver = cuda.Driver.load()
        assert cudasteps.cuda_processes(driver, [job.pid, child]) == [job.pid]
        rss = psutil.Process(job.pid).memory_info().rss
        cudasteps.suspend(driver, [job.pid], 5)
        assert driver.state(job.pid) is ProcessState.CHECKPOINTED
        grown = psutil.Process(job.pid).memory_info().rss - rss
        assert 15 * 2**20 < grown < 20 * 2**20, f"the 16 MiB of device memory's host copy: {grown}"
        time.sleep(0.3)  # a call that began before the lock may still print
        held = len(lines)
        time.sleep(0.5)
        assert lines[held:] == [], f"the job ran a CUDA call while checkpointed: {lines[held:]}"
        with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_VALUE"):  # A is not on this node
            cudasteps.resume(driver, [job.pid])
        cudasteps.resume(driver, [job.pid], {A: B})
        moved = until("gpu ", held)
        assert lines[moved] == f"gpu {B}\n"  # the blocked call went on, on the new GPU
        until("call ", moved)
        assert driver.state(job.pid) is ProcessState.RUNNING
        assert not (tmp_path / str(job.pid)).exists(), "context state must not be kept in files"
    finally:
        job.kill()
        job.wait()


@needs_criu
def test_a_gpu_bundle_counts_the_device_memory_the_checkpoint_put_in_host_memory(fake_libs, tmp_path):
    """The driver's checkpoint copies device memory into the job's host memory, which CRIU writes: the
    manifest's memory (what `inspect` shows, what a target's free-memory check sizes) is read after
    it, so it holds that copy. On the H200 it was read before: 1.15 GiB said, for jobs that had moved
    1.67 to 5.67 GiB besides."""
    gpus = StandinGpus(fake_libs, tmp_path / "gpus")
    mib = 768  # more than the trainer's own resident memory: read before the checkpoint, it falls short
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_CUDA_", "FAKE_NVML_"))}
    env |= gpus.node_env(Gpu(H200, A)) | gpus.job_env(Gpu(H200, A), memory_mib=mib)
    argv = workload_cmd("train_mlp.py", "--steps", "400", "--step-time", "0.05")
    job = Job([*CRIUCTL, "run", "--name", "devbytes", "--", *argv], env=env)
    bundle_dir = tmp_path / "b"
    try:
        job.wait_for_step(3)
        r = criuctl("dump", "devbytes", "--bundle", str(bundle_dir), env=env)
        assert r.returncode == 0, r.stderr
    finally:
        job.kill()
    r = criuctl("inspect", str(bundle_dir), "--output", "json", env=env)
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)
    moved = m["gpu"]["device_bytes"]
    assert moved >= (mib - 8) << 20, m["gpu"]
    (trainer,) = [p for p in m["processes"] if p["ns_pid"] in m["gpu"]["ns_pids"]]
    assert trainer["rss_bytes"] >= moved + (16 << 20), (trainer["rss_bytes"], moved)
    assert m["rss_bytes"] >= trainer["rss_bytes"]


# What the stand-in says r580 answers (fake_libcuda.c's header), case by case of tests/gpu/probe.py
STANDIN_CLAIMS: dict[str, tuple[str, str | None]] = {
    "gone-pid state": ("OPERATING_SYSTEM", None),
    "gone-pid lock": ("OPERATING_SYSTEM", None),
    "no-cuda state": ("NOT_INITIALIZED", None),
    "no-cuda lock": ("NOT_INITIALIZED", None),
    "lock timeout": ("NOT_READY", "RUNNING"),
    "unlock while running": ("ILLEGAL_STATE", None),
    "checkpoint while running": ("ILLEGAL_STATE", None),
    "lock twice": ("ILLEGAL_STATE", "LOCKED"),
    "checkpoint twice": ("ILLEGAL_STATE", "CHECKPOINTED"),
    "unlock while checkpointed": ("ILLEGAL_STATE", None),
    "restore twice": ("ILLEGAL_STATE", None),
    "full cycle state after": ("SUCCESS", "RUNNING"),
}


@pytest.fixture
def standin_probe(fake_libs, tmp_path, monkeypatch) -> dict[str, dict[str, object]]:
    """tests/gpu/probe.py run on the stand-in, its processes holding stand-in contexts."""
    from tests.gpu import probe

    for var in [v for v in os.environ if v.startswith(("FAKE_CUDA_", "FAKE_NVML_"))]:
        monkeypatch.delenv(var)
    gpus = StandinGpus(fake_libs, tmp_path)
    for key, value in gpus.node_env(Gpu(H200, A)).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("FAKE_CUDA_LOCK_DELAY_MS", "200")  # past the probe's 50 ms timeout, short of 10 s
    holder = [sys.executable, "-c", _CONTEXT_JOB, str(Path(__file__).parent / "workloads")]

    def context() -> subprocess.Popen:
        p = subprocess.Popen(
            holder, stdout=subprocess.PIPE, text=True, env={**os.environ, **gpus.job_env(Gpu(H200, A))}
        )
        assert p.stdout is not None and p.stdout.readline().startswith("gpu ")
        return p

    plain = lambda: subprocess.Popen(["sleep", "600"])  # noqa: E731
    return probe.probe(cuda.Driver.load(), probe.Processes(cuda=context, busy=context, plain=plain))


def test_the_standin_answers_as_it_claims_r580_does(standin_probe):
    got = {case: (a["name"], a.get("state after")) for case, a in standin_probe.items()}
    assert got == STANDIN_CLAIMS


def test_the_standin_answers_as_the_recorded_real_driver(standin_probe):
    """The driver codes tests/gpu/check.sh recorded on a real GPU, against the stand-in's."""
    from tests.gpu import probe

    require("gpu-record")
    recorded = json.loads(GPU_RECORD.read_text())["driver_codes"]
    assert probe.differences(recorded, standin_probe) == []


# ------------------------------------------------------------------------------ NCCL (criuctl.gpu.nccl)


def _held(*groups: dict, **env: str) -> dict:
    return {"rank": "0", "pid": 4242, "groups": list(groups), "nccl_env": env}


def test_a_job_with_an_nccl_group_is_refused_with_how_to_run_it(monkeypatch):
    from criuctl.gpu import nccl

    monkeypatch.delenv("CRIUCTL_NCCL_TRY", raising=False)
    old = nccl.refusal(
        [_held({"backend": "gloo", "size": 2}), _held({"backend": "nccl", "size": 1, "nccl": "2.21.5"})]
    )
    assert old is not None
    assert old.line() == (
        "rank 0 (PID 4242) holds 1 NCCL process group(s) (NCCL 2.21.5), which the CUDA driver cannot "
        "checkpoint: NCCL 2.21.5 cannot suspend a communicator (ncclCommSuspend came in 2.29.7): "
        "move it with `criuctl dump --state` (the hook saves the training state), or set CRIUCTL_NCCL_TRY=1 "
        "where criuctl runs to let the driver try (a refusal rolls back), and run the job with "
        "NCCL_NVLS_ENABLE=0 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (the driver cannot checkpoint NVLS "
        "multicast buffers, peer-to-peer CUDA IPC mappings (r610+ only), shared-memory transport buffers); "
        "nothing was frozen, the job keeps running"
    )
    new = nccl.refusal([_held({"backend": "nccl", "size": 8, "nccl": "2.29.7"}, NCCL_NVLS_ENABLE="0")])
    assert new is not None and "the job's hook did not suspend its communicators" in new.what
    assert "NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (" in new.hint and "NVLS_ENABLE" not in new.hint
    off = {"NCCL_NVLS_ENABLE": "0", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    settled = nccl.refusal([_held({"backend": "nccl", "size": 1, "nccl": "2.30.7"}, **off)])
    assert settled is not None and "run the job with" not in settled.hint
    assert nccl.refusal([_held({"backend": "gloo", "size": 2}), _held()]) is None  # no NCCL: nothing to say
    monkeypatch.setenv("CRIUCTL_NCCL_TRY", "1")
    assert nccl.refusal([_held({"backend": "nccl", "size": 1, "nccl": "2.21.5"})]) is None


def test_the_hook_reports_the_jobs_process_groups_and_nccl_settings(monkeypatch):
    """What a held trainer tells criuctl: every torch.distributed group with its backend (a gloo one
    here; an NCCL one carries its version), and the job's NCCL_* settings."""
    import socket

    import torch
    import torch.distributed as dist

    from criuctl_hook import boundary

    assert boundary.process_groups(torch) == {}  # no process group: nothing to say
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        dist.new_group([0], backend="gloo")
        report = boundary.process_groups(torch)
    finally:
        dist.destroy_process_group()
    assert report["groups"] == [{"backend": "gloo", "size": 1}, {"backend": "gloo", "size": 1}]
    assert report["nccl_env"]["NCCL_NVLS_ENABLE"] == "0"


def test_suspended_communicators_go_to_the_driver_and_peers_need_the_settings(monkeypatch):
    """A trainer whose every NCCL communicator the hook suspended is not refused: alone in its world
    at once; with peers only once the job keeps out what the suspension leaves (NVLS, CUDA IPC, SHM)."""
    from criuctl.gpu import nccl

    monkeypatch.delenv("CRIUCTL_NCCL_TRY", raising=False)
    done = {"groups": 2, "suspended": 1, "skipped": 1, "how": "ncclCommSuspend", "error": ""}
    one = {"backend": "nccl", "size": 1, "nccl": "2.29.7"}
    assert nccl.refusal([{**_held(one, one), "nccl_suspend": done}]) is None
    eight = {"backend": "nccl", "size": 8, "nccl": "2.30.7"}
    peers = nccl.refusal([{**_held(eight, one, NCCL_P2P_DISABLE="1"), "nccl_suspend": done}])
    assert peers is not None
    assert peers.line() == (
        "rank 0 (PID 4242) holds 2 NCCL process group(s) (NCCL 2.30.7) with peers; suspending them leaves "
        "NVLS multicast buffers, shared-memory transport buffers, which the CUDA driver cannot checkpoint: "
        "run the job with NCCL_NVLS_ENABLE=0 NCCL_SHM_DISABLE=1, or move it with `criuctl dump --state`; "
        "nothing was frozen, the job keeps running"
    )
    off = {"NCCL_NVLS_ENABLE": "0", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
    assert nccl.refusal([{**_held(eight, one, **off), "nccl_suspend": done}]) is None
    failed = nccl.refusal([{**_held(one), "nccl_suspend": {**done, "error": "ncclCommSuspend returned 5"}}])
    assert failed is not None and "suspending them failed: ncclCommSuspend returned 5" in failed.what
    half = nccl.refusal([{**_held(one, one), "nccl_suspend": {**done, "skipped": 0}}])
    assert half is not None and "only 1 of 2 were suspended" in half.what


class _Backend:
    """A STAND-IN for torch's ProcessGroupNCCL backend (no NCCL on a CPU host): its communicator
    pointer (`_comm_ptr`, torch 2.4+), or torch 2.12's suspend()/resume() when `native` is a list."""

    def __init__(self, comm: int | None, native: list | None = None):
        self.comm = comm
        if native is not None:
            self.suspend = lambda: native.append(("suspend", comm))
            self.resume = lambda: native.append(("resume", comm))

    def _comm_ptr(self) -> int:
        if self.comm is None:
            raise RuntimeError("NCCL communicator not initialized")  # torch's words for a lazy one
        return self.comm


class _Group:
    def __init__(self, backend: str, size: int, impl: _Backend | None = None):
        self.backend, self._size, self.impl = backend, size, impl

    def size(self) -> int:
        return self._size

    def _get_backend(self, device: object) -> _Backend | None:
        return self.impl


def _torch_with(*groups: _Group):
    """A STAND-IN for the part of torch the hook's NCCL suspension reads: the process groups."""
    from types import SimpleNamespace

    dist = SimpleNamespace(
        is_available=lambda: True,
        is_initialized=lambda: True,
        get_backend=lambda pg: pg.backend,
        distributed_c10d=SimpleNamespace(_world=SimpleNamespace(pg_map={g: None for g in groups})),
    )
    return SimpleNamespace(
        distributed=dist, device=lambda *a: a, cuda=SimpleNamespace(current_device=lambda: 0)
    )


@pytest.fixture
def libnccl(fake_libs, tmp_path, monkeypatch) -> Path:
    """The stand-in libnccl loaded into this process, as torch's is into a job's; its call log."""
    import ctypes

    ctypes.CDLL(str(fake_libs["libnccl"]))
    log = tmp_path / "nccl.log"
    monkeypatch.setenv("FAKE_NCCL_LOG", str(log))
    monkeypatch.delenv("FAKE_NCCL_VERSION", raising=False)
    monkeypatch.delenv("FAKE_NCCL_SUSPEND_RC", raising=False)
    return log


def test_the_hook_suspends_each_created_communicator_through_the_loaded_libnccl(libnccl, monkeypatch):
    """Through ctypes on the libnccl the process loaded: every created communicator suspended with
    NCCL_SUSPEND_MEM, a lazy one skipped, a gloo group left alone; resumed in the same order, and
    criuctl lets the driver checkpoint the trainer."""
    from criuctl.gpu import nccl
    from criuctl_hook import nccl as hook_nccl

    torch = _torch_with(
        _Group("gloo", 1),
        _Group("nccl", 1, _Backend(0x1234)),
        _Group("nccl", 1, _Backend(None)),
        _Group("nccl", 1, _Backend(0x5678)),
    )
    done = hook_nccl.suspend(torch)
    report = done.report()["nccl_suspend"]
    assert report == {"groups": 3, "suspended": 2, "skipped": 1, "how": "ncclCommSuspend", "error": ""}
    assert libnccl.read_text().split("\n")[:-1] == ["suspend 0x1234 1", "suspend 0x5678 1"]
    done.resume()
    assert libnccl.read_text().split("\n")[2:-1] == ["resume 0x1234", "resume 0x5678"]
    groups = [{"backend": "nccl", "size": 1, "nccl": "2.29.7"}] * 3
    assert nccl.refusal([{**_held(*groups), "nccl_suspend": report}]) is None


def test_the_hook_says_why_it_could_not_suspend_and_criuctl_refuses(libnccl, monkeypatch):
    """An NCCL older than 2.29.7 is not called at all; a suspension NCCL refuses is reported with its
    code; either way criuctl refuses in one line, and the communicators suspended so far resume."""
    from criuctl.gpu import nccl
    from criuctl_hook import nccl as hook_nccl

    monkeypatch.delenv("CRIUCTL_NCCL_TRY", raising=False)
    torch = _torch_with(_Group("nccl", 1, _Backend(0x1234)))
    monkeypatch.setenv("FAKE_NCCL_VERSION", "22805")
    old = hook_nccl.suspend(torch)
    assert old.report()["nccl_suspend"]["error"] == "NCCL 22805 has no ncclCommSuspend (2.29.7, code 22907)"
    assert not libnccl.exists()  # nothing was called
    refused = nccl.refusal([{**_held({"backend": "nccl", "size": 1, "nccl": "2.28.5"}), **old.report()}])
    assert refused is not None and "NCCL 2.28.5 cannot suspend a communicator" in refused.what

    monkeypatch.setenv("FAKE_NCCL_VERSION", "22907")
    monkeypatch.setenv("FAKE_NCCL_SUSPEND_RC", "5")
    failed = hook_nccl.suspend(
        _torch_with(_Group("nccl", 1, _Backend(0x42)), _Group("nccl", 1, _Backend(0x43)))
    )
    assert (
        failed.report()["nccl_suspend"]["error"] == "RuntimeError: ncclCommSuspend returned 5 (invalid usage)"
    )
    assert failed.report()["nccl_suspend"]["suspended"] == 0  # the first refused: the second was not asked
    refused = nccl.refusal([{**_held({"backend": "nccl", "size": 1, "nccl": "2.29.7"}), **failed.report()}])
    assert (
        refused is not None
        and "suspending them failed: RuntimeError: ncclCommSuspend returned 5" in refused.what
    )


def test_the_hook_prefers_torchs_own_suspend(libnccl):
    """torch 2.12's ProcessGroupNCCL.suspend()/resume() when the backend has them: no ctypes call."""
    from criuctl_hook import nccl as hook_nccl

    calls: list = []
    done = hook_nccl.suspend(_torch_with(_Group("nccl", 2, _Backend(0x99, native=calls))))
    assert done.report()["nccl_suspend"]["how"] == "ProcessGroupNCCL.suspend"
    done.resume()
    assert calls == [("suspend", 0x99), ("resume", 0x99)]
    assert not libnccl.exists()
    assert hook_nccl.suspend(_torch_with(_Group("gloo", 2))).report() == {}  # no NCCL: nothing to say


def test_inspect_says_how_many_nccl_communicators_the_boundary_suspended():
    from types import SimpleNamespace

    from criuctl.cli import render
    from criuctl.format import bundle

    held = bundle.StepBoundary("r", 1, 1, 7, 0.5, nccl_suspended=2)
    assert render._boundary_line(SimpleNamespace(state=None, boundary=held)) == (
        "step boundary: yes, after optimizer step 7 (1 trainer(s) held, 2 NCCL communicator(s) "
        "suspended; waited 0.50 s); no step was cut in half"
    )
    plain = bundle.StepBoundary("r", 1, 1, 7, 0.5)
    assert "NCCL" not in render._boundary_line(SimpleNamespace(state=None, boundary=plain))


def test_a_checkpoint_that_carried_torchs_idle_cache_says_how_to_leave_it_behind():
    """The H200's case (docs/benchmarks.md): 4.26 GiB still reserved after empty_cache() by a job
    whose live tensors are far less (the numbers for what was allocated are this test's). The dump's
    summary and `inspect` say how much and what to run the job with; a cache that returned it, a
    boundary nobody reached, or a job without the driver's checkpoint say nothing."""
    from types import SimpleNamespace

    from criuctl.cli import render
    from criuctl.format import bundle
    from criuctl.gpu import gpustate

    gib = 2**30

    def manifest(reserved: float, allocated: float, held: int = 1, gpu: bool = True):
        boundary = bundle.StepBoundary(
            "r", 1, held, 7, 0.5, cuda_bytes=int(allocated * gib), cuda_reserved=int(reserved * gib)
        )
        facts = bundle.GpuFacts("580.159.04", [], [10], [2], 2.9, int(4.86 * gib)) if gpu else None
        return SimpleNamespace(boundary=boundary, gpu=facts)

    fragmented = manifest(4.26, 0.75)
    assert gpustate.stranded_cache(fragmented) == int(4.26 * gib) - int(0.75 * gib)
    said = render._stranded_cache(fragmented)
    assert said.startswith("note: 3.5 GiB of the device memory the checkpoint carried was torch's cache")
    assert said.endswith(
        "with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and the checkpoint leaves it behind"
    )
    assert gpustate.stranded_cache(manifest(1.12, 1.0)) == 0  # expandable segments: returned
    assert gpustate.stranded_cache(manifest(5.07, 4.5)) == 0  # kept alive: the job's own
    assert gpustate.stranded_cache(manifest(4.26, 0.75, held=0)) == 0  # no boundary: no report
    assert gpustate.stranded_cache(manifest(4.26, 0.75, gpu=False)) == 0  # the state pre-dump
    assert render._stranded_cache(manifest(1.12, 1.0)) == ""


def test_a_gpu_state_goes_only_where_the_driver_that_took_it_runs(fake, monkeypatch):
    """The job maps the driver's libraries by their versioned names, which CRIU restores by path: a
    node on another driver version (even a patch apart) is refused in one line, by the restore's
    plan and by a move's check before anything is frozen; a version not known is not held against
    it (an older agent, a bundle from a node without NVML)."""
    from criuctl.format import bundle
    from criuctl.gpu import gpustate

    monkeypatch.setenv("FAKE_NVML_GPUS", f"{H200}={A}")
    facts = bundle.GpuFacts("580.95.06", [bundle.GpuDevice(0, A, H200, 150_754_820_096)], [1], [1])
    with pytest.raises(gpus.GpuMismatch) as err:
        gpustate.plan(facts)
    assert err.value.line() == (
        "the bundle's CUDA state was taken under NVIDIA driver 580.95.06 but this node "
        "runs 580.95.05, and the driver restores a checkpoint only under the version that took it: "
        "restore it on a node with driver 580.95.06, or install 580.95.06 there"
    )
    monkeypatch.setenv("FAKE_NVML_DRIVER", "580.95.06")
    assert gpustate.plan(facts) == {A: A}
    assert gpustate.plan(bundle.GpuFacts("13000", facts.devices, [1], [1])) == {A: A}  # not NVML's: unknown
    with pytest.raises(gpus.GpuMismatch, match=r"the job runs under NVIDIA driver 580\.95\.06 but"):
        gpus.check_driver("580.95.06", "580.65.06", what="the job", where="the target node")
    gpus.check_driver("580.95.06", None, what="the job", where="the target node")
    gpus.check_driver("580.95.06", "", what="the job", where="the target node")
