"""Kubelet/CRI checkpoint archives: the real CheckpointContainer call, the import, and hostile input.

The real half runs containerd 2.x (extracted from Debian sid by scripts/install-containerd2.sh; 1.6
and 1.7 do not implement CheckpointContainer) with Debian 12's runc and our CRIU, in a folder of its
own: a pod with host network and its own PID namespace per container, a busybox shell counting
and a Python "trainer" (a DataLoader-like worker process fed through a pipe, a thread, a log file
in its writable layer) run from the host's Python through read-only mounts. The kubelet's call
underneath `POST /checkpoint/...` is then made through `criuctl.container.runtime`, the archive imported as a
bundle and inspected through the CLI.

The hostile half needs nothing but Python: archives built here that no runtime writes.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from localcluster import containerd_config

from criuctl.container.runtime import archive
from criuctl.format import bundle
from tests.requirements import BUSYBOX_TAR as IMAGE_TAR
from tests.requirements import CONTAINERD2, needs, require

REPO = Path(__file__).resolve().parent.parent
CRIUCTL = REPO / ".venv" / "bin" / "criuctl"
# The test image scripts/install-containerd.sh builds, IMAGE_TAR (as tests/containerd.py uses it; not
# imported from there: that module needs the CRI stubs, and the hostile-archive tests here need nothing).
# Its applets: sh, sleep, cat, ls, echo; its command sleeps (the pause container).
IMAGE = "criuctl.test/busybox:1"
KEY = b"k" * 32

TRAINER = r"""
import multiprocessing as mp, random, threading, time

def worker(conn):
    r = random.Random(0)
    while True:
        conn.send([r.random() for _ in range(64)])

if __name__ == "__main__":
    with open("/tmp/train.log", "w") as f:
        f.write("started\n")
    rx, tx = mp.Pipe(duplex=False)
    mp.Process(target=worker, args=(tx,), daemon=True).start()
    threading.Thread(target=lambda: [time.sleep(0.5) for _ in iter(int, 1)], daemon=True).start()
    w, step = [0.0] * 64, 0
    while True:
        x = rx.recv()
        w = [wi - 0.01 * xi for wi, xi in zip(w, x)]
        step += 1
        if step % 10 == 0:
            print("step", step, round(sum(w), 6), flush=True)
        time.sleep(0.01)
"""
COUNTER = "busybox rm /bin/cat; echo kept > /written; i=0; while :; do echo $i; i=$((i+1)); sleep 0.2; done"


# ------------------------------------------------------------------------------ containerd 2 node


@dataclass
class Node:
    """A containerd 2.x of this test's own: root, state, sockets and cgroup parent in `root`."""

    root: Path
    proc: subprocess.Popen[bytes]
    cgroup_parent: str
    pb: object = None
    rt: object = None
    channel: object = None
    sandboxes: list[str] = field(default_factory=list)

    @property
    def sock(self) -> Path:
        return self.root / "containerd.sock"

    @property
    def endpoint(self) -> str:
        return f"unix://{self.sock}"


def _wait_socket(node: Node, deadline: float) -> None:
    while not node.sock.exists():
        if node.proc.poll() is not None or time.monotonic() > deadline:
            log = (node.root / "containerd.log").read_text(errors="replace")[-2000:]
            raise AssertionError(f"containerd 2 did not start:\n{log}")
        time.sleep(0.05)


def _start(root: Path) -> Node:
    for d in ("cni-bin", "cni-conf", "logs"):
        (root / d).mkdir()
    (root / "config.toml").write_text(containerd_config.v3(root, IMAGE))
    env = dict(os.environ)
    # the 2.x shim first (containerd starts the shim it finds on PATH), CRIU 4 before any other
    env["PATH"] = f"{CONTAINERD2 / 'bin'}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    with (root / "containerd.log").open("wb") as log:
        proc = subprocess.Popen(
            [CONTAINERD2 / "bin" / "containerd", "--config", root / "config.toml"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    node = Node(root, proc, cgroup_parent=f"/criuctl-cri-archive-{os.getpid()}")
    _wait_socket(node, time.monotonic() + 20)
    subprocess.run(
        [CONTAINERD2 / "bin" / "ctr", "-a", node.sock, "-n", "k8s.io", "images", "import", IMAGE_TAR],
        check=True,
        capture_output=True,
        env=env,
    )
    import grpc
    from criuctl_cri import api_pb2, api_pb2_grpc

    node.pb = api_pb2
    node.channel = grpc.insecure_channel(node.endpoint)
    node.rt = api_pb2_grpc.RuntimeServiceStub(node.channel)
    return node


def _namespaces(pb):
    return pb.NamespaceOption(network=pb.NamespaceMode.NODE, pid=pb.NamespaceMode.CONTAINER)


def _pod(node: Node, name: str):
    pb = node.pb
    config = pb.PodSandboxConfig(
        metadata=pb.PodSandboxMetadata(name=name, namespace="ml", uid=f"uid-{name}", attempt=0),
        log_directory=str(node.root / "logs" / name),
        linux=pb.LinuxPodSandboxConfig(
            cgroup_parent=node.cgroup_parent,
            security_context=pb.LinuxSandboxSecurityContext(namespace_options=_namespaces(pb)),
        ),
    )
    sid = node.rt.RunPodSandbox(pb.RunPodSandboxRequest(config=config), timeout=60).pod_sandbox_id
    node.sandboxes.append(sid)
    return sid, config


def _container(node: Node, sid: str, pod_config, name: str, command: list[str], mounts: list[str]) -> str:
    pb = node.pb
    config = pb.ContainerConfig(
        metadata=pb.ContainerMetadata(name=name),
        image=pb.ImageSpec(image=IMAGE),
        command=command,
        log_path=f"{name}.log",
        mounts=[pb.Mount(container_path=m, host_path=m, readonly=True) for m in mounts],
        linux=pb.LinuxContainerConfig(
            security_context=pb.LinuxContainerSecurityContext(namespace_options=_namespaces(pb))
        ),
    )
    req = pb.CreateContainerRequest(pod_sandbox_id=sid, config=config, sandbox_config=pod_config)
    cid = node.rt.CreateContainer(req, timeout=60).container_id
    node.rt.StartContainer(pb.StartContainerRequest(container_id=cid), timeout=60)
    return cid


def _log(node: Node, pod: str, name: str) -> str:
    try:
        return (node.root / "logs" / pod / f"{name}.log").read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _wait_log(node: Node, pod: str, name: str, text: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while text not in (log := _log(node, pod, name)):
        assert time.monotonic() < deadline, f"{name} never printed {text!r}; its log:\n{log[-2000:]}"
        time.sleep(0.05)
    return log


def _kill(pids: set[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _cgroup_pids(folder: Path) -> set[int]:
    pids: set[int] = set()
    for procs in folder.rglob("cgroup.procs"):
        try:
            pids |= {int(p) for p in procs.read_text().split()}
        except OSError:
            continue
    return pids


def _shims(node: Node) -> set[int]:
    """This node's shims: processes whose command line names this node's socket (never any other's)."""
    found = set()
    needle = str(node.sock).encode()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if needle in (d / "cmdline").read_bytes() and int(d.name) != node.proc.pid:
                    found.add(int(d.name))
            except OSError:
                continue
    return found


def _stop(node: Node) -> None:
    """Remove the pods, stop containerd and its shims, unmount what it mounted under its root, and
    remove the cgroup folders of its pods from every hierarchy."""
    pb = node.pb
    if node.rt is not None:
        for sid in node.sandboxes:
            try:
                node.rt.StopPodSandbox(pb.StopPodSandboxRequest(pod_sandbox_id=sid), timeout=20)
                node.rt.RemovePodSandbox(pb.RemovePodSandboxRequest(pod_sandbox_id=sid), timeout=20)
            except Exception as exc:  # the cleanup below kills what is left
                print(f"cleanup: pod {sid[:12]}: {exc}", file=sys.stderr)
        node.channel.close()
    node.proc.terminate()
    try:
        node.proc.wait(10)
    except subprocess.TimeoutExpired:
        node.proc.kill()
        node.proc.wait()
    cgroups = [h / node.cgroup_parent.lstrip("/") for h in Path("/sys/fs/cgroup").iterdir()]
    pids = _shims(node)
    for cg in cgroups:
        pids |= _cgroup_pids(cg) if cg.is_dir() else set()
    _kill(pids)
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    for point in sorted((p for p in points if p.startswith(f"{node.root}/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
    deadline = time.monotonic() + 10
    for cg in cgroups:
        for d in sorted((p for p in [cg, *cg.rglob("*")] if p.is_dir()), key=lambda p: -len(p.parts)):
            while True:
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # processes still leaving it
                    if time.monotonic() > deadline:
                        print(f"cleanup: cannot remove {d}", file=sys.stderr)
                        break
                    _kill(_cgroup_pids(d))
                    time.sleep(0.05)
    shutil.rmtree(node.root, ignore_errors=True)


@dataclass
class Checkpointed:
    node: Node
    archive: Path  # the trainer's
    counter_archive: Path
    trainer_id: str
    counter_id: str
    seconds: dict[str, float]


@pytest.fixture(scope="module")
def checkpointed() -> Iterator[Checkpointed]:
    """One containerd 2 node, two containers in one pod, each checkpointed once through CRI."""
    for name in ("criu", "containerd-2"):
        require(name)
    from criuctl.container import runtime

    root = Path(tempfile.mkdtemp(prefix="criuctl-cri2-", dir="/tmp"))
    seconds: dict[str, float] = {}
    node = None
    try:
        started = time.monotonic()
        node = _start(root)
        seconds["containerd start + image import"] = time.monotonic() - started
        sid, pod = _pod(node, "trainer-0")
        started = time.monotonic()
        counter = _container(node, sid, pod, "counter", ["/bin/sh", "-c", COUNTER], [])
        mounts = ["/usr", "/lib", "/lib64", str(REPO / ".venv")]
        if not sys.base_prefix.startswith("/usr"):
            mounts.append(sys.base_prefix)  # the venv's interpreter (pyenv here)
        script = ["/bin/sh", "-c", 'exec "$0" -c "$1"', str(REPO / ".venv" / "bin" / "python"), TRAINER]
        trainer = _container(node, sid, pod, "trainer", script, mounts)
        seconds["two containers created and started"] = time.monotonic() - started
        _wait_log(node, "trainer-0", "trainer", "step 20")
        _wait_log(node, "trainer-0", "counter", " 3\n")
        rt = runtime.connect(node.endpoint)
        out = {}
        for name, cid in (("trainer", trainer), ("counter", counter)):
            out[name] = root / f"{name}.checkpoint.tar"
            started = time.monotonic()
            rt.checkpoint(cid, str(out[name]))
            seconds[f"CheckpointContainer ({name})"] = time.monotonic() - started
        yield Checkpointed(node, out["trainer"], out["counter"], trainer, counter, seconds)
    finally:
        if node is not None:
            _stop(node)
        else:
            shutil.rmtree(root, ignore_errors=True)
        for what, s in seconds.items():
            print(f"\ntiming: {what}: {s:.2f} s", end="")


# ------------------------------------------------------------------------------------ real tests


def test_checkpoint_leaves_the_container_running(checkpointed: Checkpointed) -> None:
    """CheckpointContainer wrote the standard archive, and the job went on (it is a snapshot)."""
    from criuctl.container import runtime

    node = checkpointed.node
    assert archive.is_archive(checkpointed.archive)
    with tarfile.open(checkpointed.archive) as t:
        names = t.getnames()
    for member in ("checkpoint/pstree.img", "config.dump", "spec.dump", "rootfs-diff.tar"):
        assert member in names
    c = runtime.connect(node.endpoint).container(checkpointed.trainer_id)
    assert (c.state, c.name, c.pod_name, c.pod_namespace) == ("running", "trainer", "trainer-0", "ml")
    steps = _log(node, "trainer-0", "trainer").count("step ")
    _wait_log(node, "trainer-0", "trainer", f"step {(steps + 2) * 10}")
    assert checkpointed.seconds["CheckpointContainer (trainer)"] < 30


def test_read_says_what_the_archive_holds(checkpointed: Checkpointed) -> None:
    facts = archive.read(checkpointed.archive)
    assert facts.container_id == checkpointed.trainer_id
    assert (facts.name, facts.pod_name, facts.pod_namespace, facts.pod_uid) == (
        "trainer",
        "trainer-0",
        "ml",
        "uid-trainer-0",
    )
    assert facts.image == IMAGE
    assert facts.command[-1] == TRAINER
    assert {"/usr", str(REPO / ".venv"), "/etc/hosts", "/dev/shm"} <= {m.destination for m in facts.mounts}
    assert facts.rootfs_diff
    assert set(facts.stdio_pipes) == {"stdout", "stderr"}
    assert facts.cgroup.startswith(checkpointed.node.cgroup_parent)
    assert "pstree.img" in facts.images


def test_import_makes_a_verified_container_bundle(checkpointed: Checkpointed, tmp_path: Path) -> None:
    started = time.monotonic()
    manifest = archive.import_archive(checkpointed.archive, tmp_path / "b", KEY)
    took = time.monotonic() - started
    print(f"\ntiming: import of the trainer's archive: {took:.2f} s", end="")
    assert bundle.verify(tmp_path / "b", KEY).id == manifest.id
    c = manifest.container
    assert c is not None
    assert (c.id, c.name, c.pod_name, c.pod_namespace, c.image, c.runtime) == (
        checkpointed.trainer_id,
        "trainer",
        "trainer-0",
        "ml",
        IMAGE,
        "cri-archive",
    )
    # runc marks every bind and cgroup mount external; the host network is the node's, not external
    assert {"/usr", str(REPO / ".venv"), "/etc/hosts", "/etc/resolv.conf", "/dev/shm"} <= set(
        c.external_mounts
    )
    assert any(m.startswith("/sys/fs/cgroup") for m in c.external_mounts)
    assert c.netns_external is False
    assert c.rootfs_diff == "rootfs-diff.tar"
    with tarfile.open(tmp_path / "b" / c.rootfs_diff) as diff:
        assert "tmp/train.log" in diff.getnames()  # the trainer wrote it into its writable layer
    assert set(manifest.stdio_pipes) == {"stdout", "stderr"}
    assert all(v.startswith("pipe:[") for v in manifest.stdio_pipes.values())
    by_pid = {p.ns_pid: p for p in manifest.processes}
    init = by_pid[1]  # the trainer is PID 1 of its container (pid namespace CONTAINER)
    assert init.cmdline[-1] == TRAINER and init.name.startswith("python")
    assert init.threads >= 2  # the main thread and the ticker
    workers = [p for p in manifest.processes if p.ppid == 1]
    assert workers and workers[0].cmdline == init.cmdline  # the forked worker keeps argv
    assert init.rss_bytes > 1 << 20
    assert manifest.criu_version.startswith("4.")
    assert (tmp_path / "b" / "images" / "pstree.img").is_file()
    assert (tmp_path / "b" / "cri" / "spec.dump").is_file()


def test_import_of_an_extracted_archive(checkpointed: Checkpointed, tmp_path: Path) -> None:
    """The counter's archive extracted by hand (as a kubelet's checkpoint folder may be) imports too,
    and a file the container deleted from its image is carried as the runtime records it."""
    folder = tmp_path / "extracted"
    folder.mkdir()
    with tarfile.open(checkpointed.counter_archive) as t:
        t.extractall(folder, filter="data")
    assert archive.is_archive(folder)
    manifest = archive.import_archive(folder, tmp_path / "b", KEY)
    bundle.verify(tmp_path / "b", KEY)
    c = manifest.container
    assert c is not None and c.id == checkpointed.counter_id and c.name == "counter"
    assert [p.name for p in manifest.processes][:1] == ["sh"]
    with tarfile.open(tmp_path / "b" / "rootfs-diff.tar") as diff:
        names = diff.getnames()
    assert "written" in names
    # containerd records the deleted /bin/cat as an overlay whiteout, the import as a deleted path
    assert "bin/.wh.cat" in names and c.deleted == ["/bin/cat"]


def test_cli_inspects_an_archive(checkpointed: Checkpointed, state_dir: Path) -> None:
    r = subprocess.run([CRIUCTL, "inspect", checkpointed.archive], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    assert "checkpoint archive of container 'trainer'" in r.stdout
    assert "pod ml/trainer-0" in r.stdout
    assert "signature ok" in r.stdout
    assert not any((state_dir / "imports").iterdir())  # the import is gone again
    r = subprocess.run(
        [CRIUCTL, "inspect", checkpointed.archive, "--output", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["container"]["runtime"] == "cri-archive" and data["checks"]["ok"] is True


# ------------------------------------------------------------------------------- hostile archives


def test_dump_via_runtime_takes_the_kubelets_checkpoint(checkpointed: Checkpointed, state_dir: Path) -> None:
    """`criuctl dump CONTAINER --via-runtime`: CRI CheckpointContainer, then the archive imported as
    a bundle this node signed; the container keeps running."""
    node, out = checkpointed.node, state_dir.parent / "via-runtime"
    env = {**os.environ, "CRIUCTL_RUNTIME_ENDPOINT": node.endpoint}
    argv = [CRIUCTL, "dump", checkpointed.counter_id, "--bundle", out, "--via-runtime"]
    r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "checkpointed by its runtime" in r.stderr
    manifest = bundle.verify(out, bundle.load_key(state_dir / "bundle.key", create=False))
    assert manifest.container is not None and manifest.container.id == checkpointed.counter_id
    assert not list(out.parent.glob(".cri-checkpoint-*"))  # the runtime's archive is gone
    st = node.rt.ContainerStatus(node.pb.ContainerStatusRequest(container_id=checkpointed.counter_id))
    assert st.status.state == node.pb.CONTAINER_RUNNING


def test_archive_restores_into_a_placeholder_under_containerd_16(
    checkpointed: Checkpointed, tmp_path: Path, state_dir: Path
) -> None:
    """The other way round: the archive containerd 2.1.9 wrote, restored by criuctl into a placeholder
    container of Debian 12's containerd 1.6 (which has no CheckpointContainer at all). The trainer
    goes on from the checkpoint: the weight sums it prints after the restore are exactly those the
    original printed at the same steps (its random stream is seeded), and its log in the writable
    layer came along."""
    from criuctl.container import containers
    from tests.containerd import Containerd

    node = checkpointed.node
    node.rt.StopContainer(node.pb.StopContainerRequest(container_id=checkpointed.trainer_id, timeout=2))
    original = dict(_sums(_log(node, "trainer-0", "trainer")))
    old = Containerd(tmp_path / "c16").start()
    try:
        inject = containers.write_inject_dir(tmp_path / "inject")
        mounts = {m: m for m in ("/usr", "/lib", "/lib64", str(REPO / ".venv"), sys.base_prefix)}
        mounts["/.criuctl"] = str(inject)
        placeholder = [
            str(REPO / ".venv" / "bin" / "python"),
            "-I",
            "/.criuctl/nsinit.py",
            "--placeholder",
        ]
        holder = old.run_pod("trainer-0", placeholder, mounts=mounts, container="trainer", namespace="ml")
        deadline = time.monotonic() + 30
        while "placeholder ready" not in holder.log.read_text(errors="replace"):
            assert time.monotonic() < deadline, holder.log.read_text()
            time.sleep(0.1)
        env = {**os.environ, "CRIUCTL_RUNTIME_ENDPOINT": old.endpoint}
        argv = [CRIUCTL, "restore", checkpointed.archive, "--into", holder.container]
        restore = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while len(_sums(holder.log.read_text(errors="replace"))) < 3:
            assert restore.poll() is None, restore.stderr.read() if restore.stderr else ""
            assert time.monotonic() < deadline, holder.log.read_text()[-2000:]
            time.sleep(0.1)
        after = [
            ln.split(" F ")[-1].split() for ln in holder.log.read_text().splitlines() if " F step " in ln
        ]
        assert after and all(original.get(int(w[1]), w[2]) == w[2] for w in after), (after[:3], original)
        assert int(after[0][1]) > 10  # it went on from the checkpoint, it did not start over
        assert any(int(w[1]) in original for w in after)  # and overlaps what the original printed
        old.stop_container(holder.container, grace=2)  # PID 1 python ignores SIGTERM: SIGKILL after 2 s
        assert restore.wait(60) != 0
    finally:
        old.stop()


def _sums(cri_log: str) -> list[tuple[int, str]]:
    """(step, weight sum) the trainer printed, from a CRI log ("TIME stdout F step 20 -0.1234")."""
    out = []
    for line in cri_log.splitlines():
        words = line.split(" F ")[-1].split()
        if len(words) == 3 and words[0] == "step":
            out.append((int(words[1]), words[2]))
    return out


def _pycriu():
    require("pycriu")
    import pycriu

    return pycriu


def _image(magic: str, entries: list[dict]) -> bytes:
    buf = io.BytesIO()
    _pycriu().images.dump({"magic": magic, "entries": entries}, buf)
    return buf.getvalue()


def _tar(path: Path, members: list[tuple[str, bytes | tarfile.TarInfo]], mode: str = "w") -> Path:
    """A tar of `members`: (name, bytes) for a file, or a ready TarInfo (links, devices, folders)."""
    with tarfile.open(path, mode) as t:
        for name, data in members:
            if isinstance(data, tarfile.TarInfo):
                t.addfile(data)
            else:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    return path


def _good() -> list[tuple[str, bytes | tarfile.TarInfo]]:
    """The smallest archive that imports: a one-process tree, config and spec, stdio at the top."""
    spec = {
        "process": {"args": ["/bin/sleep", "9"]},
        "annotations": {"io.kubernetes.pod.name": "p", "io.kubernetes.pod.namespace": "n"},
    }
    folder = tarfile.TarInfo("checkpoint")
    folder.type = tarfile.DIRTYPE
    return [
        ("checkpoint", folder),
        (
            "checkpoint/pstree.img",
            _image("PSTREE", [{"pid": 1, "ppid": 0, "pgid": 1, "sid": 1, "threads": [1]}]),
        ),
        (
            "config.dump",
            json.dumps({"id": "ab" * 32, "name": "c_p_n_u_0", "rootfsImageName": "img:1"}).encode(),
        ),
        ("spec.dump", json.dumps(spec).encode()),
        ("descriptors.json", b'["/dev/null", "pipe:[7]", "/dev/null"]'),
        ("deleted.files", b'["/etc/motd"]'),
        ("rootfs-diff.tar", _diff([])),
    ]


def _link(name: str, target: str, hard: bool = False) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = tarfile.LNKTYPE if hard else tarfile.SYMTYPE
    info.linkname = target
    return info


def _diff(members: list[tuple[str, bytes | tarfile.TarInfo]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        for name, data in members:
            info = data if isinstance(data, tarfile.TarInfo) else tarfile.TarInfo(name)
            if not isinstance(data, tarfile.TarInfo):
                info.size = len(data)
            t.addfile(info, None if isinstance(data, tarfile.TarInfo) else io.BytesIO(data))
    return buf.getvalue()


def test_a_small_archive_imports(tmp_path: Path) -> None:
    """The parts the real runtimes differ in: descriptors.json at the top, deleted.files, gzip,
    names from CRI-O's annotations and the kubelet's container name."""
    _pycriu()
    diff = _diff(
        [
            ("tmp/x", b"1"),
            ("etc/localtime", _link("etc/localtime", "/usr/share/zoneinfo/UTC")),
            ("usr/lib/.wh.gone", b""),  # an overlay whiteout, as containerd writes a deletion
            ("var/cache/.wh..wh..opq", b""),
        ]
    )
    mount = {
        "fstype": 0,
        "mnt_id": 2,
        "root_dev": 1,
        "parent_mnt_id": 1,
        "flags": 0,
        "root": "/data",
        "mountpoint": "/data",
        "source": "/dev/vda",
        "options": "",
        "ext_key": "/data",
    }
    members = [
        *[(n, diff if n == "rootfs-diff.tar" else d) for n, d in _good()],
        ("checkpoint/mountpoints-12.img", _image("MNTS", [mount])),
        ("checkpoint/netns-10.img", _image("NETNS", [{"ext_key": "extRootNetNS"}])),
    ]
    src = _tar(tmp_path / "a.tar.gz", members, "w:gz")
    assert archive.is_archive(src)
    manifest = archive.import_archive(src, tmp_path / "b", KEY)
    bundle.verify(tmp_path / "b", KEY)
    c = manifest.container
    assert c is not None
    assert (c.id, c.name, c.pod_name, c.pod_namespace, c.image) == ("ab" * 32, "c", "p", "n", "img:1")
    assert c.deleted == ["/etc/motd", "/usr/lib/gone"] and c.rootfs_diff == "rootfs-diff.tar"
    assert manifest.stdio_pipes == {"stdout": "pipe:[7]"}
    assert [(p.pid, p.ppid, p.cmdline, p.rss_bytes) for p in manifest.processes] == [(1, 0, [], 0)]
    assert manifest.command == ["/bin/sleep", "9"]
    assert c.external_mounts == ["/data"] and c.netns_external is True


@needs("zstd")
def test_a_zstd_archive_imports(tmp_path: Path) -> None:
    """CRI-O and podman can compress their archives with zstd (Python's tarfile cannot read it)."""
    _pycriu()
    src = _tar(tmp_path / "a.tar", _good())
    subprocess.run(["zstd", "-q", "--rm", src, "-o", tmp_path / "a.tar.zst"], check=True)
    assert archive.is_archive(tmp_path / "a.tar.zst")
    assert archive.read(tmp_path / "a.tar.zst").pod_name == "p"
    manifest = archive.import_archive(tmp_path / "a.tar.zst", tmp_path / "b", KEY)
    assert manifest.container is not None and manifest.container.name == "c"


@pytest.mark.parametrize(
    ("case", "member", "said"),
    [
        ("traversal", ("../evil", b"x"), "points outside the archive"),
        ("traversal in checkpoint", ("checkpoint/../../evil", b"x"), "points outside the archive"),
        ("absolute", ("/etc/evil", b"x"), "absolute path"),
        (
            "symlink escape",
            ("checkpoint/core-1.img", _link("checkpoint/core-1.img", "/etc/shadow")),
            "symbolic link",
        ),
        (
            "relative symlink",
            ("checkpoint/x.img", _link("checkpoint/x.img", "../../../../etc/shadow")),
            "outside",
        ),
        (
            "hardlink escape",
            ("checkpoint/y.img", _link("checkpoint/y.img", "../../etc/passwd", hard=True)),
            "hard link",
        ),
        ("nested folder", ("checkpoint/sub/x.img", b"x"), "no subfolders"),
        ("duplicate", ("config.dump", b"{}"), "appears twice"),
    ],
)
def test_hostile_archives_are_refused(tmp_path: Path, case: str, member: tuple, said: str) -> None:
    _pycriu()
    src = _tar(tmp_path / "h.tar", [*_good(), member])
    with pytest.raises(archive.ArchiveError, match=said) as err:
        archive.import_archive(src, tmp_path / "b", KEY)
    assert "\n" not in err.value.line()
    assert not (tmp_path / "b").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["h.tar"]  # no half-built bundle left
    with pytest.raises(archive.ArchiveError, match=said):
        archive.read(src)


def test_device_files_are_refused(tmp_path: Path) -> None:
    dev = tarfile.TarInfo("checkpoint/null.img")
    dev.type, dev.devmajor, dev.devminor = tarfile.CHRTYPE, 1, 3
    src = _tar(tmp_path / "d.tar", [*_good(), ("checkpoint/null.img", dev)])
    with pytest.raises(archive.ArchiveError, match="device file"):
        archive.import_archive(src, tmp_path / "b", KEY)


def test_a_rootfs_diff_that_escapes_is_refused(tmp_path: Path) -> None:
    _pycriu()
    for bad, said in (
        ([("../../etc/cron.d/x", b"x")], "points outside the container"),
        ([("/etc/x", b"x")], "points outside the container"),
        ([("etc/x", _link("etc/x", "../../../etc/shadow", hard=True))], "hard-links"),
    ):
        members = [(n, _diff(bad) if n == "rootfs-diff.tar" else d) for n, d in _good()]
        src = _tar(tmp_path / "r.tar", members)
        with pytest.raises(archive.ArchiveError, match=said):
            archive.import_archive(src, tmp_path / "b", KEY)
        assert not (tmp_path / "b").exists()


def test_an_archive_larger_than_allowed_is_refused(tmp_path: Path) -> None:
    _pycriu()
    src = _tar(tmp_path / "big.tar", [*_good(), ("checkpoint/pages-1.img", b"\0" * 100_000)])
    with pytest.raises(archive.ArchiveError, match="does not fit"):
        archive.import_archive(src, tmp_path / "b", KEY, max_bytes=50_000)
    assert not (tmp_path / "b").exists()


def test_not_a_checkpoint_and_not_an_image(tmp_path: Path) -> None:
    _pycriu()
    plain = _tar(tmp_path / "plain.tar", [("hello.txt", b"hi")])
    with pytest.raises(archive.ArchiveError, match="not a checkpoint archive"):
        archive.import_archive(plain, tmp_path / "b", KEY)
    forged = [(n, b"not an image" if n == "checkpoint/pstree.img" else d) for n, d in _good()]
    with pytest.raises(archive.ArchiveError, match="not a CRIU image"):
        archive.import_archive(_tar(tmp_path / "f.tar", forged), tmp_path / "b", KEY)
    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"\x1f\x8b" + os.urandom(600))
    with pytest.raises(archive.ArchiveError, match=r"not a tar archive|damaged"):
        archive.import_archive(junk, tmp_path / "b", KEY)
    assert not (tmp_path / "b").exists()


def test_a_link_in_an_extracted_folder_is_refused(tmp_path: Path) -> None:
    _pycriu()
    folder = tmp_path / "x"
    with tarfile.open(_tar(tmp_path / "g.tar", _good())) as t:
        t.extractall(folder, filter="data")
    (folder / "checkpoint" / "core-1.img").symlink_to("/etc/shadow")
    with pytest.raises(archive.ArchiveError, match="symbolic link"):
        archive.import_archive(folder, tmp_path / "b", KEY)


@pytest.mark.parametrize(
    "member",
    [
        ("../evil", b"x"),
        ("/etc/evil", b"x"),
        ("checkpoint/core-1.img", _link("checkpoint/core-1.img", "/etc/shadow")),
    ],
    ids=["traversal", "absolute", "symlink"],
)
def test_cli_refuses_a_hostile_archive_in_one_line(tmp_path: Path, member: tuple) -> None:
    _pycriu()
    src = _tar(tmp_path / "h.tar", [*_good(), member])
    r = subprocess.run([CRIUCTL, "inspect", src], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("criuctl: error: "), r.stderr
    assert "Traceback" not in r.stderr
