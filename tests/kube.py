"""Pods and helpers for the tests on the local cluster (localcluster: real apiserver,
scheduler, controller-manager, kubelets, containerd; the agent as the DaemonSet).

A training pod here is an ordinary pod spec a user would write: busybox as the image, the host's
Python and the project by read-only hostPath (the cluster has no registry), an emptyDir, a log file;
it carries the label `criuctl.io/migratable: "true"` and nothing else of criuctl's: the webhook,
called by the API server, wraps it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
from localcluster.layout import BUSYBOX, HOST_PYTHON, REPO, Layout

from tests.jobs import CRIUCTL

PY = str(REPO / ".venv" / "bin" / "python")
JOB = str(REPO / "tests" / "workloads" / "train_cnn_loader.py")
_STEP = re.compile(r"^[FP] step (\d+) loss (\S+)$|^step (\d+) loss (\S+)$")
_FINAL = re.compile(r"^(?:[FP] )?final ([0-9a-f]{64})$")


def training_pod(
    name: str,
    steps: int = 40,
    node: str | None = None,
    labels: dict | None = None,
    extra_spec: dict | None = None,
    container: str = "train",
) -> dict:
    mounts = [p for p in (*HOST_PYTHON, str(REPO)) if Path(p).exists()]
    spec = {
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 10,
        "containers": [
            {
                "name": container,
                "image": BUSYBOX,
                "imagePullPolicy": "Never",
                "command": [PY, JOB],
                "args": [
                    "--steps",
                    str(steps),
                    "--workers",
                    "2",
                    "--log",
                    "/scratch/train.log",
                    "--scratch",
                    "/scratch",
                ],
                "volumeMounts": [
                    {"name": f"host{i}", "mountPath": p, "readOnly": True} for i, p in enumerate(mounts)
                ]
                + [{"name": "scratch", "mountPath": "/scratch"}],
                "resources": {"requests": {"memory": "256Mi", "cpu": "100m"}},
            }
        ],
        "volumes": [
            {"name": f"host{i}", "hostPath": {"path": p, "type": "Directory"}} for i, p in enumerate(mounts)
        ]
        + [{"name": "scratch", "emptyDir": {}}],
        **(extra_spec or {}),
    }
    if node:
        spec["nodeName"] = node
    meta = {
        "name": name,
        "labels": {"criuctl.io/migratable": "true", "app": name, **(labels or {})},
        "annotations": {"criuctl.io/python": PY},
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


DDP_JOB = str(REPO / "tests" / "workloads" / "train_ddp_nodes.py")


def _replica(name: str, node: str, replicas: int, args: list[str], migratable: bool, dcp: str) -> dict:
    pod = training_pod(name, container="pytorch", extra_spec={"terminationGracePeriodSeconds": 5})
    spec = {k: v for k, v in pod["spec"].items() if k != "restartPolicy"}
    spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    ctr = spec["containers"][0]
    ctr["args"] = [DDP_JOB, *args]
    ctr["command"] = ctr["command"][:1]
    ctr["resources"] = {"requests": {"memory": "128Mi", "cpu": "10m"}}
    if dcp:  # a folder every node sees (the local cluster's nodes share the host's disk)
        ctr["volumeMounts"].append({"name": "dcp", "mountPath": dcp})
        spec["volumes"].append({"name": "dcp", "hostPath": {"path": dcp, "type": "DirectoryOrCreate"}})
    meta = {k: pod["metadata"][k] for k in ("labels", "annotations")}
    meta["labels"] = {**meta["labels"], "app": name}
    if not migratable:
        meta["labels"].pop("criuctl.io/migratable")
    return {"replicas": replicas, "restartPolicy": "OnFailure", "template": {"metadata": meta, "spec": spec}}


def ddp_job(
    name: str,
    master_node: str = "a",
    worker_node: str = "b",
    workers: int = 2,
    args: tuple[str, ...] = ("--steps", "300", "--step-time", "0.05"),
    migratable: bool = True,
    dcp: str = "",
) -> dict:
    """A PyTorchJob as a user writes one: a master and `workers` workers running gloo DDP
    (tests/workloads/train_ddp_nodes.py `args`); `dcp`: a host folder mounted there in every pod."""
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {
            "pytorchReplicaSpecs": {
                "Master": _replica(name, master_node, 1, list(args), migratable, dcp),
                "Worker": _replica(name, worker_node, workers, list(args), migratable, dcp),
            }
        },
    }


class Kubectl:
    def __init__(self, lay: Layout) -> None:
        self.lay = lay

    def __call__(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        r = subprocess.run(
            ["kubectl", "--kubeconfig", str(self.lay.kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check and r.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)}: {r.stderr.strip()}")
        return r

    def apply(self, obj: dict, namespace: str = "default") -> None:
        self("-n", namespace, "apply", "-f", "-", input=json.dumps(obj))

    def get(self, kind: str, name: str, namespace: str = "default") -> dict | None:
        r = self("-n", namespace, "get", kind, name, "-o", "json", check=False)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def pods(self, namespace: str = "default", selector: str | None = None) -> list[dict]:
        args = ["-n", namespace, "get", "pods", "-o", "json"] + (["-l", selector] if selector else [])
        return json.loads(self(*args).stdout)["items"]

    def logs(self, pod: str, namespace: str = "default") -> str:
        return self("-n", namespace, "logs", pod, check=False).stdout

    def wait_running(self, pod: str, namespace: str = "default", timeout: float = 90) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p = self.get("pod", pod, namespace)
            if (
                p
                and p["status"].get("phase") == "Running"
                and all("running" in c.get("state", {}) for c in p["status"].get("containerStatuses", []))
            ):
                return p
            time.sleep(0.3)
        raise AssertionError(f"pod {namespace}/{pod} not running after {timeout}s: {p and p.get('status')}")

    def wait_gone(self, kind: str, name: str, namespace: str = "default", timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if (last := self.get(kind, name, namespace)) is None:
                return
            time.sleep(0.5)
        # what holds it: its finalizers, deletion, containers' states, and the Events about it
        meta, status = last.get("metadata", {}), last.get("status", {})
        held = {k: meta.get(k) for k in ("finalizers", "deletionTimestamp", "deletionGracePeriodSeconds")}
        states = {c["name"]: c.get("state") for c in status.get("containerStatuses") or []}
        about = f"involvedObject.name={name}"
        events = self("-n", namespace, "get", "events", "--field-selector", about, check=False)
        raise AssertionError(
            f"{kind} {namespace}/{name} still there after {timeout}s: {held}, node "
            f"{last.get('spec', {}).get('nodeName')}, phase {status.get('phase')}, containers {states}; "
            f"events:\n{events.stdout[-1500:]}"
        )


def steps(log: str) -> dict[int, str]:
    out = {}
    for line in log.splitlines():
        if m := _STEP.match(line.strip()):
            out[int(m[1] or m[3])] = m[2] or m[4]
    return out


def final(log: str) -> list[str]:
    return [m[1] for line in log.splitlines() if (m := _FINAL.match(line.strip()))]


def wait_step(k: Kubectl, pod: str, n: int, timeout: float = 120, namespace: str = "default") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if max(steps(k.logs(pod, namespace)) or [-1]) >= n:
            return
        time.sleep(0.5)
    raise AssertionError(f"pod {pod} did not reach step {n}: {k.logs(pod, namespace)[-800:]}")


class LogFollower(threading.Thread):
    """`kubectl logs -f POD` for as long as the container lives: every line it printed, even once
    the pod is deleted (a migrated pod's log ends where the freeze cut it)."""

    def __init__(self, k: Kubectl, pod: str) -> None:
        super().__init__(daemon=True)
        self.argv = ["kubectl", "--kubeconfig", str(k.lay.kubeconfig), "logs", "-f", pod]
        self.text = ""

    def run(self) -> None:
        self.text = subprocess.run(self.argv, capture_output=True, text=True, timeout=600).stdout


def to_the_end(k: Kubectl, pod: str, follow: list[LogFollower], timeout: float = 300) -> None:
    """Wait until `pod` has Succeeded (the job ran to its end), then until every log follower of the
    job's successive pods has read its pod's whole log."""
    deadline = time.monotonic() + timeout
    while (k.get("pod", pod) or {}).get("status", {}).get("phase") != "Succeeded":
        assert time.monotonic() < deadline, k("logs", pod, check=False).stdout[-1000:]
        time.sleep(1)
    for f in follow:
        f.join(60)


def combined_steps(parts: list[dict[int, str]]) -> dict[int, str]:
    """Every step's loss over the logs of a job's successive pods; a step that two pods report
    must carry the same loss (a resumed copy, not a second run from the start)."""
    out: dict[int, str] = {}
    for part in parts:
        for s, loss in part.items():
            assert out.get(s, loss) == loss, f"step {s} reported twice with different losses"
            out[s] = loss
    return out


def drain(k: Kubectl, node: str, selector: str) -> None:
    """`kubectl drain NODE` of this test's pods only: a pod another failed test left there (bare
    pods make drain refuse) must not decide the test."""
    r = k(
        "drain",
        node,
        f"--pod-selector={selector}",
        "--ignore-daemonsets",
        "--delete-emptydir-data",
        "--timeout=300s",
        check=False,
    )
    assert r.returncode == 0, r.stderr[-2000:]


def advertise(k: Kubectl, node: str, resource: str, count: int | None) -> None:
    """A node's device plugin resource, as a device plugin would report it (None: none at all)."""
    value = None if count is None else str(count)
    status = {"status": {"capacity": {resource: value}, "allocatable": {resource: value}}}
    k("patch", "node", node, "--subresource=status", "--type=merge", "-p", json.dumps(status))
    deadline = time.monotonic() + 30
    while (k.get("node", node) or {})["status"].get("allocatable", {}).get(resource) != value:
        assert time.monotonic() < deadline, f"node {node} did not take {resource}={value}"
        time.sleep(0.5)


def criuctl(lay, *args: str) -> subprocess.CompletedProcess:
    """A criuctl command as a user runs it, with the local cluster's kubeconfig."""
    env = {**os.environ, "KUBECONFIG": str(lay.kubeconfig)}
    return subprocess.run([*CRIUCTL, *args], capture_output=True, text=True, env=env, timeout=300)


def migrate_pod(
    lay, k: Kubectl, pod: str, node: str, *opts: str, gone: bool = True, refused_while: str = ""
) -> str:
    """Move `pod` with the CLI; returns the new pod's name, checked to run on `node` (and, with
    `gone`, the old pod deleted: the kubelet may take half a minute to remove it, while a short job
    on the new pod runs to its end). `refused_while`: a refusal naming it is tried again, twice,
    10 s apart (a node's kubelet still showing its cached copy of an edited ConfigMap)."""
    for _ in range(3 if refused_while else 1):
        r = criuctl(lay, "migrate", pod, node, "-o", "json", *opts)
        if r.returncode == 0 or refused_while not in r.stderr or "Traceback" in r.stderr:
            break
        time.sleep(10)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["pod"] == pod and out["target"] == node
    new = k.get("pod", out["new_pod"])
    assert new["spec"]["nodeName"] == node and new["status"]["phase"] == "Running"
    assert new["metadata"]["annotations"]["criuctl.io/migrated-from"].startswith(f"default/{pod}@")
    if gone:
        k.wait_gone("pod", pod)
    return out["new_pod"]


def criuctl_runs_the_built_image(lay: Layout, k: Kubectl) -> list[dict]:
    """The agent pods, once each of criuctl's pods (the agents, the webhook's, the controller's) is
    checked to run the
    image `up` built from the Dockerfile (the runtime's image ID is that build's config digest) with
    no hostPath of the project or of the host's Python: AssertionError otherwise. Every Kubernetes
    test runs behind this check."""
    agents = k.pods("criuctl-system", "app.kubernetes.io/name=criuctl-agent")
    assert sorted(p["spec"]["nodeName"] for p in agents) == sorted(lay.nodes), agents
    webhooks = k.pods("criuctl-system", "app.kubernetes.io/name=criuctl-webhook")
    assert webhooks, "no webhook pod runs"
    controllers = k.pods("criuctl-system", "app.kubernetes.io/name=criuctl-controller")
    assert controllers, "no controller pod runs"
    built = f"docker.io/library/{lay.agent_image}"
    host = {str(REPO), *HOST_PYTHON}
    for p in agents + webhooks + controllers:
        (status,) = p["status"]["containerStatuses"]
        assert (status["image"], status["imageID"]) == (built, lay.agent_image_id), (
            f"{p['metadata']['name']} runs {status['image']} ({status['imageID']}), "
            f"not the built {built} ({lay.agent_image_id})"
        )
        paths = {v["hostPath"]["path"] for v in p["spec"]["volumes"] if "hostPath" in v}
        assert not {q for q in paths for h in host if q == h or q.startswith(h + "/")}, paths
    return agents


class Points:
    """Named instants (criuctl.agent.points) armed in a pause folder that the processes of the
    local cluster read: the controller's replicas DIR/pause, an agent its node's state dir's."""

    def __init__(self, folder: Path) -> None:
        self.pause = folder
        folder.mkdir(exist_ok=True)

    def arm(self, *points: str) -> None:
        for p in points:
            for f in (self.pause / p, self.pause / f"{p}.go"):
                f.unlink(missing_ok=True)
        (self.pause / "armed").write_text("\n".join(points) + "\n")

    def disarm(self) -> None:
        (self.pause / "armed").write_text("")

    def reached(self, point: str, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        while not (self.pause / point).exists():
            assert time.monotonic() < deadline, f"nothing reached {point} (armed in {self.pause})"
            time.sleep(0.1)

    def go(self, point: str) -> None:
        (self.pause / f"{point}.go").touch()


class Controller(Points):
    """The controller Deployment's replicas, stopped at a named instant and killed by the tests: the
    local cluster's overlay gives them the pause folder DIR/pause, whose `armed` file every replica
    reads."""

    def __init__(self, lay: Layout, k: Kubectl) -> None:
        super().__init__(lay.dir / "pause")
        self.k = k
        self.restarts = 0  # the paused replica's container restarts when it was paused

    def leader(self) -> str:
        lease = self.k.get("lease", "criuctl-controller", "criuctl-system") or {}
        return (lease.get("spec", {}).get("holderIdentity") or "").rpartition("_")[0]

    def kill_leader(self) -> str:
        """Kill the leading replica's pod at once (no grace): the other replica takes the Lease over
        once it runs out. Returns the killed pod's name."""
        self.disarm()
        old = self.leader()
        assert old, "no controller holds the Lease"
        self.k("-n", "criuctl-system", "delete", "pod", old, "--grace-period=0", "--force")
        return old

    def _restarts(self, pod: str) -> int:
        got = self.k.get("pod", pod, "criuctl-system") or {}
        return sum(s.get("restartCount", 0) for s in got.get("status", {}).get("containerStatuses", []))

    def stop_replica(self, pod: str) -> list[int]:
        """SIGSTOP every process of replica `pod` (found by the HOSTNAME its container gives them):
        a stopped VM, a long GC. Returns their host PIDs for `cont_replica`."""
        self.restarts = self._restarts(pod)
        pids = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            with contextlib.suppress(psutil.Error):
                if "controller" in " ".join(p.info["cmdline"] or []) and p.environ().get("HOSTNAME") == pod:
                    p.suspend()
                    pids.append(p.pid)
        assert pids, f"no process of {pod} on this host"
        return pids

    def cont_replica(self, pids: list[int]) -> None:
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).resume()

    def wait_restarted(self, pod: str, timeout: float = 60) -> None:
        """Until replica `pod`'s container ended and was started again (it stopped by itself)."""
        deadline = time.monotonic() + timeout
        while self._restarts(pod) <= self.restarts:
            assert time.monotonic() < deadline, f"{pod} did not stop after it was deposed"
            time.sleep(0.5)

    def wait_leader(self, not_: str = "", timeout: float = 120) -> str:
        deadline = time.monotonic() + timeout
        while (now := self.leader()) in ("", not_):
            assert time.monotonic() < deadline, f"no controller took the Lease over from {not_}"
            time.sleep(0.5)
        return now


def grant_migrator(k: Kubectl, namespace: str = "default") -> None:
    """The local cluster's user `migrator` (its kubeconfig: DIR/migrator.kubeconfig) given
    criuctl-migrator, and nothing else, in `namespace`: what a user needs to move pods."""
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "migrator", "namespace": namespace},
        "roleRef": {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "ClusterRole",
            "name": "criuctl-migrator",
        },
        "subjects": [{"kind": "User", "name": "migrator", "apiGroup": "rbac.authorization.k8s.io"}],
    }
    k.apply(binding, namespace)


def wait_podmigration(k: Kubectl, name: str, timeout: float = 300, namespace: str = "default") -> dict:
    """The PodMigration once it ended (Succeeded or Failed)."""
    deadline = time.monotonic() + timeout
    obj: dict | None = None
    while time.monotonic() < deadline:
        obj = k.get("podmigration", name, namespace)
        if obj and (obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return obj
        time.sleep(0.5)
    raise AssertionError(
        f"podmigration {name} did not end within {timeout:.0f} s: {obj and obj.get('status')}"
    )


def until(what: str, get: Callable[[], Any], timeout: float = 90) -> Any:
    """`get()` once it is truthy, polled every 0.3 s; fails the test with `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while not (value := get()):
        assert time.monotonic() < deadline, f"{what}: not after {timeout:.0f}s"
        time.sleep(0.3)
    return value
