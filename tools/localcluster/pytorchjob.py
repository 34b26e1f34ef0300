"""A STAND-IN for the Kubeflow training operator's PyTorchJob controller, for the local cluster only.

The real operator (kubeflow/training-operator) cannot run on the local cluster (no registry to pull
it from), yet criuctl must meet a PyTorchJob's pods as the operator makes them: a worker's name is
its rank and its DNS name, and a deleted worker comes back under that name. This module reproduces
that part of the operator's v1 PyTorchJob controller, the way the operator does it:

- the CRD `pytorchjobs.kubeflow.org` (v1, namespaced, schema preserving unknown fields, status
  subresource); `spec.pytorchReplicaSpecs` with `Master` (1 replica) and optionally `Worker` (N);
- per replica index i a pod `<job>-<master|worker>-<i>` from the replica's template and a headless
  Service of that name selecting it; the operator's labels (`training.kubeflow.org/job-name`,
  `operator-name: pytorchjob-controller`, `replica-type`, `replica-index`, and `job-role: master`
  on the master's pod) and its controller ownerReference (deleting the job deletes them);
- the operator's env appended on every container: PYTHONUNBUFFERED ("0" as the operator writes it;
  CPython unbuffers on any non-empty value), MASTER_PORT (the master's port `pytorchjob-port`,
  default 23456), MASTER_ADDR (`<job>-master-0`), WORLD_SIZE (all replicas), RANK (master 0, worker
  i → i+1), and torchrun's PET_MASTER_ADDR, PET_MASTER_PORT, PET_NNODES (all replicas),
  PET_NODE_RANK (= RANK), PET_NPROC_PER_NODE (`spec.nprocPerNode`, default 1); the replica's
  restartPolicy on the pod (default OnFailure; ExitCode → Never);
- the operator's validation that every replica has a container named `pytorch` (the job is Failed
  otherwise, as training-operator >= 1.7 refuses it);
- a replica pod that is gone is made again under its name while the job has neither Succeeded nor
  Failed (criuctl's migration of a worker relies on this);
- `status` through the status subresource, by kubeflow/common's rules: conditions Created, Running
  (the master runs), Restarting (a replica failed or is being deleted; restartPolicy not Never),
  Failed (the same with Never, or a spec it cannot run), Succeeded (the master exited 0; Running
  turns False); `replicaStatuses`, `startTime`, `completionTime`.

- `runPolicy.backoffLimit` as the operator counts it (`ReconcileJobs`, `core.PastBackoffLimit`): the
  restarts of the containers of the job's Running pods; reached, every pod and Service is deleted
  and the job Failed (a move restarts no container: it spends none of it).

What it does NOT do: elastic jobs (torchrun rendezvous, nprocPerNode), a job without a Master, the
ExitCode policy's retries (a failed pod is not deleted and made again), the backoff's other half
(`jobHasNewFailure` with the work queue's requeue count), runPolicy (cleanPodPolicy, TTL,
deadlines, suspend), gang scheduling, the init container that waits for the
master, Events, metrics, webhooks, leader election. It polls every second rather than watching: a
local cluster has a handful of pods, and a poll misses nothing across an API server restart.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import signal
import sys
import threading
import time
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

from criuctl.kube import api

__all__ = ["CRD", "Controller", "crd", "create", "install", "install_all", "run"]

GROUP, VERSION, PLURAL, KIND = "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob"
CRD_NAME = f"{PLURAL}.{GROUP}"
LABEL = "training.kubeflow.org/"
OPERATOR = "pytorchjob-controller"
DEFAULT_CONTAINER, PORT_NAME, DEFAULT_PORT = "pytorch", "pytorchjob-port", 23456
EXCLUSIVE = {"Running": ("Restarting",), "Restarting": ("Running",)}  # one replaces the other
log = logging.getLogger(__name__)


def crd(group: str, version: str, plural: str, kind: str) -> dict[str, Any]:
    """A namespaced CRD keeping every field (1.20 requires a structural schema; the operators' own
    are generated), with the status subresource."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": kind.lower(), "kind": kind, "listKind": kind + "List"},
            "versions": [
                {
                    "name": version,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    },
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [
                        {"name": "State", "type": "string", "jsonPath": ".status.conditions[-1:].type"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                    ],
                }
            ],
        },
    }


CRD = crd(GROUP, VERSION, PLURAL, KIND)


def name_of(job: str, rtype: str, index: int) -> str:
    """The operator's genGeneralName: a replica's pod and Service name, so its DNS name and rank
    stay the same however often its pod is recreated."""
    return f"{job}-{rtype.lower()}-{index}".replace("/", "-")


def labels(job: str, rtype: str, index: int) -> dict[str, str]:
    """What the Service selects its pod by (the operator's GenLabels plus type and index)."""
    return {
        LABEL + "operator-name": OPERATOR,
        LABEL + "job-name": job.replace("/", "-"),
        LABEL + "replica-type": rtype.lower(),
        LABEL + "replica-index": str(index),
    }


def replica_specs(job: dict) -> dict[str, dict]:
    """`spec.pytorchReplicaSpecs` with its keys camel-cased, as the operator's defaulting does."""
    specs = (job.get("spec") or {}).get("pytorchReplicaSpecs") or {}
    return {rtype.capitalize(): spec or {} for rtype, spec in specs.items()}


def replicas(spec: dict) -> int:
    """A replica spec's count: 1 when unset, as the operator's defaulting writes it."""
    return int(spec.get("replicas", 1))


def invalid(specs: dict[str, dict]) -> str | None:
    """Why the stand-in cannot run these specs (the operator's validation, narrowed to this scope)."""
    if set(specs) - {"Master", "Worker"}:
        return f"replica types {sorted(set(specs) - {'Master', 'Worker'})} are not Master or Worker"
    if replicas(specs.get("Master", {})) != 1:
        return "there must be exactly 1 Master replica (a job without one is not supported here)"
    for rtype, spec in specs.items():
        containers = ((spec.get("template") or {}).get("spec") or {}).get("containers")
        if not containers:
            return f"{rtype} has no template with containers"
        if not any(c.get("name") == DEFAULT_CONTAINER for c in containers):  # ValidateV1PyTorchJob
            return f"there is no container named {DEFAULT_CONTAINER} in {rtype}"
    return None


def _port(spec: dict) -> int:
    """The `pytorchjob-port` of the replica's "pytorch" container; 23456, which the operator's
    defaulting adds when it is absent."""
    containers = spec["template"]["spec"]["containers"]
    main = next(c for c in containers if c.get("name") == DEFAULT_CONTAINER)
    ports = main.get("ports") or []
    return next((int(p["containerPort"]) for p in ports if p.get("name") == PORT_NAME), DEFAULT_PORT)


def _meta(job: dict, rtype: str, index: int, extra: dict[str, str]) -> dict:
    m = job["metadata"]
    owner = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": m["name"],
        "uid": m["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    return {
        "name": name_of(m["name"], rtype, index),
        "namespace": m["namespace"],
        "labels": {**extra, **labels(m["name"], rtype, index)},
        "ownerReferences": [owner],
    }


def pod_for(job: dict, rtype: str, index: int) -> dict:
    """Replica `rtype`/`index`'s pod: its template, the operator's labels, env and restartPolicy."""
    specs = replica_specs(job)
    template = copy.deepcopy(specs[rtype]["template"])
    tmeta, spec = template.get("metadata") or {}, template["spec"]
    policy = specs[rtype].get("restartPolicy", "OnFailure")
    spec["restartPolicy"] = "Never" if policy == "ExitCode" else policy
    world = sum(replicas(s) for s in specs.values())
    port, master = str(_port(specs["Master"])), name_of(job["metadata"]["name"], "Master", 0)
    rank = str(index + 1 if rtype == "Worker" else index)
    env = [
        {"name": "PYTHONUNBUFFERED", "value": "0"},
        {"name": "MASTER_PORT", "value": port},
        {"name": "MASTER_ADDR", "value": master},
        {"name": "WORLD_SIZE", "value": str(world)},
        {"name": "RANK", "value": rank},
        # torchrun's (elastic launch's) names for the same, as training-operator >= 1.7 sets them:
        # one process per pod unless the job says nprocPerNode; NNODES counts pods, not processes
        {"name": "PET_MASTER_ADDR", "value": master},
        {"name": "PET_MASTER_PORT", "value": port},
        {"name": "PET_NNODES", "value": str(world)},
        {"name": "PET_NODE_RANK", "value": rank},
        {"name": "PET_NPROC_PER_NODE", "value": str((job.get("spec") or {}).get("nprocPerNode", 1))},
    ]
    for c in spec["containers"]:
        c["env"] = [*(c.get("env") or []), *env]
    meta = _meta(job, rtype, index, tmeta.get("labels") or {})
    if rtype == "Master":
        meta["labels"][LABEL + "job-role"] = "master"
    if tmeta.get("annotations"):
        meta["annotations"] = tmeta["annotations"]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec}


def service_for(job: dict, rtype: str, index: int) -> dict:
    """The headless Service that gives replica `rtype`/`index` its DNS name (the pod's name)."""
    meta = _meta(job, rtype, index, {})
    port = _port(replica_specs(job)[rtype])
    spec = {
        "clusterIP": "None",
        "selector": dict(meta["labels"]),
        "ports": [{"name": PORT_NAME, "port": port, "targetPort": port}],
    }
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": spec}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def holds(status: dict, *ctypes: str) -> bool:
    return any(c["type"] in ctypes and c["status"] == "True" for c in status.get("conditions", []))


def set_condition(status: dict, ctype: str, message: str, reason: str = "") -> None:
    """kubeflow/common's setCondition (reason `PyTorchJob<type>` unless given): nothing after Failed,
    nothing if the condition already holds with that reason; Running and Restarting replace each
    other, Succeeded and Failed turn Running False, the other conditions are kept."""
    reason = reason or KIND + ctype
    conds = status.get("conditions", [])
    if holds(status, "Failed"):
        return
    cur = next((c for c in conds if c["type"] == ctype), None)
    if cur and cur["status"] == "True" and cur.get("reason") == reason:
        return
    now = _now()
    since = cur["lastTransitionTime"] if cur and cur["status"] == "True" else now
    new = {
        "type": ctype,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastUpdateTime": now,
        "lastTransitionTime": since,
    }
    gone = {ctype, *EXCLUSIVE.get(ctype, ())}
    ends = ctype in ("Succeeded", "Failed")
    kept = [
        c | {"status": "False"} if ends and c["type"] == "Running" else c
        for c in conds
        if c["type"] not in gone
    ]
    status["conditions"] = [*kept, new]


def tally(pod: dict) -> str | None:
    """Which replica count a pod adds to (kubeflow/common's UpdateJobReplicaStatuses): a Running pod
    being deleted counts as failed, for it will never report a phase of its own again."""
    phase = pod["status"].get("phase")
    if phase == "Running":
        return "failed" if pod["metadata"].get("deletionTimestamp") else "active"
    return {"Succeeded": "succeeded", "Failed": "failed"}.get(phase or "")


def _json(fn, *args: Any, **kw: Any) -> dict:
    """The API's JSON as dicts: no model classes (cheaper each poll, and the same shapes as specs)."""
    return json.loads(fn(*args, _preload_content=False, **kw).data)


class Controller:
    """One `sync` brings every PyTorchJob's pods, Services and status to what they should be."""

    KIND = KIND

    def __init__(self, api_client: client.ApiClient, t: api.KubeTimeouts) -> None:
        self.core = api.bounded(client.CoreV1Api, api_client, t)
        self.custom = api.bounded(client.CustomObjectsApi, api_client, t)

    def sync(self) -> None:
        jobs = _json(self.custom.list_cluster_custom_object, GROUP, VERSION, PLURAL)["items"]
        selector = f"{LABEL}operator-name={OPERATOR}"
        pods = _json(self.core.list_pod_for_all_namespaces, label_selector=selector)["items"]
        svcs = _json(self.core.list_service_for_all_namespaces, label_selector=selector)["items"]
        by_name, svc_names = {_key(o): o for o in pods}, {_key(o) for o in svcs}
        for job in jobs:
            if job["metadata"].get("deletionTimestamp"):
                continue
            try:
                self.reconcile(job, by_name, svc_names)
            except (ApiException, HTTPError, OSError) as exc:
                log.warning("PyTorchJob %s/%s: %s", *_key(job), _short(exc))

    def reconcile(self, job: dict, pods: dict[tuple[str, str], dict], svcs: set[tuple[str, str]]) -> None:
        ns, name = _key(job)
        status = copy.deepcopy(job.get("status") or {})
        set_condition(status, "Created", f"PyTorchJob {name} is created.")
        specs = replica_specs(job)
        if why := invalid(specs):
            set_condition(status, "Failed", f"PyTorchJobSpec is not valid: {why}", KIND + "FailedValidation")
        elif not holds(status, "Succeeded", "Failed"):
            status.setdefault("startTime", _now())
            order = sorted(specs, key="Master".__ne__)
            status["replicaStatuses"] = {rtype: self._replicas(job, rtype, pods, svcs) for rtype in order}
            update_conditions(status, name, specs, status["replicaStatuses"])
            mine = [p for p in pods.values() if _owned(p, job)]
            if past_backoff_limit(job, mine):  # ReconcileJobs: every pod and Service deleted, Failed
                for p in mine:
                    self._delete(self.core.delete_namespaced_pod, p)
                for i_rtype in order:
                    for i in range(replicas(specs[i_rtype])):
                        svc = {"metadata": {"namespace": ns, "name": name_of(name, i_rtype, i)}}
                        self._delete(self.core.delete_namespaced_service, svc)
                why = f"PyTorchJob {name} has failed because it has reached the specified backoff limit"
                set_condition(status, "Failed", why, KIND + "Failed")
            if holds(status, "Succeeded", "Failed"):
                status.setdefault("completionTime", _now())
        if status != (job.get("status") or {}):
            body = {**job, "status": status}
            self.custom.replace_namespaced_custom_object_status(GROUP, VERSION, ns, PLURAL, name, body)
            log.info("PyTorchJob %s/%s: %s", ns, name, status["conditions"][-1]["message"])

    def _replicas(self, job: dict, rtype: str, pods: dict[tuple[str, str], dict], svcs: set) -> dict:
        """Make the replica type's missing pods and Services; count its pods by what they are."""
        ns, name = _key(job)
        counts = {"active": 0, "succeeded": 0, "failed": 0}
        for i in range(replicas(replica_specs(job)[rtype])):
            key = (ns, name_of(name, rtype, i))
            pod = pods.get(key)
            if pod is None:  # never made, or gone: made (again) under its name, so with its rank
                self._create(self.core.create_namespaced_pod, ns, pod_for(job, rtype, i))
            elif _owned(pod, job) and (kind := tally(pod)):  # not a pod of an earlier job of that name
                counts[kind] += 1
            if key not in svcs:
                self._create(self.core.create_namespaced_service, ns, service_for(job, rtype, i))
        return counts

    _create = staticmethod(lambda fn, ns, obj: create(fn, ns, obj))

    @staticmethod
    def _delete(fn, obj: dict) -> None:
        try:
            fn(obj["metadata"]["name"], obj["metadata"]["namespace"], _preload_content=False)
        except ApiException as exc:
            if exc.status != 404:
                raise


def past_backoff_limit(job: dict, pods: list[dict]) -> bool:
    """training-operator's `runPolicy.backoffLimit` as `ReconcileJobs` checks it through
    `core.PastBackoffLimit`: the restarts of the containers of the job's Running pods, for replicas
    whose restartPolicy lets the kubelet restart them (OnFailure, Always, ExitCode), reach the limit
    (any restart, for a limit of 0). No limit: never."""
    limit = ((job.get("spec") or {}).get("runPolicy") or {}).get("backoffLimit")
    if limit is None:
        return False
    specs = replica_specs(job)
    restarts = 0
    for p in pods:
        rtype = next(
            (t for t in specs if t.lower() == p["metadata"]["labels"].get(LABEL + "replica-type")), None
        )
        if rtype is None or specs[rtype].get("restartPolicy", "OnFailure") == "Never":
            continue
        if (p.get("status") or {}).get("phase") != "Running":
            continue
        restarts += sum(int(c.get("restartCount") or 0) for c in p["status"].get("containerStatuses") or [])
    return restarts > 0 if int(limit) == 0 else restarts >= int(limit)


def create(fn, ns: str, obj: dict) -> None:
    """`fn(ns, obj)`, a 409 (made meanwhile, or its predecessor of that name still terminating)
    left for the next poll."""
    try:
        fn(ns, obj, _preload_content=False)
        log.info("created %s %s/%s", obj["kind"], ns, obj["metadata"]["name"])
    except ApiException as exc:
        if exc.status != 409:
            raise


def update_conditions(status: dict, name: str, specs: dict[str, dict], counts: dict[str, dict]) -> None:
    """The operator's UpdateJobStatus for a job with a Master, Master first. A pass that ends in
    Restarting does not set Running on its way there (the end is the same; the status is not
    rewritten every second while a deleted replica terminates)."""
    failing = {
        rtype: n["failed"]
        for rtype, n in counts.items()
        if n["failed"] and replicas(specs[rtype]) > n["succeeded"] + n["active"]
    }
    restarts = {rtype for rtype in failing if specs[rtype].get("restartPolicy", "OnFailure") != "Never"}
    if counts["Master"]["active"] and not restarts:
        set_condition(status, "Running", f"PyTorchJob {name} is running.")
    if counts["Master"]["succeeded"] == 1:
        set_condition(status, "Succeeded", f"PyTorchJob {name} is successfully completed.")
        return
    for rtype, failed in failing.items():
        why = f"because {failed} {rtype} replica(s) failed."
        if rtype in restarts:
            set_condition(status, "Restarting", f"PyTorchJob {name} is restarting {why}")
        else:
            set_condition(status, "Failed", f"PyTorchJob {name} is failed {why}")


def _key(obj: dict) -> tuple[str, str]:
    return obj["metadata"]["namespace"], obj["metadata"]["name"]


def _owned(obj: dict, job: dict) -> bool:
    refs = obj["metadata"].get("ownerReferences") or []
    return any(r.get("controller") and r["uid"] == job["metadata"]["uid"] for r in refs)


def _short(exc: Exception) -> str:
    return f"HTTP {exc.status} {exc.reason}" if isinstance(exc, ApiException) else repr(exc)


def install(kubeconfig: str, timeout: float = 60, crd: dict[str, Any] = CRD) -> None:
    """Create (or bring up to date) a CRD (the PyTorchJob's) and return once its objects are served."""
    t = api.timeouts()
    name, spec = crd["metadata"]["name"], crd["spec"]
    group, version, plural = spec["group"], spec["versions"][0]["name"], spec["names"]["plural"]
    api_client, _ = api.api_client(kubeconfig, t)  # its own (not the default): it may share a process
    ext = api.bounded(client.ApiextensionsV1Api, api_client, t)
    custom = api.bounded(client.CustomObjectsApi, api_client, t)
    try:
        ext.create_custom_resource_definition(crd, _preload_content=False)
    except ApiException as exc:
        if exc.status != 409:
            raise
        current = _json(ext.read_custom_resource_definition, name)  # e.g. one without status
        body = copy.deepcopy(crd)
        body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        ext.replace_custom_resource_definition(name, body, _preload_content=False)
    deadline = time.monotonic() + timeout
    while True:
        status = _json(ext.read_custom_resource_definition, name).get("status") or {}
        conds = status.get("conditions") or []  # null until the server has set one
        try:
            if any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                custom.list_cluster_custom_object(group, version, plural, limit=1, _preload_content=False)
                return
        except ApiException as exc:
            if exc.status != 404:
                raise
        if time.monotonic() > deadline:
            raise TimeoutError(f"CRD {name} not served after {timeout:.0f}s")
        time.sleep(0.5)


def run(kubeconfig: str, stop: threading.Event, interval: float = 0.25, kinds: tuple = (Controller,)) -> None:
    """Reconcile every `interval` seconds until `stop` is set; an API error waits for the next poll.
    The real operators watch and recreate a deleted pod at once: a slower poll here would add its
    own wait to every move's stall through a successor."""
    t = api.timeouts()
    api_client = api.api_client(kubeconfig, t)[0]
    controllers = [kind(api_client, t) for kind in kinds]
    while not stop.is_set():
        for ctl in controllers:
            try:
                ctl.sync()
            except (ApiException, HTTPError, OSError) as exc:
                log.warning("%s stand-in: %s", ctl.KIND, _short(exc))
        stop.wait(interval)


def install_all(kubeconfig: str) -> None:
    """The CRDs of both stand-ins: PyTorchJob's, and TrainJob's and JobSet's (localcluster.trainjob)."""
    from localcluster import trainjob

    for crd in (CRD, *trainjob.CRDS):
        install(kubeconfig, crd=crd)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m localcluster.pytorchjob", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--kubeconfig", default=os.environ.get("KUBECONFIG"), help="default: $KUBECONFIG")
    a = p.parse_args(argv)
    if not a.kubeconfig:
        p.error("--kubeconfig or KUBECONFIG is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    from localcluster import trainjob

    install_all(a.kubeconfig)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    log.info("PyTorchJob and TrainJob stand-in controllers running (not Kubeflow's operators, not JobSet)")
    run(a.kubeconfig, stop, kinds=(Controller, trainjob.Controller))
    return 0


if __name__ == "__main__":
    sys.exit(main())
