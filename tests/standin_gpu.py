"""The GPU stand-ins for hosts without a GPU: the compiled libcuda and NVML of tests/fakes/, and the
environment that makes a test "node" an NVIDIA node and a test job a CUDA job.

A node's agent loads the stand-in driver and NVML (CRIUCTL_LIBCUDA, CRIUCTL_LIBNVML) and sees the GPUs
it is given; a job holds a stand-in CUDA context (tests/workloads/_standin_cuda.py) on one of them.
The context's checkpoint state lives in the job's memory, as the real driver's does, so CRIU carries it
and both nodes of a test share nothing but the folder of context marker files.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from criuctl.core.env import LIBCUDA, LIBNVML
from tests.requirements import require

FAKES = Path(__file__).parent / "fakes"
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
BUILDS = {
    "cuda": ("fake_libcuda.c", []),
    "cuda_r550": ("fake_libcuda.c", ["-DFAKE_CUDA_NO_CHECKPOINT_API", "-Wno-unused-function"]),
    "nvml": ("fake_nvml.c", []),
    "libnccl": ("fake_libnccl.c", []),  # named so: the hook finds libnccl by name among its mappings
}


def compile_standins(out: Path) -> dict[str, Path]:
    """Every stand-in library, built with the host's C compiler into `out`."""
    require("cc")
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    assert cc is not None
    libs = {}
    for key, (source, flags) in BUILDS.items():
        libs[key] = out / f"{key}.so"
        cmd = [cc, "-shared", "-fPIC", "-O1", "-Wall", *flags, "-o", str(libs[key]), str(FAKES / source)]
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    return libs


@dataclass(frozen=True)
class Gpu:
    name: str
    uuid: str


@dataclass(frozen=True)
class StandinGpus:
    """One test's stand-in driver: its libraries and the folders its nodes and jobs share."""

    libs: dict[str, Path]
    root: Path

    @property
    def contexts(self) -> Path:
        return self.root / "contexts"

    @property
    def calls(self) -> Path:
        return self.root / "calls.log"

    def node_env(self, *gpus: Gpu) -> dict[str, str]:
        """An agent's environment: a node with these GPUs (none: a node whose driver sees no GPU)."""
        self.contexts.mkdir(parents=True, exist_ok=True)
        return {
            str(LIBCUDA): str(self.libs["cuda"]),
            str(LIBNVML): str(self.libs["nvml"]),
            "FAKE_CUDA_STATE_DIR": str(self.root),
            "FAKE_CUDA_CONTEXTS": str(self.contexts),
            "FAKE_CUDA_PRESENT": ",".join(g.uuid for g in gpus),
            "FAKE_NVML_GPUS": ",".join(f"{g.name}={g.uuid}" for g in gpus),
        }

    def daemonset_env(self, nodes: dict[str, tuple[Gpu, ...]]) -> list[dict]:
        """The agents' environment as a DaemonSet's pod template gives it: one for every node, each
        agent seeing its own node's GPUs (the stand-ins read FAKE_*_<FAKE_NODE>: the Node's name)."""
        env = {k: v for k, v in self.node_env().items() if k not in ("FAKE_CUDA_PRESENT", "FAKE_NVML_GPUS")}
        for node, gpus in nodes.items():
            own = self.node_env(*gpus)
            env |= {f"{k}_{node}": own[k] for k in ("FAKE_CUDA_PRESENT", "FAKE_NVML_GPUS")}
        node_name = {"name": "FAKE_NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}
        return [{"name": k, "value": v} for k, v in env.items()] + [node_name]

    def job_env(self, gpu: Gpu, memory_mib: int = 16) -> dict[str, str]:
        """A job's environment: it opens a stand-in CUDA context on `gpu` with that much device memory."""
        self.contexts.mkdir(parents=True, exist_ok=True)
        return {
            "FAKE_CUDA_CONTEXTS": str(self.contexts),
            "STANDIN_CUDA_DEVICE": gpu.uuid,
            "STANDIN_CUDA_MIB": str(memory_mib),
        }

    def driver_calls(self, kinds: tuple[str, ...] = ("lock", "checkpoint", "restore", "unlock")) -> list[str]:
        lines = self.calls.read_text().splitlines() if self.calls.exists() else []
        return [line for line in lines if line.split()[0] in kinds]
