"""Freeze real training jobs mid-training with real CRIU and check they continue bit-identically."""

from __future__ import annotations

import pytest

from tests.conftest import needs_criu
from tests.jobs import Job, Reference, assert_continues_exactly, criuctl

pytestmark = [needs_criu, pytest.mark.slow]


def _freeze(job: Job, name: str, at_step: int, out, *flags: str) -> None:
    job.wait_for_step(at_step)
    r = criuctl("dump", name, "--bundle", str(out), *flags)
    assert r.returncode == 0, r.stderr


def test_training_loop_continues_bit_identically(tmp_path):
    args = ("--steps", "60")
    ref = Reference("ref", "train_mlp.py", *args)
    job = Job.run("mlp", "train_mlp.py", *args)
    _freeze(job, "mlp", 10, tmp_path / "b")
    assert job.wait() == 0
    assert any("checkpointed" in line for line in job.err), job.err
    restored = Job.restore(tmp_path / "b")
    assert restored.wait() == 0, restored.err
    assert_continues_exactly(ref, job.steps, restored)


def test_loader_workers_thread_and_appended_log(tmp_path):
    # 30 steps of ~0.03 s left too little room: on a slow VM the job reached its end while the
    # dump was starting (CI: "ended while it was being frozen")
    steps = 120
    log = tmp_path / "train.log"
    ref = Reference("ref", "train_cnn_loader.py", "--steps", str(steps), "--log", str(tmp_path / "ref.log"))
    job = Job.run("cnn", "train_cnn_loader.py", "--steps", str(steps), "--log", str(log))
    _freeze(job, "cnn", 8, tmp_path / "b")
    assert job.wait() == 0
    restored = Job.restore(tmp_path / "b")
    assert restored.wait() == 0, restored.err
    assert_continues_exactly(ref, job.steps, restored)
    # The log file kept being appended to by the restored job, in order, with nothing lost.
    lines = log.read_text().splitlines()
    logged_steps = [int(x.split()[1]) for x in lines if x.startswith("step ")]
    assert logged_steps == list(range(steps)), logged_steps
    assert lines[-1] == "done"
    assert any(x.startswith("heartbeat") for x in lines), "the background thread stopped writing"


def test_ddp_gloo_job_with_tcp_connections(tmp_path):
    ref = Reference("ref", "train_ddp.py", "--steps", "60")
    job = Job.run("ddp", "train_ddp.py", "--steps", "60")
    _freeze(job, "ddp", 10, tmp_path / "b")
    assert job.wait() == 0
    manifest = criuctl("inspect", str(tmp_path / "b"), "--output", "json")
    assert "socket:[" in manifest.stdout  # the ranks' TCP connections were part of the checkpoint
    restored = Job.restore(tmp_path / "b")
    assert restored.wait() == 0, restored.err
    assert_continues_exactly(ref, job.steps, restored)


def test_leave_running_snapshot_restored_while_original_runs(tmp_path):
    # 10 s of steps: the original still runs when its copy has made its first step, on a slow VM
    # too (40 steps did not: the dump itself took past step 30, CI)
    args = ("--steps", "200")
    ref = Reference("ref", "train_mlp.py", *args)
    job = Job.run("mlp", "train_mlp.py", *args)
    _freeze(job, "mlp", 8, tmp_path / "b", "--leave-running")
    snapshot_steps = dict(job.steps)
    restored = Job.restore(tmp_path / "b", "--name", "copy")
    restored.wait_for(r"^step \d+ loss ")
    assert job.proc.poll() is None, "the original stopped although --leave-running was given"
    assert job.wait() == 0 and restored.wait() == 0, restored.err
    assert job.steps == ref.steps and job.final == ref.final, "the original was disturbed by the snapshot"
    assert_continues_exactly(ref, snapshot_steps, restored)


def test_one_bundle_restored_twice(tmp_path):
    args = ("--steps", "50")
    ref = Reference("ref", "train_mlp.py", *args)
    job = Job.run("mlp", "train_mlp.py", *args)
    _freeze(job, "mlp", 6, tmp_path / "b")
    assert job.wait() == 0
    first, second = Job.restore(tmp_path / "b"), Job.restore(tmp_path / "b")  # at the same time
    assert first.wait() == 0 and second.wait() == 0, (first.err, second.err)
    assert_continues_exactly(ref, job.steps, first)
    assert_continues_exactly(ref, job.steps, second)


def test_stdout_and_stderr_forwarding_survive_restore(tmp_path):
    job = Job.run("mlp", "train_mlp.py", "--steps", "60", "--step-time", "0.1", "--exit-code", "3")
    _freeze(job, "mlp", 5, tmp_path / "b")
    assert job.wait() == 0  # the run command ends cleanly: its workload moved into the bundle
    assert max(job.steps) < 50, "frozen too late to tell where the last heartbeat came from"
    restored = Job.restore(tmp_path / "b")
    assert restored.wait() == 3  # ...and restore exits with the workload's own status
    assert any(line.startswith("step 59 ") for line in restored.out)
    assert "stderr heartbeat 50" in restored.err
    assert any("restored 'mlp'" in line for line in restored.err)
