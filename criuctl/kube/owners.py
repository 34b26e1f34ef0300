"""Which controllers recreate a deleted pod with the same identity, and whether they want it back.

A StatefulSet recreates ordinal N while N < replicas; the training operator recreates a
PyTorchJob's replica (the local cluster's stand-in does the same): both under the same name. A
JobSet's pod (Kubeflow Trainer's TrainJob runs on one) belongs to an Indexed Job, which recreates
a completion index with a new random name but the same hostname and subdomain, so its DNS name,
what its peers use, is kept. For all of these a migrated pod keeps its identity by being recreated
*as the placeholder* (criuctl.kube.moves). A ReplicaSet's or a plain Job's pods get new names and
nothing else that stays: nothing could tell their successor from any other pod, so they do not move.

A pod's identity (`identity`) is its name, or for a JobSet's pod `HOSTNAME.SUBDOMAIN`: the name its
successor shares, which keys its move record, its preStop hook and the webhook's lookup.
"""

from __future__ import annotations

from dataclasses import dataclass

from criuctl.kube.cluster import Cluster, NotFound, call
from criuctl.kube.mutate import COMPLETION_INDEX, JOB_LABEL, JOBSET_LABEL, identity, indexed

__all__ = [
    "KINDS",
    "SAME_INDEX",
    "SAME_NAME",
    "Owner",
    "current",
    "identity",
    "indexed",
    "owner",
    "pods_of",
    "read_owner",
]

SAME_NAME = ("StatefulSet", "PyTorchJob")
# JobSet (jobset.x-k8s.io) owns Indexed Jobs that own the pods, and says whether it wants them back;
# an Indexed Job of its own says so itself.
JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
SAME_INDEX = ("Job", "JobSet")
REPLICA_TYPE = "training.kubeflow.org/replica-type"  # a PyTorchJob's pod: master, worker
KINDS = (*SAME_NAME, *SAME_INDEX)


@dataclass
class Owner:
    kind: str
    name: str
    replicas: int  # of the whole job (PyTorchJob, JobSet) or the set
    wants_back: bool  # it exists, is not being deleted, and still counts this pod among its own
    why: str = ""  # when not wants_back


def controller_ref(obj: dict) -> dict | None:
    return next((r for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")), None)


def pods_of(c: Cluster, namespace: str, ident: str, selector: str = "") -> list[dict]:
    """The pods of identity `ident` in `namespace`: none, the pod, or it and its successor. An
    Indexed Job pod's are looked for among those `selector` picks (`mutate.same_index`: one
    index's); without one, among those of the Job and completion index its hostname names
    (`<job>-<index>`, labels the Job controller writes), else, where that finds none (a cluster
    that writes no index label), among every pod of that Job."""
    if "." not in ident:  # a name: a pod's own (an Indexed Job pod's identity always has a subdomain)
        try:
            pod = call(f"pod {namespace}/{ident}", c.core.read_namespaced_pod, ident, namespace)
        except NotFound:
            return []
        return [c.serialize(pod)]
    if selector:
        return _of_identity(c, namespace, ident, selector)
    job, _, index = ident.split(".", 1)[0].rpartition("-")
    if job and index.isdigit():
        found = _of_identity(c, namespace, ident, f"{JOB_LABEL}={job},{COMPLETION_INDEX}={index}")
        if found:
            return found
        return _of_identity(c, namespace, ident, f"{JOB_LABEL}={job}")
    return _of_identity(c, namespace, ident, JOBSET_LABEL)


def _of_identity(c: Cluster, namespace: str, ident: str, selector: str) -> list[dict]:
    pods = call(f"pods of {ident}", c.core.list_namespaced_pod, namespace, label_selector=selector).items
    return [p for p in map(c.serialize, pods) if identity(p) == ident]


def current(c: Cluster, namespace: str, ident: str, not_uid: str = "", selector: str = "") -> dict | None:
    """The pod of identity `ident`: one whose UID is not `not_uid` (a successor) before the one
    whose UID it is, a live one before one being deleted (`selector`: as `pods_of`)."""
    found = pods_of(c, namespace, ident, selector)
    found.sort(key=lambda p: (p["metadata"]["uid"] == not_uid, bool(p["metadata"].get("deletionTimestamp"))))
    return found[0] if found else None


def _finished(obj: dict) -> bool:
    return any(
        c["type"] in ("Succeeded", "Completed", "Complete", "Failed") and c["status"] == "True"
        for c in (obj.get("status") or {}).get("conditions") or []
    )


def _failing(job: dict) -> bool:
    """A Job that failed, or is failing: a recent controller says FailureTarget first, then Failed
    once its pods are gone (`delayTerminalCondition`)."""
    return any(
        c["type"] in ("FailureTarget", "Failed") and c["status"] == "True"
        for c in (job.get("status") or {}).get("conditions") or []
    )


def read_owner(c: Cluster, ref: dict, ns: str) -> dict:
    """The owner `ref` names (a StatefulSet, a Job, a JobSet, a PyTorchJob), as JSON."""
    kind, name = ref["kind"], ref["name"]
    what = f"{kind} {name}"
    if kind == "StatefulSet":
        return c.serialize(call(what, c.apps.read_namespaced_stateful_set, name, ns))
    group, version, plural = {"Job": ("batch", "v1", "jobs"), "JobSet": JOBSET}.get(
        kind, ("kubeflow.org", "v1", "pytorchjobs")
    )
    return call(what, c.custom.get_namespaced_custom_object, group, version, ns, plural, name)


def owner(c: Cluster, pod: dict) -> Owner | None:
    """The pod's controller, if it is one that recreates with the same identity; None for a bare
    pod. An Indexed Job decides whether it wants its pod back, or for a JobSet's Job, its JobSet.

    Raises nothing for a controller of another kind: the caller refuses it with its kind named."""
    ref = controller_ref(pod)
    if ref is None or ref["kind"] not in KINDS:
        return None
    ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
    if ref["kind"] in SAME_INDEX and not indexed(pod):
        return None
    try:
        obj = read_owner(c, ref, ns)
        if ref["kind"] == "Job":  # an Indexed Job; a JobSet's: its JobSet is the one that decides
            if _failing(obj):  # its pods are being deleted: no successor will come
                return Owner("Job", ref["name"], 0, False, f"its Job {ref['name']} has failed")
            job_ref = controller_ref(obj)
            if job_ref is not None and job_ref["kind"] == "JobSet":
                ref, obj = job_ref, read_owner(c, job_ref, ns)
    except NotFound:
        return Owner(ref["kind"], ref["name"], 0, False, f"its {ref['kind']} is gone")
    if ref["kind"] == "StatefulSet":
        replicas = int(obj["spec"].get("replicas", 1))
        ordinal = int(name.rsplit("-", 1)[1]) if name.rsplit("-", 1)[-1].isdigit() else 0
        counted, why = ordinal < replicas, f"the StatefulSet now has {replicas} replica(s)"
    elif ref["kind"] == "Job":
        replicas = int(obj["spec"].get("parallelism", 1))
        counted, why = not _finished(obj), "the Job has finished"
    elif ref["kind"] == "JobSet":
        rjobs = (obj.get("spec") or {}).get("replicatedJobs") or []
        replicas = sum(
            int(r.get("replicas", 1))
            * int(((r.get("template") or {}).get("spec") or {}).get("parallelism", 1))
            for r in rjobs
        )
        ended = _finished(obj) or bool((obj.get("status") or {}).get("terminalState"))
        counted, why = not ended, "the JobSet has finished"
    else:
        specs = obj.get("spec", {}).get("pytorchReplicaSpecs", {})
        replicas = sum(int(s.get("replicas", 1)) for s in specs.values())
        counted, why = not _finished(obj), "the PyTorchJob has finished"
        rtype = (pod["metadata"].get("labels") or {}).get(REPLICA_TYPE, "")
        mine = next((s for t, s in specs.items() if t.lower() == rtype.lower()), {})
        if counted and mine.get("restartPolicy") == "Never":
            # the operator's UpdateJobStatus fails the whole job once a pod of a replica type that
            # never restarts is counted failed, and it counts a deleted pod so (a move deletes it)
            counted, why = (
                False,
                (
                    f"its PyTorchJob's {rtype or 'replica'} pods have restartPolicy Never, and the training "
                    "operator fails the whole job when one of them is deleted; use OnFailure or ExitCode"
                ),
            )
    if obj["metadata"].get("uid") != ref.get("uid"):
        return Owner(ref["kind"], ref["name"], 0, False, f"its {ref['kind']} was replaced")
    if obj["metadata"].get("deletionTimestamp"):
        return Owner(ref["kind"], ref["name"], replicas, False, f"its {ref['kind']} is being deleted")
    return Owner(ref["kind"], ref["name"], replicas, counted, "" if counted else why)
