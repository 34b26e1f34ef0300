"""A STAND-IN for Kubeflow Trainer's TrainJob and the JobSet controller, for the local cluster only.

Kubeflow Trainer (trainer.kubeflow.org/v1alpha1, the maintained successor of the PyTorchJob) runs
a TrainJob as a JobSet, whose replicated Job "node" is an Indexed Job: one pod per node of the
job. The real controllers cannot run here (no registry to pull them from; JobSet needs Indexed Jobs,
which Kubernetes 1.20 lacks). criuctl must meet a TrainJob's pods as they are made there, and as
harshly: this module makes the TrainJob's JobSet and the JobSet's Jobs, and
localcluster.indexedjob plays the Job controller of a recent Kubernetes for those Jobs (the
replacement made while the old pod terminates, a deleted pod counted as a failure, the
`backoffLimit`, the `podFailurePolicy`). Modelled on:

- Trainer's built-in `torch-distributed` runtime (`manifests/base/runtimes/torch_distributed.yaml`)
  and its torch plugin (`pkg/runtime/framework/plugins/torch/torch.go`, `EnforceMLPolicy`): a TrainJob
  → a JobSet of its name that it owns, one replicated Job `node` (1 replica, parallelism =
  completions = `spec.trainer.numNodes`), its container `node` from `spec.trainer` (image, command,
  args, env, resourcesPerNode), no restartPolicy and no backoffLimit of its own (JobSet's default
  OnFailure, the Job's default 6), Trainer's env: PET_NNODES, PET_NPROC_PER_NODE (`numProcPerNode`,
  default "auto": the CPUs asked for on a node without GPUs, `nproc_per_node`), PET_NODE_RANK = the
  completion index, PET_MASTER_ADDR = `<job>-node-0-0.<job>`, PET_MASTER_PORT 29500; and
  `spec.podTemplateOverrides` for target job `node` (metadata labels and annotations; spec fields
  set, a container's env and volumeMounts added to the runtime's container of its name);
- JobSet (`pkg/controllers/jobset_controller.go`, `failure_policy.go`): per replicated Job and index
  j a real batch/v1 Job `<jobset>-<rjob>-<j>` that the JobSet owns (`constructJob`; the webhook's
  defaults completionMode Indexed, restartPolicy OnFailure; JobSet's labels and annotations on the
  Job and its pods, the pods' subdomain the JobSet's), and the headless Service `<jobset>`
  (publishNotReadyAddresses) that gives the hostnames their DNS records; a failed Job fails the
  JobSet (no `failurePolicy`: reason FailedJobs), or with a `failurePolicy` restarts every Job
  (`status.restarts` + 1; the Jobs of an earlier attempt deleted and made again) until
  `maxRestarts`; a JobSet that ended deletes its active Jobs (foreground: their pods first);
  `Completed` once every Job is Complete; the TrainJob mirrors it (`Complete` / `Failed`).

What it does NOT do: runtimes other than the built-in torch one (no ClusterTrainingRuntime objects),
initializers, MPI, torchtune, JobSet's failure-policy rules (their default action only), success
policies, startup order, `RestartJob` actions, suspend, Events, webhooks.
"""

from __future__ import annotations

import copy
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from criuctl.kube import api
from localcluster import indexedjob
from localcluster.pytorchjob import _json, _key, _owned, _short, crd, create, log

TRAINER = ("trainer.kubeflow.org", "v1alpha1", "trainjobs", "TrainJob")
JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets", "JobSet")
JS = "jobset.sigs.k8s.io/"
INDEX = indexedjob.INDEX
RJOB, CONTAINER, MASTER_PORT = "node", "node", 29500


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


def nproc_per_node(trainer: dict) -> str:
    """Trainer's torch plugin (`EnforceMLPolicy`): `numProcPerNode` as given, else "auto": on a node
    without GPUs, the CPUs asked for (at least 1); with GPUs, "auto", which torchrun resolves to
    their count."""
    given = trainer.get("numProcPerNode")
    if given not in (None, "auto"):
        return str(given)
    res = trainer.get("resourcesPerNode") or {}
    asked = {**(res.get("limits") or {}), **(res.get("requests") or {})}
    if any(k.endswith("/gpu") for k in asked):
        return "auto"
    cpu = str(asked.get("cpu") or "1")
    cores = int(cpu[:-1]) // 1000 if cpu.endswith("m") else int(float(cpu))
    return str(max(1, cores))


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
        {"name": "PET_NPROC_PER_NODE", "value": nproc_per_node(trainer)},
        {"name": "PET_NODE_RANK", **index},
        {"name": "PET_MASTER_ADDR", "value": master_addr(name)},
        {"name": "PET_MASTER_PORT", "value": str(MASTER_PORT)},
    ]
    ctr["ports"] = [{"containerPort": MASTER_PORT}]
    meta: dict[str, Any] = {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}}
    pod_spec: dict[str, Any] = {"containers": [ctr]}  # no restartPolicy: JobSet's default
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


def job_for(js: dict, rjob: dict, j: int, attempt: int) -> dict:
    """Job `j` of replicated Job `rjob`, as JobSet's `constructJob` makes it: named
    `<jobset>-<rjob>-<j>`, the template's spec verbatim, JobSet's labels and annotations on the Job
    and its pods, the pods' subdomain the JobSet's. A real batch/v1 Job: the fields 1.20's API
    drops are read back from `rjob` by the Job stand-in (localcluster.indexedjob)."""
    name, ns = js["metadata"]["name"], js["metadata"]["namespace"]
    spec = copy.deepcopy(rjob["template"]["spec"])
    spec.setdefault("completionMode", "Indexed")  # JobSet's webhook defaults
    spec["template"].setdefault("spec", {}).setdefault("restartPolicy", "OnFailure")
    marks = {
        JS + "jobset-name": name,
        JS + "jobset-uid": js["metadata"]["uid"],
        JS + "replicatedjob-name": rjob["name"],
        JS + "replicatedjob-replicas": str(rjob.get("replicas", 1)),
        JS + "job-index": str(j),
        JS + "job-global-index": str(j),
        JS + "restart-attempt": str(attempt),
    }
    template = spec["template"]
    tmeta = template.setdefault("metadata", {})
    for key in ("labels", "annotations"):
        tmeta[key] = {**(tmeta.get(key) or {}), **marks}
    subdomain = ((js.get("spec") or {}).get("network") or {}).get("subdomain") or name
    template["spec"]["subdomain"] = subdomain
    meta = {
        "name": f"{name}-{rjob['name']}-{j}",
        "namespace": ns,
        "labels": dict(marks),
        "annotations": dict(marks),
        "ownerReferences": [_owner(js, JOBSET)],
    }
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": spec}


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
    indexedjob.condition(status, ctype, ctype + "Job" if ctype != "Created" else "Created", message)


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
        self.batch = api.bounded(client.BatchV1Api, api_client, t)
        self.jobs = indexedjob.Controller(api_client, t)

    def _list(self, kind: tuple[str, ...]) -> list[dict]:
        return _json(self.custom.list_cluster_custom_object, kind[0], kind[1], kind[2])["items"]

    def sync(self) -> None:
        jobsets = {_key(o): o for o in self._list(JOBSET)}
        for tj in self._list(TRAINER):
            if not tj["metadata"].get("deletionTimestamp"):
                self._guard(self._trainjob, tj, jobsets.get(_key(tj)))
        jobs = _json(self.batch.list_job_for_all_namespaces, label_selector=JS + "jobset-name")["items"]
        svcs = {_key(o) for o in _json(self.core.list_service_for_all_namespaces)["items"]}
        specs: dict[str, dict] = {}
        for js in jobsets.values():
            mine = [j for j in jobs if _owned(j, js)]
            rjobs = {r["name"]: r for r in js["spec"]["replicatedJobs"]}
            for j in mine:  # the Job's spec as the JobSet wrote it (1.20 dropped its newer fields)
                rjob = rjobs.get(j["metadata"]["labels"].get(JS + "replicatedjob-name", ""))
                if rjob is not None:  # its template as the API server keeps it (labels, defaults)
                    specs[j["metadata"]["uid"]] = {
                        **rjob["template"]["spec"],
                        "template": j["spec"]["template"],
                    }
            if not js["metadata"].get("deletionTimestamp"):
                self._guard(self._jobset, js, mine, svcs)
        self.jobs.sync(specs)

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

    def _jobset(self, js: dict, jobs: list[dict], svcs: set[tuple[str, str]]) -> None:
        """JobSet's reconcile: its Service, a Job per replicated Job and index of the current restart
        attempt (those of an earlier attempt deleted), and its failure policy (`executeFailurePolicy`):
        a failed Job restarts every Job while `status.restarts` < `failurePolicy.maxRestarts`
        (default 0), else the JobSet fails and its active Jobs are deleted with their pods."""
        ns, name = _key(js)
        status = copy.deepcopy(js.get("status") or {})
        attempt = int(status.get("restarts") or 0)
        if _ended(status):
            for j in jobs:
                if not indexedjob.finished(j.get("status") or {}):
                    self._delete_job(j)
            return
        svc = service_for(js)
        if (ns, svc["metadata"]["name"]) not in svcs:
            create(self.core.create_namespaced_service, ns, svc)
        current: dict[str, dict] = {}
        for j in jobs:
            if int(j["metadata"]["labels"].get(JS + "restart-attempt", "0")) < attempt:
                self._delete_job(j)  # of an earlier attempt
            else:
                current[j["metadata"]["name"]] = j
        complete = total = 0
        for rjob in js["spec"]["replicatedJobs"]:
            for i in range(int(rjob.get("replicas", 1))):
                total += 1
                want = job_for(js, rjob, i, attempt)
                have = current.get(want["metadata"]["name"])
                if have is None:
                    create(self.batch.create_namespaced_job, ns, want)
                    continue
                conds = {
                    c["type"]
                    for c in (have.get("status") or {}).get("conditions") or []
                    if c["status"] == "True"
                }
                if "Failed" in conds:
                    self._failure_policy(js, status, have["metadata"]["name"])
                    return self._status(JOBSET, js, status)
                complete += "Complete" in conds
        if complete == total:
            _condition(status, "Completed", f"JobSet {name} completed")
            status["terminalState"] = "Completed"
        self._status(JOBSET, js, status)
        return None

    def _failure_policy(self, js: dict, status: dict, job: str) -> None:
        """`executeFailurePolicy` for a failed Job: no `failurePolicy`, the JobSet fails (FailedJobs);
        one (its rules not modelled: their default action, RestartJobSet), a restart of every Job
        while `restartsCountTowardsMax` < `maxRestarts`, else it fails (ReachedMaxRestarts)."""
        name = js["metadata"]["name"]
        policy = js["spec"].get("failurePolicy")
        counted = int(status.get("restartsCountTowardsMax") or 0)
        if policy is not None and counted < int(policy.get("maxRestarts") or 0):
            status["restarts"] = int(status.get("restarts") or 0) + 1
            status["restartsCountTowardsMax"] = counted + 1
            _condition(status, "Restarting", f"JobSet {name}: Job {job} failed: restart {status['restarts']}")
            return
        why = "ReachedMaxRestarts" if policy is not None else "FailedJobs"
        _condition(status, "Failed", f"JobSet {name}: Job {job} failed ({why})")
        status["terminalState"] = "Failed"

    def _delete_job(self, job: dict) -> None:
        meta = job["metadata"]
        if meta.get("deletionTimestamp"):
            return
        opts = client.V1DeleteOptions(propagation_policy="Foreground")
        try:
            self.batch.delete_namespaced_job(
                meta["name"], meta["namespace"], body=opts, _preload_content=False
            )
        except ApiException as exc:
            if exc.status != 404:
                raise

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
