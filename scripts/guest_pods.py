"""The container half of scripts/guest-check.sh, run inside each guest (a node with a kernel of its
own, cgroup v2, systemd as PID 1): a containerd 2 as the GPU Operator's nodes run it — runc's
systemd cgroup driver, CDI on, a CDI spec for a stand-in device class — and pods made over the CRI
as a kubelet with the systemd driver makes them (the pod's cgroup a `kubepods-…-pod<uid>.slice`,
the device plugin's CDI device in the container's `cdi.k8s.io/*` annotation).

    ns STEPS   on the host, not in a guest: the same job and move between two of the tests'
               namespace nodes (tests/containerd.py: containerd 1.6, cgroupfs, cgroup v1), one JSON line
    up NODE    containerd up (before the node's agent, which serves its socket); on b also the
               placeholder the job moves into, ready before b's agent answers
    move STEPS the job's pod on a, `criuctl migrate` of it to b once it ran STEPS // 4 steps
    end STEPS  on b: the restored job seen in the placeholder, then its end

Each prints `key: value` lines, which the guest's console carries to the host. The pod names and
the stand-in CDI device are this file's; the job is the tests' (tests/containerd.py).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from criuctl_cri import api_pb2 as pb
from localcluster import containerd_config

from criuctl.container import cgroups, containers
from tests.containerd import BUSYBOX, INIT, Containerd, Nodes, cri_final, cri_steps, job_argv, wait_until

ROOT = Path("/var/lib/criuctl-ctr")
INJECT = ROOT / "inject"
CDI_DIR = Path("/etc/cdi")
# The stand-in device class: what a GPU's CDI spec gives a container (a device node, an
# environment variable), with /dev/zero's numbers standing in for the GPU's.
CDI_KIND, CDI_DEVICE, DEVICE_NODE = "criuctl.test/gpu", "0", "/dev/criuctl-gpu0"
CDI_ENV = "STANDIN_CDI_GPU=0"  # not CRIUCTL_*: no variable of criuctl (tests/test_env.py)
POD, CONTAINER = "trainer", "train"
UID = "5a1e0000-0000-4000-8000-00000000c0de"  # one pod's UID on both nodes, as a successor keeps its name


def say(key: str, value: object) -> None:
    print(f"{key}: {value}", flush=True)


def _cdi_spec() -> None:
    """The node's CDI spec for the stand-in device class (a GPU Operator writes the GPUs')."""
    spec = {
        "cdiVersion": "0.6.0",
        "kind": CDI_KIND,
        "devices": [
            {
                "name": CDI_DEVICE,
                "containerEdits": {"deviceNodes": [{"path": DEVICE_NODE, "hostPath": "/dev/zero"}]},
            }
        ],
        "containerEdits": {"env": [CDI_ENV]},
    }
    CDI_DIR.mkdir(parents=True, exist_ok=True)
    (CDI_DIR / "criuctl-test.json").write_text(json.dumps(spec))


def _runtime() -> Containerd:
    config = containerd_config.v3(ROOT, BUSYBOX, systemd=True, cdi_dirs=(CDI_DIR,))
    return Containerd(ROOT, config=config)


def _nodes(rt: Containerd) -> Nodes:
    return Nodes(cluster=None, runtimes={"here": rt}, inject=INJECT, root=ROOT)  # type: ignore[arg-type]


def _pod(nodes: Nodes, command: list[str]) -> object:
    """The pod on this node, as the kubelet (systemd driver) and a device plugin (CDI) make it."""
    scratch = nodes.empty_dir("here", POD)
    slice_name = f"kubepods-besteffort-pod{UID.replace('-', '_')}.slice"
    return nodes.pod(
        "here",
        POD,
        command,
        scratch,
        container=CONTAINER,
        annotations={"cdi.k8s.io/criuctl-test": f"{CDI_KIND}={CDI_DEVICE}"},
        cgroup_parent=slice_name,
    )


def _cgroup(pid: int) -> str:
    """The unified hierarchy's cgroup (the only one on a v2 node)."""
    return f"0::{cgroups.unified_path(pid)}"


def _cdi_seen(pid: int) -> str:
    """What the CDI device gave the container whose process is `pid`: its node and its variable."""
    node = Path(f"/proc/{pid}/root{DEVICE_NODE}").exists()
    env = CDI_ENV.encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return f"device node {'present' if node else 'MISSING'}, environment {'set' if env else 'MISSING'}"


def up(node: str) -> None:
    containers.write_inject_dir(INJECT)
    _cdi_spec()
    rt = _runtime().start()
    say("containerd", rt.rt.Version(pb.VersionRequest(), timeout=30).runtime_version)
    if node != "b":
        return
    holder = _pod(_nodes(rt), [*INIT, "--placeholder"])
    wait_until(lambda: "placeholder ready" in holder.log.read_text(errors="replace"), 300, "the placeholder")
    pid = rt.pid_of(holder.container)
    say("placeholder", f"{holder.container[:12]} in {_cgroup(pid)}; CDI: {_cdi_seen(pid)}")


def _connect() -> Containerd:
    """This node's containerd, started by `up` (a process of its own), reached again."""
    return _runtime().connect()


def _reference(steps: int) -> list[str]:
    """The job's `final` line from an uninterrupted run here (this CPU's float sums)."""
    ran = subprocess.run(
        [sys.executable, *job_argv(steps, "/dev/null", None)[1:]], capture_output=True, text=True, check=True
    ).stdout
    return [line for line in ran.splitlines() if line.startswith("final ")]


def _holder(rt: Containerd) -> tuple[str, Path]:
    for c in rt.rt.ListContainers(pb.ListContainersRequest(), timeout=30).containers:
        if c.metadata.name == CONTAINER:
            return c.id, Path(rt.status(c.id).log_path)
    raise SystemExit("no placeholder container on this node: `up b` made none")


def move(steps: int) -> None:
    rt = _connect()
    say("reference", next(iter(_reference(steps)), "none"))
    job = _pod(_nodes(rt), [*INIT, "--", *job_argv(steps, "/workspace/train.log")])
    wait_until(lambda: len(cri_steps(job.log)) >= steps // 4, 1800, f"{steps // 4} steps on node a")
    pid = rt.pid_of(job.container)
    say("source", f"{job.container[:12]} in {_cgroup(pid)}; CDI: {_cdi_seen(pid)}")
    r = subprocess.run(
        ["criuctl", "migrate", containers.name_of(job.container), "--to", "b", "--json"],
        capture_output=True,
        text=True,
    )
    if r.returncode == 0:
        say("migrate", r.stdout.strip().splitlines()[-1])
    else:
        say("migrate", f"failed ({r.returncode}): {' '.join(r.stderr.strip().splitlines()[-3:])}")
    time.sleep(2)
    say("steps_here", len(cri_steps(job.log)))
    say("final_here", cri_final(job.log) or "none")


def end(steps: int) -> None:
    rt = _connect()
    cid, log = _holder(rt)
    holder = rt.pid_of(cid)

    def restored() -> list[int]:
        procs = [p for p in Path("/proc").iterdir() if p.name.isdigit() and p.name != str(holder)]
        return [int(p.name) for p in procs if _is_job(p)]

    wait_until(lambda: restored() or "final " in log.read_text(errors="replace"), 3600, "the restored job")
    if pids := restored():
        say("restored", f"{len(pids)} processes in {_cgroup(pids[0])}; CDI: {_cdi_seen(pids[0])}")
        say("placeholder_cgroup", _cgroup(holder))
    wait_until(lambda: rt.status(cid).state == 2, 3600, "the placeholder's exit")  # CONTAINER_EXITED
    say("exit_code", rt.status(cid).exit_code)
    after = cri_steps(log)
    say("steps_here", len(after))
    say("first_step_here", min(after) if after else "none")
    say("final", f"final {cri_final(log)[0]}" if cri_final(log) else "none")
    say("steps_expected", steps)


def ns(steps: int) -> None:
    """The same job and move between two namespace nodes on this machine, for the numbers beside
    the guests' (one kernel, no emulator); its own reference (the guests' CPU is another)."""
    from tests.containerd import two_nodes

    made: list[str] = []

    class Folders:  # what two_nodes asks of pytest's tmp_path_factory
        def mktemp(self, name: str) -> Path:
            made.append(tempfile.mkdtemp(prefix=f"criuctl-guest-{name}-"))
            return Path(made[-1])

    reference = _reference(steps)
    cluster = two_nodes(Folders())
    nodes = next(cluster)
    try:
        job = nodes.pod(
            "a", POD, [*INIT, "--", *job_argv(steps, "/workspace/train.log")], nodes.empty_dir("a", POD)
        )
        holder = nodes.pod("b", POD, [*INIT, "--placeholder"], nodes.empty_dir("b", POD))
        wait_until(
            lambda: "placeholder ready" in holder.log.read_text(errors="replace"), 120, "the placeholder"
        )
        wait_until(lambda: len(cri_steps(job.log)) >= steps // 4, 600, f"{steps // 4} steps on node a")
        r = nodes.cluster.migrate(containers.name_of(job.container), "b")
        if r.returncode != 0:
            raise SystemExit(f"the move failed: {r.stderr.strip()[-500:]}")
        nodes.runtimes["b"].wait_exited(holder.container, timeout=600)
        after = cri_steps(holder.log)
        print(
            json.dumps(
                {
                    "migrate": json.loads(r.stdout.strip().splitlines()[-1]),
                    "reference": reference,
                    "final": [f"final {f}" for f in cri_final(holder.log)],
                    "steps_there": len(cri_steps(job.log)),
                    "steps_here": len(after),
                }
            )
        )
    finally:
        cluster.close()  # its agents, containerds and pods go
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)


def _is_job(proc: Path) -> bool:
    try:
        return b"train_cnn_loader.py" in (proc / "cmdline").read_bytes()
    except OSError:
        return False


if __name__ == "__main__":
    verbs = {
        "up": lambda a: up(a),
        "move": lambda a: move(int(a)),
        "end": lambda a: end(int(a)),
        "ns": lambda a: ns(int(a)),
    }
    if len(sys.argv) != 3 or sys.argv[1] not in verbs:
        raise SystemExit("usage: guest_pods.py up NODE | move STEPS | end STEPS | ns STEPS (guest-check.sh)")
    verbs[sys.argv[1]](sys.argv[2])
