"""The container path's pure parts: mountinfo, which mounts are external and where the host sees
them, container IDs and names, runtime endpoints, the init's moved marker. No runtime, no CRIU:
fast, and exact."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from criuctl.container import containers, mounts, runtime
from criuctl.container.runtime import Container, UnknownContainer
from criuctl.core import nsinit

# A container's view (runc under containerd 1.6, cgroup v1) and the host's, as this machine has them.
INSIDE = """\
95 60 0:49 / / rw,relatime - overlay overlay rw,lowerdir=/var/lib/c/1/fs,upperdir=/var/lib/c/3/fs,workdir=/w
96 95 0:51 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
97 95 0:52 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
98 97 0:53 / /dev/pts rw,nosuid,noexec,relatime - devpts devpts rw,gid=5,mode=620,ptmxmode=666
99 97 0:42 / /dev/mqueue rw,nosuid,nodev,noexec,relatime - mqueue mqueue rw
100 95 0:22 / /sys ro,nosuid,nodev,noexec,relatime - sysfs sysfs rw
101 100 0:54 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - tmpfs tmpfs rw,mode=755
105 101 0:32 /k8s.io/abc /sys/fs/cgroup/memory ro,nosuid,nodev,noexec,relatime - cgroup cgroup rw,memory
111 95 254:0 /usr /usr ro,relatime - ext4 /dev/vda rw
112 95 254:0 /var/lib/k/pods/u/volumes/kubernetes.io~empty-dir/scratch /scratch rw,relatime - ext4 /dev/vda rw
113 95 254:0 /srv/my\\040data /data rw,relatime - ext4 /dev/vda rw
115 97 0:39 / /dev/shm rw,nosuid,nodev,noexec,relatime - tmpfs shm rw,size=65536k
"""
HOST = """\
22 1 254:0 / / rw,relatime - ext4 /dev/vda rw
30 22 0:22 / /sys rw,nosuid,nodev,noexec,relatime - sysfs sysfs rw
40 30 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
50 22 0:39 / /run/c/sandboxes/s1/shm rw,nosuid,nodev,noexec,relatime - tmpfs shm rw,size=65536k
60 22 0:49 / /run/c/task/abc/rootfs rw,relatime - overlay overlay rw,upperdir=/var/lib/c/3/fs
"""


def test_mountinfo_is_parsed_with_escapes_and_super_options() -> None:
    m = mounts.by_point(mounts.parse(INSIDE))
    assert m["/"].fstype == "overlay" and m["/"].super_options["upperdir"] == "/var/lib/c/3/fs"
    assert m["/data"].root == "/srv/my data"  # \\040 is a space


def test_external_mounts_are_those_the_host_also_has() -> None:
    inside, host = mounts.parse(INSIDE), mounts.parse(HOST)
    assert mounts.externals(inside, host) == [
        "/sys/fs/cgroup/memory",  # a cgroup hierarchy: always external
        "/usr",
        "/scratch",
        "/data",
        "/dev/shm",  # the pod's shm: the host has the same tmpfs
    ]  # not /, /proc, the /dev tmpfs, devpts, mqueue, sysfs, the /sys/fs/cgroup tmpfs: CRIU recreates those


def test_host_path_of_a_container_mount() -> None:
    inside, host = mounts.by_point(mounts.parse(INSIDE)), mounts.parse(HOST)
    assert mounts.host_path(inside["/usr"], host) == "/usr"
    assert mounts.host_path(inside["/data"], host) == "/srv/my data"
    assert mounts.host_path(inside["/dev/shm"], host) == "/run/c/sandboxes/s1/shm"
    assert mounts.host_path(inside["/sys/fs/cgroup/memory"], host) == "/sys/fs/cgroup/memory/k8s.io/abc"
    assert mounts.host_path(inside["/"], host) == "/run/c/task/abc/rootfs"  # a placeholder's rootfs
    assert mounts.host_path(inside["/dev"], host) is None  # a private tmpfs: no host view


@pytest.mark.parametrize("bad", ["", "../etc", "xyz", "0" * 65, "ab cd", "ctr-/x"])
def test_container_ids_are_hex(bad: str) -> None:
    with pytest.raises(UnknownContainer, match="not a container ID"):
        runtime.check_id(bad)


def test_a_prefix_picks_one_container_or_says_why_not() -> None:
    found = [
        Container(id="ab" + "0" * 62, pid=1, state="running"),
        Container(id="ac" + "1" * 62, pid=2, state="running"),
    ]
    assert runtime.pick("ab", found).pid == 1
    with pytest.raises(UnknownContainer, match="matches 2 containers"):
        runtime.pick("a", found)
    with pytest.raises(UnknownContainer, match="no container 'ff'"):
        runtime.pick("ff", found)


def test_container_names_and_ids_normalize_to_one_workload_name() -> None:
    cid = "3f2a9c1b7d44" + "e" * 52
    assert containers.name_of(cid) == "ctr-3f2a9c1b7d44"
    assert containers.normalize(cid) == containers.normalize(cid[:12]) == "ctr-3f2a9c1b7d44"
    assert containers.normalize("bert") == "bert" and containers.normalize("123456789012") == "123456789012"


@pytest.mark.parametrize("endpoint", ["garbage", "unix://relative/x.sock", "tcp://10.0.0.1:1"])
def test_a_runtime_endpoint_is_an_absolute_socket(endpoint: str) -> None:
    with pytest.raises(runtime.RuntimeUnavailable, match="is not a runtime socket"):
        runtime.connect(endpoint)


def test_the_inject_dir_is_written_once_and_replaced_whole(tmp_path) -> None:
    """Agents starting together (tests start several on one host) leave one complete folder."""
    from concurrent.futures import ThreadPoolExecutor

    dest = tmp_path / "inject"
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: containers.write_inject_dir(dest), range(8)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inject"]  # no staging left behind
    assert (dest / "nsinit.py").is_file() and (dest / "hooks" / "criuctl_hook" / "__init__.py").is_file()
    (dest / "nsinit.py").write_text("stale")  # an older criuctl's files: replaced on the next start
    (dest / ".criuctl-files").write_text("old")
    containers.write_inject_dir(dest)
    assert "def placeholder" in (dest / "nsinit.py").read_text()


def _init_in(tmp_path: Path, uid: str, marked: str | None) -> subprocess.Popen:
    """criuctl's init as a container runs it (from its inject dir), for a pod with UID `uid`,
    whose job the agent marked as moved (`marked`: the UID it marked, or nothing)."""
    inject = tmp_path / "inject"
    (inject / "moved").mkdir(parents=True)
    shutil.copy(nsinit.__file__, inject / "nsinit.py")
    if marked:
        (inject / "moved" / marked).write_text("b\n")
    env = {**os.environ, nsinit.ENV_POD_UID: uid}
    argv = [sys.executable, "-I", str(inject / "nsinit.py"), "--", sys.executable, "-c", "print('TRAINED')"]
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_container_restarted_after_its_job_moved_does_not_run_it_again(tmp_path: Path) -> None:
    p = _init_in(tmp_path, "uid-1", marked="uid-1")
    assert p.stderr is not None
    said = p.stderr.readline()  # the init says why it waits, then waits: no fixed sleep needed
    assert "this pod's job moved to node b" in said, said
    assert p.poll() is None, "the init exited: a kubelet would restart it again and again"
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=10)
    assert p.returncode == 0
    assert "TRAINED" not in out


@pytest.mark.parametrize("uid, marked", [("uid-2", "uid-other"), ("../moved/uid-3", "uid-3"), ("", None)])
def test_the_job_starts_unless_its_own_pod_was_marked(tmp_path: Path, uid: str, marked: str | None) -> None:
    p = _init_in(tmp_path, uid, marked)
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0 and out.strip() == "TRAINED"


def test_a_helper_leaves_its_containers_cgroups_for_the_roots(tmp_path: Path) -> None:
    """A process in a container's cgroup (here: a pids or unified cgroup of its own, made for the
    test) leaves it for the hierarchy's root, where the container's end does not reach it; the
    cgroup it left is then empty, and /sys/fs/cgroup gets no stray file."""
    from criuctl.container import cgroups

    mount = next(
        (
            m
            for m in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
            if (m / "cgroup.procs").exists()
        ),
        None,
    )
    assert mount is not None, "no pids or unified cgroup hierarchy under /sys/fs/cgroup"
    box = mount / f"criuctl-test-{os.getpid()}"
    box.mkdir()
    try:
        code = (
            "import os, pathlib; from criuctl.container import cgroups\n"
            f"pathlib.Path({str(box / 'cgroup.procs')!r}).write_text(str(os.getpid()))\n"
            "before = open('/proc/self/cgroup').read()\n"
            "print(cgroups.leave_container()); print(before, end='')\n"
            "print(open('/proc/self/cgroup').read(), end='')"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        first, *lines = r.stdout.splitlines()
        assert first == "True", r.stdout
        here = [line for line in lines if line.endswith(box.name)]
        assert len(here) == 1, r.stdout  # in the box before, at the root after
        assert not (box / "cgroup.procs").read_text().strip()
        assert cgroups.ROOT.joinpath("cgroup.procs").exists() == (mount == cgroups.ROOT)
    finally:
        box.rmdir()


def test_a_helper_in_a_cgroup_namespace_of_its_own_enters_the_nodes_and_leaves(tmp_path: Path) -> None:
    """A handoff started by an agent whose container has a cgroup namespace of its own (cgroup v2's
    containers): /proc/self/cgroup is relative to the container's cgroup there, and nothing moves
    out of it. It enters the node's namespace (PID 1's), sees the container's cgroup by its node-wide
    path, and leaves it for the root (on cgroup v2 with nsdelegate too: scripts/guest-check.sh)."""
    from criuctl.container import cgroups

    mount = next(m for m in (Path("/sys/fs/cgroup/pids"), cgroups.ROOT) if (m / "cgroup.procs").exists())
    box = mount / f"criuctl-test-ns-{os.getpid()}"
    box.mkdir()
    try:
        code = (
            "import ctypes, os, pathlib; from criuctl.container import cgroups\n"
            f"pathlib.Path({str(box / 'cgroup.procs')!r}).write_text(str(os.getpid()))\n"
            "assert ctypes.CDLL(None, use_errno=True).unshare(0x02000000) == 0\n"  # a container's namespace
            "lines = lambda: open('/proc/self/cgroup').read().splitlines()\n"
            "mine = lambda: [x for x in lines() if ':pids:' in x or x[:3] == '0::']\n"
            "print(mine()[0]); print(cgroups.leave_container()); print(cgroups.enter_node_namespace())\n"
            "print(mine()[0]); print(cgroups.leave_container()); print(mine()[0])"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        inside, left_there, entered, seen, left, after = r.stdout.splitlines()
        assert inside.endswith(":/") and left_there == "False", r.stdout  # the container's cgroup is its root
        assert entered == "True" and seen.endswith(f":/{box.name}"), r.stdout  # the node's path of it
        assert left == "True" and after.endswith(":/"), r.stdout
        assert not (box / "cgroup.procs").read_text().strip()
    finally:
        box.rmdir()


# ------------------------------------------------ the step boundary's control directory in a container


def test_a_containers_control_directory_is_never_followed_out_of_it(tmp_path):
    """criuctl reaches a container's control directory through /proc/PID/root, where everything is
    the job's to change: a symlink the job planted (the directory itself, `held`, `trainers`,
    `released`) must not make the node's criuctl read or write outside it (an absolute symlink there
    resolves on the node), and a report that is not a small regular file is not read."""
    from criuctl.local import stepboundary as sb
    from criuctl_hook import contract

    assert containers.control_dir(4242) == "/proc/4242/root/run/criuctl/boundary"
    host = tmp_path / "host"  # what a job must not reach
    host.mkdir()
    (host / "77").write_text(json.dumps({"id": "r1", "rank": "0"}))
    run = tmp_path / "run"
    run.mkdir()
    control = f"/proc/{os.getpid()}/root{run}/boundary"  # this process's root is /: a container's view

    (run / "boundary").symlink_to(host)  # the whole directory
    with pytest.raises(OSError):
        sb._write_request(control, b"{}")
    sb.let_go_on_target(control, "r1")
    assert sorted(p.name for p in host.iterdir()) == ["77"]

    (run / "boundary").unlink()
    (run / "boundary").mkdir()
    for sub in (contract.HELD, contract.TRAINERS, contract.RELEASED):
        (run / "boundary" / sub).symlink_to(host)
    assert sb._report(control, "77", "r1") is None  # though host/77 is that very report
    assert sb._live_trainers(control, os.getpid()) == {}
    sb.let_go_on_target(control, "r1")
    assert sorted(p.name for p in host.iterdir()) == ["77"]

    # the same directory, plain: what the hook wrote is read, and criuctl writes where it should
    for sub in (contract.HELD, contract.TRAINERS, contract.RELEASED):
        (run / "boundary" / sub).unlink()
        (run / "boundary" / sub).mkdir()
    (run / "boundary" / contract.HELD / "77").write_text(json.dumps({"id": "r1", "rank": "0"}))
    (run / "boundary" / contract.HELD / "78").symlink_to(host / "77")
    os.mkfifo(run / "boundary" / contract.HELD / "79")  # a reader would block on it
    assert sb._report(control, "77", "r1") == {"id": "r1", "rank": "0"}
    assert sb._report(control, "78", "r1") is None and sb._report(control, "79", "r1") is None
    sb._write_request(control, b'{"id": "r2"}')
    assert json.loads((run / "boundary" / contract.REQUEST).read_text()) == {"id": "r2"}
    sb.let_go_on_target(control, "r2")
    assert (run / "boundary" / contract.RELEASED / "r2").is_file()


def test_a_subpath_file_the_node_replaced_is_refused_before_the_freeze() -> None:
    """An edited ConfigMap mounted by subPath: the kubelet swaps its folder, the job's file is
    deleted (the kernel's mountinfo ends its root with //deleted), and CRIU's restore would fail
    after the freeze; containers refuses before it, naming the volume."""
    vol = "/var/lib/kubelet/pods/3f1a2b4c-0000-4000-8000-000000000001/volume-subpaths/one/train/11"

    class View:  # the part of NodeView the check reads
        def paths(self, m: mounts.Mount) -> list[str]:
            return [vol] if m.point == "/etc/one.conf" else []

    def check(root: str) -> None:
        inside = mounts.parse(INSIDE + f"120 95 0:61 {root} /etc/one.conf ro,relatime - tmpfs tmpfs rw\n")
        points = [*mounts.externals(inside, mounts.parse(HOST)), "/etc/one.conf"]
        containers._refuse_replaced_mounts(inside, points, View())  # type: ignore[arg-type]

    check("/..2026_12_07_05_31_00.1/one.conf")  # as mounted: moves
    with pytest.raises(containers.NotCheckpointable, match=r"volume one .* replaced its file"):
        check("/..2026_12_07_05_31_00.1/one.conf//deleted")


# ----------------------------------------------------------------- the node's cgroup layout and driver

# /sys/fs/cgroup as each layout mounts it: (mountinfo lines, the folders of pods' cgroups)
_V1 = "31 25 0:27 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
_TMPFS = "25 22 0:24 / /sys/fs/cgroup ro - tmpfs tmpfs ro,mode=755\n"
_UNIFIED = "26 25 0:25 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate\n"
_V2 = "25 22 0:24 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot\n"
_V2_PLAIN = "25 22 0:24 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
LAYOUTS = {
    # a kubeadm node on Debian 10 (v1, cgroupfs); this machine's local cluster (hybrid, a
    # --cgroup-root per node); a GKE, EKS or kubeadm node today (v2, systemd); k3s (v2, cgroupfs)
    "v1-cgroupfs": (_TMPFS + _V1, ["memory/kubepods/burstable"], "cgroup v1, cgroupfs driver"),
    "hybrid-root": (
        _TMPFS + _V1 + _UNIFIED,
        ["memory/node-a/kubepods"],
        "cgroup hybrid (nsdelegate), cgroupfs",
    ),
    "v2-systemd": (
        _V2,
        ["kubepods.slice/kubepods-burstable.slice"],
        "cgroup v2 (nsdelegate), systemd driver",
    ),
    "v2-cgroupfs": (_V2_PLAIN, ["kubepods/besteffort"], "cgroup v2, cgroupfs driver"),
    "v2-no-pods": (_V2, ["system.slice"], "cgroup v2 (nsdelegate), no pods' cgroups"),
}


@pytest.mark.parametrize("own", [False, True])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_doctor_names_the_cgroup_layout_and_driver_it_finds(tmp_path: Path, name: str, own: bool) -> None:
    from criuctl.container import cgroups

    info, folders, said = LAYOUTS[name]
    root = tmp_path / "sys-fs-cgroup"
    for f in folders:
        (root / f).mkdir(parents=True)
    proc = tmp_path / "proc"
    for pid, ns in (("self", f"cgroup:[{4026531835 + own}]"), ("1", "cgroup:[4026531835]")):
        (proc / pid / "ns").mkdir(parents=True)
        (proc / pid / "ns" / ns).touch()  # what the link opens, as the kernel's does
        (proc / pid / "ns" / "cgroup").symlink_to(ns)
    (proc / "self" / "mountinfo").write_text(
        "22 1 254:0 / / rw - ext4 /dev/vda rw\n" + info.replace("/sys/fs/cgroup", str(root))
    )
    found = cgroups.layout(proc, root)
    assert found.describe().startswith(said), found
    assert found.own_namespace is own
    if own:  # a root process may enter the node's namespace (as a privileged agent with hostPID)
        assert found.ok and found.describe().endswith(
            "handoffs enter the node's before they read or move cgroups"
        )
        (proc / "1" / "ns" / "cgroup:[4026531835]").unlink()  # PID 1 not the node's, or not in view
        stuck = cgroups.layout(proc, root)
        assert not stuck.ok and stuck.describe().endswith("the node's cannot be entered from here")
    else:
        assert found.ok and found.describe().endswith("handoffs read and move cgroups as the node does")


def test_a_placeholders_cgroups_are_the_roots_of_the_restored_tree(tmp_path: Path) -> None:
    """CRIU's restore puts the tree under the placeholder's cgroups: a root per v1 controller; on a
    v2-only node the unified one, as the root of every controller (a cg_root without a controller:
    CRIU's --cgroup-root PATH); in a hybrid layout the unified hierarchy holds no controller and is
    CRIU's to handle."""
    import pycriu

    from criuctl.container import cgroups
    from criuctl.engine import criu

    scope = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-podu.slice/cri-containerd-ab.scope"
    cases = {
        "v1": ("4:memory:/kubepods/podu/ab\n3:cpu,cpuacct:/kubepods/podu/ab\n", {"memory", "cpu,cpuacct"}),
        "hybrid": ("4:memory:/kubepods/podu/ab\n0::/kubepods/podu/ab\n", {"memory"}),
        "v2": (f"0::{scope}\n", {cgroups.UNIFIED}),
    }
    for name, (text, keys) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "cgroup").write_text(text)
        roots = cgroups.roots_of(name, tmp_path)
        assert set(roots) == keys, (name, roots)
        opts = criu.build_restore_request(criu.RestoreOptions(tmp_path, tmp_path, cgroup_roots=roots))
        assert opts.manage_cgroups and opts.manage_cgroups_mode == pycriu.rpc.SOFT
        given = [(r.ctrl if r.HasField("ctrl") else None, r.path) for r in opts.cg_root]
        if name == "v2":
            assert given == [(None, scope)], given  # every controller's root: no ctrl at all
        else:
            assert {c for c, _ in given} == keys and all(p.endswith("/ab") for _, p in given), given


@pytest.mark.parametrize(
    ("annotations", "want"),
    [
        (
            {"cdi.k8s.io/nvidia-device-plugin_0": "nvidia.com/gpu=0,nvidia.com/gpu=1"},
            ["nvidia.com/gpu=0", "nvidia.com/gpu=1"],
        ),
        (
            {"cdi.k8s.io/a": "nvidia.com/gpu=all", "cdi.k8s.io/b": "nvidia.com/gpu=all"},
            ["nvidia.com/gpu=all"],
        ),
        ({"cdi.k8s.io/x": "vendor.example/sub/nic=eth1 "}, ["vendor.example/sub/nic=eth1"]),
        ({"io.kubernetes.pod.name": "nvidia.com/gpu=0", "cdi.k8s.io/x": "gpu=0,nvidia.com/=0,/x=1"}, []),
        ({}, []),
    ],
)
def test_cdi_devices_are_read_from_a_containers_annotations(annotations: dict, want: list) -> None:
    from criuctl.container import cdi

    assert cdi.devices(annotations) == want


def test_a_placeholder_needs_as_many_cdi_devices_of_each_kind_not_the_same_ones(tmp_path: Path) -> None:
    from criuctl.container import cdi, placeholder
    from criuctl.format.bundle import ContainerFacts

    had = ["nvidia.com/gpu=0", "nvidia.com/gpu=1", "criuctl.test/nic=a"]
    assert cdi.missing(had, ["nvidia.com/gpu=6", "nvidia.com/gpu=7", "criuctl.test/nic=b"]) == []
    assert cdi.missing(had, ["nvidia.com/gpu=6", "criuctl.test/nic=b", "other.com/x=1"]) == [
        "nvidia.com/gpu=1"
    ]
    assert cdi.missing([], ["nvidia.com/gpu=6"]) == []

    def holder(annotations: dict[str, str]) -> placeholder.Placeholder:
        c = Container(id="f" * 64, pid=os.getpid(), state="running", annotations=annotations)
        return placeholder.Placeholder(c, tmp_path, [], view=None)  # type: ignore[arg-type]

    facts = ContainerFacts(id="e" * 64, cdi_devices=had[:2])
    with pytest.raises(placeholder.NotAPlaceholder) as exc:
        placeholder.prepare(holder({"cdi.k8s.io/p": "nvidia.com/gpu=3"}), tmp_path, facts)
    assert "nvidia.com/gpu" in str(exc.value) and "2" in str(exc.value), exc.value
    placeholder.prepare(holder({"cdi.k8s.io/p": "nvidia.com/gpu=3,nvidia.com/gpu=4"}), tmp_path, facts)
