"""Ranks of a multi-node gloo DDP job move to other nodes, connections intact, with no re-rendezvous.

Nodes are network namespaces with their own addresses (`tests.cluster`); each rank is a real
`criuctl run` of tests/workloads/train_ddp_nodes.py on its node (TCP store on rank 0, gloo pairs
between the ranks over the nodes' addresses). Every case must end with the uninterrupted run's
losses and final weights: the job neither restarts nor loses a step, and every rank runs on
exactly one node at every look.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from criuctl.agent.protocol import Point
from criuctl.core.env import PAUSE_AT, PAUSE_DIR
from tests.cluster import Cluster
from tests.conftest import needs_criu
from tests.jobs import CRIUCTL, WORKLOADS, Job, undelayed, workload_cmd
from tests.test_boundaries import _wait_paused

pytestmark = [needs_criu, pytest.mark.slow]
SCRIPT = "train_ddp_nodes.py"
STEPS = ("--steps", "200", "--step-time", "0.1")  # 20 s: room for a slow CI between the moves
_REFS: dict[tuple, tuple[dict[int, str], str]] = {}


def reference(world: int) -> tuple[dict[int, str], str]:
    """Rank 0's losses and the final weights of an uninterrupted run of `world` ranks (loopback)."""
    if world not in _REFS:
        port = random.randint(20000, 29000)
        common = (
            "--world",
            str(world),
            "--master",
            f"127.0.0.1:{port}",
            "--ifname",
            "lo",
            *undelayed(SCRIPT, *STEPS),
        )
        ranks = [Job(workload_cmd(SCRIPT, "--rank", str(r), *common)) for r in range(world)]
        for j in ranks:
            assert j.wait(600) == 0, j.err[-10:]
        _REFS[world] = (ranks[0].steps, ranks[0].final)
        assert _REFS[world][0] and _REFS[world][1], "the reference run reported nothing"
    return _REFS[world]


def start(c: Cluster, placement: list[str]) -> None:
    """Rank r of a len(placement)-rank job on node placement[r], rank 0's node the rendezvous."""
    master = f"{c.nodes[placement[0]].addr}:{random.randint(20000, 29000)}"
    for rank, node in enumerate(placement):
        c.run(
            node,
            f"ddp-{rank}",
            SCRIPT,
            "--rank",
            str(rank),
            "--world",
            str(len(placement)),
            "--master",
            master,
            *STEPS,
        )
    c.wait_step("ddp-0", 8, timeout=240)


def where(c: Cluster, world: int) -> list[str]:
    """The node each rank runs on; each must run on exactly one."""
    out = []
    for rank in range(world):
        nodes = c.running(f"ddp-{rank}")
        assert len(nodes) == 1, f"rank {rank} runs on {nodes}"
        out.append(nodes[0])
    return out


def tables(c: Cluster, node: str, prefix: str) -> list[str]:
    code = f"from criuctl.net import netcut; print(' '.join(netcut.tables({prefix!r})))"
    r = subprocess.run([*c.nodes[node].inside(), sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout.split()


def finishes_exactly(c: Cluster, world: int) -> None:
    steps, final = reference(world)
    c.wait_finished("ddp-0", timeout=300)
    got = c.steps("ddp-0")
    assert got == steps, f"{len(got)} steps, first difference at {min(set(got) ^ set(steps), default=None)}"
    assert c.final("ddp-0") == [final]


def listed_jobs(c: Cluster) -> list[tuple[str, str, str]]:
    """`criuctl ps --jobs` as (job, rank, node) rows: what the agents tell the client."""
    ps = c.client("ps", "--jobs")
    assert ps.returncode == 0, ps.stderr
    return [tuple(ln.split()[:3]) for ln in ps.stdout.splitlines()[1:] if ln.strip()]  # type: ignore[misc]


def moved(r: subprocess.CompletedProcess) -> dict:
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def failed(r: subprocess.CompletedProcess) -> str:
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("criuctl: error:")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_move_one_rank_then_again(tmp_path):
    """2 ranks on a, b: rank 1 moves to c (found as a job by `migrate NAME NODE`, post-copy), then
    to d (`--job`, stop-and-copy)."""
    with Cluster(tmp_path / "c", names=("a", "b", "c", "d")) as c:
        start(c, ["a", "b"])
        assert listed_jobs(c) == [("ddp", "ddp-0", "a"), ("ddp", "ddp-1", "b")]
        # bad input first: each is one line, and nothing is frozen
        assert "no node named 'nosuch'" in failed(c.client("migrate", "--job", "ddp", "ddp-1=nosuch"))
        assert "is not a rank of job ddp" in failed(c.client("migrate", "--job", "ddp", "ddp-7=c"))
        assert "is not RANK=NODE" in failed(c.client("migrate", "--job", "ddp", "ddp-1"))
        assert where(c, 2) == ["a", "b"]
        first = moved(c.client("migrate", "ddp-1", "c", "--mode", "post-copy", "--json"))
        assert [(r["target"], r["mode"]) for r in first["ranks"]] == [("c", "post-copy")]
        assert first["redirects"] == 1
        assert where(c, 2) == ["a", "c"]
        # b's stopped tree still serves the pages c pulls: its agent lists it as moved, not as a
        # second running copy (which made the next move refuse: one rank at two addresses)
        assert listed_jobs(c) == [("ddp", "ddp-0", "a"), ("ddp", "ddp-1", "c")]
        assert tables(c, "c", "criuctl-cut-") == []  # lifted once the rank ran
        assert len(tables(c, "a", "criuctl-nat-")) == 1  # rank 0 reaches rank 1 at c
        c.wait_step("ddp-0", max(c.steps("ddp-0")) + 5)
        second = moved(c.client("migrate", "--job", "ddp", "ddp-1=d", "--mode", "stop-and-copy", "--json"))
        assert [(r["source"], r["mode"]) for r in second["ranks"]] == [("c", "stop-and-copy")]
        assert where(c, 2) == ["a", "d"]
        assert len(tables(c, "a", "criuctl-nat-")) == 2  # stacked: b → c, then c → d
        finishes_exactly(c, 2)


def test_move_rank0_the_store_host(tmp_path):
    with Cluster(tmp_path / "c", names=("a", "b", "c")) as c:
        start(c, ["a", "b"])
        out = moved(c.client("migrate", "ddp-0", "c", "--json"))
        assert out["ranks"][0]["source"] == "a"
        assert where(c, 2) == ["c", "b"]
        finishes_exactly(c, 2)


def test_four_ranks_two_move_at_once(tmp_path):
    """4 ranks on 4 nodes; ranks 1 and 3 move at once, rank 3 onto a node that hosts rank 0."""
    with Cluster(tmp_path / "c", names=("a", "b", "c", "d", "e")) as c:
        start(c, ["a", "b", "c", "d"])
        out = moved(c.client("migrate", "--job", "ddp", "ddp-1=e", "ddp-3=a", "--json"))
        assert sorted(r["target"] for r in out["ranks"]) == ["a", "e"]
        assert where(c, 4) == ["a", "e", "c", "a"]
        finishes_exactly(c, 4)


def test_failed_restore_leaves_the_whole_job_on_its_old_nodes(tmp_path):
    """Rank 1's gloo port is taken on c: its restore fails there, and every rank goes on where it was."""
    with Cluster(tmp_path / "c", names=("a", "b", "c")) as c:
        start(c, ["a", "b"])
        port = _listening_port(c, "b", "ddp-1")
        squat = f"import socket, time; s = socket.socket(); s.bind(({c.nodes['c'].addr!r}, {port})); "
        squatter = subprocess.Popen(
            [*c.nodes["c"].inside(), sys.executable, "-c", squat + "s.listen(); time.sleep(600)"]
        )
        try:
            time.sleep(0.5)
            line = failed(c.client("migrate", "ddp-1", "c"))
            assert "rank ddp-1" in line and "every rank of job ddp runs on its old node" in line, line
            assert where(c, 2) == ["a", "b"]
            assert tables(c, "a", "criuctl-nat-") == []
            assert tables(c, "c", "criuctl-cut-") == []
            finishes_exactly(c, 2)
        finally:
            squatter.kill()


def _listening_port(c: Cluster, node: str, name: str) -> int:
    """A port rank `name` listens on at its node's address (gloo's pair listener), from its agent."""
    code = (
        "import json, sys; from criuctl.client.agents import AgentClient, get_node; "
        "print(json.dumps(AgentClient(get_node(sys.argv[1])).get('/v1/workloads')))"
    )
    env = {**os.environ, "CRIUCTL_STATE_DIR": str(c.client_state)}
    r = subprocess.run([sys.executable, "-c", code, node], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    row = next(w for w in json.loads(r.stdout) if w["name"] == name and w["state"] == "running")
    return next(p for a, p in row["tcp"]["listening"] if a == c.nodes[node].addr)


def test_new_node_unreachable(tmp_path):
    with Cluster(tmp_path / "c", names=("a", "b", "c")) as c:
        start(c, ["a", "b"])
        c.link("c", up=False)
        line = failed(c.client("migrate", "ddp-1", "c"))
        assert "node c" in line and "nothing was frozen" in line, line
        assert where(c, 2) == ["a", "b"]
        finishes_exactly(c, 2)


@pytest.mark.parametrize(
    ("who", "point"),
    [
        ("peer-agent", Point.CLIENT_SENT),
        ("peer-agent", Point.CLIENT_REDIRECTED),
        ("client", Point.CLIENT_REDIRECTED),
        ("client", Point.CLIENT_RESTORED),
    ],
)
def test_a_party_killed_mid_move(tmp_path, monkeypatch, who, point):
    """peer-agent at client.sent: rank 0's agent dies before its redirect is installed: the move
    fails, the job goes on at a and b. peer-agent at client.redirected: it dies with the redirect
    in place (the kernel keeps the rules): the move completes, the job goes on at a and c. client:
    the client dies with rank 1 sent (or restored, stopped, at c): the leases settle it — c's copy
    dies behind its cut, b thaws, a's redirect asks c and goes."""
    pause = tmp_path / "pause"
    pause.mkdir()
    lands = "c" if (who, point) == ("peer-agent", Point.CLIENT_REDIRECTED) else "b"
    with Cluster(tmp_path / "c", names=("a", "b", "c"), lease=3) as c:
        start(c, ["a", "b"])
        env = {
            **os.environ,
            "CRIUCTL_STATE_DIR": str(c.client_state),
            PAUSE_AT: str(point),
            PAUSE_DIR: str(pause),
        }
        p = subprocess.Popen(
            [*CRIUCTL, "migrate", "ddp-1", "c"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _wait_paused(pause, point, p)
        if who == "peer-agent":
            c.nodes["a"].agent.send_signal(signal.SIGKILL)
            c.nodes["a"].agent.wait()
            (pause / f"{point}.go").touch()
            done = subprocess.CompletedProcess(p.args, p.wait(120), "", p.stderr.read())
            if lands == "c":
                assert done.returncode == 0, done.stderr
            else:
                line = failed(done)
                assert "node a" in line and "every rank of job ddp runs on its old node" in line, line
        else:
            p.kill()
            p.wait()
        deadline = time.monotonic() + 60
        redirects = 1 if lands == "c" else 0
        while (c.running("ddp-1") != [lands] or len(tables(c, "a", "criuctl-nat-")) != redirects) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.5)
        assert where(c, 2) == ["a", lands]
        assert len(tables(c, "a", "criuctl-nat-")) == redirects
        finishes_exactly(c, 2)


def test_a_connection_to_something_not_criuctl_refuses(tmp_path):
    """A workload talking to a server outside criuctl cannot take that connection along."""
    with Cluster(tmp_path / "c", names=("a", "b")) as c:
        server = Job(
            [
                *c.nodes["a"].inside(),
                sys.executable,
                str(WORKLOADS / "ack_server.py"),
                "--listen",
                c.nodes["a"].addr,
            ]
        )
        port = server.wait_for(r"^listening \d+$").split()[1]
        try:
            c.run(
                "a",
                "talker",
                "train_tcp_client.py",
                "--steps",
                "400",
                "--server",
                f"{c.nodes['a'].addr}:{port}",
            )
            c.wait_step("talker", 3)
            line = failed(c.client("migrate", "talker", "b"))
            assert f"{c.nodes['a'].addr}:{port}, which is not a criuctl workload" in line, line
            assert c.running("talker") == ["a"]
        finally:
            server.kill()


def test_client_killed_between_the_ranks_commits(tmp_path, monkeypatch):
    """Two ranks move; the client dies once the first runs on its new node and before it told the
    second. The first rank's commit decided the move: the second's target, asked by its source's
    lease, sees the first running and runs its copy too (it never aborts what the job's peers now
    point at), its source ends, and the redirects stay. The job finishes on a, d, e."""
    pause = tmp_path / "pause"
    pause.mkdir()
    point = Point.CLIENT_TARGET_COMMITTED
    with Cluster(tmp_path / "c", names=("a", "b", "c", "d", "e"), lease=3) as c:
        start(c, ["a", "b", "c"])
        env = {
            **os.environ,
            "CRIUCTL_STATE_DIR": str(c.client_state),
            PAUSE_AT: str(point),
            PAUSE_DIR: str(pause),
        }
        p = subprocess.Popen(
            [*CRIUCTL, "migrate", "--job", "ddp", "ddp-1=d", "ddp-2=e"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        _wait_paused(pause, point, p)
        p.kill()
        p.wait()
        deadline = time.monotonic() + 90
        while [c.running(f"ddp-{r}") for r in range(3)] != [["a"], ["d"], ["e"]]:
            assert time.monotonic() < deadline, [c.running(f"ddp-{r}") for r in range(3)]
            for r in range(3):
                assert len(c.running(f"ddp-{r}")) <= 1, f"rank {r} runs twice"
            time.sleep(0.3)
        finishes_exactly(c, 3)
