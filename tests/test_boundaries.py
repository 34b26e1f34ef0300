"""Every instant of the protocol: stop a migration at each named point, break something, check exactly once.

A migration is stopped at a `protocol.Point` (the process that reaches it waits there: no timing
windows to hope for), then one fault is applied — the source agent SIGKILLed (and restarted, as a
DaemonSet would), the target agent likewise, the client SIGKILLed, or the target's link cut for a
while — and the protocol is let go. Throughout, a sampler checks that the job never runs on two
nodes at once; at the end the job must have finished exactly once, somewhere, with every step
logged once and the losses and weights of an uninterrupted run.

Every node's agent has the stand-in GPU driver (tests/standin_gpu.py) and a GPU of its own; the GPU
cases run the job on a stand-in CUDA context, whose CUDA calls block while its device state is
locked or checkpointed: the lock is part of the freeze, so every thaw must give the state back (or the
job never finishes), and every restore must put it onto the new node's GPU.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from criuctl.agent.points import ARMED
from criuctl.agent.protocol import Point
from criuctl.core.env import PAUSE_DIR
from tests.cluster import Cluster
from tests.conftest import needs_criu
from tests.jobs import CRIUCTL
from tests.standin_gpu import H200, Gpu, StandinGpus, compile_standins

pytestmark = [needs_criu, pytest.mark.slow]

# 6 s of steps: after step 5 the migration has ~5.7 s to freeze it (2.75 s was too little on a slow VM)
JOB = ("train_mlp.py", "--steps", "120", "--step-time", "0.05")
LEASE = 3.0
FAULTS = ("source-agent", "target-agent", "client", "link")
# node b off for good at the point (its link down, its agent and handoffs killed): the client is
# killed as a person would give up on it, and the person settles the move (`criuctl settle`)
TARGET_LOST = "target-lost"
SETTLE_REFUSED = "settle-refused"  # a person settles while b still answers: refused, the move goes on

# (point, fault, mode): client points see every fault, agent points their own party's and the others'
STOP = "stop-and-copy"
DIRECT = "direct"  # a stop-and-copy whose pages go straight into the target's page server
GPU, GPU_POST = "gpu", "gpu-post-copy"  # the job holds a stand-in CUDA context (stop-and-copy, post-copy)
NODE_GPUS = {
    "a": Gpu(H200, "GPU-aaaaaaaa-0000-0000-0000-00000000000a"),
    "b": Gpu(H200, "GPU-bbbbbbbb-0000-0000-0000-00000000000b"),
}
CASES = (
    [
        (p, f, STOP)
        for p in (
            Point.CLIENT_PREPARED,
            Point.CLIENT_SENT,
            Point.CLIENT_RESTORED,
            Point.CLIENT_TARGET_COMMITTED,
            Point.CLIENT_SOURCE_COMMITTED,
        )
        for f in FAULTS
    ]
    + [
        (p, f, STOP)
        for p, f in (
            (Point.SOURCE_HELD, "source-agent"),
            (Point.SOURCE_HELD, "client"),
            (Point.SOURCE_STREAMING, "source-agent"),
            (Point.SOURCE_STREAMING, "client"),
            (Point.SOURCE_STREAMING, "target-agent"),
            (Point.SOURCE_STREAMING, "link"),
            (Point.SOURCE_FROZEN, "source-agent"),
            (Point.SOURCE_FROZEN, "client"),
            (Point.SOURCE_FROZEN, "link"),
            (Point.SOURCE_SENT_RECORDED, "source-agent"),
            (Point.SOURCE_SENT_RECORDED, "client"),
            (Point.SOURCE_SENT_RECORDED, "target-agent"),
            (Point.TARGET_RECEIVED, "target-agent"),
            (Point.TARGET_RECEIVED, "source-agent"),
            (Point.TARGET_RUNNING, "target-agent"),
            (Point.TARGET_RUNNING, "client"),
            (Point.TARGET_RUNNING, "source-agent"),
        )
    ]
    + [  # post-copy: the same rule, with the page server in the way (its window is the commit onwards)
        (Point.CLIENT_RESTORED, "target-agent", "post-copy"),
        (Point.CLIENT_RESTORED, "source-agent", "post-copy"),
        (Point.CLIENT_TARGET_COMMITTED, "source-agent", "post-copy"),
        (Point.CLIENT_TARGET_COMMITTED, "client", "post-copy"),
        # its page session's certificates exchanged (HTTPS agents: the pages go over CRIU's TLS)
        (Point.TARGET_PAGES_OPEN, "target-agent", "post-copy"),
    ]
    + [  # stop-and-copy with its pages straight into the target's page server (CRIUCTL_STREAM=direct)
        *((Point.TARGET_PAGES_OPEN, f, DIRECT) for f in FAULTS),
        (Point.SOURCE_STREAMING, "target-agent", DIRECT),  # the page server outlives its agent
        (Point.SOURCE_STREAMING, "link", DIRECT),
        (Point.SOURCE_FROZEN, "link", DIRECT),
        (Point.TARGET_RECEIVED, "target-agent", DIRECT),  # the voucher is on disk, the agent new
        (Point.CLIENT_SENT, "target-agent", DIRECT),
    ]
    + [  # a GPU job: its device state is locked + checkpointed with the freeze, given back by any thaw
        (Point.CLIENT_PREPARED, "source-agent", GPU),
        (Point.SOURCE_STREAMING, "source-agent", GPU),
        (Point.SOURCE_STREAMING, "target-agent", GPU),
        (Point.SOURCE_FROZEN, "source-agent", GPU),
        (Point.SOURCE_FROZEN, "link", GPU),
        (Point.CLIENT_SENT, "client", GPU),
        (Point.TARGET_RECEIVED, "target-agent", GPU),
        (Point.CLIENT_RESTORED, "target-agent", GPU),
        (Point.CLIENT_RESTORED, "link", GPU),
        (Point.TARGET_RUNNING, "target-agent", GPU),
        (Point.CLIENT_TARGET_COMMITTED, "source-agent", GPU),
        (Point.CLIENT_RESTORED, "source-agent", GPU_POST),
        (Point.CLIENT_TARGET_COMMITTED, "client", GPU_POST),
        # the settling verb: only where b never ran the job (a target that ran it and died took
        # its steps with it: the source goes on from its freeze, which the step count would flag)
        (Point.CLIENT_RESTORED, TARGET_LOST, STOP),
        (Point.SOURCE_SETTLE_ORDERED, "source-agent", STOP),  # b lost at client.sent, then this
        (Point.CLIENT_RESTORED, SETTLE_REFUSED, STOP),
    ]
)


@pytest.fixture
def ref(reference):
    return reference(JOB[0], *JOB[1:3], "--step-time", "0")


class Sampler(threading.Thread):
    """Watches the job from the side: it must never run on two nodes at the same instant."""

    def __init__(self, c: Cluster, name: str) -> None:
        super().__init__(daemon=True)
        self.c, self.name, self.doubled, self.stop = c, name, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            now = self.c.running(self.name)
            if len(now) > 1:
                self.doubled.append(now)
            time.sleep(0.05)


def _wait_paused(pause: Path, point: Point, p: subprocess.Popen, timeout: float = 90) -> int:
    deadline = time.monotonic() + timeout
    while not (pause / str(point)).exists():
        if p.poll() is not None:
            raise AssertionError(f"migrate ended before {point}: {p.stderr.read()[-2000:]}")
        assert time.monotonic() < deadline, f"the protocol never reached {point}"
        time.sleep(0.05)
    return int((pause / str(point)).read_text())


def _lose_target(c: Cluster, pause: Path, point: Point, paused: int, p: subprocess.Popen) -> None:
    """At `point` (where process `paused` waits), node b goes off for good: no link, no agent, no
    handoff (its restored copy, stopped and never run, is gone for the job as a powered-off node's
    memory would be; b's agent ends it when b comes back). The client `p` is killed, as a person
    gives up on a move that cannot end."""
    c.link("b", up=False)
    b = c.nodes["b"]
    b.agent.kill()
    b.agent.wait()
    for proc in c.handoffs():
        with contextlib.suppress(psutil.Error):
            if _net_ns(proc.pid) == _net_ns_of(b):
                proc.kill()
    if psutil.pid_exists(paused):
        (pause / f"{point}.go").touch()
    p.kill()
    p.wait()


def _net_ns(pid: int) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def _net_ns_of(node) -> str:
    return f"net:[{os.stat(f'/run/netns/{node.ns}').st_ino}]"


def _settle(c: Cluster, name: str) -> subprocess.Popen:
    """A person settles the move from the client's seat (a process, so that a point may stop it)."""
    return subprocess.Popen(
        [*CRIUCTL, "settle", name, "--node", "a", "--target-down"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "CRIUCTL_STATE_DIR": str(c.client_state)},
    )


def _restart_agent(c: Cluster, node: str, pause: Path) -> None:
    n = c.nodes[node]
    n.agent.kill()
    n.agent.wait()
    n.start_agent(env={PAUSE_DIR: str(pause)}, lease=LEASE)  # a DaemonSet brings it back


class Shared:
    """One cluster for every case (each case leaves it settled); rebuilt after a case that failed."""

    def __init__(self, root: Path) -> None:
        self.root, self.n, self.cluster, self.pause = root, 0, None, root / "pause"
        self.pause.mkdir(parents=True)
        self.gpus = StandinGpus(compile_standins(Path(root)), root / "gpus")

    def get(self) -> Cluster:
        if self.cluster is None:
            self.n += 1
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(PAUSE_DIR, str(self.pause))  # agents read the armed points from there
                gpu_env = {node: self.gpus.node_env(gpu) for node, gpu in NODE_GPUS.items()}
                self.cluster = Cluster(self.root / f"c{self.n}", lease=LEASE, agent_env=gpu_env).__enter__()
        return self.cluster

    def discard(self) -> None:
        if self.cluster is not None:
            cluster, self.cluster = self.cluster, None
            with contextlib.suppress(AssertionError):
                cluster.__exit__(None, None, None)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    s = Shared(tmp_path_factory.mktemp("boundaries"))
    yield s
    s.discard()


@pytest.mark.parametrize(("point", "fault", "mode"), CASES, ids=[f"{p}-{f}-{m}" for p, f, m in CASES])
def test_fault_at_boundary_runs_the_job_exactly_once(shared, ref, point, fault, mode):
    c, pause, name = shared.get(), shared.pause, f"job{CASES.index((point, fault, mode))}"
    for f in pause.iterdir():
        f.unlink()
    first = Point.CLIENT_SENT if point == Point.SOURCE_SETTLE_ORDERED else point  # (see _one_case)
    (pause / ARMED).write_text(f"{first}\n")
    try:
        _one_case(c, pause, name, point, fault, mode, ref, shared.gpus)
    except BaseException:
        shared.discard()
        raise


def _one_case(
    c: Cluster, pause: Path, name: str, point: Point, fault: str, mode: str, ref, gpus: StandinGpus
) -> None:
    gpu = mode in (GPU, GPU_POST)
    c.run("a", name, *JOB, env=gpus.job_env(NODE_GPUS["a"]) if gpu else None)
    c.wait_step(name, 5)
    sampler = Sampler(c, name)
    sampler.start()
    env = {**os.environ, "CRIUCTL_STATE_DIR": str(c.client_state), PAUSE_DIR: str(pause)}
    if mode == DIRECT:
        env["CRIUCTL_STREAM"], mode = "direct", STOP
    mode = {GPU: STOP, GPU_POST: "post-copy"}.get(mode, mode)
    p = subprocess.Popen(
        [*CRIUCTL, "migrate", name, "--to", "b", "--mode", mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        if point == Point.SOURCE_SETTLE_ORDERED:  # b lost once the move is sent, then the settle stops
            _lose_target(c, pause, Point.CLIENT_SENT, _wait_paused(pause, Point.CLIENT_SENT, p), p)
            (pause / ARMED).write_text(f"{point}\n")
            p = _settle(c, name)
        paused = _wait_paused(pause, point, p)
        (pause / ARMED).unlink()  # once is enough: nothing else may stop there in this case
        if fault == TARGET_LOST:
            _lose_target(c, pause, point, paused, p)
            p = _settle(c, name)
        elif fault == SETTLE_REFUSED:
            refused = c.client("settle", name, "--node", "a", "--target-down", timeout=120)
            assert refused.returncode == 5, refused.stderr
            assert refused.stderr.startswith("criuctl: error: node b answers"), refused.stderr
            assert len(refused.stderr.splitlines()) == 1, refused.stderr
        if fault in ("source-agent", "target-agent"):
            _restart_agent(c, "a" if fault == "source-agent" else "b", pause)
        elif fault == "client":
            p.kill()
        elif fault == "link":
            c.link("b", up=False)
        if psutil.pid_exists(paused):
            (pause / f"{point}.go").touch()
        if fault == "link":
            time.sleep(6)  # the fault itself: long enough for every party to notice, short of giving up
            c.link("b", up=True)
        try:
            _out, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            raise
        assert "Traceback" not in err, err[-3000:]
        if p.returncode == 6:  # moved, but the source could not confirm yet: said in one line
            assert sum(x.startswith("criuctl: warning:") for x in err.splitlines()) == 1, err[-3000:]
        elif p.returncode not in (0, -signal.SIGKILL):
            errors = [x for x in err.splitlines() if x.startswith("criuctl: error:")]
            assert len(errors) == 1, err[-3000:]
        if fault == TARGET_LOST:
            assert p.returncode == 0, err[-3000:]
            assert "runs on a again" in err, err
        c.wait_finished(name, timeout=240)
        if fault == TARGET_LOST or point == Point.SOURCE_SETTLE_ORDERED:
            c.link("b", up=True)  # b comes back: its agent ends the copy that never ran
            c.nodes["b"].start_agent(env={PAUSE_DIR: str(pause)}, lease=LEASE)
        deadline = time.monotonic() + 120  # and every party has settled: no handoff left waiting
        while c.handoffs():
            assert time.monotonic() < deadline, f"still unsettled: {[h.cmdline() for h in c.handoffs()]}"
            time.sleep(0.2)
    finally:
        c.link("b", up=True)
        sampler.stop.set()
        sampler.join()
        if p.poll() is None:
            p.kill()
    assert_exactly_once(c, name, ref, sampler)
    if gpu:
        assert_on_its_nodes_gpu(c, name)


def assert_on_its_nodes_gpu(c: Cluster, name: str) -> None:
    """Each node's copy ran its CUDA calls on that node's GPU: a restore paired the old GPU with the new."""
    for node in c.nodes.values():
        seen = {line.split()[1] for line in node.log(name).splitlines() if line.startswith("gpu ")}
        assert seen <= {NODE_GPUS["a"].uuid, NODE_GPUS[node.name].uuid}, (node.name, seen)
        if node.name == "b" and seen:
            assert NODE_GPUS["b"].uuid in seen, f"restored on b but still on a's GPU: {seen}"


def assert_exactly_once(c: Cluster, name: str, ref, sampler: Sampler) -> None:
    """Never on two nodes at once; ended once, with 0; every step logged once, as uninterrupted."""
    assert not sampler.doubled, f"the job ran on two nodes at once: {sampler.doubled[:3]}"
    ended = [
        (n.name, r["exit_code"])
        for n in c.nodes.values()
        for r in n.records()
        if r["name"] == name and r["state"] == "exited"
    ]
    assert len(ended) == 1 and ended[0][1] == 0, f"the job ended {ended}: expected once, with 0"
    logs = [n.log(name) for n in c.nodes.values()]
    logged = [line for text in logs for line in text.splitlines() if line.startswith("step ")]
    assert len(logged) == len(ref.steps), "a step ran twice, or never"
    assert c.steps(name) == ref.steps
    assert c.final(name) == [ref.final], "final weights differ from an uninterrupted run"
