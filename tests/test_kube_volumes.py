"""Every kind of volume a training pod uses, moved with `criuctl migrate POD NODE` on the real local
Kubernetes (tests/conftest.py `local_cluster`), or refused in one line naming the volume.

One pod carries them all, so that the cluster runs one successful move (each costs ~30-60 s here):
a hostPath under /var/tmp holding its log (open for appending, as an output folder is), a claim
bound to a local PV holding its progress file (open too), an emptyDir on disk with a subPath of it,
an emptyDir in memory at /dev/shm, a ConfigMap (whole, and one key by subPath), a Secret, a
projected volume. Before that move, an edited ConfigMap the job saw by subPath makes one move fail
in one line, the job thawed where it was; after it, the job continues bit-identically (the same
losses and final weights as an uninterrupted run) and every volume holds what it held.

Both nodes of the local cluster see this machine's /var/tmp, as nodes sharing storage do; a
claim whose PV only node a reaches is refused before anything changes."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import psutil
import pytest
from localcluster.layout import Layout
from localcluster.node import in_cgroup

from criuctl.container import mounts
from tests.conftest import needs_criu
from tests.kube import (
    JOB,
    Kubectl,
    LogFollower,
    combined_steps,
    criuctl,
    final,
    migrate_pod,
    steps,
    to_the_end,
    training_pod,
    wait_step,
)

IMAGE_VENV = "/opt/criuctl/venv"  # the Dockerfile's VENV: where the agent image runs criuctl from
pytestmark = [needs_criu, pytest.mark.timeout(900)]
STEPS = 500
TOKEN = uuid.uuid4().hex  # what the test writes into the pod's own volumes before the move


def _local_pv(name: str, path: Path, nodes: dict) -> dict:
    """A local PersistentVolume at `path`, reachable from the nodes `nodes` (a node selector term)."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolume",
        "metadata": {"name": name},
        "spec": {
            "capacity": {"storage": "1Gi"},
            "accessModes": ["ReadWriteOnce"],
            "persistentVolumeReclaimPolicy": "Retain",
            "storageClassName": "criuctl-test-local",
            "local": {"path": str(path)},
            "nodeAffinity": {"required": {"nodeSelectorTerms": [{"matchExpressions": [nodes]}]}},
        },
    }


def _claim(name: str, pv: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name},
        "spec": {
            "accessModes": ["ReadWriteOnce"],
            "storageClassName": "criuctl-test-local",
            "volumeName": pv,
            "resources": {"requests": {"storage": "1Gi"}},
        },
    }


def _every_volume(name: str, host: Path, steps_: int) -> dict:
    """The training pod with each kind of volume; its log goes to the hostPath, its progress file
    (one line per step, held open) to the claim."""
    pod = training_pod(name, steps=steps_, node="a", extra_spec={"restartPolicy": "OnFailure"})
    c = pod["spec"]["containers"][0]
    c["args"] = ["--steps", str(steps_), "--workers", "2", "--log", "/out/train.log", "--scratch", "/data"]
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] != "scratch"] + [
        {"name": "out", "mountPath": "/out"},
        {"name": "data", "mountPath": "/data"},
        {"name": "scratch", "mountPath": "/scratch"},
        {"name": "scratch", "mountPath": "/part", "subPath": "part"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cfg", "mountPath": "/etc/cfg"},
        {"name": "one", "mountPath": "/etc/one.conf", "subPath": "one.conf"},
        {"name": "sec", "mountPath": "/etc/sec", "readOnly": True},
        {"name": "proj", "mountPath": "/etc/proj"},
    ]
    pod["spec"]["volumes"] = [v for v in pod["spec"]["volumes"] if v["name"] != "scratch"] + [
        {"name": "out", "hostPath": {"path": str(host / "out"), "type": "DirectoryOrCreate"}},
        {"name": "data", "persistentVolumeClaim": {"claimName": f"{name}-data"}},
        {"name": "scratch", "emptyDir": {}},
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "cfg", "configMap": {"name": f"{name}-cfg"}},
        {"name": "one", "configMap": {"name": f"{name}-one"}},
        {"name": "sec", "secret": {"secretName": f"{name}-sec"}},
        {
            "name": "proj",
            "projected": {
                "sources": [
                    {"configMap": {"name": f"{name}-cfg", "items": [{"key": "lr", "path": "cfg/lr"}]}},
                    {
                        "downwardAPI": {
                            "items": [{"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]
                        }
                    },
                ]
            },
        },
    ]
    return pod


def _config(name: str, data: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}


@pytest.fixture(scope="module")
def host(local_cluster):
    """A folder of this machine's /var/tmp, where both nodes see the same files."""
    d = Path("/var/tmp") / f"criuctl-test-volumes-{uuid.uuid4().hex[:8]}"
    for sub in ("out", "pv", "pinned"):
        (d / sub).mkdir(parents=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _exec(k: Kubectl, pod: str, script: str) -> str:
    """`sh -c SCRIPT` in the pod's container; kubelet 1.20 may answer "container not found" for a
    few seconds after it reported the container running (its runtime cache), so that is retried."""
    deadline = time.monotonic() + 20
    while True:
        r = k("exec", pod, "--", "/bin/sh", "-c", script, check=False)
        if r.returncode == 0:
            return r.stdout
        status = (k.get("pod", pod) or {}).get("status", {}).get("containerStatuses")
        assert "container not found" in r.stderr and time.monotonic() < deadline, f"{r.stderr} {status}"
        time.sleep(1)


def _refused(lay, k: Kubectl, pod: str, node: str) -> str:
    """`criuctl migrate POD NODE` refused: one line, non-zero, no pod made or deleted; the line."""
    pods = sorted(p["metadata"]["name"] for p in k.pods())
    r = criuctl(lay, "migrate", pod, node)
    lines = r.stderr.strip().splitlines()
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert len(lines) == 1 and lines[0].startswith("criuctl: error: "), r.stderr
    assert sorted(p["metadata"]["name"] for p in k.pods()) == pods, "a refusal changed the cluster"
    assert k.get("pod", pod)["status"]["phase"] == "Running"
    return lines[0]


def _attached_left(lay: Layout, node: str) -> list[str]:
    """Mounts that node `node`'s agent attached for CRIU and did not let go of: the agent of this
    cluster (in its node's cgroups), run from the image (its venv's criuctl)."""
    agent = [f"{IMAGE_VENV}/bin/criuctl", "agent"]
    root = lay.node(node).cgroup_root
    pids = [
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if (a := p.info["cmdline"] or [])[1:3] == agent
        and a[a.index("--name") + 1] == node
        and in_cgroup(Path(f"/proc/{p.pid}"), root)
    ]
    assert pids, f"no agent of this cluster runs for node {node}"
    return [m.point for pid in pids for m in mounts.of(pid) if "criuctl-node-mount-" in m.point]


def _delete(k: Kubectl, *objs: str) -> None:
    for obj in objs:
        kind, _, name = obj.partition("/")
        k("delete", kind, name, "--wait=false", "--ignore-not-found", check=False)


def test_every_kind_of_volume_moves_bit_identically(local_cluster, reference, host) -> None:
    lay, k = local_cluster
    ref = reference(os.path.basename(JOB), "--steps", str(STEPS), "--workers", "2", "--log", "/dev/null")
    name = "vols"
    anywhere = {"key": "criuctl.io/local-cluster", "operator": "In", "values": ["true"]}
    k.apply(_local_pv(f"{name}-pv", host / "pv", anywhere))
    k.apply(_claim(f"{name}-data", f"{name}-pv"))
    k.apply(_config(f"{name}-cfg", {"lr": "0.003", "greeting": "hello"}))
    k.apply(_config(f"{name}-one", {"one.conf": "seen by subPath\n"}))
    k("create", "secret", "generic", f"{name}-sec", "--from-literal=password=s3cret")
    k.apply(_every_volume(name, host, STEPS))
    follow: list[LogFollower] = []
    try:
        k.wait_running(name, timeout=120)
        follow.append(LogFollower(k, name))
        follow[0].start()
        _exec(
            k,
            name,
            f"echo {TOKEN} > /scratch/disk; mkdir -p /scratch/part; echo {TOKEN} > /part/sub; "
            f"echo {TOKEN} > /dev/shm/mem",
        )
        wait_step(k, name, 30)

        on_b = migrate_pod(lay, k, name, "b", gone=False)
        follow.append(LogFollower(k, on_b))
        follow[-1].start()
        ours = {p: TOKEN + "\n" for p in ("/scratch/disk", "/part/sub", "/scratch/part/sub", "/dev/shm/mem")}
        want = {
            **ours,
            "/etc/cfg/greeting": "hello",
            "/etc/one.conf": "seen by subPath\n",
            "/etc/sec/password": "s3cret",
            "/etc/proj/cfg/lr": "0.003",
        }
        assert {path: _exec(k, on_b, f"cat {path}") for path in want} == want
        assert not _attached_left(lay, "b"), "the agent on b kept the node's mounts it attached for CRIU"
        k.wait_gone("pod", name)

        # The ConfigMap the job sees by subPath is edited, and node b's kubelet swaps its copy in
        # (poked by an annotation: a pod's update makes it sync the pod's volumes at once). The
        # job's file is then one the node deleted, which no restore can put back (CRIU failed
        # after the freeze: "Can't re-create deleted file"): refused before the freeze, in one
        # line naming the volume, and the job trains on, on b, to its end.
        k.apply(_config(f"{name}-one", {"one.conf": "edited since\n"}))
        uid = (k.get("pod", on_b) or {})["metadata"]["uid"]
        copy = Path(f"/proc/{lay.pids['node-b']}/root/var/lib/kubelet/pods/{uid}/volumes")
        copy = copy / "kubernetes.io~configmap" / "one" / "one.conf"
        deadline = time.monotonic() + 120
        while copy.read_text() != "edited since\n":
            assert time.monotonic() < deadline, "b's kubelet never swapped the edited ConfigMap in"
            k("annotate", "pod", on_b, f"criuctl.test/poke={time.monotonic()}", "--overwrite")
            time.sleep(2)
        r = criuctl(lay, "migrate", on_b, "a")
        lines = r.stderr.strip().splitlines()
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        assert lines[-1].startswith("criuctl: error: ") and "volume one " in lines[-1], r.stderr
        assert "replaced its file" in lines[-1] and "keeps running on b" in lines[-1], r.stderr
        k.wait_gone("pod", f"{name}-m2")
        before = max(steps(k.logs(on_b)))
        wait_step(k, on_b, before + 5)
        to_the_end(k, on_b, follow)
        parts = [steps(f.text) for f in follow]
        assert all(parts) and min(parts[1]) > 0, "a log showed no step, or the move started the job over"
        assert combined_steps(parts) == ref.steps
        assert final(follow[-1].text) == [ref.final], "final weights differ from the uninterrupted run"
        # the files the job held open on the hostPath and the claim went on where they were
        progress = (host / "pv" / "progress").read_text().split()
        assert progress == [str(s) for s in range(STEPS)], "the progress file lost or repeated steps"
        log = (host / "out" / "train.log").read_text()
        logged = [int(line.split()[1]) for line in log.splitlines() if line.startswith("step ")]
        assert logged == list(range(STEPS)) and log.endswith("done\n"), "the log lost or repeated steps"
    finally:
        k("delete", "pod", name, f"{name}-m1", f"{name}-m2", "--grace-period=1", "--wait=false", check=False)
        _delete(
            k,
            f"pvc/{name}-data",
            f"pv/{name}-pv",
            f"configmap/{name}-cfg",
            f"configmap/{name}-one",
            f"secret/{name}-sec",
        )


def test_a_claim_only_the_source_node_reaches_is_refused(local_cluster, host) -> None:
    """A claim bound to node a's local disk: refused before anything changes, the volume named."""
    lay, k = local_cluster
    name = "pinned"
    only_a = {"key": "kubernetes.io/hostname", "operator": "In", "values": ["a"]}
    k.apply(_local_pv(f"{name}-pv", host / "pinned", only_a))
    k.apply(_claim(f"{name}-data", f"{name}-pv"))
    pod = training_pod(name, steps=100000, node="a")
    pod["spec"]["containers"][0]["volumeMounts"].append({"name": "data", "mountPath": "/data"})
    pod["spec"]["volumes"].append({"name": "data", "persistentVolumeClaim": {"claimName": f"{name}-data"}})
    k.apply(pod)
    try:
        k.wait_running(name, timeout=120)
        wait_step(k, name, 5)
        said = _refused(lay, k, name, "b")
        want = f"volume data is PersistentVolumeClaim {name}-data, bound to PersistentVolume {name}-pv"
        assert want in said and "which node b cannot reach" in said, said
        assert "nothing was changed" in said
        before = max(steps(k.logs(name)))
        wait_step(k, name, before + 5)  # trains on, once: its container never restarted
        assert k.get("pod", name)["status"]["containerStatuses"][0]["restartCount"] == 0
    finally:
        k("delete", "pod", name, "--grace-period=1", "--wait=false", check=False)
        _delete(k, f"pvc/{name}-data", f"pv/{name}-pv")
