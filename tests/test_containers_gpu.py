"""A GPU pod's container moved into a placeholder pod, against the stand-in driver and NVML.

Each node's agent loads the stand-ins (tests/standin_gpu.py). Node b has two GPUs, and its
placeholder container was given the second one as the device plugin would give it: a device node
/dev/nvidia1 in its /dev. The job's GPU state must go onto that GPU, the one the kubelet gave this
pod, not onto the first free GPU of the node (which another pod may hold). The job holds a stand-in
CUDA context on node a's GPU (tests/workloads/_standin_cuda.py): its CUDA calls block until the
driver gives its state back, and it prints the GPU it runs on.
"""

from __future__ import annotations

import json

import pytest

from criuctl.container import containers
from tests.conftest import needs_criu
from tests.requirements import missing, needs
from tests.standin_gpu import H200, Gpu, StandinGpus, compile_standins

pytestmark = [needs_criu, needs("containerd"), pytest.mark.slow]

if missing("containerd") is None:
    from tests.containerd import INIT, PY, REPO, cri_final, cri_steps, two_nodes, wait_until

GPU_A = Gpu(H200, "GPU-aaaaaaaa-2222-3333-4444-00000000000a")
GPU_B0 = Gpu(H200, "GPU-b0b0b0b0-2222-3333-4444-0000000000b0")
GPU_B1 = Gpu(H200, "GPU-b1b1b1b1-2222-3333-4444-0000000000b1")
STEPS = 80


@pytest.fixture(scope="module")
def gpu_nodes(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-standins")
    gpus = StandinGpus(compile_standins(root), root / "gpus")
    env = {"a": gpus.node_env(GPU_A), "b": gpus.node_env(GPU_B0, GPU_B1)}
    for nodes in two_nodes(tmp_path_factory, agent_env=env):
        yield nodes, gpus


def test_a_gpu_pod_moves_onto_the_gpu_its_placeholder_was_given(gpu_nodes, reference):
    nodes, gpus = gpu_nodes
    ref = reference("train_mlp.py", "--steps", str(STEPS), "--step-time", "0")
    job_argv = [
        PY,
        str(REPO / "tests" / "workloads" / "train_mlp.py"),
        "--steps",
        str(STEPS),
        "--step-time",
        "0.1",
    ]
    job = nodes.pod(
        "a",
        "gpu-trainer",
        [*INIT, "--", *job_argv],
        shared=gpus.contexts,
        env=gpus.job_env(GPU_A),
        devices={"/dev/nvidia0": "/dev/null"},  # what the device plugin gave it on a (a stand-in node)
    )
    holder = nodes.pod(
        "b",
        "gpu-trainer",
        [*INIT, "--placeholder"],
        shared=gpus.contexts,
        devices={"/dev/nvidia1": "/dev/null"},
    )
    wait_until(lambda: "placeholder ready" in holder.log.read_text(errors="replace"), 30, "the placeholder")
    wait_until(lambda: len(cri_steps(job.log)) >= 10, 120, "10 steps on node a")

    r = nodes.cluster.migrate(containers.name_of(job.container), "b")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["target"] == "b"
    restores = gpus.driver_calls(("restore",))
    assert [x.split("pairs=")[1] for x in restores] == [f"{GPU_A.uuid}>{GPU_B1.uuid}"], gpus.driver_calls()

    assert nodes.runtimes["b"].wait_exited(holder.container, timeout=300) == 0, holder.log.read_text()[-3000:]
    before, after = cri_steps(job.log), cri_steps(holder.log)
    assert {**before, **after} == ref.steps
    assert cri_final(holder.log) == [ref.final]
    assert f"gpu {GPU_B1.uuid}" in holder.log.read_text(), "the job did not run on its placeholder's GPU"
