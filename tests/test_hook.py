"""The in-process hook on real jobs: step boundaries, the state pre-dump, the `migrator` API.

CPU only (no GPU here): the boundary's CUDA synchronisation is a no-op on CPU, everything else is
the same code a GPU job runs. tests/gpu/check.sh runs the GPU side on a GPU host.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from criuctl.core import workloads
from criuctl.local import stepboundary
from criuctl_hook import contract
from tests.conftest import needs_criu
from tests.jobs import CRIUCTL, WORKLOADS, Job, Reference, assert_continues_exactly, criuctl

pytestmark = [needs_criu, pytest.mark.slow]


NAP = "import time; print('up', flush=True); time.sleep(60)"  # a job that never trains


def test_a_dump_during_a_long_step_lands_after_it(tmp_path):
    """The request comes 1 s into a 4 s step: the dump waits for the step's end, says so, and the
    restored job finishes that step's bookkeeping and continues bit-identically."""
    args = ("--steps", "6", "--step-time", "0")
    ref = Reference("ref", "train_long_step.py", *args)
    job = Job.run("long", "train_long_step.py", "--steps", "6", "--step-time", "4")
    job.wait_for(r"^step 2 started")
    time.sleep(1)
    started = time.monotonic()
    r = criuctl("dump", "long", "--bundle", str(tmp_path / "b"))
    waited = time.monotonic() - started
    assert r.returncode == 0, r.stderr
    assert job.wait() == 0
    assert waited > 2, f"the dump did not wait for the step to end ({waited:.1f} s)"
    assert not any(line.startswith("step 2 loss") for line in job.out), "step 2 ended before the dump?"
    shown = criuctl("inspect", str(tmp_path / "b")).stdout
    assert re.search(r"step boundary: yes, after optimizer step 3 \(1 trainer", shown), shown
    restored = Job.restore(tmp_path / "b")
    assert restored.wait() == 0, restored.err
    assert_continues_exactly(ref, job.steps, restored)


def test_a_job_without_optimizer_steps_is_dumped_at_once(tmp_path):
    sleeper = Job([*CRIUCTL, "run", "--name", "nap", "--", sys.executable, "-c", NAP])
    sleeper.wait_for(r"^up")
    r = criuctl("dump", "nap", "--bundle", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    shown = criuctl("inspect", str(tmp_path / "b")).stdout
    assert "step boundary: none (no process of it has run an optimizer step" in shown, shown
    sleeper.wait()


def _open_files(pid: int) -> set[str]:
    """What `pid` holds open now, by readlink: cheap enough to sample thousands of times a second
    (psutil's open_files also reads each fd's fdinfo). A descriptor closed meanwhile is skipped."""
    seen = set()
    with contextlib.suppress(OSError):
        for n in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                seen.add(os.readlink(f"/proc/{pid}/fd/{n}"))
    return seen


def test_a_held_trainer_holds_no_descriptor_on_the_request(tmp_path):
    """CRIU reopens by path every file a frozen process holds: a trainer frozen while reading the
    request would fail its restore wherever the request is gone (another host; here after the
    release). Once held (where criuctl freezes it), the trainer must only stat the request.
    Sampled for 3 s: a poll that opened the file every 5 ms was caught in about one sample in 400."""
    job = Job.run("held", "train_mlp.py", "--steps", "400", "--step-time", "0.02")
    job.wait_for(r"^step 5 ")
    w = workloads.load("held")
    assert w is not None and w.control
    request = os.path.join(w.control, contract.REQUEST)
    reached = stepboundary.reach(w)
    try:
        assert reached.complete, reached.why
        trainers = [p.pid for p in psutil.Process(w.root_pid).children(recursive=True)] + [w.root_pid]
        samples = caught = 0
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            samples += 1
            caught += sum(request in _open_files(pid) for pid in trainers)
        assert samples > 100, samples
        assert caught == 0, f"the held trainer had the request open in {caught} of {samples} samples"
    except AssertionError:
        job.kill()
        raise
    finally:
        stepboundary.let_go(w, reached)
    assert job.wait() == 0, job.err[-2000:]


def _state_file(bundle) -> dict:
    return torch.load(bundle / "state" / "state-0.pt", weights_only=True)


def test_state_predump_of_a_plain_script_carries_model_optimizer_scheduler(tmp_path):
    """No code change: the hook finds the CNN, Adam and the cosine schedule by itself, saves them at
    a step boundary (DataLoader workers and a logging thread running), the job ends; restore starts
    it again and the hook loads them at its first training forward: Adam's step count and the LR
    go on from the saved step instead of starting over."""
    log = tmp_path / "train.log"
    args = ("--steps", "60", "--workers", "2", "--log", str(log), "--show-state")
    job = Job.run("cnn", "train_cnn_loader.py", *args)
    job.wait_for_step(12)
    r = criuctl("dump", "cnn", "--state", "--bundle", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    assert job.wait() == 0
    saved = _state_file(tmp_path / "b")
    step = saved["step"]
    kinds = sorted(k.split(":")[0] for k in saved["objects"])
    assert kinds == ["module", "optimizer", "scheduler"], kinds
    shown = criuctl("inspect", str(tmp_path / "b")).stdout
    assert f"state bundle (CUDA-aware pre-dump): taken at a step boundary, step {step}" in shown, shown
    last_lr = [line for line in job.out if line.startswith("state adam")][-1]
    assert last_lr.startswith(f"state adam {step} "), (last_lr, step)

    restored = Job.restore(tmp_path / "b")
    assert restored.wait() == 0, restored.err
    assert any(f"resumed 3 objects at step {step}" in line for line in restored.err), restored.err
    first = next(line for line in restored.out if line.startswith("state adam"))
    assert first.startswith(f"state adam {step + 1} "), first  # a fresh Adam would say 1
    fresh = Job.run(
        "fresh", "train_cnn_loader.py", "--steps", "1", "--workers", "0", "--log", str(log), "--show-state"
    )
    assert fresh.wait() == 0
    assert next(line for line in fresh.out if line.startswith("state adam")).startswith("state adam 1 ")


def test_state_predump_of_a_migrator_script_is_exact(tmp_path, monkeypatch):
    """A script written for the migrator API, moved by `criuctl dump --state`: its final weights are
    those of an uninterrupted run (its registered position says where to go on)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(WORKLOADS), os.environ.get("PYTHONPATH", "")]))
    args = ("--epochs", "6", "--style", "step")
    ref = Reference("ref", "train_migrator.py", *args, "--step-time", "0")
    (tmp_path / "ckpts").mkdir(exist_ok=True)
    for f in (tmp_path / "ckpts").iterdir():
        f.unlink()
    job = Job.run("mig", "train_migrator.py", *args, "--step-time", "0.03")
    job.wait_for_step(40)
    r = criuctl("dump", "mig", "--state", "--bundle", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    assert job.wait() == 0
    restored = Job.restore(tmp_path / "b")
    assert restored.wait() == 0, restored.err
    assert any(line.startswith("load migration ckpt") for line in restored.out), restored.out[:3]
    assert_continues_exactly(ref, job.steps, restored)


def test_state_predump_refused_for_a_job_that_does_not_train(tmp_path):
    sleeper = Job([*CRIUCTL, "run", "--name", "nap", "--", sys.executable, "-c", NAP])
    sleeper.wait_for(r"^up")
    r = criuctl("dump", "nap", "--state", "--bundle", str(tmp_path / "b"))
    assert r.returncode != 0
    assert "its state could not be saved at a step boundary" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "b").exists()
    assert criuctl("ps").stdout.count("nap") == 1  # still running, once
    sleeper.kill()


# -- the migrator API on its own, as pytorchjob-migration's README uses it -------------------------


def _migrator_job(tmp_path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(WORKLOADS)}
    env.pop("CRIUCTL_WORKLOAD", None)
    return subprocess.Popen(
        [sys.executable, str(WORKLOADS / "train_migrator.py"), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_step(job: subprocess.Popen, n: int) -> None:
    for line in job.stdout:
        if line.startswith(f"step {n} "):
            return
    raise AssertionError(f"the job ended before step {n}: {job.stderr.read()[-2000:]}")


def _steps(text: str) -> dict[int, str]:
    return {int(m[1]): m[2] for m in re.finditer(r"^step (\d+) loss (\S+)$", text, re.M)}


@pytest.mark.parametrize("style", ["epoch", "step"])
def test_migrator_prestop_kill_resume_is_exact(tmp_path, style):
    """The pod's life: training; the preStop (`criuctl prestop`) asks for a save and returns once
    saved; the pod is killed (SIGKILL); the recreated pod sees `resume`, loads, and finishes with the
    weights of an uninterrupted run. No root, no criuctl run: only the changed import."""
    (tmp_path / "ref").mkdir()
    ref = _migrator_job(tmp_path / "ref", "--style", style, "--step-time", "0", "--epochs", "10")
    ref_out, ref_err = ref.communicate(timeout=300)
    assert ref.returncode == 0, ref_err
    job = _migrator_job(tmp_path, "--style", style, "--step-time", "0.03", "--epochs", "10")
    _wait_for_step(job, 30)
    signal_file = tmp_path / "ckpts" / "signal"
    stop = subprocess.run(
        [*CRIUCTL, "prestop", "--signal", str(signal_file), "--timeout", "60"], capture_output=True, text=True
    )
    assert stop.returncode == 0, stop.stderr
    assert signal_file.read_text() == "resume"
    job.send_signal(signal.SIGKILL)
    job.communicate()
    again = _migrator_job(tmp_path, "--style", style, "--step-time", "0", "--epochs", "10")
    out, err = again.communicate(timeout=300)
    assert again.returncode == 0, err
    assert "load migration ckpt from epoch" in out
    assert signal_file.read_text() == "init"
    resumed = _steps(out)
    assert resumed and min(resumed) > 0
    for i, loss in resumed.items():
        assert loss == _steps(ref_out)[i], f"step {i}: {loss} != {_steps(ref_out)[i]}"
    assert out.strip().splitlines()[-1] == ref_out.strip().splitlines()[-1]  # final weights


def test_migrator_refuses_an_altered_checkpoint(tmp_path):
    job = _migrator_job(tmp_path, "--style", "step", "--step-time", "0.03", "--epochs", "10")
    _wait_for_step(job, 5)
    signal_file = tmp_path / "ckpts" / "signal"
    stop = subprocess.run([*CRIUCTL, "prestop", "--signal", str(signal_file)], capture_output=True, text=True)
    assert stop.returncode == 0, stop.stderr
    job.kill()
    job.communicate()
    ckpt = tmp_path / "ckpts" / "migration.pth"
    data = bytearray(ckpt.read_bytes())
    data[len(data) // 2] ^= 0xFF
    ckpt.write_bytes(bytes(data))
    again = _migrator_job(tmp_path, "--style", "step")
    _, err = again.communicate(timeout=120)
    assert again.returncode != 0
    assert "migration.pth is missing or was altered since it was saved" in err, err


def test_prestop_without_a_job_gives_up_in_one_line(tmp_path):
    (tmp_path / "ckpts").mkdir()
    r = subprocess.run(
        [*CRIUCTL, "prestop", "--signal", str(tmp_path / "ckpts" / "signal"), "--timeout", "1"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1
    assert "did not save within 1 s" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run(
        [*CRIUCTL, "prestop", "--signal", str(tmp_path / "nowhere" / "signal")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "is not mounted here" in r.stderr


def test_prestop_never_overwrites_a_file_that_is_not_a_signal(tmp_path):
    precious = tmp_path / "passwd"
    precious.write_text("root:x:0:0:root:/root:/bin/bash\n")
    r = subprocess.run([*CRIUCTL, "prestop", "--signal", str(precious)], capture_output=True, text=True)
    assert r.returncode == 2 and "is not a migration signal file" in r.stderr, r.stderr
    assert precious.read_text().startswith("root:x:0:0")
    r = subprocess.run([*CRIUCTL, "prestop", "--signal", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_an_altered_state_bundle_is_refused_and_nothing_starts(tmp_path):
    log = tmp_path / "train.log"
    job = Job.run("cnn", "train_cnn_loader.py", "--steps", "400", "--workers", "0", "--log", str(log))
    job.wait_for_step(5)
    r = criuctl("dump", "cnn", "--state", "--bundle", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    assert job.wait() == 0
    state = tmp_path / "b" / "state" / "state-0.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01
    state.write_bytes(bytes(data))
    r = criuctl("restore", str(tmp_path / "b"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "state/state-0.pt" in r.stderr, r.stderr
    assert "cnn" not in criuctl("ps").stdout


# A training job that removes criuctl's control directory at its 5th step, then trains on.
_REMOVES_ITS_CONTROL = """
import os, shutil, sys, time, torch
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(400):
    x = torch.randn(16, 8)
    loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 5:
        shutil.rmtree(os.environ["CRIUCTL_CONTROL_DIR"])
    print(f"step {step} loss {loss.item().hex()}", flush=True)
    time.sleep(0.05)
"""


def test_a_job_that_removes_its_control_directory_is_dumped_without_a_boundary(tmp_path):
    """The hook does not stop the job when its control directory goes; the dump cannot ask the
    trainers, so it freezes where the job stands (CRIU's image is exact regardless), says why, and
    the restored job goes on where it was."""
    job = Job([*CRIUCTL, "run", "--name", "nodir", "--", sys.executable, "-c", _REMOVES_ITS_CONTROL])
    job.wait_for(r"^step 10 ")
    r = criuctl("dump", "nodir", "--bundle", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr
    job.wait()
    shown = criuctl("inspect", str(tmp_path / "b")).stdout
    assert "step boundary: none (its control directory is gone" in shown, shown
    restored = Job.restore(tmp_path / "b")
    assert restored.wait() == 0, restored.err
    before, after = job.steps, restored.steps
    assert after and min(after) == max(before) + 1 and max(after) == 399, (max(before), sorted(after)[:3])
