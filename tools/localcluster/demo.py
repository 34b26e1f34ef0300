"""`scripts/local-cluster demo` (the end of `make demo`): the Kubernetes flow on the local cluster.

A 3-rank DDP PyTorchJob (the demo's job on gloo: DataLoader workers, AdamW, OneCycle; the stand-in
operator makes its pods `train-master-0` on node a and `train-worker-0`, `-1` on node b, labelled
migratable, so the API server has the webhook wrap them) trains while the same job runs untouched
as PyTorchJob `reference`. Mid-training, `criuctl migrate train-worker-0 a` moves one worker:
checkpointed by its preStop hook, recreated under its name by the operator, restored on a with its
connections re-pointed, while the master and the other worker go on. The job's losses and final
weights (rank 0's log, which never stops) are compared with the reference's, and drawn.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import threading
import time
from pathlib import Path

from criuctl.cli import demo
from localcluster.layout import BUSYBOX, HOST_PYTHON, REPO, Layout

PY = str(REPO / ".venv" / "bin" / "python")
SCRIPT = str(REPO / "criuctl" / "cli" / "examples" / "train_demo.py")
_STEP = re.compile(r"^step (\d+) loss (\S+)$")
_FINAL = re.compile(r"^final (\w+)$")


def pod(name: str, steps: int, node: str, migratable: bool) -> dict:
    paths = [p for p in (*HOST_PYTHON, str(REPO)) if Path(p).exists()]
    container = {
        "name": "pytorch",  # the training operator refuses a replica without one of this name
        "image": BUSYBOX,
        "imagePullPolicy": "Never",
        "command": [PY, SCRIPT],
        "args": ["--steps", str(steps), "--workers", "2"],
        "volumeMounts": [{"name": f"h{i}", "mountPath": p, "readOnly": True} for i, p in enumerate(paths)],
    }
    labels = {"criuctl.io/migratable": "true"} if migratable else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels, "annotations": {"criuctl.io/python": PY}},
        "spec": {
            "nodeName": node,
            "restartPolicy": "Never",
            "containers": [container],
            "volumes": [{"name": f"h{i}", "hostPath": {"path": p}} for i, p in enumerate(paths)],
        },
    }


def pytorchjob(name: str, steps: int, master: str, worker: str, workers: int, migratable: bool) -> dict:
    """A PyTorchJob of a master on node `master` and `workers` workers on node `worker` (node
    selectors), each a rank of the DDP job whose pod is `pod(...)`'s."""

    def replica(node: str, replicas: int) -> dict:
        template = pod(name, steps, node, migratable)
        spec = {k: v for k, v in template["spec"].items() if k not in ("nodeName", "restartPolicy")}
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
        return {
            "replicas": replicas,
            "restartPolicy": "OnFailure",
            "template": {
                "metadata": {k: template["metadata"][k] for k in ("labels", "annotations")},
                "spec": spec,
            },
        }

    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {"pytorchReplicaSpecs": {"Master": replica(master, 1), "Worker": replica(worker, workers)}},
    }


class Follow(threading.Thread):
    """`kubectl logs -f` of one pod, parsed as it comes: each step's loss and when it came."""

    def __init__(self, kubectl: list[str], name: str) -> None:
        super().__init__(daemon=True)
        self.argv = [*kubectl, "logs", "-f", name]
        self.steps: dict[int, float] = {}
        self.times: dict[int, float] = {}
        self.final: str | None = None

    def run(self) -> None:
        while True:  # the container may not have started yet
            proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for line in proc.stdout:
                if m := _STEP.match(line.strip()):
                    self.steps[int(m[1])] = float.fromhex(m[2])
                    self.times[int(m[1])] = time.monotonic()
                elif m := _FINAL.match(line.strip()):
                    self.final = m[1]
            if proc.wait() == 0 or self.steps:
                return
            time.sleep(0.5)

    def longest_wait(self, since: float) -> tuple[int, float, float]:
        """The step after which the job waited longest from `since` on, that wait, and the median
        wait between steps (what a step takes)."""
        xs = sorted(self.times)
        gaps = [
            (self.times[b] - self.times[a], a) for a, b in itertools.pairwise(xs) if self.times[b] >= since
        ]
        typical = sorted(g for g, _ in gaps)[len(gaps) // 2] if gaps else 0.0
        wait, after = max(gaps, default=(0.0, -1))
        return after, wait, typical


def _apply(kubectl: list[str], obj: dict) -> bool:
    deadline = time.monotonic() + 60  # the stand-in operator's CRD may still be settling
    while subprocess.run(
        [*kubectl, "apply", "-f", "-"], input=json.dumps(obj), capture_output=True, text=True
    ).returncode:
        if time.monotonic() > deadline:
            print(f"criuctl demo: the cluster refused the {obj['kind']}; see `kubectl get crd`")
            return False
        time.sleep(1)
    return True


def run(lay: Layout, out: Path, steps: int = 400, move_at: int = 120) -> int:
    """Two 3-rank DDP PyTorchJobs: `train` (master on a, workers on b), moved; `reference` (master
    on b, workers on a), never touched. `train-worker-0` moves to node a mid-training; the master's
    log, which never stops, is compared with the reference's."""
    kubectl = ["kubectl", "--kubeconfig", str(lay.kubeconfig)]
    env = {**os.environ, "KUBECONFIG": str(lay.kubeconfig)}
    if not all(
        _apply(kubectl, job)
        for job in (
            pytorchjob("train", steps, "a", "b", 2, True),
            pytorchjob("reference", steps, "b", "a", 2, False),
        )
    ):
        return 1
    master, worker = "train-master-0", "train-worker-0"
    ref, job = Follow(kubectl, "reference-master-0"), Follow(kubectl, master)
    ref.start()
    job.start()
    print(
        f"criuctl demo: PyTorchJob train (3 ranks of gloo DDP: {master} on node a, its workers on b, "
        "wrapped by the webhook) and PyTorchJob reference (the same job, never touched); "
        f"moving {worker} to node a after step {move_at}"
    )
    deadline = time.monotonic() + 600
    while max(job.steps, default=-1) < move_at:
        if time.monotonic() > deadline or not job.is_alive():
            print(f"criuctl demo: the job did not get going; see `kubectl describe pod {master}`")
            return 1
        time.sleep(0.2)
    began = time.monotonic()
    r = subprocess.run(
        [str(REPO / ".venv" / "bin" / "criuctl"), "migrate", worker, "a", "-o", "json"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    if r.returncode != 0:
        print("criuctl demo: the migration failed (above)")
        return 1
    moved = json.loads(r.stdout.strip().splitlines()[-1])
    listed = subprocess.run([*kubectl, "get", "podmigrations"], capture_output=True, text=True).stdout
    print(f"criuctl demo: the move is PodMigration {moved['podmigration']}, carried out by the controller:")
    print("  " + listed.strip().replace("\n", "\n  "))
    said = subprocess.run(
        [*kubectl, "get", "events", "--field-selector", f"involvedObject.name={worker},reason=Migrated"],
        capture_output=True,
        text=True,
    ).stdout
    print("criuctl demo: the moved pod's Migrated event (each step of its stall):")
    print("  " + said.strip().replace("\n", "\n  "))
    jobs = subprocess.run(
        [str(REPO / ".venv" / "bin" / "criuctl"), "ps", "--jobs"], env=env, capture_output=True, text=True
    ).stdout
    print("criuctl demo: `criuctl ps --jobs` after the move:\n  " + jobs.strip().replace("\n", "\n  "))
    for f in (ref, job):
        f.join(900)
    frozen_after, stall, typical = job.longest_wait(began)
    identical = ref.final == job.final and job.steps == ref.steps
    out.mkdir(parents=True, exist_ok=True)
    plot = demo._plot(
        out / "criuctl-kube-demo.png",
        ref.steps,
        {s: v for s, v in job.steps.items() if s <= frozen_after},
        {s: v for s, v in job.steps.items() if s > frozen_after},
        frozen_after,
        labels=(
            f"rank 0 ({master}), {worker} on node b",
            f"rank 0 ({master}), {worker} on node a",
            f"criuctl migrate {worker} a (the job waited {stall:.1f} s)",
        ),
        title="A worker of a 3-rank DDP PyTorchJob moved to another node mid-training",
    )
    print(
        f"criuctl demo: {worker} moved after step {frozen_after}: {moved['downtime_seconds']:.1f} s from "
        f"its pod's delete to it running again on node a; the other ranks never stopped, the job "
        f"waited {stall:.1f} s at that step (a step takes {typical:.2f} s); losses and final weights "
        f"{'bit-identical to' if identical else 'DIFFERENT from'} the uninterrupted job's; plot: {plot}"
    )
    return 0 if identical else 1
