"""The TrainJob/JobSet stand-in and its Job controller (localcluster.trainjob, .indexedjob): as harsh
as the real controllers where a move can break a job. Pure passes of the Job controller first, then
on the local cluster, on pods criuctl does not touch: the Pod → Job → JobSet chain, a replacement made
while the old pod terminates, the deleted pod counted as a failure, and the JobSet failing with it."""

from __future__ import annotations

from typing import Any

import pytest
from localcluster import indexedjob as ij
from localcluster import trainjob
from localcluster.layout import BUSYBOX

from tests.conftest import needs_criu
from tests.kube import Kubectl
from tests.kube import until as _until

NS = "default"


def _pod(i: int, phase: str = "Running", deleting: bool = False, tracked: bool = True, **status: Any) -> dict:
    meta: dict[str, Any] = {
        "name": f"j-{i}-{phase.lower()}{'-d' if deleting else ''}",
        "annotations": {ij.INDEX: str(i)},
        "creationTimestamp": f"2026-12-05T00:00:0{i}Z",
        "finalizers": [ij.FINALIZER] if tracked else [],
    }
    if deleting:
        meta["deletionTimestamp"] = "2999-01-01T00:00:00Z"  # its grace runs yet
    return {"metadata": meta, "status": {"phase": phase, **status}}


def _spec(**over: Any) -> ij.Spec:
    job = {"completions": 2, "parallelism": 2, "template": {"spec": {"restartPolicy": "Never"}}, **over}
    return ij.Spec.of(job)


def test_a_terminating_pod_is_replaced_at_once_and_counted_as_failed() -> None:
    """podReplacementPolicy TerminatingOrFailed (the default without a podFailurePolicy): index 1's
    pod being deleted is not active, so index 1 is made again in the same pass, and the deleted pod
    counts against backoffLimit (6 by default: the Job goes on)."""
    p = ij.plan("j", _spec(), {}, [_pod(0), _pod(1, deleting=True)])
    assert p.make == [1] and p.status["failed"] == 1 and not ij.finished(p.status)
    assert [x["metadata"]["name"] for x in p.counted] == ["j-1-running-d"]


def test_a_pod_without_the_tracking_finalizer_is_never_judged_but_still_replaced() -> None:
    """`trackJobStatusAndRemoveFinalizers` skips a pod without the finalizer: deleted (or failed)
    with backoffLimit 0, it counts nothing and fails nothing, and its index is made again at once;
    its end, however it comes, is never counted later either."""
    p = ij.plan("j", _spec(backoffLimit=0), {}, [_pod(0), _pod(1, deleting=True, tracked=False)])
    assert p.make == [1] and not p.status.get("failed") and not p.status.get("conditions") and not p.counted
    later = ij.plan(
        "j", _spec(backoffLimit=0), p.status, [_pod(0), _pod(1, "Failed", deleting=True, tracked=False)]
    )
    assert not later.status.get("failed") and not ij.finished(later.status)


def test_a_deleted_pod_fails_a_job_whose_backoff_limit_is_zero() -> None:
    """backoffLimit 0: the one deletion fails the Job; every active pod is deleted, FailureTarget
    first, Failed once none terminates (`delayTerminalCondition`)."""
    p = ij.plan("j", _spec(backoffLimit=0), {}, [_pod(0), _pod(1, deleting=True)])
    conds = {c["type"]: c["reason"] for c in p.status["conditions"]}
    assert conds == {"FailureTarget": "BackoffLimitExceeded"} and [
        x["metadata"]["name"] for x in p.delete
    ] == ["j-0-running"]
    assert not p.make
    later = ij.plan("j", _spec(backoffLimit=0), p.status, [_pod(1, "Failed", tracked=False)])
    assert ij.finished(later.status) and later.status["conditions"][-1]["type"] == "Failed"


def test_with_a_pod_failure_policy_the_index_waits_and_a_disruption_is_ignored() -> None:
    """A podFailurePolicy makes the replacement policy Failed: a terminating pod keeps its index; once
    it failed, a rule Ignore on DisruptionTarget leaves it uncounted, and its index is made again.
    Without the condition the same pod is counted (and with backoffLimit 0 fails the Job)."""
    rules = [{"action": "Ignore", "onPodConditions": [{"type": ij.DISRUPTION}]}]
    spec = _spec(backoffLimit=0, podFailurePolicy={"rules": rules})
    p = ij.plan("j", spec, {}, [_pod(0), _pod(1, deleting=True)])
    assert p.make == [] and not p.counted and "failed" not in p.status
    disrupted = _pod(1, "Failed", deleting=True, conditions=[{"type": ij.DISRUPTION, "status": "True"}])
    p = ij.plan("j", spec, {}, [_pod(0), disrupted])
    assert p.make == [1] and int(p.status.get("failed") or 0) == 0 and p.counted == [disrupted]
    plain = _pod(1, "Failed", deleting=True)
    p = ij.plan("j", spec, {}, [_pod(0), plain])
    assert p.status["failed"] == 1 and p.status["conditions"][-1]["type"] == "FailureTarget"


def test_exit_code_rules_and_on_failure_restarts() -> None:
    """`onExitCodes` (In/NotIn, 0 never matches) decides FailJob; with restartPolicy OnFailure the
    live pods' container restarts count against the limit."""
    code = {
        "containerStatuses": [{"name": "c", "restartCount": 0, "state": {"terminated": {"exitCode": 42}}}]
    }
    rule = [{"action": "FailJob", "onExitCodes": {"operator": "In", "values": [42]}}]
    assert ij.match_policy(_pod(0, "Failed", **code), rule) == "FailJob"
    assert (
        ij.match_policy(
            _pod(0, "Failed", **code), [{**rule[0], "onExitCodes": {"operator": "NotIn", "values": [42]}}]
        )
        is None
    )
    p = ij.plan("j", _spec(podFailurePolicy={"rules": rule}), {}, [_pod(0, "Failed", **code), _pod(1)])
    assert p.status["conditions"][-1]["reason"] == "PodFailurePolicy"
    on_failure = ij.Spec.of(
        {"completions": 1, "backoffLimit": 2, "template": {"spec": {"restartPolicy": "OnFailure"}}}
    )
    restarted = _pod(0, containerStatuses=[{"name": "c", "restartCount": 2}])
    assert ij.past_backoff_limit(on_failure, 0, [restarted]) and not ij.past_backoff_limit(
        on_failure, 0, [_pod(0)]
    )


def test_one_active_pod_per_index_and_none_for_a_succeeded_index() -> None:
    p = ij.plan("j", _spec(), {}, [_pod(0, "Succeeded"), _pod(0), _pod(1), _pod(1, "Pending")])
    assert sorted(x["metadata"]["name"] for x in p.delete) == ["j-0-running", "j-1-pending"]
    assert p.status["succeeded"] == 1 and not p.make


def test_trainers_env_and_jobsets_job_as_they_make_them() -> None:
    """Trainer's PET_* (port 29500, numProcPerNode "auto" = the CPUs asked for), no backoffLimit or
    restartPolicy of the runtime's own; JobSet's Job named `<js>-node-0`, Indexed, OnFailure."""
    tj = {
        "metadata": {"name": "t", "namespace": NS, "uid": "u"},
        "spec": {"trainer": {"numNodes": 2, "image": "i", "resourcesPerNode": {"requests": {"cpu": "2"}}}},
    }
    js = trainjob.jobset_for(tj)
    js["metadata"]["uid"] = "js"
    rjob = js["spec"]["replicatedJobs"][0]
    env = {
        e["name"]: e.get("value")
        for e in rjob["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert (env["PET_MASTER_PORT"], env["PET_NPROC_PER_NODE"], env["PET_NNODES"]) == ("29500", "2", "2")
    assert "backoffLimit" not in rjob["template"]["spec"]
    job = trainjob.job_for(js, rjob, 0, 0)
    assert job["metadata"]["name"] == "t-node-0" and job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"
    assert job["metadata"]["ownerReferences"][0]["kind"] == "JobSet"
    pod = ij.pod_for({**job, "metadata": {**job["metadata"], "uid": "j", "namespace": NS}}, 1)
    assert pod["spec"]["hostname"] == "t-node-0-1" and pod["metadata"]["generateName"] == "t-node-0-1-"
    assert pod["spec"]["subdomain"] == "t" and pod["metadata"]["finalizers"] == [ij.FINALIZER]


def _jobset(name: str, job_spec: dict) -> dict:
    """A JobSet (no Trainer) of 2 indexes whose pods ignore SIGTERM for their 8 s of grace: a
    deleted one terminates long enough to be seen beside its replacement."""
    ctr = {
        "name": "c",
        "image": BUSYBOX,
        "imagePullPolicy": "Never",
        "command": ["/bin/sh", "-c", "trap '' TERM; while :; do sleep 1; done"],
        "resources": {"requests": {"memory": "8Mi", "cpu": "10m"}},
    }
    template = {"spec": {"terminationGracePeriodSeconds": 8, "containers": [ctr]}}
    spec = {"parallelism": 2, "completions": 2, "template": template, **job_spec}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "namespace": NS},
        "spec": {"replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": spec}}]},
    }


def _index_pods(k: Kubectl, js: str, i: int) -> list[dict]:
    return [
        p
        for p in k.pods(NS, f"jobset.sigs.k8s.io/jobset-name={js}")
        if p["metadata"]["annotations"].get(ij.INDEX) == str(i)
    ]


def _conditions(k: Kubectl, kind: str, name: str) -> dict[str, str]:
    obj = k.get(kind, name, NS) or {}
    return {c["type"]: c.get("reason", "") for c in (obj.get("status") or {}).get("conditions") or []}


@needs_criu
@pytest.mark.timeout(300)
def test_a_deleted_pod_is_replaced_while_it_terminates_counted_and_fails_the_jobset(local_cluster) -> None:
    """backoffLimit 1, no podFailurePolicy, pods criuctl does not touch. The pods belong to the Job
    `<js>-node-0` (a real batch/v1 Job), which belongs to the JobSet. `kubectl delete` of index 1's
    pod: its replacement is made while the old one still terminates (two pods of index 1) and the
    deletion is counted as a failure; a second deletion passes the limit: the Job fails
    (BackoffLimitExceeded) and deletes its pods, and the JobSet fails (FailedJobs)."""
    _, k = local_cluster
    name, job = "sjs", "sjs-node-0"
    k.apply(_jobset(name, {"backoffLimit": 1}), NS)
    try:
        for i in (0, 1):
            _until(
                f"index {i} running",
                lambda i=i: any(p["status"].get("phase") == "Running" for p in _index_pods(k, name, i)),
            )
        old = _index_pods(k, name, 1)[0]
        ref = old["metadata"]["ownerReferences"][0]
        assert (ref["kind"], ref["name"]) == ("Job", job)
        got = k.get("job", job, NS)
        assert got["metadata"]["ownerReferences"][0]["kind"] == "JobSet" and got["apiVersion"] == "batch/v1"
        k("-n", NS, "delete", "pod", old["metadata"]["name"], "--wait=false")
        both = _until(
            "a replacement beside the terminating pod",
            lambda: ps if len(ps := _index_pods(k, name, 1)) == 2 else None,
            timeout=15,
        )
        assert sum(bool(p["metadata"].get("deletionTimestamp")) for p in both) == 1
        assert _until(
            "the deletion counted", lambda: (k.get("job", job, NS)["status"].get("failed") or 0) == 1, 15
        )
        assert "Failed" not in _conditions(k, "jobset", name)
        k("-n", NS, "delete", "pod", _index_pods(k, name, 0)[0]["metadata"]["name"], "--wait=false")
        _until(
            "the Job failed", lambda: _conditions(k, "job", job).get("Failed") == "BackoffLimitExceeded", 90
        )
        assert not [
            p for i in (0, 1) for p in _index_pods(k, name, i) if not p["metadata"].get("deletionTimestamp")
        ]
        _until("the JobSet failed", lambda: "Failed" in _conditions(k, "jobset", name), 30)
    finally:
        k("-n", NS, "delete", "jobset", name, "--wait=false")


def test_a_deleted_pods_phase_is_terminal_once_it_ended() -> None:
    """The local cluster's 1.20 kubelet leaves a deleted pod "Running" while a finalizer keeps it; a
    recent one writes it terminal: Failed unless every container exited 0, and ended by the end of
    its grace."""
    ended = [{"name": "c", "state": {"terminated": {"exitCode": 137}}}]
    assert ij.phase(_pod(0, deleting=True, containerStatuses=ended)) == "Failed"
    ok = [{"name": "c", "state": {"terminated": {"exitCode": 0}}}]
    assert ij.phase(_pod(0, deleting=True, containerStatuses=ok)) == "Succeeded"
    running = [{"name": "c", "state": {"running": {}}}]
    assert ij.phase(_pod(0, deleting=True, containerStatuses=running)) == "Running"
    late = _pod(0, deleting=True, containerStatuses=running)
    late["metadata"]["deletionTimestamp"] = "2020-01-01T00:00:00Z"
    assert ij.phase(late) == "Failed" and ij.phase(_pod(0, containerStatuses=ended)) == "Running"


def test_the_pod_failure_backoff_doubles_from_ten_seconds() -> None:
    """`getRemainingTime`: no pod made until 10 s after one counted failure, 20 s after two, …, at
    most 10 min; none without a failure since the last success."""
    assert [ij.pod_failure_backoff(n) for n in (0, 1, 2, 3)] == [0.0, 10.0, 20.0, 40.0]
    assert ij.pod_failure_backoff(20) == 600.0
