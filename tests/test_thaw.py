"""Thaw keeps the job whole: every local path that lets a dumped tree run on keeps its TCP connections.

Two jobs whose connections CRIU locks: DDP on gloo (TCP between the ranks, both ends in the tree)
and a trainer that reports every step to a server outside its tree and waits for the ack. Each goes
through every local thaw path — `dump --leave-running`, a dump that fails after CRIU dumped, a
second dump refused while the first runs — and must finish with the uninterrupted run's losses and
weights, over the connection it started with, leaving no `CRIU-*` nftables table behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from criuctl.core import workloads
from criuctl.core.env import FAULT_DIR
from criuctl.core.faults import Fault
from criuctl.net import netlock
from tests.conftest import needs_criu
from tests.jobs import CRIUCTL, WORKLOADS, Job, criuctl, tree_state
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
    before = set(criu_tables())  # another test's frozen job may hold one: only ours count
    j = Job.run(kind, script, *args)
    try:
        j.wait_for_step(5)
        yield j, kind, ref, server
    finally:
        j.kill()
        if server is not None:
            server.kill()
        assert set(criu_tables()) <= before, "a CRIU network lock table outlived its dump"


def criu_tables() -> list[str]:
    return netlock.tables()


def _tables_of(bundle_dir: Path) -> list[str]:
    table = netlock.table_for_images(bundle_dir / "images")
    assert table, "no CRIU run id in the bundle's inventory"
    return [table]


def assert_finishes_like_reference(job: Job, ref, server: AckServer | None) -> None:
    assert job.wait() == 0, job.err[-10:]
    assert not any("checkpointed" in line for line in job.err), job.err[-3:]
    assert job.steps == ref.steps and job.final == ref.final, "the job was disturbed"
    if server is not None:
        server.assert_one_connection_carried(job.steps)


def test_leave_running_keeps_connections(job, tmp_path):
    j, name, ref, server = job
    r = criuctl("dump", name, "--bundle", str(tmp_path / "b"), "--leave-running")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "b" / "manifest.json").is_file()
    assert not any(t in criu_tables() for t in _tables_of(tmp_path / "b")), "its network lock is still there"
    assert_finishes_like_reference(j, ref, server)


def test_leave_running_whose_lock_cannot_be_lifted_runs_and_says_so_until_thawed(job, tmp_path):
    """The kernel refuses to delete CRIU's lock table (a fault switched on for the test). Before: the
    thaw stopped at that step, the tree never got its SIGCONT, and the job hung frozen. Now it runs
    (its connections blocked), the dump exits 1 saying so, `ps` shows it, and `criuctl thaw` lifts
    the lock once the kernel lets go: the job then finishes as if never touched."""
    j, name, ref, server = job
    faults = tmp_path / "faults"
    faults.mkdir()
    (faults / Fault.NETLOCK_LIFT).touch()
    env = {**os.environ, FAULT_DIR: str(faults)}
    r = criuctl("dump", name, "--bundle", str(tmp_path / "b"), "--leave-running", env=env)
    line = assert_error_line(r, "runs again, but its thaw did not complete", "network lock", "criuctl thaw")
    assert r.returncode == 1, line
    assert (tmp_path / "b" / "manifest.json").is_file(), "the bundle itself is good"
    assert any(t in criu_tables() for t in _tables_of(tmp_path / "b")), "the lock is still there"
    w = workloads.load(name)
    assert psutil.Process(w.root_pid).status() != psutil.STATUS_STOPPED, "the tree must run"
    assert "thaw incomplete" in criuctl("ps").stdout
    r = criuctl("thaw", name, env=env)
    assert r.returncode == 1 and "still not complete" in r.stderr, r.stderr
    (faults / Fault.NETLOCK_LIFT).unlink()
    r = criuctl("thaw", name)
    assert r.returncode == 0, r.stderr
    assert not any(t in criu_tables() for t in _tables_of(tmp_path / "b"))
    assert "thaw incomplete" not in criuctl("ps").stdout
    assert_finishes_like_reference(j, ref, server)


def test_dump_failing_after_criu_keeps_connections(job, tmp_path):
    """The bundle cannot be moved into place (its -o folder filled up meanwhile): CRIU had dumped."""
    j, name, ref, server = job
    out = tmp_path / "b"
    dump = subprocess.Popen(
        [*CRIUCTL, "dump", name, "--bundle", str(out)],
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
        r = criuctl("dump", name, "--bundle", str(small / "b"))
        assert_error_line(r, "disk full", "keeps running")
        assert list(small.iterdir()) == [], "a partial bundle was left on the full disk"
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
    assert_finishes_like_reference(j, ref, server)


def test_second_dump_is_refused_at_once(job, tmp_path):
    j, name, ref, server = job
    first = subprocess.Popen(
        [*CRIUCTL, "dump", name, "--bundle", str(tmp_path / "first"), "--leave-running"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for_staging(tmp_path, first, name)
    # held where it holds the workload's lock: a small job's whole dump (1.1 s on a slow VM) could
    # end before the second command had started, which then rightly dumped it (CI)
    os.kill(first.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        second = criuctl("dump", name, "--bundle", str(tmp_path / "second"), timeout=30)
        took = time.monotonic() - started
    finally:
        os.kill(first.pid, signal.SIGCONT)
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


# ------------------------------------------------------------------ an interrupted restore

BIG = Path(__file__).resolve().parent.parent / "bench" / "big_state.py"


def _copies_of(script: Path) -> list[int]:
    """PIDs of every process running `script`, stopped or not, wherever it was reparented."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        if str(script) in (p.info["cmdline"] or []):
            found.append(p.pid)
    return found


@pytest.fixture(scope="module")
def big_bundle(tmp_path_factory):
    """A bundle of a job holding ~200 MB of model + Adam state (its own state dir)."""
    import os

    d = tmp_path_factory.mktemp("big")
    env = {**os.environ, "CRIUCTL_STATE_DIR": str(d / "state")}
    # Ctrl-C must reach the job as it reaches one started from a terminal: a suite started in the
    # background of a non-interactive shell (CI's `nohup … &`) inherits SIGINT ignored, and so did
    # the job and its bundle; a SIGINT forwarded after the restore then never ended it (the CI hang)
    job = Job(
        [*CRIUCTL, "run", "--name", "big", "--", sys.executable, str(BIG), "--gib", "0.2"],
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    job.wait_for(r"^ready ")
    r = subprocess.run([*CRIUCTL, "dump", "big", "-b", str(d / "b")], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    job.wait()
    return d / "b", env


@pytest.mark.parametrize("sig", [2, 15])  # SIGINT (Ctrl-C), SIGTERM
def test_interrupted_restore_leaves_no_copy(big_bundle, sig):
    bundle_dir, env = big_bundle
    assert _copies_of(BIG) == []
    codes = []
    for delay in (0.3, 0.6, 0.9, 1.2, 1.6, 2.2):  # before, while, and after CRIU restores
        restore = subprocess.Popen(
            [*CRIUCTL, "restore", str(bundle_dir), "--name", "big"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        time.sleep(delay)
        restore.send_signal(sig)
        try:
            _, err = restore.communicate(timeout=120)
        except subprocess.TimeoutExpired:  # say where it hangs (a job ignoring the signal: see the fixture)
            state = tree_state(restore.pid)
            restore.kill()
            for pid in _copies_of(BIG):
                subprocess.run(["kill", "-9", str(pid)], check=False)
            pytest.fail(f"signal {sig} after {delay} s: the restore did not end in 120 s; its tree:\n{state}")
        codes.append(restore.returncode)
        time.sleep(0.2)  # a leaked copy would be reparented by now
        left = _copies_of(BIG)
        for pid in left:
            subprocess.run(["kill", "-9", str(pid)], check=False)
        assert left == [], f"signal {sig} after {delay} s left a copy of the job: {left}; stderr {err!r}"
        if "interrupted" in err:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("criuctl: error: restore of "), err
            assert restore.returncode == 128 + sig, err
        else:
            assert restore.returncode != 0, err  # killed before or after CRIU: the job's status
    assert 128 + sig in codes, f"no signal landed while CRIU restored: exit codes {codes}"


# ------------------------------------------------------------------ the lock table itself


def test_lift_removes_exactly_the_named_table_and_is_idempotent():
    mine, other = netlock.table_name("0badc0de-0000-4000-8000-000000000001"), "CRIU-0badc0de-other"
    assert mine == "CRIU-0badc0de-0000-4000-80"  # cut as CRIU cuts it (31 bytes with "inet ")
    lib = netlock.Nft()
    try:
        for t in (mine, other):
            ok, _, err = lib.run(f"add table inet {t}")
            assert ok, err
        ok, _, err = lib.run(
            f"add set inet {mine} conns4 {{ type ipv4_addr . inet_service . ipv4_addr . inet_service; }}"
        )
        assert ok, err
        ok, _, err = lib.run(f"add element inet {mine} conns4 {{ 127.0.0.1 . 5000 . 127.0.0.1 . 6000 }}")
        assert ok, err
    finally:
        lib.close()
    try:
        assert netlock.tables_holding({("::ffff:127.0.0.1", 5000, "127.0.0.1", 6000)}) == [mine]
        assert netlock.lift(mine) is True
        assert netlock.lift(mine) is False  # already gone: fine
        assert mine not in netlock.tables() and other in netlock.tables()
    finally:
        netlock.lift(mine)
        netlock.lift(other)
