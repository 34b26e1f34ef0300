"""Multi-worker training jobs on the local cluster (issue 24, first part): a PyTorchJob with a master
and two workers on both kubelet nodes, real gloo DDP over TCP between pods, its rendezvous by the
master's Service name through the cluster DNS stand-in (localcluster.dns).

What is on main for such a job: its pods are one job to criuctl (each agent reads a pod's sockets
in the pod's network namespace), and a move of one of its workers is refused in one line with
nothing changed — the job goes on to its end, no pod restarted. Moving the worker live is the rest
of issue 24 (docs/kubernetes.md, "Multi-worker jobs").
"""

from __future__ import annotations

import json
import time

import pytest
from localcluster.layout import REPO

from tests.conftest import needs_criu
from tests.kube import Kubectl, criuctl, final, steps, training_pod

pytestmark = [needs_criu, pytest.mark.slow]

DDP = str(REPO / "tests" / "workloads" / "train_ddp_nodes.py")
STEPS = 300


def _replica(name: str, node: str, replicas: int) -> dict:
    pod = training_pod(name, container="pytorch", extra_spec={"terminationGracePeriodSeconds": 5})
    spec = {k: v for k, v in pod["spec"].items() if k != "restartPolicy"}
    spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    ctr = spec["containers"][0]
    ctr["args"] = [DDP, "--steps", str(STEPS), "--step-time", "0.05"]
    ctr["command"] = ctr["command"][:1]
    ctr["resources"] = {"requests": {"memory": "128Mi", "cpu": "10m"}}
    meta = {k: pod["metadata"][k] for k in ("labels", "annotations")}
    meta["labels"] = {**meta["labels"], "app": name}
    return {"replicas": replicas, "restartPolicy": "OnFailure", "template": {"metadata": meta, "spec": spec}}


def ddp_job(name: str, master_node: str = "a", worker_node: str = "b", workers: int = 2) -> dict:
    """A PyTorchJob as a user writes one: a master and `workers` workers running gloo DDP."""
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name},
        "spec": {
            "pytorchReplicaSpecs": {
                "Master": _replica(name, master_node, 1),
                "Worker": _replica(name, worker_node, workers),
            }
        },
    }


def _restarts(k: Kubectl, job: str) -> dict[str, tuple[str, int]]:
    """Each pod of the job: its UID and its container's restart count."""
    pods = k.pods(selector=f"training.kubeflow.org/job-name={job}")
    return {
        p["metadata"]["name"]: (
            p["metadata"]["uid"],
            sum(s.get("restartCount", 0) for s in p["status"].get("containerStatuses", [])),
        )
        for p in pods
    }


def _wait_steps(k: Kubectl, pod: str, n: int, timeout: float = 240) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = k.logs(pod)
        if max(steps(log) or [-1]) >= n:
            return log
        time.sleep(1)
    raise AssertionError(f"{pod} did not reach step {n}: {k.logs(pod)[-1500:]}")


def test_a_multi_worker_pytorchjob_is_one_job_and_its_worker_is_refused_whole(local_cluster) -> None:
    lay, k = local_cluster
    k.apply(ddp_job("ddp"))
    try:
        pods = ["ddp-master-0", "ddp-worker-0", "ddp-worker-1"]
        _wait_steps(k, "ddp-master-0", 20)  # the workers found the master by its Service's DNS name
        before = _restarts(k, "ddp")
        assert sorted(before) == pods and all(n == 0 for _, n in before.values()), before

        # every pod is a rank of one job, each connected to the others across both nodes
        r = criuctl(lay, "ps", "--jobs", "--kubeconfig", str(lay.kubeconfig))
        assert r.returncode == 0, r.stderr
        rows = [row for line in r.stdout.splitlines() if (row := line.split()) and row[0] == "ddp"]
        assert sorted((row[1], row[2]) for row in rows) == [
            ("ddp-master-0", "a"),
            ("ddp-worker-0", "b"),
            ("ddp-worker-1", "b"),
        ], r.stdout
        for row in rows:
            others = {p for p in pods if p != row[1]}
            assert all(f"{p}@" in " ".join(row[3:]) for p in others), r.stdout

        # a worker's move is refused in one line, before anything changes
        r = criuctl(lay, "migrate", "ddp-worker-0", "a")
        assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
        said = [line for line in r.stderr.splitlines() if line.startswith("criuctl:")]
        assert len(said) == 1 and "one of 3 replicas of PyTorchJob ddp" in said[0], r.stderr
        assert "nothing was changed" in r.stderr

        # the job goes on to its end, every step once, no pod restarted or replaced
        deadline = time.monotonic() + 300
        while not final(log := k.logs("ddp-master-0")):
            assert time.monotonic() < deadline, log[-1500:]
            time.sleep(2)
        assert sorted(steps(log)) == list(range(STEPS))
        assert _restarts(k, "ddp") == before
        job = k.get("pytorchjob", "ddp")
        assert job["status"]["conditions"][-1]["type"] == "Succeeded", json.dumps(job["status"])
    finally:
        k("delete", "pytorchjob", "ddp", "--wait=false", check=False)


def test_a_pytorchjob_worker_moves_with_its_connections_and_the_job_never_stops(local_cluster) -> None:
    """`criuctl migrate` of a worker of a running 3-rank PyTorchJob: the operator recreates it, its
    successor on the other node gets the restored worker with every connection re-pointed; the
    master and the other worker never stop. The job ends with an uninterrupted run's losses and
    weights, and no pod restarted."""
    from tests.test_multinode import STEPS as REF_STEPS
    from tests.test_multinode import reference

    lay, k = local_cluster
    job = ddp_job("mv")
    for spec in job["spec"]["pytorchReplicaSpecs"].values():  # the reference's steps, slower
        ctr = spec["template"]["spec"]["containers"][0]
        ctr["args"] = [DDP, *REF_STEPS[:2], "--step-time", "0.3"]
    ref_steps, ref_final = reference(3)
    k.apply(job)
    try:
        _wait_steps(k, "mv-master-0", 15)
        before = _restarts(k, "mv")
        r = criuctl(lay, "migrate", "mv-worker-0", "a", "-o", "json")
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["target"] == "a", out
        new = k.get("pod", "mv-worker-0")
        assert new["spec"]["nodeName"] == "a" and new["metadata"]["uid"] != before["mv-worker-0"][0]
        assert "criuctl.io/migrated-at" in new["metadata"]["annotations"]
        r = criuctl(lay, "ps", "--jobs", "--kubeconfig", str(lay.kubeconfig))
        rows = [row for line in r.stdout.splitlines() if (row := line.split()) and row[0] == "mv"]
        assert ("mv-worker-0", "a") in [(row[1], row[2]) for row in rows], r.stdout
        deadline = time.monotonic() + 300
        while not final(log := k.logs("mv-master-0")):
            assert time.monotonic() < deadline, log[-1500:]
            time.sleep(2)
        assert steps(log) == ref_steps, "the job's losses differ from an uninterrupted run's"
        assert final(log) == [ref_final], "final weights differ from an uninterrupted run"
        after = _restarts(k, "mv")
        assert after["mv-master-0"] == before["mv-master-0"] and after["mv-worker-1"] == before["mv-worker-1"]
        assert after["mv-worker-0"][1] == 0, "the moved worker's successor restarted"
    finally:
        k("delete", "pytorchjob", "mv", "--wait=false", check=False)
