"""Multi-worker training jobs on the local cluster (docs/kubernetes.md, "Multi-worker jobs"): a
PyTorchJob with a master and workers on both kubelet nodes, real gloo DDP over TCP between pods,
its rendezvous by the master's Service name through the cluster DNS stand-in (localcluster.dns).
A worker moves through its successor pod with every connection (criuctl.kube.jobmoves); the ranks
that stay never stop, and the job ends as an uninterrupted run does.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pytest
from localcluster import __main__ as lc

from criuctl.agent.protocol import Point
from tests.conftest import needs_criu
from tests.jobs import CRIUCTL
from tests.kube import (
    DDP_JOB,
    Controller,
    Kubectl,
    LogFollower,
    Points,
    combined_steps,
    criuctl,
    ddp_job,
    drain,
    final,
    grant_migrator,
    steps,
    training_pod,
    until,
    wait_podmigration,
)

pytestmark = [needs_criu, pytest.mark.slow]

SYSTEM_NS = "criuctl-system"


@pytest.fixture(autouse=True)
def _migrator(local_cluster) -> None:
    """The user `migrator` may move (and list) the pods of namespace default, nothing else: what
    `_jobs` runs `criuctl ps --jobs` as."""
    grant_migrator(local_cluster[1])


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


def _jobs(
    lay, name: str, pods: list[str] | None = None, on: tuple[str, str] | None = None
) -> list[tuple[str, str, str]]:
    """`criuctl ps --jobs` on the cluster as the user `migrator` (criuctl-migrator in namespace
    default, nothing else: the agents publish each rank on its pod, criuctl.kube.jobs): (rank,
    node, connected to) of job `name`. With `pods`, asked again (the agents look every 10 s) until
    those are its ranks, each connected to all the others, and `on` = (pod, node) is one of them."""
    deadline = time.monotonic() + 90
    while True:
        r = criuctl(lay, "ps", "--jobs", "--kubeconfig", str(lay.dir / "migrator.kubeconfig"))
        assert r.returncode == 0, r.stderr
        rows = sorted(
            (row[1], row[2], " ".join(row[3:]))
            for line in r.stdout.splitlines()
            if (row := line.split()) and row[0] == name
        )
        whole = pods is None or (
            sorted(x[0] for x in rows) == sorted(pods)
            and all(f"{p}@" in peers for rank, _, peers in rows for p in pods if p != rank)
            and (on is None or on in [(x[0], x[1]) for x in rows])
        )
        if whole or time.monotonic() > deadline:
            return rows
        time.sleep(2)


def _all_connected(rows: list[tuple[str, str, str]], pods: list[str]) -> None:
    assert sorted(r[0] for r in rows) == sorted(pods), rows
    for rank, _, peers in rows:
        assert all(f"{p}@" in peers for p in pods if p != rank), rows


def _slow(job: dict, step_time: str) -> dict:
    """The reference's steps (tests.test_multinode), each taking `step_time` s: the losses are the same."""
    from tests.test_multinode import STEPS as REF_STEPS

    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        ctr = spec["template"]["spec"]["containers"][0]
        ctr["args"] = [DDP_JOB, *REF_STEPS[:2], "--step-time", step_time]
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


def _migrated(k: Kubectl, pod: str) -> str:
    """The message of the newest Migrated Event of pod `pod`."""
    out = k("get", "events", "--field-selector", f"involvedObject.name={pod},reason=Migrated", "-o", "json")
    items = sorted(json.loads(out.stdout)["items"], key=lambda e: e["lastTimestamp"] or "")
    assert items, f"no Migrated event for {pod}"
    return items[-1]["message"]


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
        rows = _jobs(lay, job, pods)
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
        # its Event says what the stall was made of, and that the staying ranks' connections to it
        # were braced (criuctl.net.rto): 2 peers x (the store's or gloo's) connections
        said = _migrated(k, moved)
        assert all(f"{step} " in said for step in ("checkpoint", "deleted", "kept", "running")), said
        assert re.search(r"; [1-9][0-9]* of the staying ranks' connections to it retransmitted", said), said
        # still one job, the moved rank on its new node, every connection seen whole through the redirects
        rows = _jobs(lay, job, pods, on=(moved, to))
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


def test_a_drain_moves_the_workers_on_the_node_one_after_another(local_cluster) -> None:
    """`kubectl drain b` with both workers of a 3-rank job there: the drain evicts them at once, and
    their preStops move them one after another (criuctl.kube.prestop: the second waits until the
    first runs on a, then re-points its connection to it too). The master never stops; the job
    ends as an uninterrupted run does, the workers' connection to each other whole."""
    lay, k = local_cluster
    k.apply(_slow(ddp_job("dw", workers=2), "0.3"))
    workers = ["dw-worker-0", "dw-worker-1"]
    try:
        _wait_steps(k, "dw-master-0", 15)
        before = _restarts(k, "dw")
        drain(k, "b", "training.kubeflow.org/job-name=dw")
        deadline = time.monotonic() + 300
        for w in workers:
            while True:
                new = k.get("pod", w)
                notes = (new or {}).get("metadata", {}).get("annotations") or {}
                if new and "criuctl.io/migrated-at" in notes:
                    break
                assert time.monotonic() < deadline, f"{w} was not restored: {new}"
                time.sleep(1)
            assert new["spec"]["nodeName"] == "a"
        rows = _jobs(lay, "dw", ["dw-master-0", *workers])
        _all_connected(rows, ["dw-master-0", *workers])
        _finishes_as_the_reference(k, "dw", 3)
        after = _restarts(k, "dw")
        assert after["dw-master-0"] == before["dw-master-0"]
        assert all(after[w][1] == 0 for w in workers), after
        _no_rule_on_the_nodes(lay)
    finally:
        k("uncordon", "b", check=False)
        k("delete", "pytorchjob", "dw", "--wait=false", check=False)


@pytest.mark.parametrize("victim", ["staying", "holder"])
def test_an_agent_killed_between_the_redirects_and_the_restore_loses_nothing(
    local_cluster, victim: str
) -> None:
    """worker-0 moves from b to a; node a's agent (the bundle's holder, whose loop restores it into
    the successor) stops once the cut and the staying ranks' redirects are in place (master-0's on
    a, worker-1's on b), before it restores, and there

    - `staying`: b's agent pod is killed. The restore goes on; the keep of worker-1's redirect
      waits for b's restarted agent (criuctl.kube.jobmoves), so that b's record of it is kept:
      `criuctl ps --jobs` shows worker-1 connected to worker-0 on a, and a later move would
      re-point that connection;
    - `holder`: a's own agent pod is killed. Its DaemonSet's next pod finds the record `kept` and
      does the step again: the same cut, the same redirects (each peer's agent knows them by the
      move: none installed twice, none left pending), the restore.

    The job ends as an uninterrupted run does, no pod restarted, no rule left on a node."""
    lay, k = local_cluster
    job = {"staying": "ks", "holder": "kh"}[victim]
    pods = [f"{job}-master-0", f"{job}-worker-0", f"{job}-worker-1"]
    k.apply(_slow(ddp_job(job), "0.3"))
    points = Points(lay.node_dir("a") / "var-lib-criuctl" / "pause")
    try:
        _wait_steps(k, pods[0], 15)
        before = _restarts(k, job)
        points.arm(Point.SUCCESSOR_REDIRECTED)
        env = {**os.environ, "KUBECONFIG": str(lay.kubeconfig)}
        cli = subprocess.Popen(
            [*CRIUCTL, "migrate", pods[1], "a", "-o", "json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        points.reached(Point.SUCCESSOR_REDIRECTED)
        assert sorted(_redirects(lay)) == [("a", "pending"), ("b", "pending")], _redirects(lay)
        points.disarm()
        if victim == "staying":
            _kill_agent(k, "b")
            points.go(Point.SUCCESSOR_REDIRECTED)
        else:
            _kill_agent(k, "a")
        out, err = cli.communicate(timeout=600)
        assert cli.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1])["target"] == "a"
        assert k.get("pod", pods[1])["spec"]["nodeName"] == "a"
        _agents_back(lay)  # b's lists worker-1 again: through its redirect
        # each peer's redirect kept, once: a restarted step found them by the move
        assert sorted(_redirects(lay)) == [("a", "kept"), ("b", "kept")], _redirects(lay)
        _all_connected(_jobs(lay, job, pods), pods)
        _finishes_as_the_reference(k, job, 3)
        after = _restarts(k, job)
        assert all(after[p] == before[p] for p in pods if p != pods[1]), (before, after)
        assert after[pods[1]][1] == 0, "the moved rank's successor restarted"
        _no_rule_on_the_nodes(lay)
    finally:
        points.disarm()
        k("delete", "pytorchjob", job, "--wait=false", check=False)
        _agents_back(lay)  # the next test needs the killed agent again


def _kill_agent(k: Kubectl, node: str) -> None:
    """The agent pod of `node` forced away at once (its DaemonSet makes another)."""
    (agent,) = [
        p["metadata"]["name"]
        for p in k.pods(SYSTEM_NS, "app.kubernetes.io/name=criuctl-agent")
        if p["spec"]["nodeName"] == node
    ]
    k("-n", SYSTEM_NS, "delete", "pod", agent, "--grace-period=0", "--force")


def _redirects(lay) -> list[tuple[str, str]]:
    """(node, state) of each pod redirect record on the nodes whose pods are still there."""
    out = []
    for node in lay.nodes:
        for f in (lay.node_dir(node) / "var-lib-criuctl" / "redirects").glob("*.json"):
            rec = json.loads(f.read_text())
            try:  # an earlier job's, whose pod is gone, waits for its agent's janitor
                ns = os.stat(f"/proc/{rec['pid']}/ns/net").st_ino if rec.get("pid") is not None else None
                alive = ns is not None and ns == rec["netns"]
            except OSError:
                alive = False
            if alive:
                out.append((node, rec["state"]))
    return out


def _agents_back(lay) -> None:
    deadline = time.monotonic() + 120
    while not lc._agents_ready(lay):
        assert time.monotonic() < deadline, "b's agent did not come back"
        time.sleep(1)


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
        # whole, but not moved: a failure, in one line that says where the job runs
        (line,) = r.stderr.strip().splitlines()[-1:]
        assert r.returncode == 4 and line.startswith("criuctl: error: "), r.stderr
        assert "not moved to node a" in line and "on node b" in line, r.stderr
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


def train_job(name: str, nodes: int, procs_per_node: int) -> dict:
    """A TrainJob as a user writes one for Kubeflow Trainer's torch runtime: torchrun in each pod
    (what most TrainJobs run): its agent reads Trainer's PET_* variables, hosts the static
    rendezvous store on node 0 (`PET_MASTER_ADDR`, index 0's DNS name), and starts
    `procs_per_node` workers, which find their rank and the store through env://."""
    from tests.test_multinode import STEPS as REF_STEPS

    ctr = ddp_job(name)["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]
    pod = training_pod(name, container="pytorch")
    override = {
        "targetJobs": [{"name": "node"}],
        "metadata": {k: pod["metadata"][k] for k in ("labels", "annotations")},
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "volumes": pod["spec"]["volumes"],
            # Trainer's override merges volumeMounts into the container by name; here the template's
            "containers": [{"name": "node", "volumeMounts": ctr["volumeMounts"]}],
        },
    }
    return {
        "apiVersion": "trainer.kubeflow.org/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name},
        "spec": {
            "runtimeRef": {"name": "torch-distributed"},
            "trainer": {
                "numNodes": nodes,
                "image": ctr["image"],
                "command": [*ctr["command"], "-m", "torch.distributed.run"],
                "args": [DDP_JOB, *REF_STEPS[:2], "--step-time", "0.3"],
                "resourcesPerNode": ctr["resources"],
                "numProcPerNode": procs_per_node,
            },
            "podTemplateOverrides": [override],
        },
    }


def _trainjob_pods(k: Kubectl, job: str, selector: str = "") -> dict[str, dict]:
    """The job's live pods by completion index (a JobSet's, or those `selector` picks)."""
    pods = k.pods(selector=selector or f"jobset.sigs.k8s.io/jobset-name={job}")
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return {p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"]: p for p in live}


@pytest.mark.parametrize("how", ["migrate", "drain"])
def test_a_trainjob_pod_moves_by_index_and_the_job_never_stops(local_cluster, how: str) -> None:
    """A TrainJob (the stand-ins make its pods as JobSet's Indexed Job does: random names, hostname
    `trn-node-0-I`, subdomain `trn`; the store found as `trn-node-0-0.trn`; the replacement made
    while the old pod terminates). `criuctl migrate` of index 0's pod of a 2-node job that runs
    torchrun in each pod, 2 workers per node (the pod holds torchrun's agent, the static
    rendezvous store every worker talks to, and ranks 0 and 1); or `kubectl drain` of index 1's
    node in a 3-node job with torchrun and one worker per pod (every index there moves, one after
    another, node 0 too if it is there). A successor has another name but the same index,
    hostname and DNS name, and criuctl knows it by that (criuctl.kube.owners.identity). The job
    never stops and ends as an uninterrupted run does; no pod restarted; no rule left on a node."""
    lay, k = local_cluster
    job = {"migrate": "trn", "drain": "trd"}[how]
    nodes, world, index = (2, 4, "0") if how == "migrate" else (3, 3, "1")
    k.apply(train_job(job, nodes, procs_per_node=2 if how == "migrate" else 1))
    source = ""
    try:
        deadline = time.monotonic() + 180
        while len(pods := _trainjob_pods(k, job)) < nodes or any(
            p["status"].get("phase") != "Running" for p in pods.values()
        ):
            assert time.monotonic() < deadline, {i: p["status"].get("phase") for i, p in pods.items()}
            time.sleep(1)
        rank0 = pods["0"]["metadata"]["name"]
        _wait_steps(k, rank0, 15)
        assert {p["spec"]["hostname"] for p in pods.values()} == {f"{job}-node-0-{i}" for i in range(nodes)}
        name, source = pods[index]["metadata"]["name"], pods[index]["spec"]["nodeName"]
        to = "a" if source == "b" else "b"
        before = {
            i: (p["metadata"]["uid"], p["status"]["containerStatuses"][0]["restartCount"])
            for i, p in pods.items()
        }
        names = [p["metadata"]["name"] for p in pods.values()]
        rows = _jobs(lay, f"{job}-node-0", names)  # a job is named by its pods' common prefix
        _all_connected(rows, names)
        first0 = LogFollower(k, rank0)  # a moved rank 0's log goes on in its successor
        first0.start()

        if how == "migrate":
            moved = [index]
            r = criuctl(lay, "migrate", name, to, "-o", "json")
            assert r.returncode == 0, r.stderr[-3000:]
            out = json.loads(r.stdout.strip().splitlines()[-1])
            assert out["target"] == to and out["via_successor"], out
        else:
            moved = sorted(i for i, p in pods.items() if p["spec"]["nodeName"] == source)
            drain(k, source, f"jobset.sigs.k8s.io/jobset-name={job}")
        deadline = time.monotonic() + 300
        for i in moved:
            while True:
                new = _trainjob_pods(k, job).get(i) or {"metadata": {}}
                if new["metadata"].get("uid", before[i][0]) != before[i][0] and "criuctl.io/migrated-at" in (
                    new["metadata"].get("annotations") or {}
                ):
                    break
                assert time.monotonic() < deadline, f"index {i} was not restored: {new}"
                time.sleep(1)
            old = pods[i]["metadata"]["name"]
            assert new["metadata"]["name"] != old
            assert new["spec"]["nodeName"] == to and new["spec"]["hostname"] == f"{job}-node-0-{i}"
            assert new["metadata"]["annotations"]["criuctl.io/migrated-from"] == f"default/{old}@{source}"
        now = _trainjob_pods(k, job)
        names = [p["metadata"]["name"] for p in now.values()]
        rows = _jobs(lay, f"{job}-node-0", names, on=(now[index]["metadata"]["name"], to))
        assert (now[index]["metadata"]["name"], to) in [(r[0], r[1]) for r in rows], rows
        _all_connected(rows, names)

        from tests.test_multinode import reference

        ref_steps, ref_final = reference(world)
        rank0_now = now["0"]["metadata"]["name"]
        deadline = time.monotonic() + 300
        while not final(log := k.logs(rank0_now)):
            assert time.monotonic() < deadline, log[-1500:]
            time.sleep(2)
        earlier = []
        if rank0_now != rank0:
            first0.join(60)
            earlier = [steps(first0.text)]
        assert combined_steps([*earlier, steps(log)]) == ref_steps, (
            "the losses differ from an uninterrupted run's"
        )
        assert final(log) == [ref_final], "final weights differ from an uninterrupted run"
        after = _trainjob_pods(k, job)
        for i in before:
            if i in moved:
                assert after[i]["status"]["containerStatuses"][0]["restartCount"] == 0
                continue
            assert after[i]["metadata"]["uid"] == before[i][0], f"index {i}'s pod was replaced"
            assert after[i]["status"]["containerStatuses"][0]["restartCount"] == before[i][1]
        while (k.get("trainjob", job).get("status") or {}).get("conditions", [{}])[-1].get(
            "type"
        ) != "Complete":
            assert time.monotonic() < deadline, k.get("trainjob", job)
            time.sleep(1)
        # its moves cost the Job nothing (criuctl.kube.jobfailures: out of the count before the
        # delete): no failure counted, so no pod-failure backoff either, and the JobSet never restarted
        js = k.get("jobset", job)
        assert int((js.get("status") or {}).get("restarts") or 0) == 0, js.get("status")
        counted = k.get("job", f"{job}-node-0")["status"]
        assert int(counted.get("failed") or 0) == 0, counted
        _no_rule_on_the_nodes(lay)
    finally:
        if how == "drain" and source:
            k("uncordon", source, check=False)
        k("delete", "trainjob", job, "--wait=false", check=False)


def _strict_job(name: str, steps: int = 400) -> dict:
    """An Indexed Job of one pod (a training pod criuctl wraps, its DNS name through the subdomain
    NAME) with backoffLimit 0 and restartPolicy Never, no podFailurePolicy: one failure counted
    fails it."""
    pod = training_pod(name, steps=steps)
    pod["spec"].update(restartPolicy="Never", terminationGracePeriodSeconds=5)
    job: dict = {"parallelism": 1, "completions": 1, "backoffLimit": 0}
    job["template"] = {
        "metadata": {k: pod["metadata"][k] for k in ("labels", "annotations")},
        "spec": pod["spec"],
    }
    return job


def _strict_jobset(name: str, steps: int) -> dict:
    """`_strict_job` as the one Job of a JobSet without Trainer (the JobSet fails with it: no
    failurePolicy)."""
    job = _strict_job(name, steps)
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": {"replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": job}}]},
    }


def _indexed_job(name: str, steps: int) -> dict:
    """`_strict_job` as a Job of its own: `completionMode: Indexed`, written where the Job stand-in
    reads the fields Kubernetes 1.20 drops (localcluster.indexedjob.SPEC)."""
    from localcluster import indexedjob

    job = _strict_job(name, steps)
    job["template"]["spec"]["subdomain"] = name
    dropped = json.dumps({"completionMode": "Indexed"})
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "annotations": {indexedjob.SPEC: dropped}},
        "spec": job,
    }


def test_a_jobs_pod_moves_uncounted_and_an_eviction_refused_leaves_it_counted(local_cluster) -> None:
    """Two Jobs that fail at their first counted failure (backoffLimit 0, restartPolicy Never, no
    podFailurePolicy; the stand-in counts a deleted pod as a recent Job controller does): pjm, an
    Indexed Job of its own (no JobSet; its pod's DNS name through its subdomain), and sje's, a
    JobSet's. `criuctl migrate` of pjm's pod takes it out of its Job's count before the delete
    (the tracking finalizer): it moves by index into the replacement the Job makes at once, and
    the Job counts nothing. sje's pod is evicted under a disruption budget that refuses: the
    webhook took it out of the count for an eviction that never came, so the job trains on,
    untouched, and the agents' loop puts it back in the count (its finalizer back, the label
    gone) within STALE and a look."""
    from criuctl.kube import jobfailures as jf

    lay, k = local_cluster
    # both at once: the evicted one is watched while the other moves; sje trains until it is
    # deleted (its pod must still run when it is looked at)
    k.apply(_strict_jobset("sje", steps=5000))
    k.apply(_indexed_job("pjm", steps=400))
    cases = {"sje": "", "pjm": "job-name=pjm"}
    k.apply(
        {
            "apiVersion": "policy/v1beta1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "sje"},
            "spec": {
                "minAvailable": 1,
                "selector": {"matchLabels": {"jobset.sigs.k8s.io/jobset-name": "sje"}},
            },
        }
    )
    try:
        first: dict[str, dict] = {}
        deadline = time.monotonic() + 180
        for name, selector in cases.items():
            while (
                not (pods := _trainjob_pods(k, name, selector))
                or pods["0"]["status"].get("phase") != "Running"
            ):
                assert time.monotonic() < deadline, pods
                time.sleep(1)
            first[name] = pods["0"]
            _wait_steps(k, pods["0"]["metadata"]["name"], 5)
        evicted, pod = first["sje"], first["pjm"]
        assert jf.TRACKING in evicted["metadata"]["finalizers"]
        ename = evicted["metadata"]["name"]
        body = {
            "apiVersion": "policy/v1beta1",
            "kind": "Eviction",
            "metadata": {"name": ename, "namespace": "default"},
        }
        r = k(
            "create",
            "--raw",
            f"/api/v1/namespaces/default/pods/{ename}/eviction",
            "-f",
            "-",
            input=json.dumps(body),
            check=False,
        )
        assert r.returncode != 0 and "disruption budget" in r.stderr, r.stderr
        now = k.get("pod", ename)
        assert jf.TRACKING not in (now["metadata"].get("finalizers") or []), "the webhook did not untrack it"
        assert jf.UNTRACKED in now["metadata"]["labels"] and not now["metadata"].get("deletionTimestamp")

        pname, source = pod["metadata"]["name"], pod["spec"]["nodeName"]
        to = "a" if source == "b" else "b"
        r = criuctl(lay, "migrate", pname, to)
        assert r.returncode == 0, r.stderr[-3000:]

        def restored() -> dict | None:
            new = _trainjob_pods(k, "pjm", cases["pjm"]).get("0") or {"metadata": {}}
            notes = new["metadata"].get("annotations") or {}
            fresh = new["metadata"].get("uid") not in (None, pod["metadata"]["uid"])
            return new if fresh and "criuctl.io/migrated-at" in notes else None

        new = until("pjm's index restored into its successor", restored, timeout=180)
        assert new["spec"]["nodeName"] == to and new["spec"]["hostname"] == "pjm-0"
        assert new["metadata"]["annotations"]["criuctl.io/migrated-from"] == f"default/{pname}@{source}"
        assert jf.TRACKING in new["metadata"]["finalizers"], "the successor is its Job's to count"
        _wait_steps(k, new["metadata"]["name"], 10)
        k.wait_gone("pod", pname)
        job = k.get("job", "pjm")
        assert int(job["status"].get("failed") or 0) == 0, job["status"]
        assert not {c["type"] for c in (job["status"].get("conditions") or [])} & {"FailureTarget", "Failed"}

        back = until(
            "the evicted pod's tracking finalizer back",
            lambda: (
                (p := k.get("pod", ename)) and jf.TRACKING in (p["metadata"].get("finalizers") or []) and p
            ),
            timeout=jf.STALE + 60,
        )
        assert jf.UNTRACKED not in back["metadata"]["labels"]
        assert back["metadata"]["uid"] == evicted["metadata"]["uid"] and not back["metadata"].get(
            "deletionTimestamp"
        )
        assert max(steps(k.logs(ename))) > 5
        assert int(k.get("job", "sje-node-0")["status"].get("failed") or 0) == 0
    finally:
        k("delete", "pdb", "sje", "--wait=false", check=False)
        k("delete", "jobset", "sje", "--wait=false", check=False)
        k("delete", "job", "pjm", "--wait=false", check=False)


def test_the_leader_killed_between_the_untrack_and_the_delete_moves_the_job_once(local_cluster) -> None:
    """The state table's row for a Job's pod taken out of its count before its delete: the leading
    controller is killed right there (`controller.untracked`: the pod untracked, not deleted, the
    job training on). The next leader plans the move again from the PodMigration's status and
    deletes the pod; the job moves once, into the Job's replacement on the target, and the Job
    (backoffLimit 0, which one counted failure would fail) counts nothing."""
    from criuctl.kube import jobfailures as jf

    lay, k = local_cluster
    name = "kuj"
    k.apply(_indexed_job(name, steps=600))
    selector = f"job-name={name}"
    pod = until(
        "kuj's pod running",
        lambda: (
            (p := _trainjob_pods(k, name, selector).get("0")) and p["status"].get("phase") == "Running" and p
        ),
        timeout=180,
    )
    pname, source = pod["metadata"]["name"], pod["spec"]["nodeName"]
    to = "a" if source == "b" else "b"
    _wait_steps(k, pname, 5)
    ctl = Controller(lay, k)
    ctl.arm("controller.untracked")
    try:
        r = criuctl(lay, "migrate", pname, to, "--detach", "--as", "pm-kuj")
        assert r.returncode == 0, r.stderr
        ctl.reached("controller.untracked")
        now = k.get("pod", pname)
        assert jf.TRACKING not in (now["metadata"].get("finalizers") or []), "not untracked"
        assert not now["metadata"].get("deletionTimestamp"), "deleted before the point"
        old = ctl.kill_leader()
    finally:
        ctl.disarm()
    ctl.wait_leader(old)
    st = wait_podmigration(k, "pm-kuj")["status"]
    assert st["phase"] == "Succeeded", st
    new = _trainjob_pods(k, name, selector)["0"]
    assert new["metadata"]["uid"] != pod["metadata"]["uid"] and new["spec"]["nodeName"] == to
    assert new["metadata"]["annotations"]["criuctl.io/migrated-from"] == f"default/{pname}@{source}"
    assert new["status"]["containerStatuses"][0]["restartCount"] == 0
    _wait_steps(k, new["metadata"]["name"], max(steps(k.logs(new["metadata"]["name"])) or [0]) + 5)
    k.wait_gone("pod", pname)
    job = k.get("job", name)
    assert int(job["status"].get("failed") or 0) == 0, job["status"]
    assert len(k.pods(selector=selector)) == 1, "one pod of the index, training"
    k("delete", "job", name, "--wait=false", check=False)
