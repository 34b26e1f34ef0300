"""Containers of a real runtime move between nodes: containerd 1.6 + runc on each node, pods made
over the CRI as a kubelet makes them, one criuctl agent per node.

The job is a training container (DataLoader workers, a heartbeat thread, a log file in its
writable layer, a progress file held open in an emptyDir) whose PID 1 is criuctl's init, delivered
by a read-only volume. On the target a placeholder container (same image, same volumes, criuctl's
init waiting) receives it. What a user checks, checked here: the losses and final weights are an
uninterrupted run's, the rest of the output is in the placeholder's CRI log, the job's files came
along, its processes are in the placeholder's cgroups, the placeholder exits with the job's status,
and at no moment did the job run on both nodes or on neither.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from criuctl.container import containers, mounts, runtime
from tests.conftest import needs_criu
from tests.jobs import CRIUCTL
from tests.requirements import missing, needs

pytestmark = [needs_criu, needs("containerd"), pytest.mark.slow]

if missing("containerd") is None:  # the CRI stubs exist only where make install made them
    from criuctl_cri import api_pb2 as pb

    from tests.containerd import INIT, JOB, PY, Containerd, Nodes, cri_final, cri_steps, job_argv, wait_until

STEPS = 160


def _job_argv(log: str, scratch: str = "/scratch") -> list[str]:
    return job_argv(STEPS, log, scratch)


class DoubleRunWatch:
    """Samples, all through a migration, on how many nodes the job's processes run (not stopped)."""

    def __init__(self, nodes: Nodes, source_cid: str) -> None:
        self.nodes, self.source_cid = nodes, source_cid
        self.bad: list[str] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _running(self) -> list[str]:
        import psutil

        out = []
        for node in self.nodes.cluster.nodes.values():
            for rec in node.records():
                if rec.get("state") != "running" or not (rec.get("container") or "").strip():
                    continue
                try:
                    st = psutil.Process(rec["root_pid"]).status()
                except psutil.Error:
                    continue
                if st not in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP, psutil.STATUS_ZOMBIE):
                    again = {r["name"]: r for r in node.records()}.get(rec["name"])
                    if again and again.get("state") == "running":
                        out.append(node.name)
        return out

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            where = self._running()
            if len(where) > 1:
                self.bad.append(f"running on {where} at {time.time():.3f}")

    def stop(self) -> list[str]:
        self._stop.set()
        self._t.join()
        return self.bad


@pytest.mark.parametrize("mode", ["stop-and-copy", "post-copy"])
def test_container_moves_into_a_placeholder(nodes: Nodes, reference, tmp_path, mode: str) -> None:
    ref = reference(JOB.name, "--steps", str(STEPS), "--workers", "2", "--log", "/dev/null")
    pod = f"trainer-{mode}"
    src_scratch, dst_scratch = nodes.empty_dir("a", f"{pod}-a"), nodes.empty_dir("b", f"{pod}-b")
    init = [PY, "-I", "/.criuctl/nsinit.py"]
    job = nodes.pod("a", pod, [*init, "--", *_job_argv("/workspace/train.log")], src_scratch)
    holder = nodes.pod("b", pod, [*init, "--placeholder"], dst_scratch)
    wait_until(lambda: "placeholder ready" in holder.log.read_text(errors="replace"), 30, "the placeholder")
    # what the successor loop finds a placeholder by (criuctl.kube.successors): its pod's UID, ready
    rts = [runtime.connect(nodes.runtimes[n].endpoint) for n in "ab"]
    listed = {r["container"]: r for rt in rts for r in containers.rows(rt)}
    assert listed[holder.container]["placeholder_ready"] is True, listed[holder.container]
    assert str(listed[holder.container]["pod_uid"]).startswith(f"uid-{pod}-"), listed[holder.container]
    assert listed[job.container]["placeholder_ready"] is False, "a job is no placeholder"
    upper = Path(_root_mount(nodes.runtimes["b"], holder.container).super_options["upperdir"])
    wait_until(lambda: len(cri_steps(job.log)) >= 40, 120, "40 steps on node a")

    watch = DoubleRunWatch(nodes, job.container)
    r = nodes.cluster.migrate(containers.name_of(job.container), "b", "--mode", mode)
    bad = watch.stop()
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["target"] == "b" and result["mode"] == mode
    assert not bad, f"the job ran on two nodes at once: {bad[:3]}"

    # The job runs in the placeholder: in its cgroups, its PID namespace its own.
    rec = next(
        r for r in nodes.cluster.nodes["b"].records() if r["state"] == "running" and r.get("container")
    )
    assert rec["container"] == holder.container
    cgroups = Path(f"/proc/{rec['root_pid']}/cgroup").read_text()
    assert f"memory:/k8s.io/{holder.container}" in cgroups, cgroups
    # It was frozen at a step boundary (its trainer held by the hook, in the container's own /run),
    # and node b let the restored copy go on, in the placeholder's /run.
    released = Path(containers.control_dir(rec["root_pid"])) / "released"
    assert len(list(released.iterdir())) == 1, "the restored trainer was not released at its boundary"
    b = nodes.runtimes["b"]
    code = b.wait_exited(holder.container, timeout=300)
    assert code == 0, holder.log.read_text()[-3000:]
    assert nodes.runtimes["a"].status(job.container).state == 2  # CONTAINER_EXITED: the source ended

    # Every step exactly once across the two CRI logs, and bit-identical to the uninterrupted run.
    before, after = cri_steps(job.log), cri_steps(holder.log)
    assert before and after and min(after) > 0, (sorted(before)[-3:], sorted(after)[:3])
    assert not set(before) & set(after) or all(before[s] == after[s] for s in set(before) & set(after))
    assert {**before, **after} == ref.steps
    assert cri_final(holder.log) == [ref.final]
    assert not cri_final(job.log)

    # The job's files came along: its log in the writable layer, its progress file in the emptyDir.
    assert [int(x) for x in (dst_scratch / "progress").read_text().split()] == list(range(STEPS))
    rootfs_log = (upper / "workspace" / "train.log").read_text()
    logged = [int(line.split()[1]) for line in rootfs_log.splitlines() if line.startswith("step ")]
    assert logged == list(range(STEPS)) and rootfs_log.rstrip().endswith("done")
    assert "the job was restored here and runs" in holder.log.read_text()


def _root_mount(rt: Containerd, cid: str) -> mounts.Mount:
    pid = json.loads(
        rt.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid, verbose=True)).info["info"]
    )
    return mounts.root_mount(mounts.of(pid["pid"]))


def test_local_dump_then_restore_into_a_placeholder(nodes: Nodes, reference, tmp_path) -> None:
    """The third way: `criuctl dump CONTAINER --bundle DIR` on one node, `criuctl restore DIR --into
    PLACEHOLDER` on another, by hand. Run from the host's network namespace, so the dump finds the
    pod's network outside CRIU's and leaves it external: the restore joins the placeholder's."""
    ref = reference(JOB.name, "--steps", str(STEPS), "--workers", "2", "--log", "/dev/null")
    pod = "trainer-by-hand"
    src_scratch, dst_scratch = nodes.empty_dir("a", f"{pod}-a"), nodes.empty_dir("b", f"{pod}-b")
    job = nodes.pod("a", pod, [*INIT, "--", *job_argv(STEPS, "/workspace/train.log")], src_scratch)
    holder = nodes.pod("b", pod, [*INIT, "--placeholder"], dst_scratch)
    wait_until(lambda: "placeholder ready" in holder.log.read_text(errors="replace"), 30, "the placeholder")
    wait_until(lambda: len(cri_steps(job.log)) >= 30, 120, "30 steps on node a")
    state = {**os.environ, "CRIUCTL_STATE_DIR": str(tmp_path / "state")}
    out = tmp_path / "bundle"
    a = {**state, "CRIUCTL_RUNTIME_ENDPOINT": nodes.runtimes["a"].endpoint}
    # the state pre-dump cannot reach a container's trainers: refused in one line, nothing written
    r = subprocess.run(
        [*CRIUCTL, "dump", "--state", job.container, "-b", str(out)], env=a, capture_output=True, text=True
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and len(lines) == 1 and "is a container" in lines[0], r.stderr
    assert "without --state" in lines[0] and not out.exists()
    went = max(cri_steps(job.log))
    wait_until(lambda: max(cri_steps(job.log)) >= went + 3, 60, "steps after the refusal")
    r = subprocess.run(
        [*CRIUCTL, "dump", job.container, "--bundle", str(out)], env=a, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    assert nodes.runtimes["a"].wait_exited(job.container, timeout=30) == 128 + 9  # committed: the tree ended
    b = {**state, "CRIUCTL_RUNTIME_ENDPOINT": nodes.runtimes["b"].endpoint}
    argv = [*CRIUCTL, "restore", str(out), "--into", holder.container[:12]]
    restore = subprocess.run(argv, env=b, capture_output=True, text=True, timeout=300)
    assert restore.returncode == 0, restore.stderr  # it stood by the job to its end: the job's status
    assert nodes.runtimes["b"].wait_exited(holder.container, timeout=30) == 0
    before, after = cri_steps(job.log), cri_steps(holder.log)
    assert {**before, **after} == ref.steps and min(after) > 0
    assert cri_final(holder.log) == [ref.final]
