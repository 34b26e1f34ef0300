"""GPU facts for the manifest and the target check, read through NVML (libnvidia-ml.so.1) with ctypes.

The driver restores device memory only onto a GPU of the same chip with enough memory, and every GPU the
job was checkpointed on needs a partner; so a bundle records its GPUs and a target is checked (and its
GPUs paired, old UUID to new) before CRIU starts, not when the driver fails halfway through a restore.
Nothing is loaded at import; hosts without NVML simply have no GPUs. Tests point CRIUCTL_LIBNVML at a
compiled stand-in (tests/fakes/fake_nvml.c).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from criuctl.core import env
from criuctl.core.errors import CriuctlError

NAME_SIZE = 96  # NVML_DEVICE_NAME_V2_BUFFER_SIZE
UUID_SIZE = 96  # NVML_DEVICE_UUID_V2_BUFFER_SIZE
VERSION_SIZE = 80  # NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE


class NvmlError(CriuctlError):
    """NVML answered, but with an error, while listing GPUs that it said are there."""


class GpuMismatch(CriuctlError):
    """The target node cannot take the bundle's GPU state: other models, or too few GPUs."""


class _Memory(ctypes.Structure):  # nvmlMemory_t (v1)
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


@dataclass(frozen=True)
class GpuInfo:
    index: int  # NVML's index: PCI bus order, not CUDA_VISIBLE_DEVICES order
    uuid: str  # "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx", what the driver's restore pairs name
    name: str  # the model, e.g. "NVIDIA H200": the driver restores only onto the same chip
    memory_total: int  # bytes
    memory_free: int | None = None  # bytes free when NVML was asked; None: not known
    driver: str = ""  # the node's NVIDIA driver version ("580.95.05"); "": not said (an older agent)

    def to_dict(self) -> dict[str, int | str | None]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> GpuInfo:
        values = [data.get(k) for k in ("index", "uuid", "name", "memory_total")]
        if [type(v) for v in values] != [int, str, str, int]:  # type(), not isinstance: True is no index
            raise ValueError(f"not a GPU record: {data!r}")
        free, driver = data.get("memory_free"), data.get("driver", "")
        if (free is not None and type(free) is not int) or type(driver) is not str:
            raise ValueError(f"not a GPU record: {data!r}")
        return cls(*values, memory_free=free, driver=driver)  # type: ignore[arg-type]


def library_path() -> str:
    return env.LIBNVML.get()


@contextmanager
def _nvml() -> Iterator[ctypes.CDLL | None]:
    """An initialized NVML, or None where there is no NVIDIA driver (no library, or init refused)."""
    try:
        lib = ctypes.CDLL(library_path())
    except OSError:
        yield None
        return
    lib.nvmlErrorString.restype = ctypes.c_char_p
    lib.nvmlErrorString.argtypes = [ctypes.c_int]
    lib.nvmlDeviceGetHandleByIndex_v2.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)]
    for fn in ("nvmlDeviceGetName", "nvmlDeviceGetUUID"):
        getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint]
    lib.nvmlDeviceGetMemoryInfo.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Memory)]
    if lib.nvmlInit_v2() != 0:
        yield None
        return
    try:
        yield lib
    finally:
        lib.nvmlShutdown()


def _check(lib: ctypes.CDLL, call: str, code: int) -> None:
    if code != 0:
        raise NvmlError(
            f"NVML {call} failed: {lib.nvmlErrorString(code).decode(errors='replace')}",
            "check the GPUs with nvidia-smi",
        )


def list_gpus() -> list[GpuInfo]:
    """Every GPU NVML sees, in index order; [] where there is no NVIDIA driver."""
    with _nvml() as lib:
        if lib is None:
            return []
        count = ctypes.c_uint(0)
        _check(lib, "nvmlDeviceGetCount_v2", lib.nvmlDeviceGetCount_v2(ctypes.byref(count)))
        driver = _driver_version(lib)
        out = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            _check(
                lib,
                "nvmlDeviceGetHandleByIndex_v2",
                lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)),
            )
            name, uuid = ctypes.create_string_buffer(NAME_SIZE), ctypes.create_string_buffer(UUID_SIZE)
            memory = _Memory()
            _check(lib, "nvmlDeviceGetName", lib.nvmlDeviceGetName(handle, name, NAME_SIZE))
            _check(lib, "nvmlDeviceGetUUID", lib.nvmlDeviceGetUUID(handle, uuid, UUID_SIZE))
            _check(lib, "nvmlDeviceGetMemoryInfo", lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)))
            out.append(
                GpuInfo(index, uuid.value.decode(), name.value.decode(), memory.total, memory.free, driver)
            )
        return out


def _driver_version(lib: ctypes.CDLL) -> str:
    buf = ctypes.create_string_buffer(VERSION_SIZE)
    lib.nvmlSystemGetDriverVersion.argtypes = [ctypes.c_char_p, ctypes.c_uint]
    _check(lib, "nvmlSystemGetDriverVersion", lib.nvmlSystemGetDriverVersion(buf, VERSION_SIZE))
    return buf.value.decode()


def driver_version() -> str | None:
    """The NVIDIA driver's version, e.g. "580.95.05"; None where there is none."""
    with _nvml() as lib:
        return None if lib is None else _driver_version(lib)


def driver_of(listed: list[GpuInfo]) -> str | None:
    """The driver version a node's GPU list says (each GPU carries its node's); None: not said."""
    return next((g.driver for g in listed if g.driver), None)


def check_driver(taken: str, here: str | None, what: str = "the bundle", where: str = "this node") -> None:
    """GpuMismatch in one line unless `here` runs the NVIDIA driver version the state was `taken`
    under. The checkpointed process maps the driver's libraries by their versioned names
    (libcuda.so.580.95.05; NVIDIA's container toolkit mounts them so), which CRIU restores by path:
    under another version they are not there, even 580.95.05 against 580.95.06 (NVIDIA/cuda-checkpoint
    issue 21). Unknown on either side (an older agent, a version NVML did not give): not checked."""
    if not here or "." not in taken or taken == here:
        return
    bundle = what == "the bundle"
    said = f"{what}'s CUDA state was taken under" if bundle else f"{what} runs under"
    raise GpuMismatch(
        f"{said} NVIDIA driver {taken} but {where} runs {here}, and the driver restores a checkpoint "
        "only under the version that took it",
        f"{'restore' if bundle else 'move'} it on a node with driver {taken}, or install {taken} there",
    )


def maps_use_gpu(maps: str) -> bool:
    """Whether /proc/PID/maps text maps an NVIDIA device file (what a CUDA context does)."""
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/dev/nvidia"):
            return True
    return False


def _fds_use_gpu(pid: int) -> bool:
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(fd).startswith("/dev/nvidia"):
                return True
        except OSError:
            continue
    return False


def gpu_pids(pids: Iterable[int]) -> list[int]:
    """The processes of a tree that use a GPU, in the given order; vanished ones are skipped.

    A child forked after CUDA started (a DataLoader worker) inherits the mappings and the open device
    files but has no CUDA state, and the driver refuses to lock it (NOT_INITIALIZED, seen on r580): pass
    the result through cuda.cuda_processes before cuda.suspend.
    """
    out = []
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            maps = ""
        if maps_use_gpu(maps) or _fds_use_gpu(pid):
            out.append(pid)
    return out


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _describe(gpus: Iterable[GpuInfo]) -> str:
    counts = Counter(g.name for g in gpus)
    return " + ".join(f"{n} × {name}" for name, n in counts.items()) or "no GPU"


def plan_gpu_map(
    recorded: list[GpuInfo],
    present: list[GpuInfo],
    need_bytes: int = 0,
    what: str = "the bundle",
    where: str = "this node",
) -> dict[str, str]:
    """Old UUID -> new UUID for every recorded GPU, or GpuMismatch in one line.

    A GPU still present keeps itself (a restore on the same node moves nothing); the others take the
    GPUs of the same model in index order, so the pairing is stable from one try to the next, skipping
    one whose free memory (where NVML said it) is below `need_bytes`, the job's device memory per GPU:
    the driver would refuse the restore with OUT_OF_MEMORY only after CRIU had restored the tree.
    """
    verb = "restore" if what == "the bundle" else "move"
    by_uuid = {g.uuid.lower(): g for g in present}
    mapping = {g.uuid: by_uuid[g.uuid.lower()].uuid for g in recorded if g.uuid.lower() in by_uuid}
    free = [g for g in sorted(present, key=lambda g: g.index) if g.uuid not in mapping.values()]
    for old in sorted(recorded, key=lambda g: g.index):
        if old.uuid in mapping:
            continue
        same = [g for g in free if g.name == old.name]
        new = next((g for g in same if g.memory_free is None or g.memory_free >= need_bytes), None)
        if new is None and same:
            raise GpuMismatch(
                f"{what} needs {_size(need_bytes)} free on each {old.name} but those of {where} have "
                + ", ".join(_size(g.memory_free or 0) for g in same)
                + " free",
                f"{verb} it on a node whose GPUs are free, or free them here first",
            )
        if new is None:
            raise GpuMismatch(
                f"{what} needs {_describe(recorded)} but {where} has {_describe(present)}",
                f"{verb} it on a node with the same GPU model and at least as many GPUs",
            )
        free.remove(new)
        mapping[old.uuid] = new.uuid
    return {g.uuid: mapping[g.uuid] for g in recorded}


_DEVICE_NODE = re.compile(r"^/dev/nvidia(\d+)$")


def used_gpus(pids: Iterable[int], present: list[GpuInfo]) -> list[GpuInfo]:
    """Of `present`, the GPUs whose device node (/dev/nvidiaN) the processes hold open.

    CUDA opens the node of every GPU it uses; N is the device's minor number, which NVML's index
    follows on the nodes we know (PCI order). A process with no such node open (an unusual driver
    layout) is taken to use every GPU present.
    """
    minors: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    if m := _DEVICE_NODE.match(os.readlink(fd)):
                        minors.add(int(m[1]))
    chosen = [g for g in present if g.index in minors]
    return chosen or list(present)


def visible_in(pid: int) -> set[int] | None:
    """The GPU indices whose device node (/dev/nvidiaN) a container's process sees in its /dev; None
    where its /dev cannot be read.

    A pod gets its GPUs from the device plugin as device nodes in its own /dev (NVIDIA's container
    toolkit keeps the host's names): a job restored into a placeholder pod must go onto those, not
    onto any free GPU of the node, or it would run on a GPU the kubelet gave another pod.
    """
    try:
        names = os.listdir(f"/proc/{pid}/root/dev")
    except OSError:
        return None
    return {int(m[1]) for n in names if (m := _DEVICE_NODE.match(f"/dev/{n}"))}
