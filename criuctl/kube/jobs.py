"""The distributed jobs of a cluster, as `criuctl ps --jobs` shows them: every node's agent asked at
once (found through the API, as `criuctl migrate POD NODE` finds them), its workloads joined into
jobs by their TCP connections (criuctl.client.jobs). A PyTorchJob's master and workers are one job
here however many nodes they run on: each agent reads a pod's connections in the pod's own
network namespace (criuctl.net.peers)."""

from __future__ import annotations

from criuctl.client.agents import Node
from criuctl.client.jobs import JobSurvey, survey
from criuctl.core.errors import CriuctlError
from criuctl.kube.cluster import Cluster, agent_for, call


def cluster_survey(c: Cluster) -> JobSurvey:
    """Every node's jobs; a node without a Ready agent is named among the silent ones."""
    agents: list[Node] = []
    silent: list[str] = []
    for n in call("the nodes", c.core.list_node).items:
        node = c.serialize(n)
        try:
            agents.append(agent_for(c, node))
        except CriuctlError:
            silent.append(node["metadata"]["name"])
    found = survey(agents)
    found.silent += silent
    return found
