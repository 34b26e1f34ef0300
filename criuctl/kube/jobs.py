"""The distributed jobs of a cluster, as `criuctl ps --jobs` shows them, read through the API
server alone: each node's agent publishes, on every pod whose job it runs, the rank it is there —
the workload, the node, its TCP endpoints as the agent reads them in the pod's own network
namespace (criuctl.net.peers) — as the pod's annotation `criuctl.io/rank` (`publish`, from the
agent's Kubernetes side: criuctl.kube.nodeside). The CLI lists pods and joins their ranks into jobs
by their connections (criuctl.client.jobs), so a user needs to read pods and nothing of criuctl's:
no Secret, no agent's token (before, it read the agents' token Secret and called every agent).
Each user sees the jobs of the namespaces they may list pods in; a PyTorchJob's master and
workers are one job however many nodes they run on.

An annotation is as fresh as its agent's last look (`nodeside.RANKS_EVERY`): a rank whose agent is
down shows the connections it had then.
"""

from __future__ import annotations

import json
from typing import Any

from criuctl.client.jobs import JobSurvey, Rank, group
from criuctl.core.workloads import WorkloadRow
from criuctl.kube.cluster import Cluster, Forbidden, call
from criuctl.net.peers import Endpoints

RANK = "criuctl.io/rank"


def note(row: WorkloadRow, node: str) -> tuple[str, str, str] | None:
    """(namespace, pod, the annotation's value) for a running container workload's row with its
    connections; None for any other row."""
    parts = str(row.get("pod") or "").split("/")
    if len(parts) != 3 or not isinstance(row.get("tcp"), dict):
        return None
    value = {"node": node, "workload": row["name"], "tcp": row["tcp"]}
    return parts[0], parts[1], json.dumps(value, sort_keys=True, separators=(",", ":"))


def publish(c: Cluster, namespace: str, pod: str, value: str) -> None:
    body = {"metadata": {"annotations": {RANK: value}}}
    call(f"pod {namespace}/{pod}", c.core.patch_namespaced_pod, pod, namespace, body)


def _rank(pod: dict[str, Any]) -> Rank | None:
    meta = pod["metadata"]
    try:
        said = json.loads((meta.get("annotations") or {})[RANK])
        return Rank(
            str(said["node"]),
            str(said["workload"]),
            Endpoints.from_json(said["tcp"]),
            f"{meta['namespace']}/{meta['name']}",
        )
    except (KeyError, TypeError, ValueError):  # none, or not what an agent writes: not a rank
        return None


def cluster_survey(c: Cluster) -> JobSurvey:
    """The jobs of every namespace the user may list pods in: all of them, else the kubeconfig's."""
    try:
        listed = call("the pods of every namespace", c.core.list_pod_for_all_namespaces)
    except Forbidden:
        listed = call(f"the pods of namespace {c.namespace}", c.core.list_namespaced_pod, c.namespace)
    ranks = []
    for item in listed.items:
        pod = c.serialize(item)
        if (pod.get("status") or {}).get("phase") == "Running" and (r := _rank(pod)) is not None:
            ranks.append(r)
    return JobSurvey(group(ranks), [])
