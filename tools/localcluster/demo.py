"""`scripts/local-cluster demo` (the end of `make demo`): the Kubernetes flow on the local cluster.

A single-worker PyTorchJob (the demo's job: DataLoader workers, AdamW, OneCycle; the stand-in
operator makes its pod `train-master-0`, labelled migratable, so the API server has the webhook wrap
it) starts on node a, while the same job runs uninterrupted in a plain pod on node b as the
reference. Mid-training, `criuctl migrate train-master-0 b` moves the worker: checkpointed by its
preStop hook, recreated under its name by the operator, restored on b. The moved job's losses and
final weights are compared with the reference's, and both curves are drawn.
"""

from __future__ import annotations

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


def pytorchjob(name: str, steps: int, node: str) -> dict:
    """A one-replica PyTorchJob whose pod is `pod(...)`'s, started on `node` by a node selector."""
    template = pod(name, steps, node, True)
    spec = {k: v for k, v in template["spec"].items() if k not in ("nodeName", "restartPolicy")}
    spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    master = {
        "replicas": 1,
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
        "spec": {"pytorchReplicaSpecs": {"Master": master}},
    }


class Follow(threading.Thread):
    """`kubectl logs -f` of one pod, parsed as it comes."""

    def __init__(self, kubectl: list[str], name: str) -> None:
        super().__init__(daemon=True)
        self.argv = [*kubectl, "logs", "-f", name]
        self.steps: dict[int, float] = {}
        self.final: str | None = None

    def run(self) -> None:
        while True:  # the container may not have started yet
            proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            for line in proc.stdout:
                if m := _STEP.match(line.strip()):
                    self.steps[int(m[1])] = float.fromhex(m[2])
                elif m := _FINAL.match(line.strip()):
                    self.final = m[1]
            if proc.wait() == 0 or self.steps:
                return
            time.sleep(0.5)


def run(lay: Layout, out: Path, steps: int = 300, move_at: int = 100) -> int:
    kubectl = ["kubectl", "--kubeconfig", str(lay.kubeconfig)]
    env = {**os.environ, "KUBECONFIG": str(lay.kubeconfig)}
    for p in (pytorchjob("train", steps, "a"), pod("reference", steps, "b", False)):
        deadline = time.monotonic() + 60  # the stand-in operator's CRD may still be settling
        while (
            subprocess.run(
                [*kubectl, "apply", "-f", "-"], input=json.dumps(p), capture_output=True, text=True
            ).returncode
            != 0
        ):
            if time.monotonic() > deadline:
                print(f"criuctl demo: the cluster refused the {p['kind']}; see `kubectl get crd`")
                return 1
            time.sleep(1)
    worker = "train-master-0"
    ref, before = Follow(kubectl, "reference"), Follow(kubectl, worker)
    ref.start()
    before.start()
    print(
        f"criuctl demo: PyTorchJob train's worker {worker} on node a (wrapped by the webhook), pod "
        f"reference on node b; moving the worker to node b after step {move_at}"
    )
    deadline = time.monotonic() + 600
    while max(before.steps, default=-1) < move_at:
        if time.monotonic() > deadline or not before.is_alive():
            print(f"criuctl demo: the worker did not get going; see `kubectl describe pod {worker}`")
            return 1
        time.sleep(0.2)
    r = subprocess.run(
        [str(REPO / ".venv" / "bin" / "criuctl"), "migrate", worker, "b", "-o", "json"],
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
    after = Follow(kubectl, moved["new_pod"])
    after.start()
    for f in (ref, before, after):
        f.join(900)
    frozen_after = max(before.steps)
    identical = (
        ref.final == after.final
        and all(ref.steps.get(s) == loss for s, loss in {**before.steps, **after.steps}.items())
        and set({**before.steps, **after.steps}) == set(ref.steps)
    )
    out.mkdir(parents=True, exist_ok=True)
    plot = demo._plot(
        out / "criuctl-kube-demo.png",
        ref.steps,
        before.steps,
        after.steps,
        frozen_after,
        labels=(
            f"{worker} on node a",
            f"{moved['new_pod']} on node b (same name)",
            f"criuctl migrate {worker} b ({moved['downtime_seconds']:.1f} s from delete to running again)",
        ),
        title="A PyTorchJob worker moved to another kubelet node mid-training",
    )
    print(
        f"criuctl demo: moved after step {frozen_after}, {moved['downtime_seconds']:.1f} s from the "
        f"delete to the job running again, "
        f"{len(after.steps)} steps on node b; losses and final weights "
        f"{'bit-identical to' if identical else 'DIFFERENT from'} the uninterrupted pod; "
        f"plot: {plot}"
    )
    return 0 if identical else 1
