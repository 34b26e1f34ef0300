"""Where a container's move differs from a process's: the placeholder and the runtime.

The placeholder's life is the job's (stopping it stops the job with the job's status; killing it
kills the job), and every way the target's side can be missing or die before the commit leaves
the job running on its source, whole, never on both nodes: no placeholder, a placeholder stopped
after the bundle arrived or after the restore, the target's runtime down. Bad input gets one line
and freezes nothing. The process-level fault matrix (agents, links, CRIU missing) is the same
code for containers and is not repeated here (tests/test_boundaries.py, tests/test_migrate.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest

from criuctl.agent.protocol import Point
from criuctl.container import containers
from criuctl.core.env import PAUSE_AT, PAUSE_DIR
from tests.conftest import needs_criu
from tests.jobs import CRIUCTL
from tests.requirements import missing, needs

pytestmark = [needs_criu, needs("containerd"), pytest.mark.slow]

if missing("containerd") is None:  # tests.containerd needs the CRI stubs make install made
    from tests.containerd import INIT, PY, Nodes, cri_steps, job_argv, wait_until

LONG = 5000  # steps: the job outlives every test here


def _job(nodes: Nodes, pod: str, placeholder: bool = True, **kw):
    """A long training container on node a (and, if asked, its placeholder on node b); `kw` for
    the job's container (Containerd.run_pod)."""
    job = nodes.pod(
        "a", pod, [*INIT, "--", *job_argv(LONG, "/workspace/train.log")], nodes.empty_dir("a", pod), **kw
    )
    holder = _placeholder(nodes, pod) if placeholder else None
    wait_until(lambda: len(cri_steps(job.log)) >= 10, 120, "10 steps on node a")
    return job, holder


def _placeholder(nodes: Nodes, pod: str, **kw):
    holder = nodes.pod("b", pod, [*INIT, "--placeholder"], nodes.empty_dir("b", pod), **kw)
    wait_until(lambda: "placeholder ready" in holder.log.read_text(errors="replace"), 30, "the placeholder")
    return holder


def _keeps_training(nodes: Nodes, job, more: int = 5) -> None:
    """The job runs on node a, not stopped, and makes progress; nothing of it runs on node b."""
    seen = max(cri_steps(job.log))
    wait_until(lambda: max(cri_steps(job.log)) >= seen + more, 60, f"{more} more steps on node a")
    assert nodes.runtimes["a"].status(job.container).state == 1  # CONTAINER_RUNNING
    for rec in nodes.cluster.nodes["b"].records():
        assert not (rec.get("container") and rec["state"] == "running" and psutil.pid_exists(rec["root_pid"]))


def _migrated(nodes: Nodes, job) -> dict:
    r = nodes.cluster.migrate(containers.name_of(job.container), "b", "--mode", "stop-and-copy")
    assert r.returncode == 0, r.stderr
    recs = nodes.cluster.nodes["b"].records()
    return next(x for x in recs if x["state"] == "running" and x.get("container"))


def test_stopping_the_placeholder_stops_the_job_with_its_status(nodes: Nodes) -> None:
    job, holder = _job(nodes, "stop-me")
    rec = _migrated(nodes, job)
    nodes.runtimes["b"].stop_container(holder.container, grace=20)  # what the kubelet does: SIGTERM
    code = nodes.runtimes["b"].wait_exited(holder.container, timeout=60)
    assert code == 128 + signal.SIGTERM, holder.log.read_text()[-2000:]  # the trainer died of SIGTERM
    wait_until(lambda: not psutil.pid_exists(rec["root_pid"]), 10, "the restored tree to end")


def test_killing_the_placeholder_kills_the_job(nodes: Nodes) -> None:
    job, holder = _job(nodes, "kill-me")
    rec = _migrated(nodes, job)
    os.kill(nodes.runtimes["b"].pid_of(holder.container), signal.SIGKILL)
    wait_until(lambda: not psutil.pid_exists(rec["root_pid"]), 10, "the restored tree to die with it")
    assert nodes.runtimes["b"].wait_exited(holder.container, timeout=30) == 128 + signal.SIGKILL


def test_no_placeholder_keeps_the_job_on_its_node(nodes: Nodes) -> None:
    job, _ = _job(nodes, "homeless", placeholder=False)
    r = nodes.cluster.migrate(containers.name_of(job.container), "b")
    assert r.returncode == 4, r.stderr
    assert "no empty placeholder for default/homeless/train" in r.stderr
    assert "Traceback" not in r.stderr
    _keeps_training(nodes, job)


def test_a_placeholder_without_the_jobs_kind_of_cdi_device_keeps_the_job_on_its_node(nodes: Nodes) -> None:
    """The device plugin gave the job a CDI device (its `cdi.k8s.io/*` annotation, as the kubelet
    passes it); a placeholder given none of that kind is refused, after the dump, and the job goes
    on at home. One given another device of the same kind (another GPU's index) takes the job.
    (containerd 1.6 keeps the annotation without acting on it; the devices themselves, with CDI on,
    in containerd 2 on cgroup v2 and systemd: scripts/guest-check.sh.)"""
    gpu = {"cdi.k8s.io/criuctl-test": "criuctl.test/gpu=0"}
    job, holder = _job(nodes, "cdi", annotations=gpu)
    r = nodes.cluster.migrate(containers.name_of(job.container), "b")
    assert r.returncode == 4, r.stderr
    assert "was given 0 CDI device(s) (none); the job had 1 (criuctl.test/gpu=0)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    _keeps_training(nodes, job)
    b = nodes.runtimes["b"]
    b.stop_container(holder.container, grace=5)
    b.wait_exited(holder.container, timeout=60)
    other = _placeholder(nodes, "cdi", annotations={"cdi.k8s.io/criuctl-test": "criuctl.test/gpu=3"})
    rec = _migrated(nodes, job)
    assert rec["container"] == other.container
    seen = max(cri_steps(other.log), default=-1)
    wait_until(lambda: max(cri_steps(other.log), default=-1) >= seen + 3, 60, "3 more steps on node b")
    b.stop_container(other.container, grace=5)  # the job ends with it: node b runs nothing of it after
    b.wait_exited(other.container, timeout=60)
    wait_until(lambda: not psutil.pid_exists(rec["root_pid"]), 10, "the restored tree to end")


@pytest.mark.parametrize("point", [Point.CLIENT_SENT, Point.CLIENT_RESTORED])
def test_placeholder_stopped_before_the_commit(nodes: Nodes, tmp_path: Path, point: Point) -> None:
    """Stopped after the bundle arrived (before the restore), or after the restore (before the commit)."""
    job, holder = _job(nodes, f"gone-{point.split('.')[1]}")
    pause = tmp_path / "pause"
    pause.mkdir()
    env = {**os.environ, "CRIUCTL_STATE_DIR": str(nodes.cluster.client_state)}
    env.update({PAUSE_AT: str(point), PAUSE_DIR: str(pause)})
    name = containers.name_of(job.container)
    p = subprocess.Popen(
        [*CRIUCTL, "migrate", name, "--to", "b"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_until(lambda: (pause / str(point)).exists() or p.poll() is not None, 120, f"the client at {point}")
    assert p.poll() is None, p.stderr.read() if p.stderr else ""
    os.kill(nodes.runtimes["b"].pid_of(holder.container), signal.SIGKILL)
    nodes.runtimes["b"].wait_exited(holder.container, timeout=30)
    (pause / f"{point}.go").touch()
    _, err = p.communicate(timeout=180)
    assert p.returncode == 4, err
    assert "Traceback" not in err
    _keeps_training(nodes, job)


def test_target_runtime_down_keeps_the_job_on_its_node(nodes: Nodes) -> None:
    job, _ = _job(nodes, "runtime-down")
    b = nodes.runtimes["b"]
    b.kill_daemon()  # containerd dies; its shims (and the placeholder) live on, as in a real crash
    try:
        r = nodes.cluster.migrate(containers.name_of(job.container), "b")
        assert r.returncode == 4, r.stderr
        assert "does not answer" in r.stderr and "Traceback" not in r.stderr
        _keeps_training(nodes, job)
    finally:
        b.restart_daemon()


def test_bad_input_one_line_nothing_frozen(nodes: Nodes, tmp_path: Path) -> None:
    plain = nodes.runtimes["a"].run_pod("plain", ["/bin/sleep", "3600"])  # no criuctl init in it
    job, _ = _job(nodes, "bystander", placeholder=False)
    cases = [
        (nodes.cluster.migrate("ctr-0123456789ab", "b"), "no node runs a workload named 'ctr-0123456789ab'"),
        (nodes.cluster.migrate(containers.name_of(plain.container), "b"), "not criuctl's init"),
    ]
    env = {**os.environ, "CRIUCTL_STATE_DIR": str(tmp_path / "state")}
    local = [*CRIUCTL, "dump", "0123456789abcdef", "--bundle", str(tmp_path / "b1")]
    dead = {**env, "CRIUCTL_RUNTIME_ENDPOINT": f"unix://{tmp_path / 'nothing.sock'}"}
    cases.append((subprocess.run(local, env=dead, capture_output=True, text=True), "does not answer"))
    sock = nodes.runtimes["a"].endpoint
    unknown = {**env, "CRIUCTL_RUNTIME_ENDPOINT": sock}
    cases.append((subprocess.run(local, env=unknown, capture_output=True, text=True), "no container"))
    plain_dump = [*CRIUCTL, "dump", plain.container, "--bundle", str(tmp_path / "b2")]
    cases.append(
        (subprocess.run(plain_dump, env=unknown, capture_output=True, text=True), "not criuctl's init")
    )
    for r, says in cases:
        assert r.returncode != 0 and says in r.stderr, (r.returncode, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, r.stderr
    assert nodes.runtimes["a"].status(plain.container).state == 1
    assert not (tmp_path / "b1").exists() and not (tmp_path / "b2").exists()
    _keeps_training(nodes, job)
    # `ps --node` lists both containers next to each other: the job as a workload, the other with why not
    ps = nodes.cluster.client("ps", "--node", "a")
    assert ps.returncode == 0, ps.stderr
    rows = {line.split()[0]: line for line in ps.stdout.splitlines() if line.strip().startswith("ctr-")}
    assert containers.name_of(job.container) in rows, ps.stdout
    assert "default/bystander" in rows[containers.name_of(job.container)]
    assert rows[containers.name_of(job.container)].rstrip().endswith("running")
    assert "not checkpointable" in rows[containers.name_of(plain.container)]


def test_target_agent_and_handoff_killed_after_the_restore(nodes: Nodes, tmp_path: Path) -> None:
    """Kill at a boundary the container path adds: the tree restored into the placeholder (stopped),
    then the target's agent and its handoff die before the commit. The restarted agent kills the
    copy that never ran and tells the placeholder; the source thaws; the job goes on at home."""
    job, holder = _job(nodes, "agent-dies")
    pause = tmp_path / "pause"
    pause.mkdir()
    env = {**os.environ, "CRIUCTL_STATE_DIR": str(nodes.cluster.client_state)}
    env.update({PAUSE_AT: str(Point.CLIENT_RESTORED), PAUSE_DIR: str(pause)})
    name = containers.name_of(job.container)
    p = subprocess.Popen(
        [*CRIUCTL, "migrate", name, "--to", "b"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    point = pause / str(Point.CLIENT_RESTORED)
    wait_until(lambda: point.exists() or p.poll() is not None, 120, "the client after the restore")
    assert p.poll() is None, p.stderr.read() if p.stderr else ""
    b = nodes.cluster.nodes["b"]
    handoffs = [h for h in nodes.cluster.handoffs() if str(b.state.parent) in " ".join(h.cmdline())]
    assert handoffs, "no target handoff holds the restored tree"
    b.stop_agent(signal.SIGKILL)
    for h in handoffs:
        h.kill()
    b.start_agent(lease=nodes.cluster.lease)  # a DaemonSet brings it back
    (pause / f"{Point.CLIENT_RESTORED}.go").touch()
    _, err = p.communicate(timeout=240)
    assert p.returncode in (4, 5), err
    ready = lambda: "this placeholder is empty" in holder.log.read_text(errors="replace")  # noqa: E731
    wait_until(ready, 30, "the placeholder to say it is empty")
    _keeps_training(nodes, job)


HOLD = (
    "import sys, time\nf = open(sys.argv[1], 'rb', buffering=0)\n"
    "print('holding', flush=True)\ntime.sleep(1e6)\n"
)
CONNECT = (
    "import socket, sys, time\ns = socket.create_connection((sys.argv[1], int(sys.argv[2])))\n"
    "print('connected', flush=True)\ntime.sleep(1e6)\n"
)


def _refused(nodes: Nodes, pod, says: str) -> None:
    """Migrating `pod`'s container is refused in one line before anything froze; it runs on."""
    r = nodes.cluster.migrate(containers.name_of(pod.container), "b")
    assert r.returncode != 0 and says in r.stderr, r.stderr
    assert "nothing was frozen" in r.stderr and "Traceback" not in r.stderr
    said = [line for line in r.stderr.splitlines() if line.startswith("criuctl:")]  # besides progress bars
    assert len(said) == 1, r.stderr
    assert nodes.runtimes["a"].status(pod.container).state == 1  # CONTAINER_RUNNING


def test_unknown_device_and_remote_connection_are_refused_before_freezing(nodes: Nodes) -> None:
    """A device criuctl cannot reopen elsewhere, and a TCP connection to another host (the pod's
    address changes with its node): both refused before the freeze, the container untouched."""
    import socket

    dev = nodes.pod(
        "a", "holds-dev", [*INIT, "--", PY, "-c", HOLD, "/dev/loop-control"], devices=["/dev/loop-control"]
    )
    bridge = f"{nodes.cluster.net}.1"  # the host's side of the test network: another host to the pod
    server = socket.create_server((bridge, 0))
    port = server.getsockname()[1]
    tcp = nodes.pod("a", "talks", [*INIT, "--", PY, "-c", CONNECT, bridge, str(port)])
    try:
        peer, _ = server.accept()
        for pod, word in ((dev, "holding"), (tcp, "connected")):
            wait_until(lambda p=pod, w=word: w in p.log.read_text(errors="replace"), 30, word)
        _refused(nodes, dev, "holds device /dev/loop-control open")
        # the agent lists the pod's connections: it is a rank of a job whose far end is no workload
        _refused(nodes, tcp, f"connection to {bridge}:{port}")
        peer.sendall(b"still there")  # the connection was never frozen or cut
    finally:
        server.close()


def test_criu_missing_on_the_target_refuses_before_freezing(nodes: Nodes) -> None:
    job, _ = _job(nodes, "no-criu-there")
    b = nodes.cluster.nodes["b"]
    b.stop_agent()
    b.start_agent(env={"CRIUCTL_CRIU": "/nonexistent/criu"}, lease=nodes.cluster.lease)
    try:
        r = nodes.cluster.migrate(containers.name_of(job.container), "b")
        assert r.returncode != 0 and "node b cannot restore" in r.stderr and "CRIU" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        _keeps_training(nodes, job)
    finally:
        b.stop_agent()
        b.start_agent(lease=nodes.cluster.lease)


def test_containers_are_found_without_the_runtime(nodes: Nodes) -> None:
    """The /proc fallback (no runtime socket) finds a container's PID 1 by its ID, as the CRI does."""
    from criuctl.container import runtime

    job, _ = _job(nodes, "by-cgroup", placeholder=False)
    found = runtime.connect("procfs").container(job.container[:12])
    assert found.id == job.container
    assert found.pid == nodes.runtimes["a"].pid_of(job.container)
