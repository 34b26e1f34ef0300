"""A STAND-IN for the Job controller of a recent Kubernetes (1.31–1.34), for the local cluster only:
the Indexed Jobs a JobSet owns, and Indexed Jobs of their own.

The local cluster's Kubernetes is 1.20: its Job controller knows no Indexed Job, no
`podReplacementPolicy`, no `podFailurePolicy`, and it would fight over pods it did not make
(`getPodsForJob` releases a pod its selector does not match), so the local cluster runs it off
(`--controllers=…,-job`, localcluster.control) and this module plays it for the Jobs whose owner is a
JobSet. The Job objects are real `batch/v1` Jobs; the fields 1.20's API drops (`completionMode`,
`podReplacementPolicy`, `podFailurePolicy`, `backoffLimitPerIndex`) are read from the JobSet's
replicated-Job template the Job was made from, which a JobSet copies verbatim
(localcluster.trainjob), or for a Job of no JobSet from its annotation `SPEC` (JSON; such a Job is
run only if that says `completionMode: Indexed`). It does what the real controller does where a
move of a pod can break a job, modelled on `pkg/controller/job/job_controller.go` and `indexed_job_utils.go`:

- **Replacement while the old pod terminates** (`onlyReplaceFailedPods`, `manageJob`): with
  `podReplacementPolicy: TerminatingOrFailed` (the default without a `podFailurePolicy`) a pod with
  a deletion timestamp is not active (`controller.FilterActivePods`), so its index is pending and a
  replacement is made at once: two pods of one index live together while the old one's preStop
  runs. With `Failed` (the default with a `podFailurePolicy`) the index waits until the old pod is
  terminal.
- **A deleted pod is a failure** (`isPodFailed`): phase Failed, or, under TerminatingOrFailed, a
  deletion timestamp on a pod that did not succeed. Every pod carries the tracking finalizer
  `batch.kubernetes.io/job-tracking`, removed only once the pod is counted
  (`trackJobStatusAndRemoveFinalizers`), so a pod deleted at once (grace 0) is counted all the same;
  a pod that lost it to someone else is never judged (that function skips it) and never given it
  back (`getPodsForJob` adds it only to a pod it adopts). Pods are looked at every 0.25 s, sooner
  than the real one's batch period (`syncJobBatchPeriod`, 1 s) lets it.
- **The count against `backoffLimit`** (`syncJob`, `pastBackoffLimitOnFailure`): more failed pods
  than the limit, or with restartPolicy OnFailure the live pods' container restarts reaching it;
  then the condition `FailureTarget` (reason `BackoffLimitExceeded`), every active pod deleted, and
  `Failed` once none terminates (`delayTerminalCondition`, `enactJobFinished`).
- **`podFailurePolicy`** (`pod_failure_policy.go`, `matchPodFailurePolicy`): the first rule that
  matches a failed pod decides: `Ignore` (not counted), `FailJob` (the Job fails, reason
  `PodFailurePolicy`), `Count`; a rule matches on `onExitCodes` (a container's exit code, In or
  NotIn, 0 never counted) or `onPodConditions` (type and status, default "True").
- **Backoffs** (`manageJob`, `getRemainingTime`): no pod is made until 10 s × 2^(n−1) (at most
  10 min) after the last of the n failures counted since the Job's last success; a refused
  creation (the sync's error, requeued) is tried again after 1 s, doubling, at most 60 s.
- **Indexes** (`indexed_job_utils.go`): a pod per pending index, `generateName` `<job>-<i>-`,
  hostname `<job>-<i>`, the index in the annotation and label `batch.kubernetes.io/job-completion-index`
  and `JOB_COMPLETION_INDEX`; one active pod per index is kept, the most advanced
  (`appendDuplicatedIndexPodsForRemoval`), and an index that succeeded keeps none (the real one
  removes the least advanced of `active - (completions - succeeded)` extras: the same count); the
  Job is `Complete` once every index succeeded.

What it does NOT do: Jobs that are not Indexed (left alone: nothing runs them here),
`backoffLimitPerIndex`/`maxFailedIndexes`, success policies, `activeDeadlineSeconds`, suspend,
TTL, the exponential backoff between pod creations, `uncountedTerminatedPods` (a failure is
written to the status before its finalizer goes: a crash between the two counts it twice, harsher
than the real one, never kinder), Events, metrics.
"""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from criuctl.kube import api
from localcluster.pytorchjob import _json, _now, _owned, log

FINALIZER = "batch.kubernetes.io/job-tracking"
INDEX = "batch.kubernetes.io/job-completion-index"
DISRUPTION = "DisruptionTarget"
# the controller's backoffs (`DefaultJobApiBackOff`, `MaxJobApiBackOff`,
# `DefaultJobPodFailureBackOff`, `MaxJobPodFailureBackOff`), in seconds
API_BACKOFF, MAX_API_BACKOFF = 1.0, 60.0
POD_FAILURE_BACKOFF, MAX_POD_FAILURE_BACKOFF = 10.0, 600.0
# a Job of no JobSet carries the fields 1.20's API drops here, as JSON (a convention of the stand-in's
# tests: a real cluster keeps them in the Job's spec)
SPEC = "localcluster.criuctl.io/job-spec"
GRACE_MARGIN = 5.0  # s past a deleted pod's deletionTimestamp (its grace's end) it is taken as ended


@dataclass
class Spec:
    """A Job's spec as a recent API server keeps it, with its defaults."""

    completions: int
    parallelism: int
    backoff_limit: int
    restart_policy: str
    replacement: str  # podReplacementPolicy: TerminatingOrFailed | Failed
    rules: list[dict] = field(default_factory=list)  # podFailurePolicy.rules

    @classmethod
    def of(cls, job_spec: dict) -> Spec:
        """Defaults as the API server's (`SetDefaults_Job`): backoffLimit 6, the replacement policy
        Failed when a podFailurePolicy is set, else TerminatingOrFailed."""
        completions = int(job_spec.get("completions") or 1)
        rules = list((job_spec.get("podFailurePolicy") or {}).get("rules") or [])
        default = "Failed" if job_spec.get("podFailurePolicy") else "TerminatingOrFailed"
        return cls(
            completions=completions,
            parallelism=int(job_spec.get("parallelism", completions)),
            backoff_limit=int(job_spec.get("backoffLimit", 6)),
            restart_policy=(job_spec.get("template") or {}).get("spec", {}).get("restartPolicy", "Never"),
            replacement=job_spec.get("podReplacementPolicy") or default,
            rules=rules,
        )

    @property
    def only_replace_failed(self) -> bool:
        """`onlyReplaceFailedPods`: a terminating pod keeps its index until it is terminal."""
        return self.replacement == "Failed" or bool(self.rules)


def pod_failure_backoff(failures: int) -> float:
    """`backoffRecord.getRemainingTime`'s delay after `failures` counted failures since the Job's
    last success: 10 s, doubling, at most 10 min (none without a failure)."""
    return 0.0 if failures <= 0 else min(POD_FAILURE_BACKOFF * 2 ** (failures - 1), MAX_POD_FAILURE_BACKOFF)


def index_of(pod: dict) -> int | None:
    raw = ((pod["metadata"].get("annotations") or {}).get(INDEX)) or ""
    return int(raw) if raw.isdigit() else None


def phase(pod: dict) -> str:
    """The pod's phase as a recent kubelet writes it: a deleted pod whose containers all ended is
    terminal (Failed unless every one exited 0, `getPhase`). The local cluster's 1.20 kubelet
    leaves such a pod "Running" while its finalizer keeps it."""
    st = pod.get("status") or {}
    said = st.get("phase") or "Pending"
    ctrs = st.get("containerStatuses") or []
    gone = pod["metadata"].get("deletionTimestamp")
    if said in ("Succeeded", "Failed") or not gone:
        return said
    ended = [(s.get("state") or {}).get("terminated") for s in ctrs]
    if not ctrs or not all(ended):  # past its grace (and a margin) a recent kubelet has ended it
        late = datetime.fromisoformat(gone.replace("Z", "+00:00")).timestamp() + GRACE_MARGIN < time.time()
        return "Failed" if late else said
    return "Succeeded" if all(int(e.get("exitCode", 1)) == 0 for e in ended if e) else "Failed"


def terminal(pod: dict) -> bool:
    return phase(pod) in ("Succeeded", "Failed")


def is_failed(pod: dict, spec: Spec) -> bool:
    """`isPodFailed`: a pod that failed, or (replacing terminating pods) one being deleted that did
    not succeed: what a deletion of a running pod counts as."""
    now = phase(pod)
    if now == "Failed":
        return True
    if spec.only_replace_failed:
        return False
    return bool(pod["metadata"].get("deletionTimestamp")) and now != "Succeeded"


def past_backoff_limit(spec: Spec, failed: int, live: list[dict]) -> bool:
    """`syncJob`'s `failed > backoffLimit`, or with restartPolicy OnFailure
    `pastBackoffLimitOnFailure`: the restarts of the live pods' containers reach the limit (any
    restart, for a limit of 0)."""
    if failed > spec.backoff_limit:
        return True
    if spec.restart_policy != "OnFailure":
        return False
    restarts = sum(
        int(s.get("restartCount") or 0)
        for pod in live
        for s in (pod.get("status") or {}).get("containerStatuses") or []
    )
    return restarts > 0 if spec.backoff_limit == 0 else restarts >= spec.backoff_limit


def active(pod: dict) -> bool:
    """`controller.FilterActivePods`: neither terminal nor being deleted."""
    return not terminal(pod) and not pod["metadata"].get("deletionTimestamp")


def _exit_codes(pod: dict, container: str | None) -> list[int]:
    codes = []
    for s in pod.get("status", {}).get("containerStatuses") or []:
        done = (s.get("state") or {}).get("terminated") or {}
        if "exitCode" in done and (container is None or s["name"] == container):
            codes.append(int(done["exitCode"]))
    return codes


def match_policy(pod: dict, rules: list[dict]) -> str | None:
    """`matchPodFailurePolicy`: the action of the first rule that matches the failed pod, if any."""
    conds = {c["type"]: c.get("status") for c in pod.get("status", {}).get("conditions") or []}
    for rule in rules:
        codes = rule.get("onExitCodes")
        if codes:
            values = {int(v) for v in codes.get("values") or []}
            inside = codes.get("operator") == "In"
            for code in _exit_codes(pod, codes.get("containerName")):
                if code != 0 and (code in values) == inside:
                    return str(rule["action"])
        for want in rule.get("onPodConditions") or []:
            if conds.get(want["type"]) == want.get("status", "True"):
                return str(rule["action"])
    return None


@dataclass
class Plan:
    """What one sync of a Job does: pods to make (indexes), to delete, finalizers to drop, its status."""

    make: list[int] = field(default_factory=list)
    delete: list[dict] = field(default_factory=list)
    counted: list[dict] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    failures: int = 0  # new failures counted this pass (the pod-failure backoff's)
    success: bool = False  # a pod succeeded this pass (it resets that backoff)


def condition(status: dict, ctype: str, reason: str, message: str) -> None:
    """Set condition `ctype` True (replacing one of that type), as the controllers write theirs."""
    status["conditions"] = [
        *(c for c in status.get("conditions") or [] if c["type"] != ctype),
        {"type": ctype, "status": "True", "reason": reason, "message": message, "lastTransitionTime": _now()},
    ]


def finished(status: dict) -> bool:
    return any(
        c["type"] in ("Complete", "Failed") and c["status"] == "True" for c in status.get("conditions") or []
    )


def plan(name: str, spec: Spec, status: dict, pods: list[dict]) -> Plan:
    """One pass of `syncJob` over a Job's pods (`pods`: those it owns)."""
    p = Plan(status=copy.deepcopy(status))
    st = p.status
    st.setdefault("startTime", _now())
    failed_job = ""
    for pod in pods:  # trackJobStatusAndRemoveFinalizers: count each finished pod once
        if FINALIZER not in (pod["metadata"].get("finalizers") or []):
            continue
        if phase(pod) == "Succeeded":
            st["succeeded"] = int(st.get("succeeded") or 0) + 1
            p.success = True
        elif is_failed(pod, spec):
            action = match_policy(pod, spec.rules)
            if action == "FailJob":
                failed_job = f"pod {pod['metadata']['name']} matched a FailJob rule of the podFailurePolicy"
            if action != "Ignore":
                st["failed"] = int(st.get("failed") or 0) + 1
                p.failures += 1
        else:
            continue
        p.counted.append(pod)
    if finished(st):
        return p
    live = [pod for pod in pods if active(pod)]
    terminating = [pod for pod in pods if pod["metadata"].get("deletionTimestamp") and not terminal(pod)]
    target = any(c["type"] == "FailureTarget" for c in st.get("conditions") or [])
    if not target and (failed_job or past_backoff_limit(spec, int(st.get("failed") or 0), live)):
        reason = "PodFailurePolicy" if failed_job else "BackoffLimitExceeded"
        condition(st, "FailureTarget", reason, failed_job or "Job has reached the specified backoff limit")
        target = True
    if target:  # delayTerminalCondition: Failed once no pod of it terminates any more
        p.delete = live
        st["active"] = 0
        if not terminating and not live:
            why = next(c for c in st["conditions"] if c["type"] == "FailureTarget")
            condition(st, "Failed", why["reason"], why["message"])
        return p
    done = {i for pod in pods if phase(pod) == "Succeeded" and (i := index_of(pod)) is not None}
    by_index: dict[int, list[dict]] = {}
    for pod in live:
        i = index_of(pod)
        by_index.setdefault(-1 if i is None else i, []).append(pod)
    for i, group in by_index.items():  # appendDuplicatedIndexPodsForRemoval
        if i in done or not 0 <= i < spec.completions:
            p.delete += group
        elif len(group) > 1:
            group.sort(
                key=lambda x: (
                    x.get("status", {}).get("phase") != "Running",
                    x["metadata"]["creationTimestamp"],
                )
            )
            p.delete += group[1:]
    holding = set(by_index)
    if spec.only_replace_failed:  # a terminating pod keeps its index until it is terminal
        holding |= {index_of(pod) for pod in terminating}
    room = spec.parallelism - sum(1 for i in by_index if 0 <= i < spec.completions and i not in done)
    p.make = [i for i in range(spec.completions) if i not in done and i not in holding][: max(room, 0)]
    st["active"] = len(live) - len(p.delete) + len(p.make)
    if len(done) == spec.completions:
        condition(st, "Complete", "CompletionsReached", f"Job {name} completed")
        st["completionTime"] = _now()
    return p


def own_spec(job: dict) -> dict | None:
    """A Job of no JobSet: its spec with the fields 1.20's API dropped, from the annotation SPEC
    (JSON) its test wrote them into; None (left alone) unless that says `completionMode: Indexed`."""
    try:
        dropped = json.loads((job["metadata"].get("annotations") or {}).get(SPEC) or "{}")
    except ValueError:
        return None
    return {**job["spec"], **dropped} if dropped.get("completionMode") == "Indexed" else None


def pod_for(job: dict, i: int) -> dict:
    """Index `i` of `job`, as the controller makes it (`podGenerateNameWithIndex`, hostname set)."""
    name, ns = job["metadata"]["name"], job["metadata"]["namespace"]
    template = copy.deepcopy(job["spec"]["template"])
    tmeta, spec = template.get("metadata") or {}, template["spec"]
    labels = {**(tmeta.get("labels") or {}), INDEX: str(i)}
    annotations = {**(tmeta.get("annotations") or {}), INDEX: str(i)}
    spec["hostname"] = f"{name}-{i}"
    index = {
        "name": "JOB_COMPLETION_INDEX",
        "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX}']"}},
    }
    for c in spec["containers"]:
        c["env"] = [*(c.get("env") or []), index]
    ref = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "name": name,
        "uid": job["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    meta = {
        "generateName": f"{name}-{i}-",
        "namespace": ns,
        "labels": labels,
        "annotations": annotations,
        "finalizers": [FINALIZER],
        "ownerReferences": [ref],
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


class Controller:
    """One `sync` runs every Job a JobSet owns and every Indexed Job of its own one pass (their
    full specs: `specs` from the JobSets' templates, `own_spec`; 1.20 drops the newer fields)."""

    KIND = "Job"

    def __init__(self, api_client: client.ApiClient, t: api.KubeTimeouts) -> None:
        self.core = api.bounded(client.CoreV1Api, api_client, t)
        self.batch = api.bounded(client.BatchV1Api, api_client, t)
        self.retry: dict[str, tuple[int, float]] = {}  # a Job's UID → (failed creations, next try)
        self.backoff: dict[str, tuple[int, float]] = {}  # → (failures since a success, the last's time)

    def sync(self, specs: dict[str, dict]) -> None:
        """`specs`: a Job's UID → its spec as the JobSet wrote it."""
        jobs = _json(self.batch.list_job_for_all_namespaces)["items"]
        pods = _json(self.core.list_pod_for_all_namespaces, label_selector="job-name")["items"]
        uids = {j["metadata"]["uid"] for j in jobs}
        for pod in pods:  # an orphan's finalizer goes (cleanupPodFinalizers): its Job is gone
            refs = pod["metadata"].get("ownerReferences") or []
            ours = [r for r in refs if r.get("kind") == "Job" and r.get("controller")]
            if ours and ours[0]["uid"] not in uids and FINALIZER in (pod["metadata"].get("finalizers") or []):
                self._drop_finalizer(pod)
        for job in jobs:
            spec = specs.get(job["metadata"]["uid"]) or own_spec(job)
            if spec is None or job["metadata"].get("deletionTimestamp"):
                continue
            try:
                self._job(job, Spec.of(spec), [p for p in pods if _owned(p, job)])
            except ApiException as exc:
                log.warning(
                    "Job %s/%s: HTTP %s", job["metadata"]["namespace"], job["metadata"]["name"], exc.status
                )

    def _job(self, job: dict, spec: Spec, pods: list[dict]) -> None:
        ns, name = job["metadata"]["namespace"], job["metadata"]["name"]
        p = plan(name, spec, job.get("status") or {}, pods)
        if p.status != (job.get("status") or {}):  # counted before the finalizers go
            self.batch.replace_namespaced_job_status(
                name, ns, {**job, "status": p.status}, _preload_content=False
            )
            if finished(p.status) and not finished(job.get("status") or {}):
                log.info("Job %s/%s: %s", ns, name, p.status["conditions"][-1]["message"])
        for pod in p.counted:
            self._drop_finalizer(pod)
        for pod in p.delete:
            try:
                self.core.delete_namespaced_pod(pod["metadata"]["name"], ns, _preload_content=False)
            except ApiException as exc:
                if exc.status != 404:
                    raise
        uid = job["metadata"]["uid"]
        failures, last = self.backoff.get(uid, (0, 0.0))
        if p.success:
            failures = 0
        if p.failures:
            failures, last = failures + p.failures, time.monotonic()
        self.backoff[uid] = (failures, last)
        tries, not_before = self.retry.get(uid, (0, 0.0))
        if not p.make or time.monotonic() < max(not_before, last + pod_failure_backoff(failures)):
            return
        try:
            for i in p.make:
                self.core.create_namespaced_pod(ns, pod_for(job, i), _preload_content=False)
                log.info("Job %s/%s: made a pod for index %d", ns, name, i)
        except ApiException:  # a refused creation: the sync's error requeued with the API backoff
            self.retry[uid] = (tries + 1, time.monotonic() + min(API_BACKOFF * 2**tries, MAX_API_BACKOFF))
            raise
        self.retry.pop(uid, None)

    def _drop_finalizer(self, pod: dict) -> None:
        """A JSON patch that removes just this finalizer (a strategic merge would keep it: the
        list's strategy is "merge"), tested in place: another writer's change waits a poll."""
        meta = pod["metadata"]
        at = (meta.get("finalizers") or []).index(FINALIZER)
        body = [
            {"op": "test", "path": f"/metadata/finalizers/{at}", "value": FINALIZER},
            {"op": "remove", "path": f"/metadata/finalizers/{at}"},
        ]
        try:
            self.core.patch_namespaced_pod(meta["name"], meta["namespace"], body, _preload_content=False)
        except ApiException as exc:
            if exc.status not in (404, 422):
                raise


__all__ = ["FINALIZER", "Controller", "Spec", "is_failed", "match_policy", "phase", "plan", "pod_for"]
