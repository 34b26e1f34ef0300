"""NCCL communicators at the step boundary: suspended before criuctl freezes a trainer, resumed once it
goes on (restored on the target, or thawed on the source).

A communicator holds device memory of its own (its buffers, work FIFO, proxy state) that NCCL
allocates with cuMem outside torch's caching allocator: emptying the cache leaves it there, and the
CUDA driver's checkpoint would have to carry it. NCCL 2.29.7 added `ncclCommSuspend(comm,
NCCL_SUSPEND_MEM)`, which releases that memory while the communicator keeps its topology and
connections, and `ncclCommResume(comm)`, which allocates it again (on the device the process then
has: after a move, the target's GPU) and, with several ranks, exchanges the peers' handles again,
so every rank resumes together, as every rank holds together at the boundary.

Two ways to reach it, the first that works:
- `ProcessGroupNCCL.suspend()` / `resume()`: torch 2.12 and later;
- the loaded libnccl's own functions through ctypes, on the communicator `_comm_ptr()` returns
  (torch 2.4 and later), when the library reports NCCL 2.29.7 or later.

A communicator that torch has not created yet (lazy init, no collective so far) holds nothing and is
skipped. What was suspended and how goes into the trainer's report; criuctl.gpu.nccl decides from it
whether the driver may checkpoint the trainer. Standard library only (the hook's rule); torch is the
job's.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from criuctl_hook import contract

SUSPEND_MEM = 0x01  # NCCL_SUSPEND_MEM (nccl.h)
_MAJOR, _MINOR, _PATCH = contract.NCCL_SUSPEND_SINCE
SUSPEND_SINCE = _MAJOR * 10000 + _MINOR * 100 + _PATCH  # as NCCL_VERSION_CODE (22907)
NOT_CREATED = "not initialized"  # what torch raises for a communicator it has not made yet


@dataclass
class Suspension:
    """What the boundary suspended, to resume in the same order once the trainer goes on."""

    resumers: list[tuple[str, Callable[[], None]]] = field(default_factory=list)
    groups: int = 0  # NCCL process groups the job has
    skipped: int = 0  # of them, not created yet: nothing to suspend
    how: str = ""
    error: str = ""

    def report(self) -> dict[str, Any]:
        if not self.groups:
            return {}
        return {
            "nccl_suspend": {
                "groups": self.groups,
                "suspended": len(self.resumers),
                "skipped": self.skipped,
                "how": self.how,
                "error": self.error,
            }
        }

    def resume(self) -> None:
        """Resume every suspended communicator; a failure is said on stderr (the job's next collective
        will fail with NCCL's own error) and does not stop the others."""
        for name, resume in self.resumers:
            try:
                resume()
            except Exception as exc:
                print(f"criuctl: cannot resume the NCCL communicator of {name}: {exc}", file=sys.stderr)
        self.resumers = []


def library() -> ctypes.CDLL | None:
    """The libnccl this process already loaded (torch's), found by its path in /proc/self/maps:
    dlopen of the same path returns the same library, never a second copy."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if "libnccl" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        if ".so" in path.rsplit("/", 1)[-1]:
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None


def _ctypes_api() -> tuple[Any, str]:
    """The loaded libnccl when it can suspend, else (None, why not)."""
    lib = library()
    if lib is None:
        return None, "no libnccl is loaded in the process"
    code = ctypes.c_int(0)
    if lib.ncclGetVersion(ctypes.byref(code)) != 0:
        return None, "ncclGetVersion failed"
    if code.value < SUSPEND_SINCE or not hasattr(lib, "ncclCommSuspend"):
        return None, f"NCCL {code.value} has no ncclCommSuspend (2.29.7, code {SUSPEND_SINCE})"
    lib.ncclCommSuspend.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.ncclCommResume.argtypes = [ctypes.c_void_p]
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    return lib, ""


def _checked(lib: Any, fn: str, *args: Any) -> None:
    rc = getattr(lib, fn)(*args)
    if rc != 0:
        raise RuntimeError(f"{fn} returned {rc} ({(lib.ncclGetErrorString(rc) or b'').decode()})")


def suspend(torch: Any) -> Suspension:
    """Suspend every NCCL communicator of the job's process groups (CUDA already synchronised: NCCL
    wants no collective in flight). Never raises: what failed is in the result's `error`."""
    out = Suspension()
    dist = getattr(torch, "distributed", None)
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return out
        groups = [
            pg for pg in list(dist.distributed_c10d._world.pg_map) if str(dist.get_backend(pg)) == "nccl"
        ]
        out.groups = len(groups)
        if not groups:
            return out
        device = torch.device("cuda", torch.cuda.current_device())
        lib: Any = None
        for i, pg in enumerate(groups):
            name = f"process group {i} (size {pg.size()})"
            backend = pg._get_backend(device)
            if callable(getattr(backend, "suspend", None)) and callable(getattr(backend, "resume", None)):
                out.how = "ProcessGroupNCCL.suspend"
                try:
                    backend.suspend()
                except RuntimeError as exc:
                    if NOT_CREATED in str(exc):
                        out.skipped += 1
                        continue
                    raise
                out.resumers.append((name, backend.resume))
                continue
            if lib is None:
                lib, why = _ctypes_api()
                if lib is None:
                    out.error = why
                    return out
            out.how = "ncclCommSuspend"
            try:
                comm = int(backend._comm_ptr())
            except RuntimeError as exc:
                if NOT_CREATED not in str(exc):
                    raise
                comm = 0
            if not comm:
                out.skipped += 1
                continue
            _checked(lib, "ncclCommSuspend", ctypes.c_void_p(comm), SUSPEND_MEM)
            out.resumers.append(
                (name, lambda lib=lib, comm=comm: _checked(lib, "ncclCommResume", ctypes.c_void_p(comm)))
            )
    except Exception as exc:  # a torch or NCCL whose internals moved: say so, criuctl refuses
        out.error = f"{type(exc).__name__}: {exc}"
    return out
