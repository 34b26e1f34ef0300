"""Multi-worker training jobs on the local cluster (docs/kubernetes.md, "Multi-worker jobs"): a
PyTorchJob with a master and workers on both kubelet nodes, real gloo DDP over TCP between pods,
its rendezvous by the master's Service name through the cluster DNS stand-in (localcluster.dns).
A worker moves through its successor pod with every connection (criuctl.kube.jobmoves); the ranks
that stay never stop, and the job ends as an uninterrupted run does.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from localcluster.layout import REPO

from tests.conftest import needs_criu
from tests.kube import Kubectl, LogFollower, combined_steps, criuctl, drain, final, steps, training_pod

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


def _jobs(lay, name: str) -> list[tuple[str, str, str]]:
    """`criuctl ps --jobs` on the cluster: (rank, node, connected to) of job `name`."""
    r = criuctl(lay, "ps", "--jobs", "--kubeconfig", str(lay.kubeconfig))
    assert r.returncode == 0, r.stderr
    return sorted(
        (row[1], row[2], " ".join(row[3:]))
        for line in r.stdout.splitlines()
        if (row := line.split()) and row[0] == name
    )


def _all_connected(rows: list[tuple[str, str, str]], pods: list[str]) -> None:
    assert sorted(r[0] for r in rows) == sorted(pods), rows
    for rank, _, peers in rows:
        assert all(f"{p}@" in peers for p in pods if p != rank), rows


def _slow(job: dict, step_time: str) -> dict:
    """The reference's steps (tests.test_multinode), each taking `step_time` s: the losses are the same."""
    from tests.test_multinode import STEPS as REF_STEPS

    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        ctr = spec["template"]["spec"]["containers"][0]
        ctr["args"] = [DDP, *REF_STEPS[:2], "--step-time", step_time]
    return job


def _finishes_as_the_reference(k: Kubectl, job: str, world: int, earlier: tuple[str, ...] = ()) -> None:
    """The master's log (and `earlier` logs of its pods, a moved master's) has every step of an
    uninterrupted run with its loss, each once, and its final weights."""
    from tests.test_multinode import reference

    ref_steps, ref_final = reference(world)
    deadline = time.monotonic() + 300
    while not final(log := k.logs(f"{job}-master-0")):
        assert time.monotonic() < deadline, log[-1500:]
        time.sleep(2)
    got = combined_steps([*(steps(t) for t in earlier), steps(log)])
    assert got == ref_steps, "the job's losses differ from an uninterrupted run's"
    assert final(log) == [ref_final], "final weights differ from an uninterrupted run"
    while (status := k.get("pytorchjob", job)["status"])["conditions"][-1]["type"] != "Succeeded":
        assert time.monotonic() < deadline, json.dumps(status)  # its pods exit after the last line
        time.sleep(1)


def _no_rule_on_the_nodes(lay) -> None:
    """The cut and the redirects live in the pods' own namespaces: none in a node's."""
    for node in lay.nodes:
        r = subprocess.run(
            ["ip", "netns", "exec", lay.node(node).ns, "nft", "list", "tables"],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0 and "criuctl-" not in r.stdout and "CRIU-" not in r.stdout, r.stdout


# each case its own job: a job deleted with --wait=false still has its pods for a while
@pytest.mark.parametrize(("job", "moved", "to"), [("mw", "mw-worker-0", "a"), ("mm", "mm-master-0", "b")])
def test_a_pytorchjob_pod_moves_with_its_connections_and_the_job_never_stops(
    local_cluster, job: str, moved: str, to: str
) -> None:
    """A 3-rank gloo DDP PyTorchJob (master on a, workers on b; the workers find the master by its
    Service's DNS name) is one job to criuctl. `criuctl migrate` of a worker, or of the master (the
    rendezvous store and every rank's peer): the operator recreates it, its successor on the other
    node gets the restored rank with every connection re-pointed, and the other ranks never stop.
    The job ends with an uninterrupted run's losses and weights; no pod restarted; no rule left on
    a node."""
    lay, k = local_cluster
    pods = [f"{job}-master-0", f"{job}-worker-0", f"{job}-worker-1"]
    k.apply(_slow(ddp_job(job), "0.3"))
    try:
        _wait_steps(k, pods[0], 15)
        before = _restarts(k, job)
        assert sorted(before) == pods and all(n == 0 for _, n in before.values()), before
        rows = _jobs(lay, job)
        assert [(r[0], r[1]) for r in rows] == [(pods[0], "a"), (pods[1], "b"), (pods[2], "b")], rows
        _all_connected(rows, pods)

        old_master = LogFollower(k, pods[0])  # a moved master's log goes on in its successor
        old_master.start()
        r = criuctl(lay, "migrate", moved, to, "-o", "json")
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["target"] == to and out["via_successor"], out
        new = k.get("pod", moved)
        assert new["spec"]["nodeName"] == to and new["metadata"]["uid"] != before[moved][0]
        assert "criuctl.io/migrated-at" in new["metadata"]["annotations"]
        # still one job, the moved rank on its new node, every connection seen whole through the redirects
        rows = _jobs(lay, job)
        assert (moved, to) in [(r[0], r[1]) for r in rows], rows
        _all_connected(rows, pods)

        earlier = ()
        if moved == pods[0]:
            old_master.join(60)
            earlier = (old_master.text,)
        _finishes_as_the_reference(k, job, 3, earlier)
        after = _restarts(k, job)
        assert all(after[p] == before[p] for p in pods if p != moved), (before, after)
        assert after[moved][1] == 0, "the moved rank's successor restarted"
        _no_rule_on_the_nodes(lay)
    finally:
        k("delete", "pytorchjob", job, "--wait=false", check=False)


def test_a_drain_moves_the_worker_on_the_node_and_the_job_goes_on(local_cluster) -> None:
    """`kubectl drain b` with one worker of a 2-rank job there: the eviction's preStop checkpoints
    it, its successor is restored on a with its connections; the master never stops."""
    lay, k = local_cluster
    k.apply(_slow(ddp_job("dw", workers=1), "0.3"))
    try:
        _wait_steps(k, "dw-master-0", 15)
        before = _restarts(k, "dw")
        drain(k, "b", "training.kubeflow.org/job-name=dw")
        deadline = time.monotonic() + 180
        while True:
            new = k.get("pod", "dw-worker-0")
            notes = (new or {}).get("metadata", {}).get("annotations") or {}
            if new and "criuctl.io/migrated-at" in notes:
                break
            assert time.monotonic() < deadline, f"the worker was not restored: {new}"
            time.sleep(1)
        assert new["spec"]["nodeName"] == "a"
        _finishes_as_the_reference(k, "dw", 2)
        after = _restarts(k, "dw")
        assert after["dw-master-0"] == before["dw-master-0"] and after["dw-worker-0"][1] == 0
        _no_rule_on_the_nodes(lay)
    finally:
        k("uncordon", "b", check=False)
        k("delete", "pytorchjob", "dw", "--wait=false", check=False)


def test_a_worker_whose_restore_fails_on_the_target_comes_back_on_its_node(local_cluster) -> None:
    """The restore on node a fails (criuctl.core.faults, in node a's state dir): the peers'
    redirects to a go, the cut lifts, and the worker is restored from the source's own copy into
    its successor on b, rewired to that pod's address. The job never stops for good, and ends as
    an uninterrupted run does."""
    lay, k = local_cluster
    fault = lay.node_dir("a") / "var-lib-criuctl" / "faults" / "restore"
    fault.parent.mkdir(exist_ok=True)
    k.apply(_slow(ddp_job("fb"), "0.3"))
    try:
        _wait_steps(k, "fb-master-0", 15)
        before = _restarts(k, "fb")
        fault.touch()
        r = criuctl(lay, "migrate", "fb-worker-0", "a")
        fault.unlink()
        assert "Traceback" not in r.stderr, r.stderr
        assert "on node b" in r.stderr, r.stderr  # where the job runs: said as it is
        new = k.get("pod", "fb-worker-0")
        assert new["spec"]["nodeName"] == "b" and new["metadata"]["uid"] != before["fb-worker-0"][0]
        assert "criuctl.io/migrated-at" in new["metadata"]["annotations"]
        events = k("get", "events", "--field-selector", "involvedObject.name=fb-worker-0").stdout
        assert "injected fault" in events, events[-2000:]
        _finishes_as_the_reference(k, "fb", 3)
        after = _restarts(k, "fb")
        assert after["fb-master-0"] == before["fb-master-0"] and after["fb-worker-1"] == before["fb-worker-1"]
        _no_rule_on_the_nodes(lay)
    finally:
        fault.unlink(missing_ok=True)
        k("delete", "pytorchjob", "fb", "--wait=false", check=False)
