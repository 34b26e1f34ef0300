"""GPU jobs moved by `criuctl migrate` through the agents, against the stand-in driver and NVML.

Each node's agent loads the stand-in libcuda and NVML (tests/standin_gpu.py) and sees its own GPUs;
the job holds a stand-in CUDA context whose checkpoint state lives in the job's memory, as the real
driver's does, and whose "CUDA calls" block while the driver holds it locked or checkpointed. So a
move that forgot to give the device state back leaves the job stuck, and one that restored it onto the
wrong GPU is refused by the stand-in as by r580. What the real driver does on a real GPU is
tests/gpu/check.sh's.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest

from tests.cluster import Cluster
from tests.conftest import needs_criu
from tests.jobs import CRIUCTL
from tests.standin_gpu import H100, H200, Gpu, StandinGpus, compile_standins
from tests.test_migrate import MLP, _failed, _migrate_ok, assert_ran_once

pytestmark = [needs_criu, pytest.mark.slow]

GPU_A = Gpu(H200, "GPU-aaaaaaaa-1111-2222-3333-00000000000a")
GPU_B = Gpu(H200, "GPU-bbbbbbbb-1111-2222-3333-00000000000b")
GPU_C = Gpu(H100, "GPU-cccccccc-1111-2222-3333-00000000000c")


@pytest.fixture
def mlp_ref(reference):
    return reference("train_mlp.py", *MLP[1:3], "--step-time", "0")


@pytest.fixture(scope="module")
def standin_libs(tmp_path_factory):
    return compile_standins(tmp_path_factory.mktemp("standin-gpu"))


@pytest.fixture
def gpus(standin_libs, tmp_path) -> StandinGpus:
    return StandinGpus(standin_libs, tmp_path / "gpus")


def _gpu_cluster(tmp_path, gpus: StandinGpus, b: tuple[Gpu, ...] = (GPU_B,)) -> Cluster:
    return Cluster(tmp_path / "c", agent_env={"a": gpus.node_env(GPU_A), "b": gpus.node_env(*b)})


def _gpu_job_on_a(c: Cluster, gpus: StandinGpus, step: int = 8) -> None:
    c.run("a", "gpujob", *MLP, env=gpus.job_env(GPU_A))
    c.wait_step("gpujob", step)


def _gpu_lines(c: Cluster, name: str) -> list[str]:
    return [line for n in c.nodes.values() for line in n.log(name).splitlines() if line.startswith("gpu ")]


@pytest.mark.parametrize("mode", ["stop-and-copy", "post-copy"])
def test_a_gpu_job_moves_onto_the_target_nodes_gpu(tmp_path, gpus, mlp_ref, mode):
    """Lock + checkpoint on a, CRIU, restore onto b's GPU (the old -> new pair), unlock: the job's
    CUDA calls go on, on b's GPU, and it ends once with an uninterrupted run's losses and weights."""
    with _gpu_cluster(tmp_path, gpus) as c:
        _gpu_job_on_a(c, gpus)
        moved = _migrate_ok(c, "gpujob", "b", "--mode", mode)
        calls = gpus.driver_calls()
        kinds = [line.split()[0] for line in calls]
        assert kinds == ["lock", "checkpoint", "restore", "unlock"], calls
        # the driver's restore, inside the downtime, said apart (post-copy: it pulls the host copy)
        assert 0 < moved["phases"]["gpu_restore"] < moved["downtime_seconds"], moved
        assert calls[2].endswith(f"pairs={GPU_A.uuid}>{GPU_B.uuid}"), calls
        assert_ran_once(c, "gpujob", mlp_ref, "b")
        assert _gpu_lines(c, "gpujob") == [f"gpu {GPU_A.uuid}", f"gpu {GPU_B.uuid}"]


@pytest.mark.parametrize(("b", "has"), [((GPU_C,), f"1 × {H100}"), ((), "no GPU")], ids=["h100", "none"])
def test_a_target_without_the_jobs_gpu_model_is_refused_before_anything_is_frozen(
    tmp_path, gpus, mlp_ref, b, has
):
    """b has an H100, or no GPU; the job an H200: refused in one line before the lock (the target
    agent's GPU list travels with the move), and the job goes on on a, its device state untouched."""
    with _gpu_cluster(tmp_path, gpus, b=b) as c:
        _gpu_job_on_a(c, gpus)
        line = _failed(c.migrate("gpujob", "b"))
        assert f"the job ({H200}) needs 1 × {H200} but the target node has {has}" in line, line
        assert "nothing was frozen" in line, line
        assert gpus.driver_calls() == [], "the driver was asked to lock a job that could not move"
        assert_ran_once(c, "gpujob", mlp_ref, "a")
        assert _gpu_lines(c, "gpujob") == [f"gpu {GPU_A.uuid}"]


def test_a_target_on_another_driver_version_is_refused_before_anything_is_frozen(tmp_path, gpus, mlp_ref):
    """b's driver is a patch release apart (NVML says 580.95.06 against a's 580.95.05): the job's
    mapped libraries would not be there by their names, so the move is refused in one line before
    the lock (the version travels in the target agent's GPU list), and the job goes on on a."""
    b = {**gpus.node_env(GPU_B), "FAKE_NVML_DRIVER": "580.95.06"}
    with Cluster(tmp_path / "c", agent_env={"a": gpus.node_env(GPU_A), "b": b}) as c:
        _gpu_job_on_a(c, gpus)
        line = _failed(c.migrate("gpujob", "b"))
        assert "the job runs under NVIDIA driver 580.95.05 but the target node runs 580.95.06" in line, line
        assert "nothing was frozen" in line, line
        assert gpus.driver_calls() == [], "the driver was asked to lock a job that could not move"
        assert_ran_once(c, "gpujob", mlp_ref, "a")


def test_a_target_whose_gpu_memory_is_taken_is_refused_before_its_restore(tmp_path, gpus, mlp_ref):
    """b's H200 has too little free memory (NVML) for what the checkpoint moved: b's restore refuses
    before CRIU runs, the source thaws, and the job gets its device state back on a."""
    full = gpus.node_env(GPU_B)
    full["FAKE_NVML_GPUS"] = f"{GPU_B.name}={GPU_B.uuid}:150754820096:{8 << 20}"  # 8 MiB free
    with Cluster(tmp_path / "c", agent_env={"a": gpus.node_env(GPU_A), "b": full}) as c:
        _gpu_job_on_a(c, gpus)
        line = _failed(c.migrate("gpujob", "b"))
        # what the checkpoint moved: the 16 MiB context, give or take what the locked job still touched
        wanted = rf"needs 1[6-8] MiB free on each {H200} but those of this node have 8 MiB free"
        assert re.search(wanted, line), line
        kinds = [x.split()[0] for x in gpus.driver_calls()]
        assert kinds == ["lock", "checkpoint", "restore", "unlock"], gpus.driver_calls()  # given back on a
        assert_ran_once(c, "gpujob", mlp_ref, "a")
        assert _gpu_lines(c, "gpujob") == [f"gpu {GPU_A.uuid}"]


def test_a_failed_checkpoint_leaves_the_job_running_on_its_gpu(tmp_path, gpus, mlp_ref):
    """The driver refuses the checkpoint (NOT_SUPPORTED: say, IPC memory): the lock is undone, the job
    is never frozen by CRIU, the one line says what the driver said and that the job runs on."""
    with Cluster(
        tmp_path / "c",
        agent_env={
            "a": {**gpus.node_env(GPU_A), "FAKE_CUDA_FAIL": "checkpoint:801"},
            "b": gpus.node_env(GPU_B),
        },
    ) as c:
        _gpu_job_on_a(c, gpus)
        line = _failed(c.migrate("gpujob", "b"))
        assert "CUDA_ERROR_NOT_SUPPORTED" in line, line
        assert [x.split()[0] for x in gpus.driver_calls()] == ["lock", "checkpoint", "unlock"]
        assert_ran_once(c, "gpujob", mlp_ref, "a")


def test_a_gpu_job_goes_back_and_forth(tmp_path, gpus, mlp_ref):
    """a -> b -> a: the second move pairs b's GPU back to a's."""
    with _gpu_cluster(tmp_path, gpus) as c:
        _gpu_job_on_a(c, gpus)
        _migrate_ok(c, "gpujob", "b")
        c.wait_step("gpujob", max(c.steps("gpujob")) + 3)
        _migrate_ok(c, "gpujob", "a")
        restores = gpus.driver_calls(("restore",))
        assert [r.split("pairs=")[1] for r in restores] == [
            f"{GPU_A.uuid}>{GPU_B.uuid}",
            f"{GPU_B.uuid}>{GPU_A.uuid}",
        ]
        assert_ran_once(c, "gpujob", mlp_ref, "a")
        assert json.dumps(_gpu_lines(c, "gpujob")).count(GPU_B.uuid) == 1


def test_a_gpu_restore_refused_after_the_commit_is_tried_again_until_the_state_is_back(
    tmp_path, gpus, mlp_ref
):
    """b's driver refuses the restore for a while (OUT_OF_MEMORY: another process holds the GPU's
    memory). The job already runs on b and its source copy ends, so b's handoff asks the driver
    again, with a backoff, until the GPU state is back: the job then ends once, on b, exact."""
    gate = tmp_path / "gpu-busy"
    gate.touch()
    busy = {**gpus.node_env(GPU_B), "FAKE_CUDA_FAIL": "restore:2", "FAKE_CUDA_FAIL_WHILE": str(gate)}
    with Cluster(tmp_path / "c", agent_env={"a": gpus.node_env(GPU_A), "b": busy}) as c:
        _gpu_job_on_a(c, gpus)
        env = {**os.environ, "CRIUCTL_STATE_DIR": str(c.client_state)}
        p = subprocess.Popen(
            [*CRIUCTL, "migrate", "gpujob", "--to", "b"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            deadline = time.monotonic() + 120
            while len(gpus.driver_calls(("restore",))) < 3:
                assert p.poll() is None or p.returncode == 0, p.stderr.read()[-2000:]
                assert time.monotonic() < deadline, gpus.driver_calls()
                time.sleep(0.2)
            gate.unlink()  # the GPU's memory is free again
            _out, err = p.communicate(timeout=180)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 0, err[-3000:]
        assert gpus.driver_calls()[-2:][-1].startswith("unlock "), gpus.driver_calls()
        assert_ran_once(c, "gpujob", mlp_ref, "b")
        assert _gpu_lines(c, "gpujob")[-1] == f"gpu {GPU_B.uuid}"
