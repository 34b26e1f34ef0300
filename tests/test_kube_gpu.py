"""A GPU training pod moved by `criuctl migrate POD NODE` on the real Kubernetes, against the
stand-in driver and NVML (tests/standin_gpu.py).

The agents are the DaemonSet's, from the built image. For this module their pod template also
mounts the stand-in libraries from a host folder and names them (CRIUCTL_LIBCUDA, CRIUCTL_LIBNVML),
each node seeing its own GPU through FAKE_NODE (the Node's name, from the downward API); the
DaemonSet rolls out, and rolls back to its own template at the end. No device plugin runs here: the
nodes advertise nvidia.com/gpu as one would, and a pod's /dev/nvidia0 is a host device mounted
there, as the plugin would put the GPU's node in its /dev (the stand-in needs the name, not a GPU).
The job holds a stand-in CUDA context whose state lives in its memory and whose CUDA calls block
while the driver holds it: a move that forgot to give the device state back leaves it stuck, and
one that paired the GPUs wrongly is refused by the stand-in as by r580.
"""

from __future__ import annotations

import copy
import json
import time

import pytest
from localcluster import __main__ as lc
from localcluster.layout import REPO

from tests.conftest import needs_criu
from tests.kube import (
    PY,
    Kubectl,
    LogFollower,
    advertise,
    combined_steps,
    final,
    migrate_pod,
    steps,
    to_the_end,
    training_pod,
    wait_step,
)
from tests.standin_gpu import H200, Gpu, StandinGpus, compile_standins

pytestmark = [needs_criu, pytest.mark.timeout(900)]

GPU = "nvidia.com/gpu"
GPU_A = Gpu(H200, "GPU-aaaaaaaa-5555-6666-7777-00000000000a")
GPU_B = Gpu(H200, "GPU-bbbbbbbb-5555-6666-7777-00000000000b")
MLP = str(REPO / "tests" / "workloads" / "train_mlp.py")
STEPS = 300
AGENTS = ("-n", "criuctl-system")


def _roll_agents(lay, k: Kubectl, template: dict) -> None:
    """The agents' pod template replaced, and every node's agent of it ready."""
    patch = [{"op": "replace", "path": "/spec/template", "value": template}]
    k(*AGENTS, "patch", "daemonset", "criuctl-agent", "--type=json", "-p", json.dumps(patch))
    k(*AGENTS, "rollout", "status", "daemonset/criuctl-agent", "--timeout=300s")
    deadline = time.monotonic() + 120
    while not lc._agents_ready(lay):
        assert time.monotonic() < deadline, "the agents did not come back after the rollout"
        time.sleep(1)


@pytest.fixture(scope="module")
def gpu_cluster(local_cluster, tmp_path_factory):
    """The local cluster with GPU nodes: a's agent sees GPU_A, b's GPU_B, each advertised as one."""
    lay, k = local_cluster
    root = tmp_path_factory.mktemp("kube-gpu")
    gpus = StandinGpus(compile_standins(root), root / "gpus")
    gpus.contexts.mkdir(parents=True)
    original = k.get("daemonset", "criuctl-agent", "criuctl-system")["spec"]["template"]
    template = copy.deepcopy(original)
    spec = template["spec"]
    agent = spec["containers"][0]
    agent["env"] = [*agent.get("env", []), *gpus.daemonset_env({"a": (GPU_A,), "b": (GPU_B,)})]
    agent["volumeMounts"] = [*agent.get("volumeMounts", []), {"name": "standin-gpu", "mountPath": str(root)}]
    spec["volumes"] = [
        *spec.get("volumes", []),
        {"name": "standin-gpu", "hostPath": {"path": str(root), "type": "Directory"}},
    ]
    _roll_agents(lay, k, template)
    try:
        for node in ("a", "b"):
            advertise(k, node, GPU, 1)
        yield lay, k, gpus
    finally:
        for node in ("a", "b"):
            advertise(k, node, GPU, None)
        _roll_agents(lay, k, original)


def _gpu_pod(name: str, gpus: StandinGpus) -> dict:
    """A training pod on node a holding one GPU: the device plugin's share of its spec, by hand."""
    pod = training_pod(name, node="a", extra_spec={"restartPolicy": "OnFailure"})
    ctr = pod["spec"]["containers"][0]
    ctr["command"] = [PY, MLP]
    ctr["args"] = ["--steps", str(STEPS), "--step-time", "0.1"]
    ctr["env"] = [{"name": k, "value": v} for k, v in gpus.job_env(GPU_A).items()]
    ctr["resources"]["limits"] = {GPU: "1"}
    ctr["volumeMounts"] += [
        {"name": "standin-contexts", "mountPath": str(gpus.contexts)},
        {"name": "nvidia0", "mountPath": "/dev/nvidia0"},
    ]
    pod["spec"]["volumes"] += [
        {"name": "standin-contexts", "hostPath": {"path": str(gpus.contexts), "type": "Directory"}},
        {"name": "nvidia0", "hostPath": {"path": "/dev/null", "type": "CharDevice"}},
    ]
    return pod


def test_a_gpu_pod_moves_onto_the_target_nodes_gpu_and_the_job_never_stops(gpu_cluster, reference) -> None:
    """The source agent locks and checkpoints the container's CUDA process (found by its host PID
    through the pod), CRIU carries it into the placeholder pod on b (which asked the scheduler for a
    GPU as the pod did), b's agent restores the device state onto b's GPU (the a -> b UUID pair) and
    unlocks: the job's CUDA calls go on on b, and it ends once with an uninterrupted run's losses
    and weights."""
    lay, k, gpus = gpu_cluster
    ref = reference("train_mlp.py", "--steps", str(STEPS), "--step-time", "0")
    k.apply(_gpu_pod("gpu-train", gpus))
    moved = None
    try:
        k.wait_running("gpu-train")
        follow = [LogFollower(k, "gpu-train")]
        follow[0].start()
        wait_step(k, "gpu-train", 20)
        moved = migrate_pod(lay, k, "gpu-train", "b")
        placed = k.get("pod", moved)
        assert placed["spec"]["containers"][0]["resources"]["limits"][GPU] == "1"
        follow.append(LogFollower(k, moved))
        follow[-1].start()
        to_the_end(k, moved, follow)
        calls = gpus.driver_calls()
        assert [c.split()[0] for c in calls] == ["lock", "checkpoint", "restore", "unlock"], calls
        assert calls[2].endswith(f"pairs={GPU_A.uuid}>{GPU_B.uuid}"), calls
        before, after = steps(follow[0].text), steps(follow[1].text)
        assert before and after and min(after) > 0, "the move was not mid-training, or started it over"
        assert combined_steps([before, after]) == ref.steps
        assert final(follow[1].text) == [ref.final], "final weights differ from the uninterrupted run"
        gpu_lines = [x for f in follow for x in f.text.splitlines() if x.startswith("gpu ")]
        assert gpu_lines == [f"gpu {GPU_A.uuid}", f"gpu {GPU_B.uuid}"], gpu_lines
    finally:
        gone = ("--grace-period=1", "--wait=false", "--ignore-not-found")
        k("delete", "pod", "gpu-train", *([moved] if moved else []), *gone)
    for name in ("gpu-train", moved):
        if name:
            k.wait_gone("pod", name)
