"""Drive real training jobs through the real `criuctl` CLI and read what they report."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

WORKLOADS = Path(__file__).parent / "workloads"
CRIUCTL = [sys.executable, "-m", "criuctl.cli.main"]
_STEP = re.compile(r"^step (\d+) loss (\S+)$")
_FINAL = re.compile(r"^final ([0-9a-f]{64})$")


def criuctl(*args: str, timeout: float = 180, **kw) -> subprocess.CompletedProcess:
    """Run one criuctl verb to completion."""
    return subprocess.run([*CRIUCTL, *args], capture_output=True, text=True, timeout=timeout, **kw)


def workload_cmd(script: str, *args: str) -> list[str]:
    return [sys.executable, str(WORKLOADS / script), *args]


# each workload's flag that only sleeps (input latency, a slow step): nothing a loss or a weight
# depends on. A reference run, which only reports them, runs with it at 0
_SLOW_STEP = ("train_ddp.py", "train_ddp_nodes.py", "train_gpu.py", "train_migrator.py", "train_mlp.py")
_DELAY = {"train_cnn_loader.py": "--read-latency"} | {
    s: "--step-time" for s in (*_SLOW_STEP, "train_long_step.py", "train_tcp_client.py")
}


def undelayed(script: str, *args: str) -> tuple[str, ...]:
    """`args` with the script's sleep (`_DELAY`) at 0: for a reference run, whose losses and final
    weights are the same at any pace (the jobs it is compared with keep theirs)."""
    flag = _DELAY.get(Path(script).name)
    if flag is None:
        return args
    out = list(args)
    for i, a in enumerate(out[:-1]):
        if a == flag:
            out[i + 1] = "0"
            return tuple(out)
    return (*out, flag, "0")


class Job:
    """A foreground criuctl process (`run` or `restore`) whose output is collected as it comes."""

    def __init__(self, argv: list[str], **kw) -> None:
        self.argv = argv
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
        self.out: list[str] = []
        self.err: list[str] = []
        self._cv = threading.Condition()
        self._readers = [
            threading.Thread(target=self._read, args=(s, buf), daemon=True)
            for s, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))
        ]
        for t in self._readers:
            t.start()

    @classmethod
    def run(cls, name: str, script: str, *args: str, run_flags: tuple[str, ...] = ()) -> Job:
        return cls([*CRIUCTL, "run", "--name", name, *run_flags, "--", *workload_cmd(script, *args)])

    @classmethod
    def restore(cls, bundle: Path, *flags: str) -> Job:
        return cls([*CRIUCTL, "restore", str(bundle), *flags])

    def _read(self, stream, buf: list[str]) -> None:
        for line in stream:
            with self._cv:
                buf.append(line.rstrip("\n"))
                self._cv.notify_all()

    def wait_for(self, pattern: str, timeout: float = 120, stream: str = "out") -> str:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                lines = self.out if stream == "out" else self.err
                for line in lines:
                    if rx.search(line):
                        return line
                left = deadline - time.monotonic()
                if left <= 0 or (
                    self.proc.poll() is not None and not any(t.is_alive() for t in self._readers)
                ):
                    raise AssertionError(
                        f"no line matching {pattern!r} within {timeout}s;\n"
                        f"stdout: {self.out[-10:]}\nstderr: {self.err[-10:]}"
                    )
                self._cv.wait(min(left, 0.5))

    def wait_for_step(self, n: int, timeout: float = 120) -> None:
        self.wait_for(rf"^step {n} loss ", timeout)

    def wait(self, timeout: float = 180) -> int:
        rc = self.proc.wait(timeout)
        for t in self._readers:
            t.join(timeout=10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    @property
    def steps(self) -> dict[int, str]:
        return {int(m[1]): m[2] for line in self.out if (m := _STEP.match(line))}

    @property
    def final(self) -> str | None:
        return next((m[1] for line in self.out if (m := _FINAL.match(line))), None)


class Reference:
    """The losses and final weights of an uninterrupted run, under the same supervisor."""

    def __init__(self, name: str, script: str, *args: str) -> None:
        job = Job.run(name, script, *undelayed(script, *args))
        assert job.wait() == 0, job.err[-10:]
        self.steps, self.final = job.steps, job.final
        assert self.steps and self.final, "reference run reported nothing"


class Ref:
    """Losses and final weights of an uninterrupted run of the same job (its own state dir)."""

    def __init__(self, root: Path, script: str, *args: str) -> None:
        job = Job(
            [
                *CRIUCTL,
                "run",
                "--state-dir",
                str(root),
                "--name",
                "ref",
                "--",
                *workload_cmd(script, *undelayed(script, *args)),
            ]
        )
        assert job.wait(600) == 0, job.err[-10:]
        self.steps, self.final = job.steps, job.final
        assert self.steps and self.final, "reference run reported nothing"


def reference_and_job(tmp: Path, script: str, *args: str, at_step: int = 10) -> tuple[Reference, Job, Path]:
    """An uninterrupted run of `script` (its log in `tmp`), and the same job started as workload
    "cnn" and past step `at_step`, with the log file it holds open."""
    ref = Reference("ref", script, *args, "--log", str(tmp / "ref.log"))
    log = tmp / "train.log"
    job = Job.run("cnn", script, *args, "--log", str(log))
    job.wait_for_step(at_step)
    return ref, job, log


def assert_continues_exactly(ref: Reference, before_steps: dict[int, str], after: Job) -> None:
    """A job reported `before_steps`, was frozen, and `after` restored from it: together they are `ref`."""
    assert after.steps, "the restored job reported no step: the freeze came after training ended"
    assert before_steps, "the job was frozen before its first step: the test did not freeze mid-training"
    assert min(after.steps) > 0, "the restored job started over instead of continuing"
    combined = {**before_steps, **after.steps}
    for step, loss in after.steps.items():
        assert before_steps.get(step, loss) == loss, f"step {step} reported twice with different losses"
    assert combined == ref.steps, _diff(combined, ref.steps)
    assert after.final == ref.final, "final weights differ from the uninterrupted run"


def _diff(got: dict[int, str], want: dict[int, str]) -> str:
    missing = sorted(set(want) - set(got))
    wrong = [s for s in sorted(set(want) & set(got)) if want[s] != got[s]]
    return f"missing steps {missing[:10]}, differing steps {wrong[:10]}"


def env_without(var: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(var, None)
    return env


def tree_state(pid: int) -> str:
    """Each process of `pid`'s tree and each of its threads: state, kernel wait, signal masks.

    For a test whose process did not end when it should have: what it and its tree wait on, so that
    a hang seen once in CI says why instead of only that it timed out.
    """
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return f"PID {pid} is gone"
    fields = ("State", "SigQ", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt", "NSpid")
    lines = []
    for p in procs:
        try:
            lines.append(f"{p.pid} {' '.join(p.cmdline()[:6])}")
            for tid in sorted(os.listdir(f"/proc/{p.pid}/task"), key=int):
                t = Path(f"/proc/{p.pid}/task/{tid}")
                status = dict(
                    line.split(":\t", 1) for line in (t / "status").read_text().splitlines() if ":\t" in line
                )
                stack = (t / "stack").read_text().split("\n")[:4] if (t / "stack").exists() else []
                calls = "|".join(s.split()[-1] for s in stack if s)
                lines.append(
                    f"  task {tid}: "
                    + " ".join(f"{k}={status.get(k, '?').strip()}" for k in fields)
                    + f" wchan={(t / 'wchan').read_text()} stack={calls}"
                )
        except (psutil.NoSuchProcess, FileNotFoundError, ProcessLookupError, PermissionError) as exc:
            lines.append(f"{p.pid}: {exc}")
    return "\n".join(lines)
