"""A STAND-IN for Kubeflow Trainer's TrainJob and the JobSet controller, for the local cluster only.

Kubeflow Trainer (trainer.kubeflow.org/v1alpha1, the maintained successor of the PyTorchJob) runs
a TrainJob as a JobSet, whose replicated Job "node" is an Indexed Job: one pod per node of the
job. The real controllers cannot run here: JobSet needs Indexed Jobs, which Kubernetes 1.20 lacks.
criuctl must meet a TrainJob's pods as they are made there, because they are unlike a PyTorchJob's:
a pod's name ends in a random suffix that a recreated pod does not share, while its completion
index, hostname and subdomain (so its DNS name, which its peers use) stay. This module makes them
that way:

- the CRDs `trainjobs.trainer.kubeflow.org` (v1alpha1) and `jobsets.jobset.x-k8s.io` (v1alpha2),
  namespaced, schemas preserving unknown fields, status subresources;
- a TrainJob → a JobSet of its name that it owns, as Trainer's built-in `torch-distributed`
  runtime makes it: one replicated Job `node` (1 replica, parallelism = completions =
  `spec.trainer.numNodes`, Indexed), its container `node` from `spec.trainer` (image, command,
  args, env, resourcesPerNode), Trainer's torch env (PET_NNODES, PET_NPROC_PER_NODE from
  `numProcPerNode` (default 1), PET_NODE_RANK = the completion index, PET_MASTER_ADDR =
  `<job>-node-0-0.<job>`, PET_MASTER_PORT 29400), and `spec.podTemplateOverrides` for target job
  `node` (metadata labels and annotations; spec fields set, a container's env and volumeMounts
  added to the runtime's container of its name);
- a JobSet → per completion index i the pod `<jobset>-node-0-<i>-<5 random>` (generateName, as
  the Job controller names it), hostname `<jobset>-node-0-<i>`, subdomain `<jobset>`, the labels
  and annotations JobSet and the Job controller put on it (`jobset.sigs.k8s.io/*`,
  `batch.kubernetes.io/job-completion-index`, `job-name`), JOB_COMPLETION_INDEX in its env, and
  the headless Service `<jobset>` (publishNotReadyAddresses) that gives the hostnames their DNS
  records; a pod that is gone is made again with the same index, hostname and subdomain and a new
  name (the Job controller's podReplacementPolicy `Failed`: not while the old one terminates);
- status: the JobSet `Completed` once every index succeeded, `Failed` once a pod failed (backoffLimit
  0, JobSet's default failure policy); the TrainJob mirrors it (`Complete` / `Failed`).

What it does NOT do: the Jobs between the JobSet and its pods (here the JobSet owns its pods: criuctl
walks Pod → Job → JobSet on a real cluster, Pod → JobSet here), runtimes other than a built-in
torch one (no ClusterTrainingRuntime objects), initializers, MPI, JobSet's restarts
(failurePolicy.maxRestarts), success policies, suspend, startup order, Events, webhooks.
"""

from __future__ import annotations

import copy
import secrets
import string
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from criuctl.kube import api
from localcluster.pytorchjob import _json, _key, _now, _owned, _short, crd, create, log

TRAINER = ("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob")
JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet")
JS = "jobset.sigs.k8s.io/"
INDEX = "batch.kubernetes.io/job-completion-index"
RJOB, CONTAINER, MASTER_PORT = "node", "node", 29400


CRDS = (crd(*TRAINER), crd(*JOBSET))


def _owner(obj: dict, kind: tuple[str, ...]) -> dict:
    m = obj["metadata"]
    return {
        "apiVersion": f"{kind[0]}/{kind[1]}",
        "kind": kind[3],
        "name": m["name"],
        "uid": m["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def master_addr(job: str) -> str:
    """Trainer's PET_MASTER_ADDR: index 0's DNS name, `<job>-node-0-0.<job>`."""
    return f"{job}-{RJOB}-0-0.{job}"


def jobset_for(tj: dict) -> dict:
    """The JobSet Trainer makes of a TrainJob with the torch-distributed runtime."""
    name, trainer = tj["metadata"]["name"], (tj.get("spec") or {}).get("trainer") or {}
    nodes = int(trainer.get("numNodes", 1))
    ctr: dict[str, Any] = {"name": CONTAINER, "image": trainer.get("image", "")}
    for key in ("command", "args"):
        if trainer.get(key):
            ctr[key] = list(trainer[key])
    if trainer.get("resourcesPerNode"):
        ctr["resources"] = copy.deepcopy(trainer["resourcesPerNode"])
    index = {"valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX}']"}}}
    ctr["env"] = [
        *copy.deepcopy(trainer.get("env") or []),
        {"name": "PET_NNODES", "value": str(nodes)},
        {"name": "PET_NPROC_PER_NODE", "value": str(trainer.get("numProcPerNode", 1))},
        {"name": "PET_NODE_RANK", **index},
        {"name": "PET_MASTER_ADDR", "value": master_addr(name)},
        {"name": "PET_MASTER_PORT", "value": str(MASTER_PORT)},
    ]
    ctr["ports"] = [{"containerPort": MASTER_PORT}]
    meta: dict[str, Any] = {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}}
    pod_spec: dict[str, Any] = {"containers": [ctr], "restartPolicy": "OnFailure"}
    for o in (tj.get("spec") or {}).get("podTemplateOverrides") or []:
        if not any(t.get("name") == RJOB for t in o.get("targetJobs") or []):
            continue
        om = o.get("metadata") or {}
        for key in ("labels", "annotations"):
            meta[key] = {**meta.get(key, {}), **(om.get(key) or {})}
        over = copy.deepcopy(o.get("spec") or {})
        for c in over.pop("containers", []):  # merged into the runtime's container of that name
            mine = next((x for x in pod_spec["containers"] if x["name"] == c["name"]), None)
            if mine is None:
                continue
            for key in ("env", "volumeMounts"):
                mine[key] = [*(mine.get(key) or []), *(c.get(key) or [])]
        pod_spec.update(over)
    job = {
        "parallelism": nodes,
        "completions": nodes,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "template": {"metadata": meta, "spec": pod_spec},
    }
    return {
        "apiVersion": f"{JOBSET[0]}/{JOBSET[1]}",
        "kind": JOBSET[3],
        "metadata": {
            "name": name,
            "namespace": tj["metadata"]["namespace"],
            "ownerReferences": [_owner(tj, TRAINER)],
        },
        "spec": {
            "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
            "replicatedJobs": [{"name": RJOB, "replicas": 1, "template": {"spec": job}}],
        },
    }


def pod_for(js: dict, rjob: dict, j: int, i: int) -> dict:
    """Completion index `i` of Job `j` of replicated Job `rjob`: what the Job controller makes of
    the JobSet's template (a new random name each time; the same hostname and subdomain)."""
    name, ns = js["metadata"]["name"], js["metadata"]["namespace"]
    job_name = f"{name}-{rjob['name']}-{j}"
    template = copy.deepcopy(rjob["template"]["spec"]["template"])
    tmeta, spec = template.get("metadata") or {}, template["spec"]
    marks = {
        JS + "jobset-name": name,
        JS + "replicatedjob-name": rjob["name"],
        JS + "replicatedjob-replicas": str(rjob.get("replicas", 1)),
        JS + "job-index": str(j),
        JS + "job-global-index": str(j),
        JS + "restart-attempt": "0",
    }
    labels = {**(tmeta.get("labels") or {}), **marks, INDEX: str(i), "job-name": job_name}
    labels["batch.kubernetes.io/job-name"] = job_name
    annotations = {**(tmeta.get("annotations") or {}), **marks, INDEX: str(i)}
    subdomain = ((js.get("spec") or {}).get("network") or {}).get("subdomain") or name
    spec["hostname"], spec["subdomain"] = f"{job_name}-{i}", subdomain
    spec["restartPolicy"] = spec.get("restartPolicy", "OnFailure")
    index = {
        "name": "JOB_COMPLETION_INDEX",
        "valueFrom": {"fieldRef": {"fieldPath": f"metadata.annotations['{INDEX}']"}},
    }
    for c in spec["containers"]:
        c["env"] = [*(c.get("env") or []), index]
    suffix = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(5))
    meta = {
        "name": f"{job_name}-{i}-{suffix}",
        "namespace": ns,
        "labels": labels,
        "annotations": annotations,
        "ownerReferences": [_owner(js, JOBSET)],
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def service_for(js: dict) -> dict:
    """JobSet's headless Service: the pods' hostnames resolve under it, ready or not."""
    name = js["metadata"]["name"]
    subdomain = ((js.get("spec") or {}).get("network") or {}).get("subdomain") or name
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": subdomain,
            "namespace": js["metadata"]["namespace"],
            "ownerReferences": [_owner(js, JOBSET)],
        },
        "spec": {
            "clusterIP": "None",
            "selector": {JS + "jobset-name": name},
            "publishNotReadyAddresses": True,
        },
    }


def _condition(status: dict, ctype: str, message: str) -> None:
    conds = [c for c in status.get("conditions") or [] if c["type"] != ctype]
    reason = ctype + "Job" if ctype != "Created" else "Created"
    conds.append(
        {"type": ctype, "status": "True", "reason": reason, "message": message, "lastTransitionTime": _now()}
    )
    status["conditions"] = conds


def _ended(status: dict) -> bool:
    return any(
        c["type"] in ("Completed", "Complete", "Failed") and c["status"] == "True"
        for c in status.get("conditions") or []
    )


class Controller:
    """One `sync` brings every TrainJob's JobSet, and every JobSet's pods, Service and status, to
    what they should be."""

    KIND = "TrainJob"

    def __init__(self, api_client: client.ApiClient, t: api.KubeTimeouts) -> None:
        self.core = api.bounded(client.CoreV1Api, api_client, t)
        self.custom = api.bounded(client.CustomObjectsApi, api_client, t)

    def _list(self, kind: tuple[str, ...]) -> list[dict]:
        return _json(self.custom.list_cluster_custom_object, kind[0], kind[1], kind[2])["items"]

    def sync(self) -> None:
        jobsets = {_key(o): o for o in self._list(JOBSET)}
        for tj in self._list(TRAINER):
            if not tj["metadata"].get("deletionTimestamp"):
                self._guard(self._trainjob, tj, jobsets.get(_key(tj)))
        pods = _json(self.core.list_pod_for_all_namespaces, label_selector=JS + "jobset-name")["items"]
        svcs = {_key(o) for o in _json(self.core.list_service_for_all_namespaces)["items"]}
        for js in jobsets.values():
            if not js["metadata"].get("deletionTimestamp"):
                mine = [p for p in pods if _owned(p, js)]
                self._guard(self._jobset, js, mine, svcs)

    def _guard(self, fn, obj: dict, *args: Any) -> None:
        try:
            fn(obj, *args)
        except (ApiException, OSError) as exc:
            log.warning("%s %s/%s: %s", obj["kind"], *_key(obj), _short(exc))

    def _trainjob(self, tj: dict, js: dict | None) -> None:
        ns, name = _key(tj)
        if js is None:
            self._create_custom(JOBSET, ns, jobset_for(tj))
        status = copy.deepcopy(tj.get("status") or {})
        if not status.get("conditions"):
            _condition(status, "Created", f"TrainJob {name} is created.")
        for c in ((js or {}).get("status") or {}).get("conditions") or []:
            if c["type"] in ("Completed", "Failed") and c["status"] == "True" and not _ended(status):
                _condition(status, "Complete" if c["type"] == "Completed" else "Failed", c["message"])
        self._status(TRAINER, tj, status)

    def _jobset(self, js: dict, pods: list[dict], svcs: set[tuple[str, str]]) -> None:
        ns, name = _key(js)
        status = copy.deepcopy(js.get("status") or {})
        if _ended(status):
            return
        svc = service_for(js)
        if (ns, svc["metadata"]["name"]) not in svcs:
            create(self.core.create_namespaced_service, ns, svc)
        succeeded = total = 0
        for rjob in js["spec"]["replicatedJobs"]:
            job = rjob["template"]["spec"]
            for j in range(int(rjob.get("replicas", 1))):
                for i in range(int(job.get("completions", 1))):
                    total += 1
                    have = [
                        p
                        for p in pods
                        if p["metadata"]["labels"].get(JS + "replicatedjob-name") == rjob["name"]
                        and p["metadata"]["labels"].get(JS + "job-index") == str(j)
                        and p["metadata"]["labels"].get(INDEX) == str(i)
                    ]
                    phases = {p["status"].get("phase") for p in have}
                    if "Failed" in phases:
                        _condition(status, "Failed", f"JobSet {name}: a pod of index {i} failed")
                        return self._status(JOBSET, js, status)
                    if "Succeeded" in phases:
                        succeeded += 1
                    elif not have:  # gone: made again, same index and hostname, a new name
                        create(self.core.create_namespaced_pod, ns, pod_for(js, rjob, j, i))
        if succeeded == total:
            _condition(status, "Completed", f"JobSet {name} completed")
        self._status(JOBSET, js, status)
        return None

    def _status(self, kind: tuple[str, ...], obj: dict, status: dict) -> None:
        if status != (obj.get("status") or {}):
            ns, name = _key(obj)
            body = {**obj, "status": status}
            self.custom.replace_namespaced_custom_object_status(kind[0], kind[1], ns, kind[2], name, body)
            log.info("%s %s/%s: %s", kind[3], ns, name, status["conditions"][-1]["message"])

    def _create_custom(self, kind: tuple[str, ...], ns: str, obj: dict) -> None:
        def fn(n: str, o: dict, **kw: Any) -> Any:
            return self.custom.create_namespaced_custom_object(kind[0], kind[1], n, kind[2], o, **kw)

        create(fn, ns, obj)
