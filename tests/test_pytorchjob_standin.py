"""The PyTorchJob stand-in (localcluster.pytorchjob): what it makes from a job, checked as
pure functions, then on the local cluster (tests/conftest.py `local_cluster`): the pods and headless
Services the training operator would make, a deleted worker made again under its name and rank,
and the job Succeeded once its master exits 0."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from localcluster import pytorchjob as ptj
from localcluster.layout import BUSYBOX

from tests.conftest import needs_criu
from tests.kube import Kubectl
from tests.kube import until as _until

NS = "ptj"
FINISH = "/tmp/finish"  # the master exits 0 once this file exists: the test decides when
L = ptj.LABEL


def _replica(command: list[str], ports: list[dict] | None = None, replicas: int = 1) -> dict:
    container = {
        "name": "pytorch",
        "image": BUSYBOX,
        "imagePullPolicy": "Never",
        "command": command,
        "env": [{"name": "OWN", "value": "kept"}],
        "ports": ports or [],
        "resources": {"requests": {"memory": "16Mi", "cpu": "10m"}},
    }
    spec = {"terminationGracePeriodSeconds": 1, "containers": [container]}
    return {
        "replicas": replicas,
        "restartPolicy": "OnFailure",
        "template": {"metadata": {"labels": {"app": "mnist"}}, "spec": spec},
    }


def _job(name: str = "mnist", workers: int = 1, master_port: int | None = 29500) -> dict:
    ports = [{"name": ptj.PORT_NAME, "containerPort": master_port}] if master_port else []
    master = _replica(["/bin/sh", "-c", f"until [ -e {FINISH} ]; do sleep 0.2; done"], ports)
    worker = _replica(["/bin/sleep", "3600"], replicas=workers)
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": NS, "uid": "u-1"},
        "spec": {"pytorchReplicaSpecs": {"Master": master, "Worker": worker}},
    }


def _owner(uid: str) -> list[dict]:
    """The training operator's controller reference to job `mnist`."""
    return [
        {
            "apiVersion": "kubeflow.org/v1",
            "kind": "PyTorchJob",
            "name": "mnist",
            "uid": uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]


def _env(pod: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}


# -- pure: what the stand-in makes -----------------------------------------------------------------


def test_pods_env_labels_and_owner_as_the_operator_makes_them() -> None:
    job = _job(workers=2)
    master, worker = ptj.pod_for(job, "Master", 0), ptj.pod_for(job, "Worker", 1)
    assert (master["metadata"]["name"], worker["metadata"]["name"]) == ("mnist-master-0", "mnist-worker-1")
    assert _env(master) == {
        "OWN": "kept",
        "PYTHONUNBUFFERED": "0",
        "MASTER_PORT": "29500",
        "MASTER_ADDR": "mnist-master-0",
        "WORLD_SIZE": "3",
        "RANK": "0",
        "PET_MASTER_ADDR": "mnist-master-0",
        "PET_MASTER_PORT": "29500",
        "PET_NNODES": "3",
        "PET_NODE_RANK": "0",
        "PET_NPROC_PER_NODE": "1",
    }
    ranks = {"RANK": "0", "PET_NODE_RANK": "0"}
    assert (
        _env(worker) | ranks == _env(master) and _env(worker)["RANK"] == _env(worker)["PET_NODE_RANK"] == "2"
    )
    assert worker["metadata"]["labels"] == {
        "app": "mnist",
        L + "operator-name": "pytorchjob-controller",
        L + "job-name": "mnist",
        L + "replica-type": "worker",
        L + "replica-index": "1",
    }
    assert master["metadata"]["labels"][L + "job-role"] == "master"
    assert master["metadata"]["ownerReferences"] == _owner("u-1")
    assert master["spec"]["restartPolicy"] == "OnFailure"
    spec = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert spec["containers"][0]["env"] == [{"name": "OWN", "value": "kept"}], "the job's template changed"
    assert _env(ptj.pod_for(_job(master_port=None), "Worker", 0))["MASTER_PORT"] == "23456"


def test_service_is_headless_and_selects_its_pod() -> None:
    job = _job()
    svc, pod = ptj.service_for(job, "Worker", 0), ptj.pod_for(job, "Worker", 0)
    assert svc["metadata"]["name"] == pod["metadata"]["name"] == "mnist-worker-0"
    assert svc["spec"]["clusterIP"] == "None"
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert svc["spec"]["ports"] == [{"name": ptj.PORT_NAME, "port": 23456, "targetPort": 23456}]


def test_conditions_follow_kubeflow_common() -> None:
    status: dict[str, Any] = {}
    ptj.set_condition(status, "Created", "created")
    ptj.set_condition(status, "Running", "running")
    first = [dict(c) for c in status["conditions"]]
    ptj.set_condition(status, "Running", "running")
    assert status["conditions"] == first, "an unchanged condition is not rewritten"
    ptj.set_condition(status, "Restarting", "restarting")
    assert [c["type"] for c in status["conditions"]] == ["Created", "Restarting"]
    ptj.set_condition(status, "Running", "running")
    ptj.set_condition(status, "Succeeded", "done")
    assert [(c["type"], c["status"], c["reason"]) for c in status["conditions"]] == [
        ("Created", "True", "PyTorchJobCreated"),
        ("Running", "False", "PyTorchJobRunning"),
        ("Succeeded", "True", "PyTorchJobSucceeded"),
    ]
    assert ptj.invalid(ptj.replica_specs({"spec": {"pytorchReplicaSpecs": {"Master": {"replicas": 1}}}}))
    assert ptj.invalid(ptj.replica_specs(_job())) is None
    unnamed = _job()
    unnamed["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "train"
    assert ptj.invalid(ptj.replica_specs(unnamed)) == "there is no container named pytorch in Worker"


def test_a_deleted_worker_leaves_restarting_written_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The master runs, the worker is being deleted (counted failed): each pass ends in Restarting,
    and a second pass changes nothing (no status write every second while the pod terminates)."""
    ticks = iter(range(1000))
    monkeypatch.setattr(ptj, "_now", lambda: f"t{next(ticks)}")
    specs = ptj.replica_specs(_job())
    counts = {
        "Master": {"active": 1, "succeeded": 0, "failed": 0},
        "Worker": {"active": 0, "succeeded": 0, "failed": 1},
    }
    status: dict[str, Any] = {}
    ptj.update_conditions(status, "mnist", specs, counts)
    ptj.update_conditions(status, "mnist", specs, counts)
    assert [(c["type"], c["lastUpdateTime"]) for c in status["conditions"]] == [("Restarting", "t0")]
    counts["Worker"] = {"active": 1, "succeeded": 0, "failed": 0}  # made again, running
    ptj.update_conditions(status, "mnist", specs, counts)
    assert [c["type"] for c in status["conditions"]] == ["Running"]


# -- on the local cluster --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(local_cluster) -> Iterator[Kubectl]:
    """The CRD installed and the stand-in running in a thread (unless `up` already runs it), in a
    namespace of this module's; all of it removed at the end."""
    lay, k = local_cluster
    had_crd = k.get("crd", ptj.CRD_NAME) is not None
    ptj.install(str(lay.kubeconfig))
    stop = threading.Event()
    thread = threading.Thread(target=ptj.run, args=(str(lay.kubeconfig), stop), daemon=True)
    if "pytorchjob-standin" not in lay.pids:
        thread.start()
    k("create", "namespace", NS)
    try:
        yield k
    finally:
        k("delete", "namespace", NS, "--timeout=120s", check=False)
        stop.set()
        if thread.is_alive():
            thread.join(10)
        if not had_crd:
            k("delete", "crd", ptj.CRD_NAME, "--timeout=60s", check=False)


def test_the_backoff_limit_counts_the_running_pods_container_restarts() -> None:
    """`PastBackoffLimit`: restarts of Running pods' containers, for restartable replicas, reach
    runPolicy.backoffLimit (any restart when it is 0); a deleted pod (a move) restarts nothing."""
    job = _job()

    def pod(rtype: str, restarts: int, phase: str = "Running") -> dict:
        labels = {L + "replica-type": rtype}
        status = {"phase": phase, "containerStatuses": [{"name": "pytorch", "restartCount": restarts}]}
        return {"metadata": {"labels": labels}, "status": status}

    assert not ptj.past_backoff_limit(job, [pod("worker", 5)]), "no limit, no check"
    job["spec"]["runPolicy"] = {"backoffLimit": 0}
    assert ptj.past_backoff_limit(job, [pod("master", 0), pod("worker", 1)])
    assert not ptj.past_backoff_limit(job, [pod("master", 0), pod("worker", 0)])
    assert not ptj.past_backoff_limit(job, [pod("worker", 3, "Pending")])
    job["spec"]["runPolicy"] = {"backoffLimit": 2}
    assert not ptj.past_backoff_limit(job, [pod("worker", 1)]) and ptj.past_backoff_limit(
        job, [pod("worker", 2)]
    )
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["restartPolicy"] = "Never"
    assert not ptj.past_backoff_limit(job, [pod("worker", 2)])


def _conditions(k: Kubectl, name: str) -> dict[str, str]:
    job = k.get("pytorchjob", name, NS) or {}
    return {c["type"]: c["status"] for c in (job.get("status") or {}).get("conditions", [])}


@needs_criu
@pytest.mark.timeout(400)
def test_job_pods_services_recreation_and_success(cluster: Kubectl) -> None:
    k = cluster
    job = _job()
    del job["metadata"]["uid"]
    k.apply(job, NS)
    uid = k.get("pytorchjob", "mnist", NS)["metadata"]["uid"]
    pods = {n: k.wait_running(n, NS) for n in ("mnist-master-0", "mnist-worker-0")}
    for name, rank in (("mnist-master-0", "0"), ("mnist-worker-0", "1")):
        meta = pods[name]["metadata"]
        assert meta["ownerReferences"] == _owner(uid)
        assert meta["labels"][L + "job-name"] == "mnist" and meta["labels"][L + "replica-index"] == "0"
        assert meta["labels"][L + "operator-name"] == "pytorchjob-controller"
        env = _env(pods[name])
        assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["WORLD_SIZE"], env["RANK"]) == (
            "mnist-master-0",
            "29500",
            "2",
            rank,
        )
        svc = k.get("service", name, NS)
        assert (
            svc["spec"]["clusterIP"] == "None"
            and svc["metadata"]["ownerReferences"] == meta["ownerReferences"]
        )
        assert svc["spec"]["selector"].items() <= meta["labels"].items()
    assert pods["mnist-master-0"]["metadata"]["labels"][L + "job-role"] == "master"
    assert pods["mnist-worker-0"]["metadata"]["labels"][L + "replica-type"] == "worker"
    assert (k.pods(NS, f"{L}job-name=mnist,{L}replica-type=worker"))[0]["metadata"][
        "name"
    ] == "mnist-worker-0"
    _until("Created and Running", lambda: _conditions(k, "mnist") == {"Created": "True", "Running": "True"})

    # a deleted worker comes back under its name (its rank and DNS name), as a new pod
    k("-n", NS, "delete", "pod", "mnist-worker-0", "--wait=true")
    again = _until(
        "mnist-worker-0 made again",
        lambda: (
            (p := k.get("pod", "mnist-worker-0", NS))
            and p["metadata"]["uid"] != pods["mnist-worker-0"]["metadata"]["uid"]
            and p
        ),
    )
    assert _env(again)["RANK"] == "1"
    k.wait_running("mnist-worker-0", NS)
    _until("Running again", lambda: _conditions(k, "mnist").get("Running") == "True")

    # the master exits 0: the job Succeeded (Running False) and nothing is made again after that
    k("-n", NS, "exec", "mnist-master-0", "--", "/bin/sh", "-c", f": > {FINISH}")
    _until("Succeeded", lambda: _conditions(k, "mnist").get("Succeeded") == "True")
    final = k.get("pytorchjob", "mnist", NS)["status"]
    assert _conditions(k, "mnist")["Running"] == "False" and final["completionTime"]
    assert final["replicaStatuses"]["Master"]["succeeded"] == 1
    assert k.get("pod", "mnist-master-0", NS)["status"]["phase"] == "Succeeded"
    k("-n", NS, "delete", "pod", "mnist-worker-0", "--wait=true")
    time.sleep(3)  # three polls
    assert k.get("pod", "mnist-worker-0", NS) is None, "a finished job's pod was made again"

    # deleting the job deletes its pods and Services (ownerReferences, by the garbage collector)
    k("-n", NS, "delete", "pytorchjob", "mnist")
    for kind in ("pod", "service"):
        for name in ("mnist-master-0", "mnist-worker-0"):
            k.wait_gone(kind, name, NS)
