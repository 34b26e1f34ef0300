"""The volume logic's parts without a cluster: which kind each mount of a container is, read from
the node's mount table (not the agent's); the node's namespace found and reached for real (a private
mount namespace of a child stands for a node's); what a dump carries and how a restore lays it down;
the API-side checks of `criuctl migrate` on pod, claim and PV objects as the API server sends them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from criuctl.container import mounts, nodeview, rootfsdiff, volumes
from criuctl.container.nodeview import NodeView
from criuctl.container.volumes import Kind
from criuctl.core.errors import CriuctlError
from criuctl.kube import podvolumes
from tests.requirements import needs

UID = "0f4b2a8e-93c4-4c1e-9d55-6c1b1e0a7d21"
PODS = "/var/lib/kubelet/pods/" + UID
NODE_DIR = "/tmp/kube0/nodes/a"  # the local cluster binds the node's folders over the kubelet's paths
# Node a's mount namespace (the kubelet's and containerd's), as the local cluster makes it
NODE = f"""\
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
25 24 0:23 / /dev/shm rw shared:2 - tmpfs tmpfs rw
300 27 254:0 {NODE_DIR}/var-lib-kubelet /var/lib/kubelet rw shared:5 - ext4 /dev/vda rw
301 27 254:0 {NODE_DIR}/run-containerd /run/containerd rw shared:6 - ext4 /dev/vda rw
310 300 0:60 / {PODS}/volumes/kubernetes.io~empty-dir/dshm rw shared:7 - tmpfs tmpfs rw
311 300 0:61 / {PODS}/volumes/kubernetes.io~secret/sec rw shared:8 - tmpfs tmpfs rw
313 300 254:0 /var/tmp/v/pv {PODS}/volumes/kubernetes.io~local-volume/vols-pv rw - ext4 /dev/vda rw
314 300 254:0 {NODE_DIR}/var-lib-kubelet/pods/{UID}/volumes/kubernetes.io~empty-dir/scratch/part \
{PODS}/volume-subpaths/scratch/train/3 rw - ext4 /dev/vda rw
320 301 0:70 / /run/containerd/io.containerd.grpc.v1.cri/sandboxes/5e1/shm rw - tmpfs shm rw
330 27 0:80 / /mnt/nfs rw - nfs4 srv:/export rw
340 27 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
"""
# The agent's own (the DaemonSet's container): only the host folders its manifest mounts
AGENT = f"""\
500 400 0:90 / / rw - overlay overlay rw,upperdir=/x
501 500 254:0 {NODE_DIR}/var-lib-kubelet/pods /var/lib/kubelet/pods rw - ext4 /dev/vda rw
502 501 0:60 / {PODS}/volumes/kubernetes.io~empty-dir/dshm rw - tmpfs tmpfs rw
503 500 254:0 {NODE_DIR}/run-containerd /run/containerd rw - ext4 /dev/vda rw
504 503 0:70 / /run/containerd/io.containerd.grpc.v1.cri/sandboxes/5e1/shm rw - tmpfs shm rw
"""
# The job's container: every kind of volume a training pod mounts
INSIDE = f"""\
600 590 0:95 / / rw - overlay overlay rw,upperdir=/y
601 600 0:96 / /dev rw - tmpfs tmpfs rw
602 601 0:70 / /dev/shm rw - tmpfs shm rw
603 601 0:60 / /dev/shm rw - tmpfs tmpfs rw
604 600 254:0 /var/tmp/v/out /out rw - ext4 /dev/vda rw
605 600 254:0 /var/tmp/v/pv /data rw - ext4 /dev/vda rw
606 600 254:0 {NODE_DIR}/var-lib-kubelet/pods/{UID}/volumes/kubernetes.io~empty-dir/scratch /scratch rw - ext4 /dev/vda rw
607 600 254:0 {NODE_DIR}/var-lib-kubelet/pods/{UID}/volumes/kubernetes.io~empty-dir/scratch/part /part rw - ext4 /dev/vda rw
608 600 0:61 / /etc/sec ro - tmpfs tmpfs rw
609 600 254:0 {NODE_DIR}/var-lib-kubelet/pods/{UID}/volumes/kubernetes.io~configmap/cfg /etc/cfg ro - ext4 /dev/vda rw
610 600 254:0 {NODE_DIR}/var-lib-kubelet/pods/{UID}/etc-hosts /etc/hosts rw - ext4 /dev/vda rw
611 600 0:80 /sub /shared rw - nfs4 srv:/export rw
612 600 0:32 /k8s/pod /sys/fs/cgroup/memory ro - cgroup cgroup rw,memory
"""  # noqa: E501 (mountinfo lines as the kernel writes them)


def _view(own: str = AGENT) -> NodeView:
    return NodeView(4242, mounts.parse(NODE), mounts.parse(own), same=False)


def test_each_kind_of_volume_is_read_from_the_nodes_mount_table() -> None:
    found = {v.point: (v.kind, v.name) for v in volumes.of_container(mounts.parse(INSIDE), _view())}
    assert found == {
        "/dev/shm": (Kind.EMPTY_DIR, "dshm"),  # medium: Memory, over the pod's own shm
        "/out": (Kind.NODE_LOCAL, ""),  # a hostPath: the kubelet hands the runtime its own path
        "/data": (Kind.NODE_LOCAL, "vols-pv"),  # a local PV: the folder is named after the PV
        "/scratch": (Kind.EMPTY_DIR, "scratch"),
        "/part": (Kind.EMPTY_DIR, "scratch"),  # a subPath of it
        "/etc/sec": (Kind.API, "sec"),
        "/etc/cfg": (Kind.API, "cfg"),
        "/shared": (Kind.SHARED, ""),
    }  # not /etc/hosts nor the cgroup: the runtime's; not / nor /dev: the container's own


def test_the_pods_own_shm_is_carried_and_the_nodes_is_not() -> None:
    inside = mounts.parse(INSIDE.replace("603 601 0:60 / /dev/shm rw - tmpfs tmpfs rw\n", ""))
    kinds = {v.point: v.kind for v in volumes.of_container(inside, _view())}
    assert kinds["/dev/shm"] is Kind.POD_MEMORY
    host_shm = mounts.parse("700 600 0:23 / /dev/shm rw - tmpfs tmpfs rw\n")  # a hostPath of /dev/shm
    assert volumes.of_container(host_shm, _view())[0].kind is Kind.NODE_LOCAL


def test_a_hostpath_the_agent_does_not_mount_is_reached_through_the_node() -> None:
    """What failed before: the placeholder's /out was looked up in the agent's own mount table,
    which has no /var/tmp ("the placeholder has no mount at /out")."""
    inside, view = mounts.by_point(mounts.parse(INSIDE)), _view()
    assert mounts.host_path(inside["/out"], mounts.parse(AGENT)) is None
    assert view.path(inside["/out"]) == "/var/tmp/v/out"
    assert view.reach(inside["/out"]) == "/proc/4242/root/var/tmp/v/out"
    assert view.path(inside["/part"]) == f"{PODS}/volume-subpaths/scratch/train/3"
    assert view.paths(inside["/part"])[1] == f"{PODS}/volumes/kubernetes.io~empty-dir/scratch/part"
    # what the agent mounts itself it reaches (and attaches) directly
    assert (
        view.reach(inside["/dev/shm"])
        == view.attach(inside["/dev/shm"])
        == f"{PODS}/volumes/kubernetes.io~empty-dir/dshm"
    )
    assert not view.attached
    assert view.externals(mounts.parse(INSIDE)) == [
        "/dev/shm",
        "/dev/shm",
        "/out",
        "/data",
        "/scratch",
        "/part",
        "/etc/sec",
        "/etc/cfg",
        "/etc/hosts",
        "/shared",
        "/sys/fs/cgroup/memory",
    ]


def _node_process(tmp_path: Path) -> subprocess.Popen:
    """A process in a private mount namespace with a tmpfs only it sees: a node's runtime, here."""
    (tmp_path / "nodeonly").mkdir()
    (tmp_path / "bind").mkdir()
    (tmp_path / "one-file").touch()
    script = (
        f"mount -t tmpfs t {tmp_path}/nodeonly && echo kept > {tmp_path}/nodeonly/f && "
        f"mount --bind {tmp_path}/nodeonly {tmp_path}/bind && "
        f"mount --bind {tmp_path}/nodeonly/f {tmp_path}/one-file && echo up && exec sleep 60"
    )
    p = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "up"
    return p


@needs("root")  # mount namespaces
def test_a_mount_only_the_node_has_is_reached_and_attached_here(tmp_path) -> None:
    node = _node_process(tmp_path)
    try:
        view = NodeView.of_pid(node.pid)
        assert not view.same
        m = next(x for x in view.table if x.point == str(tmp_path / "bind"))
        assert mounts.host_path(m, view.own) is None  # our namespace has no such tmpfs
        assert Path(view.reach(m), "f").read_text() == "kept\n"
        here = view.attach(m)
        assert here is not None and Path(here, "f").read_text() == "kept\n"
        assert any(x.point == here for x in mounts.of("self")), "not a mount of our namespace"
        # a file's mount (a hostPath File, a device node) is attached onto a file, not a folder
        f = next(x for x in view.table if x.point == str(tmp_path / "one-file"))
        assert mounts.host_path(f, view.own) is None
        one = view.attach(f)
        assert one is not None and Path(one).is_file() and Path(one).read_text() == "kept\n"
        view.detach()
        for point in (here, one):
            assert not os.path.exists(point) and not any(x.point == point for x in mounts.of("self"))
        assert not os.path.exists(os.path.dirname(one))
    finally:
        node.kill()
        node.wait()


def test_the_node_is_the_process_serving_the_runtime_socket(tmp_path) -> None:
    sock = tmp_path / "rt.sock"
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import socket,time; s=socket.socket(socket.AF_UNIX); "
            f"s.bind({str(sock)!r}); s.listen(); print('up', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        assert nodeview.runtime_pid(f"unix://{sock}") == server.pid
    finally:
        server.kill()
        server.wait()
    assert nodeview.runtime_pid(f"unix://{sock}") == 1  # nobody answers: PID 1's namespace
    assert nodeview.runtime_pid("procfs") == 1


def test_files_open_for_writing_are_found_under_their_mount(tmp_path) -> None:
    vol = tmp_path / "vol"
    (vol / "sub").mkdir(parents=True)
    for name in ("log", "sub/ckpt", "dataset", "mapped", "gone"):
        (vol / name).write_bytes(b"x" * 4096)
    code = (
        "import mmap, os, sys, time\n"
        f"d = {str(vol)!r}\n"
        "a = open(d + '/log', 'a'); b = open(d + '/sub/ckpt', 'r+b'); c = open(d + '/dataset', 'rb')\n"
        "m = open(d + '/mapped', 'r+b'); mm = mmap.mmap(m.fileno(), 4096); m.close()\n"
        "g = open(d + '/gone', 'a'); os.unlink(d + '/gone')\n"
        "print('up', flush=True); time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        found = volumes.open_for_writing([p.pid], [str(tmp_path), str(vol)])
        # the deepest mount point holds them; read-only and deleted files are not carried
        assert found == {str(vol): {"log", "sub/ckpt", "mapped"}}
    finally:
        p.kill()
        p.wait()


@needs("root")  # unpacking chroots into the volume
def test_carried_files_are_written_only_where_they_differ(tmp_path) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    for d in (src, dst):
        (d / "logs").mkdir(parents=True)
    (src / "logs" / "same").write_text("step 1\nstep 2\n")
    (src / "logs" / "other").write_text("step 1\nstep 2\n")
    (src / "new").write_text("fresh\n")
    (dst / "logs" / "same").write_text("step 1\nstep 2\n")  # storage both nodes share: the same file
    (dst / "logs" / "other").write_text("stale\n")  # another node's disk: a stale copy
    before = os.stat(dst / "logs" / "same")
    tar = tmp_path / "carry.tar"
    volumes.write_files(str(src), {"logs/same", "logs/other", "new"}, tar)
    time.sleep(0.01)
    rootfsdiff.apply(tar, [], dst, keep_equal=True)
    after = os.stat(dst / "logs" / "same")
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns), (
        "an equal file was rewritten"
    )
    assert (dst / "logs" / "other").read_text() == "step 1\nstep 2\n"
    assert (dst / "new").read_text() == "fresh\n"


def _atomic_writer(d: Path, stamp: str, files: dict[str, str]) -> None:
    """A ConfigMap volume as the kubelet writes it: a timestamped folder, `..data` → it, each key
    a link to `..data/KEY`."""
    (d / stamp).mkdir(parents=True)
    for k, v in files.items():
        (d / stamp / k).write_text(v)
        (d / k).symlink_to(f"..data/{k}")
    (d / "..data").symlink_to(stamp)


def test_a_configmaps_digest_is_its_keys_and_values(tmp_path) -> None:
    _atomic_writer(tmp_path / "a", "..2026_12_01_10_00_00.1", {"lr": "0.003", "greeting": "hello"})
    _atomic_writer(tmp_path / "b", "..2026_12_01_11_22_33.9", {"lr": "0.003", "greeting": "hello"})
    _atomic_writer(tmp_path / "c", "..2026_12_01_10_00_00.1", {"lr": "0.01", "greeting": "hello"})
    digest = {d: volumes.digest(str(tmp_path / d)) for d in "abc"}
    assert digest["a"] == digest["b"], "the kubelet's timestamps must not count"
    assert digest["a"] != digest["c"]
    assert volumes.digest(str(tmp_path / "a" / "lr")) != volumes.digest(
        str(tmp_path / "c" / "lr")
    )  # a subPath


def _pod(*vols: dict) -> dict:
    return {"metadata": {"name": "train", "namespace": "default"}, "spec": {"volumes": list(vols)}}


NODE_B = {"metadata": {"name": "b", "labels": {"kubernetes.io/hostname": "b", "zone": "z1"}}}


def _pv(source: dict, affinity: list | None = None) -> dict:
    spec = {"accessModes": ["ReadWriteOnce"], "capacity": {"storage": "1Gi"}, **source}
    if affinity is not None:
        spec["nodeAffinity"] = {"required": {"nodeSelectorTerms": affinity}}
    return {"metadata": {"name": "pv1"}, "spec": spec}


def _claim(phase: str = "Bound", modes: tuple[str, ...] = ("ReadWriteOnce",)) -> dict:
    return {
        "metadata": {"name": "data"},
        "spec": {"volumeName": "pv1", "accessModes": list(modes)},
        "status": {"phase": phase, "accessModes": list(modes)},
    }


CLAIM = {"name": "data", "persistentVolumeClaim": {"claimName": "data"}}


@pytest.mark.parametrize(
    ("claim", "pv", "says"),
    [
        (None, None, "names PersistentVolumeClaim data, which does not exist"),
        (_claim("Pending"), None, "is PersistentVolumeClaim data, which is Pending"),
        (_claim(), None, "bound to PersistentVolume pv1, which is gone"),
        (
            _claim(),
            _pv(
                {"local": {"path": "/d"}},
                [
                    {
                        "matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["a"]}
                        ]
                    }
                ],
            ),
            "which node b cannot reach",
        ),
        (
            _claim(),
            _pv({"csi": {"driver": "ebs.csi.aws.com", "volumeHandle": "v"}}),
            "a ReadWriteOnce csi volume: attached to one node at a time",
        ),
        (
            _claim(),
            _pv(
                {"local": {"path": "/d"}},
                [  # ORed terms: the second lets b in
                    {
                        "matchExpressions": [
                            {"key": "kubernetes.io/hostname", "operator": "In", "values": ["a"]}
                        ]
                    },
                    {
                        "matchExpressions": [{"key": "zone", "operator": "Exists"}],
                        "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["c"]}],
                    },
                ],
            ),
            None,
        ),
        (_claim(modes=("ReadWriteMany",)), _pv({"csi": {"driver": "efs.csi.aws.com"}}), None),
        (_claim(), _pv({"hostPath": {"path": "/d"}}), None),
    ],
)
def test_a_claim_follows_when_bound_reachable_and_not_attached_elsewhere(claim, pv, says) -> None:
    claims = {"data": claim} if claim else {}
    pvs = {"pv1": pv} if pv else {}
    r = podvolumes.check(_pod({"name": "scratch", "emptyDir": {}}, CLAIM), NODE_B, claims, pvs)
    if says is None:
        assert r is None
    else:
        assert r is not None and r.volume == "data" and says in r.what, r


@pytest.mark.parametrize(
    ("volume", "says"),
    [
        ({"ephemeral": {"volumeClaimTemplate": {}}}, "generic ephemeral volume"),
        ({"gitRepo": {"repository": "r"}}, "cloned anew for each pod"),
        ({"awsElasticBlockStore": {"volumeID": "v"}}, "inline awsElasticBlockStore disk"),
        (
            {"csi": {"driver": "secrets-store.csi.k8s.io"}},
            "inline csi volume (driver secrets-store.csi.k8s.io)",
        ),
        ({"flexVolume": {"driver": "x"}}, "flexVolume volume, which criuctl does not know how to move"),
    ],
)
def test_volumes_no_other_node_sees_alike_are_refused_by_name(volume: dict, says: str) -> None:
    follow = [
        {"name": k, k: {}}
        for k in ("emptyDir", "hostPath", "configMap", "secret", "projected", "downwardAPI", "nfs")
    ]
    assert podvolumes.check(_pod(*follow), NODE_B, {}, {}) is None
    r = podvolumes.check(_pod(*follow, {"name": "odd", **volume}), NODE_B, {}, {})
    assert r is not None and r.volume == "odd" and says in r.what and r.hint, r


def test_a_volumes_digest_is_read_as_the_process_sees_it_and_waits_out_a_kubelet_swap(
    tmp_path, monkeypatch
) -> None:
    """Read through /proc/PID/root: the digest is what that process sees. A read that lost a race
    with the kubelet's swap (the old folder removed between the link and the file) is tried again,
    not a crash; a volume still unreadable after the retries is one clear error."""
    _atomic_writer(tmp_path / "a", "..2026_12_01_10_00_00.1", {"lr": "0.003"})
    want = volumes.digest(str(tmp_path / "a"))
    assert volumes.seen_digest(os.getpid(), str(tmp_path / "a"), "volume cfg (api)") == want
    with pytest.raises(CriuctlError) as err:
        volumes.seen_digest(os.getpid(), str(tmp_path / "missing"), "volume cfg (api)")
    assert err.value.what.startswith("cannot read volume cfg (api) at "), err.value.what

    real, lost = volumes.digest, [FileNotFoundError(2, "No such file or directory")] * 2

    def racing(base: str) -> str:
        if lost:
            raise lost.pop()
        return real(base)

    monkeypatch.setattr(volumes, "digest", racing)
    assert volumes.seen_digest(os.getpid(), str(tmp_path / "a"), "volume cfg (api)") == want
    assert not lost
