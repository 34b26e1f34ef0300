"""Thaw keeps the job whole: every local path that lets a dumped tree run on keeps its TCP connections.

Two jobs whose connections CRIU locks: DDP on gloo (TCP between the ranks, both ends in the tree)
and a trainer that reports every step to a server outside its tree and waits for the ack. Each goes
through every local thaw path — `dump --leave-running`, a dump that fails after CRIU dumped, a
second dump refused while the first runs — and must finish with the uninterrupted run's losses and
weights, over the connection it started with, leaving no `CRIU-*` nftables table behind.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from criuctl import netlock
from tests.conftest import needs_criu
from tests.jobs import CRIUCTL, WORKLOADS, Job, criuctl
from tests.test_errors import assert_error_line

pytestmark = [needs_criu, pytest.mark.slow]
STEPS = "30"


class AckServer:
    """tests/workloads/ack_server.py, outside any tree: the peer the job must keep talking to."""

    def __init__(self) -> None:
        self.job = Job([sys.executable, str(WORKLOADS / "ack_server.py")])
        self.port = int(self.job.wait_for(r"^listening \d+$").split()[1])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def assert_one_connection_carried(self, steps: dict[int, str]) -> None:
        assert self.job.wait(60) == 0, self.job.out[-5:]
        conns = [line for line in self.job.out if line.startswith("conn ")]
        assert conns == ["conn 1"], f"the job had to reconnect: {conns}"
        got = [line.removeprefix("got ") for line in self.job.out if line.startswith("got step ")]
        assert got == [f"step {i} loss {loss}" for i, loss in sorted(steps.items())], got[:5]

    def kill(self) -> None:
        self.job.kill()


@pytest.fixture(params=["ddp", "tcp"])
def kind(request) -> str:
    return request.param


@pytest.fixture
def job(kind, reference):
    """(the running job, its name, the uninterrupted reference, the ack server or None)."""
    server = AckServer() if kind == "tcp" else None
    if kind == "ddp":
        script, args = "train_ddp.py", ("--steps", STEPS)
    else:
        script, args = "train_tcp_client.py", ("--steps", STEPS)
    ref = reference(script, *args)  # the server does not change the losses: the reference needs none
    if server is not None:
        args = (*args, "--server", server.address)
    j = Job.run(kind, script, *args)
    try:
        j.wait_for_step(5)
        yield j, kind, ref, server
    finally:
        j.kill()
        if server is not None:
            server.kill()
        assert criu_tables() == [], "a CRIU network lock table outlived its dump"


def criu_tables() -> list[str]:
    return netlock.tables()


def assert_finishes_like_reference(job: Job, ref, server: AckServer | None) -> None:
    assert job.wait() == 0, job.err[-10:]
    assert not any("checkpointed" in line for line in job.err), job.err[-3:]
    assert job.steps == ref.steps and job.final == ref.final, "the job was disturbed"
    if server is not None:
        server.assert_one_connection_carried(job.steps)


def test_leave_running_keeps_connections(job, tmp_path):
    j, name, ref, server = job
    r = criuctl("dump", name, "-o", str(tmp_path / "b"), "--leave-running")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "b" / "manifest.json").is_file()
    assert criu_tables() == [], "the leave-running dump left its network lock in place"
    assert_finishes_like_reference(j, ref, server)


def test_dump_failing_after_criu_keeps_connections(job, tmp_path):
    """The bundle cannot be moved into place (its -o folder filled up meanwhile): CRIU had dumped."""
    j, name, ref, server = job
    out = tmp_path / "b"
    dump = subprocess.Popen(
        [*CRIUCTL, "dump", name, "-o", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_staging(tmp_path, dump, name)
    out.mkdir()
    (out / "in-the-way").write_text("x")
    _, err = dump.communicate(timeout=180)
    r = subprocess.CompletedProcess(dump.args, dump.returncode, "", err)
    assert_error_line(r, "cannot move the bundle", "keeps running")
    assert not list(tmp_path.glob(f".{name}.partial-*")), "the staging folder was left behind"
    assert_finishes_like_reference(j, ref, server)


def test_dump_failing_in_criu_keeps_connections(job, tmp_path):
    """Disk full while CRIU writes: CRIU gives up and unlocks itself; we thaw."""
    j, name, ref, server = job
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(small)], check=True)
    try:
        r = criuctl("dump", name, "-o", str(small / "b"))
        assert_error_line(r, "disk full", "keeps running")
        assert list(small.iterdir()) == [], "a partial bundle was left on the full disk"
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
    assert_finishes_like_reference(j, ref, server)


def test_second_dump_is_refused_at_once(job, tmp_path):
    j, name, ref, server = job
    first = subprocess.Popen(
        [*CRIUCTL, "dump", name, "-o", str(tmp_path / "first"), "--leave-running"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_staging(tmp_path, first, name)
    started = time.monotonic()
    second = criuctl("dump", name, "-o", str(tmp_path / "second"), timeout=30)
    took = time.monotonic() - started
    line = assert_error_line(second, "already being checkpointed", "criuctl dump", "keeps running")
    assert second.returncode == 75, line
    assert took < 10, f"the second dump took {took:.1f} s to be refused"
    assert not (tmp_path / "second").exists()
    assert len(list(tmp_path.glob(f".{name}.partial-*"))) <= 1, "the refused dump made a staging folder"
    _, err = first.communicate(timeout=180)
    assert first.returncode == 0, err
    assert not list(tmp_path.glob(f".{name}.partial-*")), "a staging folder was left behind"
    assert (tmp_path / "first" / "manifest.json").is_file()
    assert_finishes_like_reference(j, ref, server)


def _wait_for_staging(parent: Path, dump: subprocess.Popen, name: str) -> None:
    """Until the dump has created its staging folder: it holds the workload's lock, CRIU starts."""
    deadline = time.monotonic() + 60
    while not list(parent.glob(f".{name}.partial-*")):
        assert dump.poll() is None, f"the dump ended before freezing: {dump.communicate()}"
        assert time.monotonic() < deadline, "the dump never started freezing"
        time.sleep(0.01)
