"""A real containerd per test node, driven over the CRI exactly as a kubelet drives it.

Each node gets its own containerd (Debian 12's 1.6.20 + runc, or 2.x where installed) with root,
state and sockets under the test's folder, started inside the node's network namespace so that
host-network pods have the node's address. No CNI: pods use the node's network, as
/work/shared/design.md §2 says works here. Pods are created with the CRI calls the kubelet makes
(RunPodSandbox, CreateContainer, StartContainer), with the labels a kubelet would set.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import psutil
from criuctl_cri import api_pb2 as pb
from criuctl_cri import api_pb2_grpc as rpc
from localcluster import containerd_config

from criuctl.container import containers
from tests.cluster import Cluster

IMAGES = Path("/usr/local/lib/criuctl/images")
BUSYBOX = "criuctl.test/busybox:1"
REPO = Path(__file__).resolve().parent.parent
# What a training container needs from the host, read-only: the Python the venv was made from,
# its libraries, and the project (venv, test workloads).
PYTHON_MOUNTS = ("/usr", "/lib", "/lib64", "/root/.pyenv", str(REPO))
CGROUP_PARENT = "k8s.io"  # containerd's default parent under every cgroup hierarchy


def containerd_binary() -> str | None:
    return shutil.which("containerd")


@dataclass
class Pod:
    sandbox: str
    container: str
    log: Path
    config: object = field(repr=False)


class Containerd:
    def __init__(self, root: Path, netns: str | None = None, config: str | None = None) -> None:
        """`config`: a containerd configuration of the caller's (default: format 2, 1.6's)."""
        self.root = root
        self.config = config
        self.sock = root / "containerd.sock"
        self.netns = netns
        self.proc: subprocess.Popen | None = None
        self.pods: list[Pod] = []

    @property
    def endpoint(self) -> str:
        return f"unix://{self.sock}"

    def start(self) -> Containerd:
        for d in ("cni-bin", "cni-conf", "logs"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        config = self.root / "config.toml"
        criu = shutil.which("criu") or "criu"
        config.write_text(self.config or containerd_config.v2(self.root, BUSYBOX, criu))
        argv = ["containerd", "--config", str(config)]
        if self.netns:
            argv = ["nsenter", f"--net=/run/netns/{self.netns}", *argv]
        log = (self.root / "containerd.log").open("ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 30
        while not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"containerd did not start: {self.log()[-2000:]}")
            time.sleep(0.1)
        self.connect()
        while True:  # a restarted containerd recovers its containers before its CRI serves
            try:
                self.rt.Version(pb.VersionRequest(), timeout=30)
                break
            except grpc.RpcError as exc:
                if "not initialized" not in (exc.details() or "") or time.monotonic() > deadline + 30:
                    raise
                time.sleep(0.2)
        r = subprocess.run(
            ["ctr", "-a", str(self.sock), "-n", "k8s.io", "images", "import", str(IMAGES / "busybox.tar")],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
        return self

    def connect(self) -> Containerd:
        """The CRI client of this containerd (started here, or by another process at `root`)."""
        self.channel = grpc.insecure_channel(self.endpoint)
        self.rt = rpc.RuntimeServiceStub(self.channel)
        return self

    def log(self) -> str:
        return (self.root / "containerd.log").read_text(errors="replace")

    def run_pod(
        self,
        name: str,
        command: list[str],
        mounts: dict[str, str] | None = None,
        rw_mounts: dict[str, str] | None = None,
        container: str = "train",
        namespace: str = "default",
        memory_limit: int = 0,
        env: dict[str, str] | None = None,
        devices: list[str] | dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
        cgroup_parent: str = "",
    ) -> Pod:
        """A pod with one container, as the kubelet would create it (host network, own PID ns).
        `annotations`: the container's (a device plugin's CDI devices, `cdi.k8s.io/NAME: KIND=DEV`);
        `cgroup_parent`: the pod's cgroup, as the kubelet names it for its cgroup driver."""
        uid = f"uid-{name}-{os.urandom(3).hex()}"
        logdir = self.root / "logs" / f"{namespace}_{name}_{uid}"
        logdir.mkdir(parents=True, exist_ok=True)
        ns = pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER, ipc=pb.POD)
        labels = {
            "io.kubernetes.pod.name": name,
            "io.kubernetes.pod.namespace": namespace,
            "io.kubernetes.pod.uid": uid,
        }
        cfg = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(name=name, namespace=namespace, uid=uid, attempt=0),
            log_directory=str(logdir),
            labels=labels,
            linux=pb.LinuxPodSandboxConfig(
                cgroup_parent=cgroup_parent,
                security_context=pb.LinuxSandboxSecurityContext(namespace_options=ns),
            ),
        )
        sandbox = self.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=cfg), timeout=60).pod_sandbox_id
        m = [pb.Mount(container_path=p, host_path=h, readonly=True) for p, h in (mounts or {}).items()]
        m += [pb.Mount(container_path=p, host_path=h) for p, h in (rw_mounts or {}).items()]
        cc = pb.ContainerConfig(
            metadata=pb.ContainerMetadata(name=container),
            image=pb.ImageSpec(image=BUSYBOX),
            command=command,
            envs=[pb.KeyValue(key=k, value=v) for k, v in (env or {}).items()],
            log_path=f"{container}.log",
            mounts=m,
            devices=[
                pb.Device(container_path=c, host_path=h, permissions="rw")
                for c, h in (
                    devices.items() if isinstance(devices, dict) else ((d, d) for d in devices or [])
                )
            ],
            labels={**labels, "io.kubernetes.container.name": container},
            annotations=annotations or {},
            linux=pb.LinuxContainerConfig(
                resources=pb.LinuxContainerResources(memory_limit_in_bytes=memory_limit),
                security_context=pb.LinuxContainerSecurityContext(namespace_options=ns),
            ),
        )
        cid = self.rt.CreateContainer(
            pb.CreateContainerRequest(pod_sandbox_id=sandbox, config=cc, sandbox_config=cfg), timeout=60
        ).container_id
        self.rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=60)
        pod = Pod(sandbox, cid, logdir / f"{container}.log", cfg)
        self.pods.append(pod)
        return pod

    def status(self, cid: str) -> object:
        return self.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid), timeout=10).status

    def pid_of(self, cid: str) -> int:
        st = self.rt.ContainerStatus(pb.ContainerStatusRequest(container_id=cid, verbose=True), timeout=10)
        return int(json.loads(st.info["info"])["pid"])

    def kill_daemon(self) -> None:
        """containerd itself dies (SIGKILL); its shims, and the containers, live on."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.channel.close()
        self.sock.unlink(missing_ok=True)

    def restart_daemon(self) -> None:
        self.start()

    def stop_container(self, cid: str, grace: int = 10) -> None:
        self.rt.StopContainer(pb.StopContainerRequest(container_id=cid, timeout=grace), timeout=grace + 30)

    def wait_exited(self, cid: str, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.status(cid)
            if st.state == pb.CONTAINER_EXITED:
                return st.exit_code
            time.sleep(0.2)
        raise AssertionError(f"container {cid[:12]} still {self.status(cid).state} after {timeout}s")

    def stop(self) -> None:
        """Everything this containerd started goes: pods, shims, mounts, cgroups."""
        if self.proc is None:
            return
        for pod in self.pods:
            with contextlib.suppress(grpc.RpcError):
                self.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=pod.sandbox), timeout=30)
                self.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=pod.sandbox), timeout=30)
        with contextlib.suppress(Exception):
            self.channel.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        for p in psutil.process_iter(["cmdline"]):  # shims outlive containerd by design
            if str(self.sock) in " ".join(p.info["cmdline"] or []):
                with contextlib.suppress(psutil.Error):
                    for child in p.children(recursive=True):
                        child.kill()
                    p.kill()
        for line in reversed(Path("/proc/self/mountinfo").read_text().splitlines()):
            point = line.split()[4]
            if point.startswith(str(self.root) + "/"):
                subprocess.run(["umount", "-l", point], capture_output=True)
        for pod in self.pods:
            for cid in (pod.sandbox, pod.container):
                for hier in Path("/sys/fs/cgroup").iterdir():
                    with contextlib.suppress(OSError):
                        (hier / CGROUP_PARENT / cid).rmdir()
        self.proc = None


JOB = REPO / "tests" / "workloads" / "train_cnn_loader.py"
PY = str(REPO / ".venv" / "bin" / "python")
INIT = [PY, "-I", "/.criuctl/nsinit.py"]  # criuctl's init, from the inject volume at /.criuctl
_STEP = re.compile(r" (?:stdout|stderr) [FP] step (\d+) loss (\S+)$")
_FINAL = re.compile(r" stdout [FP] final ([0-9a-f]{64})$")


def job_argv(steps: int, log: str, scratch: str | None = "/scratch") -> list[str]:
    """The training job (DataLoader workers, a thread, a log file, a file held open in /scratch)."""
    argv = [PY, str(JOB), "--steps", str(steps), "--workers", "2", "--log", log]
    return argv + (["--scratch", scratch] if scratch else [])


def cri_steps(log: Path) -> dict[int, str]:
    out: dict[int, str] = {}
    if log.exists():
        for line in log.read_text(errors="replace").splitlines():
            if m := _STEP.search(line):
                out[int(m[1])] = m[2]
    return out


def cri_final(log: Path) -> list[str]:
    return [m[1] for line in log.read_text(errors="replace").splitlines() if (m := _FINAL.search(line))]


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class Nodes:
    """Two test nodes (network namespaces), each with its own containerd and criuctl agent."""

    cluster: Cluster
    runtimes: dict[str, Containerd]
    inject: Path
    root: Path

    def empty_dir(self, node: str, pod: str) -> Path:
        d = self.root / node / "kubelet" / "pods" / pod / "volumes" / "kubernetes.io~empty-dir" / "scratch"
        d.mkdir(parents=True, exist_ok=True)
        return d

    def pod(
        self,
        node: str,
        name: str,
        command: list[str],
        scratch: Path | None = None,
        shared: Path | None = None,
        **kw,
    ) -> Pod:
        """A pod whose container sees the host's Python (read-only) and criuctl's inject dir;
        `scratch` at /scratch, and `shared` (read-write) at its own path."""
        mounts = {p: p for p in PYTHON_MOUNTS}
        mounts["/.criuctl"] = str(self.inject)
        rw = {"/scratch": str(scratch)} if scratch else {}
        if shared is not None:
            rw[str(shared)] = str(shared)
        return self.runtimes[node].run_pod(name, command, mounts=mounts, rw_mounts=rw, **kw)


def two_nodes(tmp_path_factory, agent_env: dict[str, dict[str, str]] | None = None) -> Iterator[Nodes]:
    """The `nodes` fixture (tests/conftest.py): a cluster of two nodes with containerd and agents
    (`agent_env`: more environment for each node's agent)."""
    root = tmp_path_factory.mktemp("ctr")
    inject = containers.write_inject_dir(root / "inject")
    sockets = {n: root / n / "containerd" / "containerd.sock" for n in ("a", "b")}
    args = {
        n: ["--runtime-endpoint", f"unix://{s}", "--inject-dir", str(root / n / "inject")]
        for n, s in sockets.items()
    }
    with Cluster(root, agent_args=args, agent_env=agent_env) as cluster:
        runtimes = {}
        try:
            for n, node in cluster.nodes.items():
                runtimes[n] = Containerd(sockets[n].parent, netns=node.ns).start()
            yield Nodes(cluster, runtimes, inject, root)
        finally:
            for rt in runtimes.values():
                rt.stop()
