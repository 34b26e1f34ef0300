"""The CUDA driver's process checkpoint API (r570+), called through ctypes on libcuda.so.1.

CRIU cannot dump device memory, so before a dump the driver must move a GPU process's device memory into
its host memory (lock, then checkpoint), and after a restore move it back (restore, then unlock). criuctl
calls the driver itself rather than NVIDIA's cuda-checkpoint binary: nothing extra to install on a node,
and failures come back as CUresult codes that name what went wrong. Nothing is loaded at import, so this
module works on hosts without a GPU; tests point CRIUCTL_LIBCUDA at a compiled stand-in
(tests/fakes/fake_libcuda.c).

Layouts and values follow NVIDIA's cuda.h (the CUDA Checkpointing group of the driver API reference, 12.8
and 13.0). Every argument struct is 64 bytes; a wrong size or offset would have the driver read or write
past our buffer, so tests/test_cuda.py asserts them. The codes the hints below explain are the ones
driver 580.159.04 returned on an H200 for each case; the stand-in returns the same. tests/gpu/probe.py
asks both the same questions; a GPU check's bench/results/gpu-check.json holds the real driver's answers.
"""

from __future__ import annotations

import ctypes
import enum
from collections.abc import Callable
from dataclasses import dataclass

from criuctl.core import env
from criuctl.core.errors import CriuctlError

REMAP_VERSION = 13000  # r580 (CUDA 13.0): CUcheckpointRestoreArgs.gpuPairs, restore onto other GPUs
CHECKPOINT_SYMBOLS = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
    "cuCheckpointProcessGetRestoreThreadId",
)


class CUresult(enum.IntEnum):
    """The codes criuctl tells apart (cuda.h's CUresult); the driver may return any other."""

    SUCCESS = 0
    INVALID_VALUE = 1
    OUT_OF_MEMORY = 2
    NOT_INITIALIZED = 3
    NO_DEVICE = 100
    OPERATING_SYSTEM = 304
    ILLEGAL_STATE = 401
    NOT_READY = 600
    NOT_SUPPORTED = 801
    TIMEOUT = 909
    UNKNOWN = 999


class ProcessState(enum.IntEnum):
    """CUprocessState: lock, checkpoint, restore, unlock go RUNNING, LOCKED, CHECKPOINTED, LOCKED, RUNNING."""

    RUNNING = 0
    LOCKED = 1
    CHECKPOINTED = 2
    FAILED = 3


class CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]  # char bytes[16] in cuda.h; unsigned keeps NULs


class CUcheckpointLockArgs(ctypes.Structure):  # CUDA 12.8
    _fields_ = [
        ("timeoutMs", ctypes.c_uint),  # 12.8; 0 waits forever, so criuctl never sends 0
        ("reserved0", ctypes.c_uint),
        ("reserved1", ctypes.c_uint64 * 7),
    ]


class CUcheckpointCheckpointArgs(ctypes.Structure):  # CUDA 12.8; still all reserved in 13.0
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


class CUcheckpointGpuPair(ctypes.Structure):  # CUDA 13.0
    _fields_ = [("oldUuid", CUuuid), ("newUuid", CUuuid)]


class CUcheckpointRestoreArgs(ctypes.Structure):  # CUDA 12.8 as uint64 reserved[8]; pairs from 13.0
    _fields_ = [
        ("gpuPairs", ctypes.POINTER(CUcheckpointGpuPair)),  # 13.0
        ("gpuPairsCount", ctypes.c_uint),  # 13.0
        ("reserved", ctypes.c_char * (52 - ctypes.sizeof(ctypes.c_void_p))),
        ("reserved1", ctypes.c_uint64),
    ]


class CUcheckpointUnlockArgs(ctypes.Structure):  # CUDA 12.8
    _fields_ = [("reserved", ctypes.c_uint64 * 8)]


_NEEDS = "NVIDIA driver r570+ (CUDA 12.8)"
_BUSY = "the job kept CUDA busy past the lock timeout; retry, or allow a longer timeout"
# What r580 (580.159) was seen to mean by each code for these calls, as the user can act on it.
_HINTS = {
    CUresult.ILLEGAL_STATE: "the process is not in the CUDA state this step needs (another tool may hold it)",
    CUresult.INVALID_VALUE: "the GPU map is wrong: one pair per GPU the process used, onto GPUs of this node",
    CUresult.NOT_INITIALIZED: "the process has not started CUDA, so it has no GPU state to move",
    CUresult.OPERATING_SYSTEM: "the process is gone, or the driver cannot reach it",
    CUresult.NOT_READY: _BUSY,
    CUresult.TIMEOUT: _BUSY,
    CUresult.NOT_SUPPORTED: "the driver cannot checkpoint this process (UVM or IPC memory, or this GPU)",
    CUresult.OUT_OF_MEMORY: "the target GPU has too little free memory for the job's device memory",
}


class CudaError(CriuctlError):
    """A driver call that failed, or a driver without the call: the one line names function, PID and code."""

    def __init__(
        self,
        what: str,
        hint: str = "",
        detail: str = "",
        *,
        function: str = "",
        pid: int | None = None,
        code: int | None = None,
    ) -> None:
        super().__init__(what, hint, detail)
        self.function, self.pid, self.code = function, pid, code
        self.rollback: object | None = None  # a cudasteps.Undone, set by `suspend` after undoing its work

    @property
    def timed_out(self) -> bool:
        """The lock gave up: r580 says NOT_READY (and leaves the process RUNNING); TIMEOUT just in case."""
        return self.code in (CUresult.TIMEOUT, CUresult.NOT_READY)


def library_path() -> str:
    return env.LIBCUDA.get()


def version_text(version: int) -> str:
    """12080 -> "12.8": cuDriverGetVersion's encoding, 1000 * major + 10 * minor."""
    return f"{version // 1000}.{version % 1000 // 10}"


def uuid_bytes(uuid: str) -> bytes:
    digits = uuid.strip().removeprefix("GPU-").replace("-", "")
    try:
        raw = bytes.fromhex(digits)
    except ValueError:
        raw = b""
    if len(raw) != 16:
        raise CudaError(
            f"not a GPU UUID: {uuid!r}", "GPU UUIDs look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
        )
    return raw


def uuid_text(raw: bytes) -> str:
    h = bytes(raw).hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def _pair(old: str, new: str) -> CUcheckpointGpuPair:
    return CUcheckpointGpuPair(
        CUuuid.from_buffer_copy(uuid_bytes(old)), CUuuid.from_buffer_copy(uuid_bytes(new))
    )


class Driver:
    """One loaded libcuda. Each method is one driver call on another process and raises CudaError."""

    def __init__(self, lib: ctypes.CDLL, path: str) -> None:
        self._lib, self.path = lib, path
        self._fns: dict[str, Callable[..., int]] = {}
        self._initialized = False
        out = ctypes.c_int(0)
        self._call("cuDriverGetVersion", None, ctypes.byref(out), argtypes=[ctypes.POINTER(ctypes.c_int)])
        self.version = out.value  # the CUDA API version, e.g. 13000 on r580

    @classmethod
    def load(cls, path: str | None = None) -> Driver:
        path = path or library_path()
        try:
            lib = ctypes.CDLL(path)
        except OSError as exc:
            raise CudaError(
                f"cannot load the CUDA driver {path}",
                f"checkpointing GPU jobs needs the {_NEEDS} on this node",
                str(exc),
            ) from exc
        return cls(lib, path)

    @property
    def supports_remap(self) -> bool:
        return self.version >= REMAP_VERSION

    def lock(self, pid: int, timeout_s: float) -> None:
        """Block the process's CUDA calls; on timeout the driver leaves it RUNNING."""
        ms = min(max(1, round(timeout_s * 1000)), 2**32 - 1)  # never 0: that would wait forever
        self._checkpoint_call("cuCheckpointProcessLock", pid, CUcheckpointLockArgs(timeoutMs=ms))

    def checkpoint(self, pid: int) -> None:
        self._checkpoint_call("cuCheckpointProcessCheckpoint", pid, CUcheckpointCheckpointArgs())

    def restore(self, pid: int, gpu_map: dict[str, str] | None = None) -> None:
        """Bring device memory back, onto gpu_map's GPUs (old UUID -> new); no map: the same GPUs.

        The driver wants exactly one pair per GPU the process used: r580 refuses a pair for any other.
        """
        pairs = list((gpu_map or {}).items())
        if not self.supports_remap and all(a.lower() == b.lower() for a, b in pairs):
            pairs = []  # nothing moves, and before 13.0 the pair fields are reserved and must be zero
        if pairs and not self.supports_remap:
            raise CudaError(
                f"restoring onto other GPUs needs NVIDIA driver r580+ (CUDA 13.0); "
                f"this driver is CUDA {version_text(self.version)}",
                "restore on a node with the bundle's GPUs, or upgrade the driver",
                function="cuCheckpointProcessRestore",
                pid=pid,
            )
        array = (CUcheckpointGpuPair * len(pairs))(*(_pair(old, new) for old, new in pairs))
        args = CUcheckpointRestoreArgs(gpuPairsCount=len(pairs))
        if pairs:
            args.gpuPairs = ctypes.cast(array, ctypes.POINTER(CUcheckpointGpuPair))
        self._init()  # restore needs cuInit in the caller unless persistence mode is on
        self._checkpoint_call("cuCheckpointProcessRestore", pid, args)

    def unlock(self, pid: int) -> None:
        self._checkpoint_call("cuCheckpointProcessUnlock", pid, CUcheckpointUnlockArgs())

    def state(self, pid: int) -> ProcessState:
        value = self._query("cuCheckpointProcessGetState", pid)
        try:
            return ProcessState(value)
        except ValueError:
            raise CudaError(
                f"cuCheckpointProcessGetState(pid {pid}): unknown process state {value}",
                "this driver is newer than criuctl knows; upgrade criuctl",
                function="cuCheckpointProcessGetState",
                pid=pid,
            ) from None

    def restore_thread_id(self, pid: int) -> int:
        """The driver's helper thread in the process: CRIU must let it run while the rest is frozen."""
        return self._query("cuCheckpointProcessGetRestoreThreadId", pid)

    def _query(self, name: str, pid: int) -> int:
        out = ctypes.c_int(-1)
        self._call(name, pid, ctypes.byref(out), argtypes=[ctypes.c_int, ctypes.POINTER(ctypes.c_int)])
        return out.value

    def _init(self) -> None:
        if not self._initialized:
            self._call("cuInit", None, 0, argtypes=[ctypes.c_uint])
            self._initialized = True

    def _checkpoint_call(self, name: str, pid: int, args: ctypes.Structure) -> None:
        self._call(name, pid, ctypes.byref(args), argtypes=[ctypes.c_int, ctypes.POINTER(type(args))])

    def _fn(self, name: str, argtypes: list[type]) -> Callable[..., int]:
        if name not in self._fns:
            try:
                fn = getattr(self._lib, name)
            except AttributeError:
                have = f"CUDA {version_text(self.version)}" if hasattr(self, "version") else "no CUDA driver"
                raise CudaError(
                    f"{self.path} has no {name}",
                    f"checkpointing GPU jobs needs the {_NEEDS}; this one is {have}",
                    function=name,
                ) from None
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            self._fns[name] = fn
        return self._fns[name]

    def _call(self, name: str, pid: int | None, *args: object, argtypes: list[type]) -> None:
        call_args = args if pid is None else (pid, *args)
        code = self._fn(name, argtypes)(*call_args)
        if code != CUresult.SUCCESS:
            raise self._error(name, pid, code)

    def _error(self, function: str, pid: int | None, code: int) -> CudaError:
        name, string = self._describe("cuGetErrorName", code), self._describe("cuGetErrorString", code)
        where = function if pid is None else f"{function}(pid {pid})"
        what = f"{where}: {name or f'CUresult {code}'}" + (f": {string}" if string else "")
        return CudaError(what, _HINTS.get(code, ""), function=function, pid=pid, code=code)

    def _describe(self, getter: str, code: int) -> str:
        fn = getattr(self._lib, getter, None)
        if fn is None:
            return ""
        fn.argtypes, fn.restype = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)], ctypes.c_int
        out = ctypes.c_char_p()
        return out.value.decode(errors="replace") if fn(code, ctypes.byref(out)) == 0 and out.value else ""


@dataclass(frozen=True)
class DriverInfo:
    loaded: bool  # the library could be loaded
    driver_version: int | None  # e.g. 12080 for CUDA 12.8 (cuDriverGetVersion)
    checkpoint_symbols: tuple[str, ...]  # those of CHECKPOINT_SYMBOLS the driver exports
    error: str = ""

    @property
    def has_checkpoint_api(self) -> bool:
        return set(self.checkpoint_symbols) == set(CHECKPOINT_SYMBOLS)

    @property
    def supports_remap(self) -> bool:
        return self.has_checkpoint_api and (self.driver_version or 0) >= REMAP_VERSION


def probe(library: str | None = None) -> DriverInfo:
    """What the driver offers, without cuInit (cheap, and safe on a node whose GPUs are busy)."""
    path = library or library_path()
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        return DriverInfo(False, None, (), str(exc))
    present = tuple(s for s in CHECKPOINT_SYMBOLS if hasattr(lib, s))
    try:
        return DriverInfo(True, Driver(lib, path).version, present)
    except CudaError as exc:
        return DriverInfo(True, None, present, exc.what)
