"""What the CUDA driver returns for the cases criuctl tells apart, probed the same way on the real
driver (tests/gpu/check.py, on a GPU host) and on the stand-in (tests/test_cuda.py).

The stand-in driver (tests/fakes/fake_libcuda.c) claims to answer as r580 does: a PID that is gone,
a process that never started CUDA, a lock that times out, a call in the wrong state. The check writes
what the real driver answered into bench/results/gpu-check.json, and a test runs this same probe on
the stand-in and compares: a claim with a record behind it, or a test that says none was recorded.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from criuctl.gpu.cuda import CudaError, CUresult, Driver, ProcessState

LOCK_S = 10.0  # a lock that must succeed
TIMEOUT_S = 0.05  # a lock that must time out on a busy process


@dataclass
class Processes:
    """How to start each kind of process the probe needs; each returns a Popen the probe kills."""

    cuda: Callable[[], subprocess.Popen]  # holds a CUDA context, idle
    busy: Callable[[], subprocess.Popen]  # holds one and keeps its GPU busy (a lock must wait)
    plain: Callable[[], subprocess.Popen]  # never starts CUDA


def _answer(call: Callable[[], object]) -> dict[str, object]:
    try:
        call()
    except CudaError as exc:
        code = exc.code if exc.code is not None else -1
        name = CUresult(code).name if code in CUresult._value2member_map_ else str(code)
        return {"code": code, "name": name}
    return {"code": 0, "name": "SUCCESS"}


def _state(driver: Driver, pid: int) -> str:
    try:
        return driver.state(pid).name
    except CudaError as exc:
        return f"error {exc.code}"


def _gone_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def probe(driver: Driver, procs: Processes) -> dict[str, dict[str, object]]:
    """Every case: the call, its code and name, and the process's state after (where it has one)."""
    out: dict[str, dict[str, object]] = {}
    gone = _gone_pid()
    out["gone-pid state"] = _answer(lambda: driver.state(gone))
    out["gone-pid lock"] = _answer(lambda: driver.lock(gone, LOCK_S))
    started: list[subprocess.Popen] = []

    def start(kind: Callable[[], subprocess.Popen]) -> int:
        started.append(kind())
        return started[-1].pid

    try:
        plain = start(procs.plain)
        out["no-cuda state"] = _answer(lambda: driver.state(plain))
        out["no-cuda lock"] = _answer(lambda: driver.lock(plain, LOCK_S))
        busy = start(procs.busy)
        t = time.monotonic()
        out["lock timeout"] = _answer(lambda: driver.lock(busy, TIMEOUT_S))
        out["lock timeout"]["seconds"] = round(time.monotonic() - t, 3)
        out["lock timeout"]["state after"] = _state(driver, busy)
        _give_back(driver, busy)
        pid = start(procs.cuda)
        out["unlock while running"] = _answer(lambda: driver.unlock(pid))
        out["checkpoint while running"] = _answer(lambda: driver.checkpoint(pid))
        driver.lock(pid, LOCK_S)
        out["lock twice"] = _answer(lambda: driver.lock(pid, LOCK_S))
        out["lock twice"]["state after"] = _state(driver, pid)
        driver.checkpoint(pid)
        out["checkpoint twice"] = _answer(lambda: driver.checkpoint(pid))
        out["checkpoint twice"]["state after"] = _state(driver, pid)
        out["unlock while checkpointed"] = _answer(lambda: driver.unlock(pid))
        driver.restore(pid)
        out["restore twice"] = _answer(lambda: driver.restore(pid))
        driver.unlock(pid)
        out["full cycle state after"] = {"code": 0, "name": "SUCCESS", "state after": _state(driver, pid)}
    finally:
        for p in started:
            _give_back(driver, p.pid)
            p.kill()
            p.wait()
    return out


def _give_back(driver: Driver, pid: int) -> None:
    """Whatever the probe left locked or checkpointed runs again (a probe must not leave a GPU held)."""
    try:
        state = driver.state(pid)
        if state is ProcessState.CHECKPOINTED:
            driver.restore(pid)
            state = ProcessState.LOCKED
        if state is ProcessState.LOCKED:
            driver.unlock(pid)
    except CudaError:
        pass


def differences(recorded: dict[str, dict[str, object]], standin: dict[str, dict[str, object]]) -> list[str]:
    """Where the stand-in answers otherwise than the recorded driver: code and state after; not timings."""
    out = []
    for case, real in recorded.items():
        mine = standin.get(case)
        if mine is None:
            out.append(f"{case}: the stand-in was not probed for it")
            continue
        for key in ("name", "state after"):
            if key in real and real[key] != mine.get(key):
                out.append(f"{case}: the driver said {key} {real[key]!r}, the stand-in {mine.get(key)!r}")
    return out
