"""The CUDA driver's checkpoint API (r570+), found through ctypes on libcuda.so.1.

For now criuctl only detects it (`doctor`, and the manifest's GPU flag comes from procinfo): the
driver exports cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock} and cuCheckpointProcessGetState,
taking a PID, which move a process's device memory to host memory so that CRIU can dump it.
No GPU is needed to import this module; nothing is loaded until `probe` is called.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

LIBCUDA = "libcuda.so.1"
CHECKPOINT_SYMBOLS = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)


@dataclass(frozen=True)
class DriverInfo:
    loaded: bool  # libcuda.so.1 could be loaded
    driver_version: int | None  # e.g. 12080 for CUDA 12.8 (cuDriverGetVersion)
    checkpoint_symbols: tuple[str, ...]  # those of CHECKPOINT_SYMBOLS the driver exports
    error: str = ""

    @property
    def has_checkpoint_api(self) -> bool:
        return set(self.checkpoint_symbols) == set(CHECKPOINT_SYMBOLS)


def probe(library: str = LIBCUDA) -> DriverInfo:
    try:
        lib = ctypes.CDLL(library)
    except OSError as exc:
        return DriverInfo(False, None, (), str(exc))
    version = ctypes.c_int(0)
    rc = lib.cuDriverGetVersion(ctypes.byref(version)) if hasattr(lib, "cuDriverGetVersion") else -1
    present = tuple(s for s in CHECKPOINT_SYMBOLS if hasattr(lib, s))
    return DriverInfo(True, version.value if rc == 0 else None, present)
