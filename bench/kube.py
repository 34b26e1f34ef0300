"""Pods, side by side in one run: what `criuctl migrate POD NODE` costs on a real Kubernetes, and the
Kubernetes-native alternative.

On the local cluster (localcluster: apiserver, scheduler, controller-manager, two kubelet
nodes with containerd, the agent as the DaemonSet), for each state size a pod holding N GiB of model
+ Adam state (bench/big_state.py) under the webhook's wrapping moves between the nodes by

    pod post-copy        criuctl migrate POD NODE --mode post-copy
    pod stop-and-copy    criuctl migrate POD NODE --mode stop-and-copy
    statefulset pod      criuctl migrate st-0 NODE: a StatefulSet's pod keeping its name (its
                         preStop hook checkpoints it into a bundle kept on NODE, the controller
                         recreates it, the webhook pins it there, the agent restores it); the
                         same path as `kubectl drain` takes
    delete + recreate    kubectl delete, the same pod created on the other node, until its state
                         exists again (what a drain does to a job without criuctl: every step since
                         its last own checkpoint is lost, and this does not count them)

For the StatefulSet's pod the job is stopped from the freeze until the restore in the recreated
pod: the command's wall time (delete → running again) bounds it, and the freeze is reported apart.
For the other migrations: the job's downtime (the agents' measure: frozen → running on the target), the
agents' total, and the command's wall time (adds the checks, the placeholder pod, the API calls).
The pod moves back and forth, so contenders alternate within each repetition after a warm-up move
(these are VMs: the first touch of memory is slow); each number is the median of the repetitions.
The agents' own numbers without Kubernetes are bench/containers.py's. Run as root:
`.venv/bin/python bench/kube.py [--sizes 0.5 2] [--reps 3]`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from localcluster import __main__ as lc
from localcluster.layout import Layout
from rich.console import Console
from rich.table import Table

from tests.kube import PY, Kubectl, training_pod

HERE = Path(__file__).resolve().parent
CRIUCTL = str(HERE.parent / ".venv" / "bin" / "criuctl")
console = Console(stderr=True)


def state_pod(name: str, gib: float, node: str) -> dict:
    pod = training_pod(name, node=node, extra_spec={"restartPolicy": "Never"})
    c = pod["spec"]["containers"][0]
    c["command"], c["args"] = [PY, str(HERE / "big_state.py")], ["--gib", str(gib)]
    c["resources"] = {"requests": {"memory": f"{int(gib * 1024 + 512)}Mi", "cpu": "100m"}}
    return pod


def state_statefulset(name: str, gib: float, node: str) -> dict:
    pod = state_pod(f"{name}-0", gib, node)
    spec = {**pod["spec"], "restartPolicy": "Always", "nodeSelector": {"kubernetes.io/hostname": node}}
    spec.pop("nodeName", None)
    labels = {**pod["metadata"]["labels"], "app": name}
    template = {"metadata": {"labels": labels, "annotations": pod["metadata"]["annotations"]}, "spec": spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name},
        "spec": {
            "serviceName": name,
            "replicas": 1,
            "selector": {"matchLabels": {"app": name}},
            "template": template,
        },
    }


def _wait_ready(k: Kubectl, pod: str, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while "ready" not in k.logs(pod).split():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{pod} not ready: {k.logs(pod)[-500:]}")
        time.sleep(0.2)


def migrate(lay: Layout, pod: str, node: str, mode: str) -> dict:
    env = {**os.environ, "KUBECONFIG": str(lay.kubeconfig)}
    t0 = time.monotonic()
    r = subprocess.run(
        [CRIUCTL, "migrate", pod, node, "--mode", mode, "-o", "json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    wall = time.monotonic() - t0
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-1500:])
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {
        "downtime": out["downtime_seconds"],
        "agents": out["total_seconds"],
        "wall": wall,
        "freeze": out["freeze_seconds"],
        "new_pod": out["new_pod"],
    }


def recreate(k: Kubectl, pod: str, gib: float, node: str, name: str) -> float:
    t0 = time.monotonic()
    k("delete", "pod", pod, "--grace-period=1", "--wait=false")
    k.apply(state_pod(name, gib, node))
    _wait_ready(k, name)
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.5, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/criuctl-bench-kube"))
    a = ap.parse_args()
    lay = Layout(a.dir, prefix="kb", net="10.201.0")
    lc.up(lay)
    rows = []
    try:
        k = Kubectl(lay)
        for gib in a.sizes:
            pod, node, other = f"state{int(gib * 10)}", "a", "b"
            st, st_node = f"st{int(gib * 10)}", "b"
            k.apply(state_pod(pod, gib, node))
            k.apply(state_statefulset(st, gib, st_node))
            _wait_ready(k, pod)
            _wait_ready(k, f"{st}-0")
            pod = migrate(lay, pod, other, "post-copy")["new_pod"]  # warm-up: both nodes touched
            node, other = other, node
            runs: dict[str, list] = {"post-copy": [], "stop-and-copy": [], "statefulset": [], "recreate": []}
            for rep in range(a.reps):
                for mode in ("post-copy", "stop-and-copy"):
                    console.print(f"{gib} GiB, round {rep + 1}: pod {mode} {node} → {other} …")
                    r = migrate(lay, pod, other, mode)
                    runs[mode].append(r)
                    pod, node, other = r["new_pod"], other, node
                st_to = "a" if st_node == "b" else "b"
                console.print(f"{gib} GiB, round {rep + 1}: statefulset pod {st_node} → {st_to} …")
                runs["statefulset"].append(migrate(lay, f"{st}-0", st_to, "stop-and-copy"))
                st_node = st_to
                console.print(f"{gib} GiB, round {rep + 1}: delete + recreate {node} → {other} …")
                name = f"state{int(gib * 10)}-r{rep}"
                runs["recreate"].append({"wall": recreate(k, pod, gib, other, name)})
                pod, node, other = name, other, node
            k("delete", "pod", pod, "--grace-period=1", "--wait=false")
            k("delete", "statefulset", st, "--wait=false")
            rows.append({"gib": gib, "runs": runs})
            (HERE / "results" / "kube.json").write_text(json.dumps(rows, indent=1))  # each size as done
    finally:
        lc.down(lay)
    report(rows)
    return 0


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report(rows: list[dict]) -> None:
    t = Table(title="seconds (median)")
    for col in (
        "state",
        "post-copy downtime",
        "post-copy agents",
        "post-copy command",
        "s&c downtime",
        "s&c agents",
        "s&c command",
        "statefulset freeze",
        "statefulset delete → running",
        "delete + recreate",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        pc, sc, rc = r["runs"]["post-copy"], r["runs"]["stop-and-copy"], r["runs"]["recreate"]
        ss = r["runs"]["statefulset"]
        cells = [
            _med(pc, "downtime"),
            _med(pc, "agents"),
            _med(pc, "wall"),
            _med(sc, "downtime"),
            _med(sc, "agents"),
            _med(sc, "wall"),
            _med(ss, "freeze"),
            _med(ss, "wall"),
            _med(rc, "wall"),
        ]
        t.add_row(f"{r['gib']} GiB", *(f"{x:.2f}" for x in cells))
    Console().print(t)


if __name__ == "__main__":
    sys.exit(main())
