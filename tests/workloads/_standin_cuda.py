"""A STAND-IN for a CUDA context inside a test job, for hosts without a GPU (paired with the stand-in
driver, tests/fakes/fake_libcuda.c, in its FAKE_CUDA_CONTEXTS mode).

The real driver keeps a process's checkpoint state in that process; so does this: a 256-byte struct in
the job's memory, which the stand-in driver reads and writes from criuctl's side
(process_vm_readv/writev), found through a marker file "ctx-<hex address>" the job holds open. CRIU
carries both to wherever the job is restored, so the state a restore finds is the one the dump left,
and a source copy thawed after a failed move keeps its own.

`call()` is what every CUDA call is to the job: it blocks while the driver holds the process locked or
checkpointed (the real lock blocks CUDA calls the same way), and prints "gpu <UUIDs>" when the GPUs it
runs on change (a restore onto another node's GPUs). Nothing here is criuctl's: it is the job's side.
"""

import ctypes
import mmap
import os
import sys
import time

MAGIC = b"FAKECTX1"
SIZE = 272  # struct fake_ctx: magic[8], int state, int owner, char devices[240], u64 memory, u64 bytes
RUNNING = 0


class Context:
    """`memory_mib`: the context's "device memory", a region never touched here: the stand-in driver's
    checkpoint fills it (the job's resident memory grows, as with the real driver's host copy), and
    its restore checks that CRIU brought it back intact."""

    def __init__(self, folder: str, device: str, memory_mib: int = 0) -> None:
        self._buf = ctypes.create_string_buffer(SIZE)
        ctypes.memmove(self._buf, MAGIC, 8)
        self._int(8, RUNNING)
        self._int(12, os.getpid())
        ctypes.memmove(ctypes.addressof(self._buf) + 16, device.encode()[:239], len(device.encode()[:239]))
        # private anonymous memory, as a driver's host allocation is: what CRIU's lazy pages cover
        # (Python's default anonymous mmap is MAP_SHARED, which CRIU dumps whole, post-copy or not)
        private = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        self._memory = mmap.mmap(-1, memory_mib << 20, flags=private) if memory_mib else None
        if self._memory is not None:
            base = ctypes.addressof(ctypes.c_char.from_buffer(self._memory))
            ctypes.c_ulonglong.from_address(ctypes.addressof(self._buf) + 256).value = base
            ctypes.c_ulonglong.from_address(ctypes.addressof(self._buf) + 264).value = memory_mib << 20
        address = ctypes.addressof(self._buf)
        # held open for the job's life: the stand-in driver finds the context through it
        self._marker = open(os.path.join(folder, f"ctx-{address:x}"), "a")  # noqa: SIM115
        self._seen = ""
        self.call()

    def _int(self, offset: int, value: int | None = None) -> int:
        cell = ctypes.c_int.from_address(ctypes.addressof(self._buf) + offset)
        if value is not None:
            cell.value = value
        return cell.value

    @property
    def devices(self) -> str:
        return ctypes.string_at(ctypes.addressof(self._buf) + 16).decode()

    def call(self) -> None:
        """One CUDA call: waits out a lock or a checkpoint, then runs on the GPUs the context holds."""
        while self._int(8) != RUNNING:
            time.sleep(0.005)
        if self.devices != self._seen:
            self._seen = self.devices
            print(f"gpu {self._seen}", flush=True)


def from_environment() -> "Context | None":
    """A context when the test asked for one (FAKE_CUDA_CONTEXTS, STANDIN_CUDA_DEVICE, and
    STANDIN_CUDA_MIB of device memory), else None."""
    folder, device = os.environ.get("FAKE_CUDA_CONTEXTS"), os.environ.get("STANDIN_CUDA_DEVICE")
    if not (folder and device):
        return None
    try:
        return Context(folder, device, int(os.environ.get("STANDIN_CUDA_MIB", "0")))
    except OSError as exc:
        sys.exit(f"stand-in CUDA context: {exc}")
