"""What a move costs a Job's failure count, and the one thing criuctl does to keep it at nothing.

A move of a Job's pod ends that pod, and a recent Job controller (`pkg/controller/job`, Kubernetes ≥
1.29) counts a pod deleted before it succeeded as failed (`isPodFailed`) against the Job's
`backoffLimit` (default 6); past it the Job fails, and a JobSet with no failure policy fails with
it: every rank ends (a TrainJob's too). Only a `podFailurePolicy` rule can leave a pod uncounted:
`action: Ignore` on the pod condition `DisruptionTarget` (what the eviction API, the taint manager
and preemption set on a pod they end). A Job may carry such a rule only with restartPolicy Never.

So for a Job's pod criuctl:
- marks the pod `DisruptionTarget` (reason `CriuctlMigration`) in its preStop, before the dump
  (`mark_moving`): a `criuctl migrate` deletes it without the eviction API, which would set it;
  the Job then ignores the pod where the user's rule says so, and nowhere else;
- refuses a move, in one line and before anything is frozen, that would fail the Job (`refusal`):
  a rule that fails the Job or the index on such a pod, a per-index limit, or one more failure
  than `backoffLimit` allows.

The Job's spec comes from the Job, or for the fields an older API server drops (`podFailurePolicy`,
`backoffLimitPerIndex`) from the JobSet's replicated-Job template it was made from, which JobSet
copies verbatim. Not counted: moves of other pods of the Job under way at the same instant.
"""

from __future__ import annotations

from typing import Any

from criuctl.core.errors import CriuctlError
from criuctl.kube import events, owners
from criuctl.kube.cluster import Cluster, NotFound, call

CONDITION = "DisruptionTarget"
REASON = "CriuctlMigration"
MOVED_EXIT = 137  # the moved container's exit code: the dump ends its tree with SIGKILL


def action_on_move(spec: dict) -> str | None:
    """What the Job's `podFailurePolicy` does with a pod a move ended, as `matchPodFailurePolicy`
    takes its rules in order: the pod failed, marked `DisruptionTarget`, its containers killed
    (exit code 137, SIGKILL: how the dump ends the tree). None: no rule matches (counted)."""
    for rule in (spec.get("podFailurePolicy") or {}).get("rules") or []:
        codes = rule.get("onExitCodes")
        if codes and (MOVED_EXIT in {int(v) for v in codes.get("values") or []}) == (
            codes.get("operator") == "In"
        ):
            return str(rule.get("action"))
        conds = rule.get("onPodConditions") or []
        if any(c.get("type") == CONDITION and c.get("status", "True") == "True" for c in conds):
            return str(rule.get("action"))
    return None


def job_of(c: Cluster, pod: dict) -> dict | None:
    """The pod's Job (with the spec fields its JobSet's template has and the Job lost), or None."""
    ref = owners.controller_ref(pod)
    if ref is None or ref.get("kind") != "Job":
        return None
    ns = pod["metadata"]["namespace"]
    try:
        job = owners.read_owner(c, ref, ns)
    except NotFound:
        return None
    labels = job["metadata"].get("labels") or {}
    jobset, rjob = (
        labels.get("jobset.sigs.k8s.io/jobset-name"),
        labels.get("jobset.sigs.k8s.io/replicatedjob-name"),
    )
    if jobset and rjob and not {"podFailurePolicy", "backoffLimitPerIndex"} <= job["spec"].keys():
        try:
            js = owners.read_owner(c, {"kind": "JobSet", "name": jobset}, ns)
        except NotFound:
            return job
        for r in (js.get("spec") or {}).get("replicatedJobs") or []:
            if r.get("name") == rjob:
                template: dict[str, Any] = ((r.get("template") or {}).get("spec")) or {}
                for key in ("podFailurePolicy", "backoffLimitPerIndex"):
                    if key in template and key not in job["spec"]:
                        job["spec"][key] = template[key]
    return job


def refusal(job: dict) -> str | None:
    """Why moving a pod of `job` would fail it (None: it would not): its failure policy fails the
    Job (or the index) on such a pod, or the move counts as a failure and the Job has none left to
    spend (those counted, and those the controller has seen but not yet counted)."""
    spec, status = job.get("spec") or {}, job.get("status") or {}
    name = job["metadata"]["name"]
    action = action_on_move(spec)
    if action == "Ignore":
        return None
    if action in ("FailJob", "FailIndex"):
        return (
            f"its Job {name}'s podFailurePolicy says {action} for a pod a move ends "
            f"({CONDITION}, exit {MOVED_EXIT})"
        )
    if spec.get("backoffLimitPerIndex") is not None:
        per_index = spec["backoffLimitPerIndex"]
        return f"moving it counts as a failure of its index in Job {name} (backoffLimitPerIndex {per_index})"
    limit = int(spec.get("backoffLimit", 6))
    failed = int(status.get("failed") or 0) + len(
        (status.get("uncountedTerminatedPods") or {}).get("failed") or []
    )
    if failed + 1 <= limit:
        return None
    return (
        f"moving it counts as a failure of Job {name} (backoffLimit {limit}, {failed} failed so far): "
        "the Job, and a JobSet of it, would fail and end every rank"
    )


HINT = (
    "nothing was changed; give the Job a podFailurePolicy rule "
    "{action: Ignore, onPodConditions: [{type: DisruptionTarget}]} (restartPolicy Never), "
    "or a higher backoffLimit"
)


def mark_moving(c: Cluster, pod: dict) -> bool:
    """Set the pod's `DisruptionTarget` condition (once): its Job's Ignore rule then leaves the
    ended pod uncounted. False where the API server refused (the move goes on: counted, as before)."""
    conds = pod.get("status", {}).get("conditions") or []
    if any(x.get("type") == CONDITION and x.get("status") == "True" for x in conds):
        return True
    mine = {
        "type": CONDITION,
        "status": "True",
        "reason": REASON,
        "message": "criuctl: its job is moving to another node",
        "lastTransitionTime": events.now(),
    }
    body = {"status": {"conditions": [mine]}}  # a strategic merge: conditions merge by type
    meta = pod["metadata"]
    try:
        call(f"pod {meta['name']}", c.core.patch_namespaced_pod_status, meta["name"], meta["namespace"], body)
    except CriuctlError:  # a courtesy to the Job's accounting, never a reason to stop the move
        return False
    return True
