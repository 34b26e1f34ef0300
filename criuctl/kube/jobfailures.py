"""What a move costs a Job's failure count, and what criuctl does to keep it at nothing.

A move of a Job's pod ends that pod, and a recent Job controller (`pkg/controller/job`, Kubernetes ≥
1.29) counts a pod deleted before it succeeded as failed (`isPodFailed`) against the Job's
`backoffLimit` (default 6), and waits 10 s, doubling, before it makes the next pod (the pod-failure
backoff); past the limit the Job fails, and a JobSet with no failure policy fails with it: every
rank ends (a TrainJob's too). The controller judges a pod only while it carries the Job's tracking
finalizer `batch.kubernetes.io/job-tracking` (`trackJobStatusAndRemoveFinalizers` skips a pod
without it; `getPodsForJob` adds it only to a pod it adopts, never to one it already owns), and it
looks at a pod's deletion one batch period (`syncJobBatchPeriod`, 1 s) after it saw it, at most.

So for a Job's pod criuctl:
- takes the tracking finalizer off the pod just before the pod is deleted for a move (`untrack`):
  `criuctl migrate` and a PodMigration before their delete, the webhook when it admits an eviction
  (a drain), the preStop as its first act for any other deletion (there the controller may have
  counted it already: a race it loses by at most the batch period). The Job then counts nothing
  and waits for nothing: its replacement, the move's successor, is made at once. The pod carries
  the label `criuctl.io/untracked` (when) meanwhile;
- puts the finalizer back on a pod untracked for a deletion that did not come (an eviction a
  disruption budget refused, a `criuctl migrate` killed between the two calls: `retrack_stale`,
  from each node's agent loop), so a pod that then succeeds or fails is counted as ever;
- marks the pod `DisruptionTarget` (reason `CriuctlMigration`) in its preStop (`mark_moving`):
  where the finalizer could not be taken, a Job's `podFailurePolicy` rule `action: Ignore` on
  that condition still leaves the pod uncounted;
- refuses, in one line and before anything is frozen, a `criuctl migrate` whose pod it could not
  untrack and whose count would fail the Job (`refusal`): a rule that fails the Job or the index
  on such a pod, a per-index limit, or one more failure than `backoffLimit` allows.

The Job's spec comes from the Job, or for the fields an older API server drops (`podFailurePolicy`,
`backoffLimitPerIndex`) from the JobSet's replicated-Job template it was made from, which JobSet
copies verbatim. Not counted: moves of other pods of the Job under way at the same instant.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from criuctl.core.errors import CriuctlError
from criuctl.kube import events, owners
from criuctl.kube.cluster import Cluster, NotFound, call

log = logging.getLogger("criuctl.kube")

TRACKING = "batch.kubernetes.io/job-tracking"  # the Job controller's finalizer (batch.JobTrackingFinalizer)
UNTRACKED = "criuctl.io/untracked"  # label: when criuctl took TRACKING off the pod (epoch seconds)
STALE = 30.0  # s an untracked pod may wait for its deletion before the finalizer goes back
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


def _label_path(key: str) -> str:
    return "/metadata/labels/" + key.replace("~", "~0").replace("/", "~1")


def untrack(c: Cluster, pod: dict) -> bool:
    """Take the Job's tracking finalizer off a Job's pod about to be deleted for a move (module
    docstring). True where the Job will not judge the pod (nothing to take, or taken); False where
    the API server refused, or the controller judged it first (its count then goes as the Job's
    spec says). A pod already being deleted (the preStop's call) is untracked too: the controller
    may not have looked yet."""
    meta = pod["metadata"]
    if (owners.controller_ref(pod) or {}).get("kind") != "Job":
        return True
    finalizers = meta.get("finalizers") or []
    if TRACKING not in finalizers:
        return True
    at = finalizers.index(TRACKING)
    body: list[dict[str, Any]] = [
        {"op": "test", "path": f"/metadata/finalizers/{at}", "value": TRACKING},
        {"op": "remove", "path": f"/metadata/finalizers/{at}"},
    ]
    if not meta.get("labels"):
        body.append({"op": "add", "path": "/metadata/labels", "value": {}})
    body.append({"op": "add", "path": _label_path(UNTRACKED), "value": str(int(time.time()))})
    try:
        call(f"pod {meta['name']}", c.core.patch_namespaced_pod, meta["name"], meta["namespace"], body)
    except CriuctlError as exc:
        log.warning(
            "tracking finalizer kept", extra={"pod": f"{meta['namespace']}/{meta['name']}", "why": exc.line()}
        )
        return False
    return True


def retrack(c: Cluster, pod: dict) -> None:
    """Put the tracking finalizer back on a pod `untrack` took it from and that was not deleted
    (tested against the label it left: a newer `untrack` of the same pod wins)."""
    meta = pod["metadata"]
    when = (meta.get("labels") or {}).get(UNTRACKED)
    body: list[dict[str, Any]] = []
    if when is not None:
        body += [
            {"op": "test", "path": _label_path(UNTRACKED), "value": when},
            {"op": "remove", "path": _label_path(UNTRACKED)},
        ]
    if TRACKING not in (meta.get("finalizers") or []):
        if meta.get("finalizers"):
            body.append({"op": "add", "path": "/metadata/finalizers/-", "value": TRACKING})
        else:
            body.append({"op": "add", "path": "/metadata/finalizers", "value": [TRACKING]})
    if body:
        call(f"pod {meta['name']}", c.core.patch_namespaced_pod, meta["name"], meta["namespace"], body)


def stale(pod: dict, now: float) -> bool:
    """An untracked pod whose deletion did not come within STALE: one to `retrack`."""
    meta = pod["metadata"]
    when = (meta.get("labels") or {}).get(UNTRACKED)
    if when is None or meta.get("deletionTimestamp"):
        return False
    try:
        return now - float(when) > STALE
    except ValueError:  # not criuctl's writing: not criuctl's to judge
        return False


def retrack_stale(c: Cluster, node: str) -> int:
    """`retrack` every pod of `node` untracked for a deletion that did not come: one list by label
    and node per call (the agents' loop calls it every few ticks). How many it put back."""
    found = call(
        "the untracked pods",
        c.core.list_pod_for_all_namespaces,
        label_selector=UNTRACKED,
        field_selector=f"spec.nodeName={node}",
    )
    done = 0
    for item in found.items:
        pod = c.serialize(item)
        if stale(pod, time.time()):
            retrack(c, pod)
            done += 1
            log.info(
                "tracking finalizer put back",
                extra={"pod": f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"},
            )
    return done
