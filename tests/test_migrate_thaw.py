"""A migration that fails after the freeze thaws the job on the source with its TCP connections working.

The agent's three thaw paths — a failure before "sent" (the target's disk fills up), the lease (the
client vanished after "sent": the source asks the target, which aborts, then thaws), and restart
recovery (the source agent and its handoff both killed after "sent": the restarted agent finds the
hold record and asks the target) — each with a DDP job (TCP between its ranks) and with a job that
talks to a server outside its tree. Each must finish on the source with the uninterrupted run's
losses and weights, over the connections it started with, and leave no CRIU lock table behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from criuctl.agent.protocol import Point
from criuctl.core.env import PAUSE_AT, PAUSE_DIR
from tests.cluster import Cluster
from tests.conftest import needs_criu
from tests.jobs import CRIUCTL, WORKLOADS, Job
from tests.test_boundaries import _wait_paused
from tests.test_migrate import _failed

pytestmark = [needs_criu, pytest.mark.slow]
STEPS = ("--steps", "80")  # ~4 s: a loaded machine still freezes the job mid-run


def _tables(c: Cluster, node: str) -> list[str]:
    """CRIU lock tables in the node's network namespace (they are per namespace)."""
    code = "import json; from criuctl.net import netlock; print(json.dumps(netlock.tables()))"
    r = subprocess.run([*c.nodes[node].inside(), sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.parametrize(
    ("kind", "path", "mode"),
    [
        *((kind, path, "stop-and-copy") for kind in ("ddp", "tcp") for path in ("abort", "lease", "restart")),
        # post-copy: CRIU still holds the frozen tree to serve pages; its end must not let the tree
        # run before its sockets leave repair mode (it did: a read failed with EPERM, the job died)
        ("ddp", "lease", "post-copy"),
    ],
)
def test_failed_migration_thaws_with_connections_intact(tmp_path, monkeypatch, reference, kind, path, mode):
    script = "train_ddp.py" if kind == "ddp" else "train_tcp_client.py"
    ref = reference(script, *STEPS)
    pause = tmp_path / "pause"
    pause.mkdir()
    if path != "abort":
        monkeypatch.setenv(PAUSE_AT, str(Point.CLIENT_SENT))
        monkeypatch.setenv(PAUSE_DIR, str(pause))
    tmpfs = {"b": "48m"} if path == "abort" else None
    with Cluster(tmp_path / "c", lease=3, tmpfs=tmpfs) as c:
        server = None
        args: tuple[str, ...] = STEPS
        if kind == "tcp":
            server = Job([*c.nodes["a"].inside(), sys.executable, str(WORKLOADS / "ack_server.py")])
            args = (*STEPS, "--server", "127.0.0.1:" + server.wait_for(r"^listening \d+$").split()[1])
        try:
            c.run("a", "job", script, *args)
            c.wait_step("job", 5)
            env = {**os.environ, "CRIUCTL_STATE_DIR": str(c.client_state)}
            argv = [*CRIUCTL, "migrate", "job", "--to", "b", "--mode", mode]
            if kind == "tcp":  # its server is not criuctl's: moved alone, on purpose (it fails anyway)
                argv.append("--break-connections")
            p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            if path == "abort":
                line = _failed(subprocess.CompletedProcess(p.args, p.wait(180), "", p.stderr.read()))
                assert "disk full on node b" in line and "keeps running on a" in line, line
            else:
                _wait_paused(pause, Point.CLIENT_SENT, p)
                p.kill()
                p.wait()
                if path == "restart":  # the agent and the handoff that holds the frozen tree, both gone
                    handoff = next(h for h in c.handoffs() if " source " in " ".join(h.cmdline()))
                    c.nodes["a"].agent.kill()
                    handoff.kill()
                    psutil.wait_procs([handoff], timeout=10)
                    c.nodes["a"].agent.wait()
                    c.nodes["a"].start_agent(env={PAUSE_AT: ""}, lease=3)
            c.wait_finished("job", timeout=240)
            assert c.steps("job") == ref.steps
            assert c.final("job") == [ref.final], "final weights differ from an uninterrupted run"
            ended = [
                (n.name, r["exit_code"])
                for n in c.nodes.values()
                for r in n.records()
                if r["name"] == "job" and r["state"] == "exited"
            ]
            assert ended == [("a", 0)], ended
            if path == "restart":
                assert "recovered outgoing" in c.nodes["a"].agent_log()
            if server is not None:
                server.wait_for(rf"^got step {max(ref.steps)} loss ", timeout=30)
                conns = [x for x in server.out if x.startswith("conn ")]
                assert conns == ["conn 1"], f"the job had to reconnect: {conns}"
                got = [x.removeprefix("got ") for x in server.out if x.startswith("got step ")]
                assert got == [f"step {i} loss {loss}" for i, loss in sorted(ref.steps.items())], got[:5]
            deadline = time.monotonic() + 10
            while _tables(c, "a"):
                assert time.monotonic() < deadline, f"a CRIU lock table outlived its dump: {_tables(c, 'a')}"
                time.sleep(0.2)
        finally:
            if server is not None:
                server.kill()
