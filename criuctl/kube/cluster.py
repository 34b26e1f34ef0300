"""The API server and the node agents as `criuctl migrate POD NODE` sees them: the official client
configured from a kubeconfig or the pod's in-cluster account, nodes and their agents (the DaemonSet's
pods), the agents' CA read from the Secret `manifests/` installs. No token: the controller and the
agents show the agents their certificates (criuctl.agent.callers; $CRIUCTL_AGENT_IDENTITY). Every
failure to reach or to be allowed is one line that says what to do."""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from criuctl.client.agents import Node
from criuctl.core import env, statedir, workloads
from criuctl.core.errors import CriuctlError
from criuctl.kube import api
from criuctl_hook import durable

SYSTEM_NS = "criuctl-system"
AGENT_LABEL = "app.kubernetes.io/name=criuctl-agent"
AGENT_PORT = 7070  # manifests/daemonset.yaml's hostPort


class NotFound(CriuctlError):
    exit_code = 3


class Forbidden(CriuctlError):
    """The API server refused the user (HTTP 401/403): RBAC, not the object."""


class Conflict(CriuctlError):
    """Another writer changed the object first (a resourceVersion precondition failed)."""


def wanted(kubeconfig: str | None, namespace: str | None) -> bool:
    """Whether a NAME means a pod: the user named a namespace or kubeconfig, or one is there."""
    return bool(
        kubeconfig
        or namespace
        or os.environ.get("KUBECONFIG")
        or os.environ.get("KUBERNETES_SERVICE_HOST")
        or Path("~/.kube/config").expanduser().exists()
    )


@dataclass
class Cluster:
    """The API server's APIs criuctl uses, each bounded by the same timeouts (criuctl.kube.api)."""

    core: api.Bounded  # kubernetes.client.CoreV1Api
    custom: api.Bounded  # kubernetes.client.CustomObjectsApi
    apps: api.Bounded  # kubernetes.client.AppsV1Api
    namespace: str  # the context's namespace, for a pod named without -n
    ca_file: str | None = None  # the agents' CA, once read
    coordination: api.Bounded | None = None  # kubernetes.client.CoordinationV1Api: the controller's Lease
    certificates: api.Bounded | None = None  # kubernetes.client.CertificatesV1Api: the agents' certificates

    def serialize(self, obj: Any) -> dict:
        """A client model as the API's JSON (camelCase): what the webhook's pure functions take."""
        return self.core.api_client.sanitize_for_serialization(obj)


def connect(kubeconfig: str | None = None, timeouts: api.KubeTimeouts | None = None) -> Cluster:
    """The cluster through a kubeconfig (or the pod's service account), every API call bounded by
    `timeouts` (default: criuctl.kube.api's, with CRIUCTL_KUBE_TIMEOUTS applied)."""
    from kubernetes import client

    t = timeouts or api.timeouts()
    api_client, namespace = api.api_client(kubeconfig, t)
    return Cluster(
        api.bounded(client.CoreV1Api, api_client, t),
        api.bounded(client.CustomObjectsApi, api_client, t),
        api.bounded(client.AppsV1Api, api_client, t),
        namespace,
        coordination=api.bounded(client.CoordinationV1Api, api_client, t),
        certificates=api.bounded(client.CertificatesV1Api, api_client, t),
    )


def api_error(exc: Exception, what: str) -> CriuctlError:
    """One line for an API failure: 404 → NotFound, 401/403 → not allowed, else unreachable (a
    connection refused, or no answer within criuctl.kube.api's timeouts)."""
    from kubernetes.client.exceptions import ApiException

    if isinstance(exc, ApiException):
        if exc.status == 409:
            err = Conflict(f"{what} changed meanwhile (HTTP 409)", "try again")
            return err
        if exc.status == 404:
            return NotFound(f"no {what}", "see `kubectl get` for what there is")
        if exc.status == 422:  # the object was refused (its schema): the API server says how
            import json

            try:
                said = json.loads(exc.body or "{}").get("message") or exc.reason
            except (ValueError, AttributeError):
                said = exc.reason
            return CriuctlError(f"the API server refused {what}: {said}", "see the fields it names")
        if exc.status in (401, 403):
            return Forbidden(
                f"the API server refused access to {what} (HTTP {exc.status})",
                "use a kubeconfig whose user may do this: moving a pod needs the criuctl-migrator "
                "role (docs/deploy.md, Users)",
            )
        return CriuctlError(f"the API server failed on {what}: HTTP {exc.status} {exc.reason}", "try again")
    why = str(exc) if isinstance(exc, api.NoAnswer) else type(exc).__name__
    return CriuctlError(
        f"the API server does not answer ({what}: {why})",
        "check the cluster (`kubectl get --raw /readyz`) and KUBECONFIG",
    )


def call(what: str, fn, *args, **kw):
    """`fn(*args, **kw)`, a method of one of `Cluster`'s APIs (bounded by its timeouts), with any
    failure as one line (api_error)."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return fn(*args, **kw)
    except (ApiException, HTTPError, OSError) as exc:
        raise api_error(exc, what) from exc


def _secret_file(c: Cluster, secret: str, key: str, dest: Path) -> str | None:
    """One key of a Secret as a root-only file, replaced whole (another criuctl may be reading it)."""
    s = call(f"secret {SYSTEM_NS}/{secret}", c.core.read_namespaced_secret, secret, SYSTEM_NS)
    raw = (s.data or {}).get(key)
    if raw is None:
        return None
    durable.replace(dest, base64.b64decode(raw), 0o400)
    return str(dest)


def _ca(c: Cluster) -> str | None:
    """The agents' CA from the Secret `manifests/` installs (public), read once per process; and
    this process's certificate to show them, or one line why there is none."""
    if env.AGENT_IDENTITY.get() is None:
        raise CriuctlError(
            "this process has no certificate to show criuctl's agents (they take no token on Kubernetes)",
            "the controller asks criuctl's signer for one (--tls-from-cluster); an agent has its node's",
        )
    if c.ca_file is None:
        c.ca_file = _secret_file(c, "criuctl-agent-tls", "ca.crt", statedir.KUBE.ensure() / "ca.crt")
    return c.ca_file


def agent_for(c: Cluster, node: dict) -> Node:
    """The agent of `node` (the DaemonSet's pod there, Ready) as a criuctl node, reached at the
    node's InternalIP, its certificate checked against the agents' CA; or one line why there is none."""
    name = node["metadata"]["name"]
    pods = call(
        "the criuctl agent pods",
        c.core.list_namespaced_pod,
        SYSTEM_NS,
        label_selector=AGENT_LABEL,
        field_selector=f"spec.nodeName={name}",
    ).items
    ready = [
        p
        for p in pods
        if p.metadata.deletion_timestamp is None
        and any(cond.type == "Ready" and cond.status == "True" for cond in (p.status.conditions or []))
    ]
    if not ready:
        raise CriuctlError(
            f"node {name} has no ready criuctl agent" + (" (its agent pod is not Ready)" if pods else ""),
            "install it with `kubectl apply -k manifests/` (docs/deploy.md); a tainted node needs "
            "the DaemonSet's tolerations",
        )
    ips = [a["address"] for a in node["status"].get("addresses", []) if a["type"] == "InternalIP"]
    if not ips:
        raise CriuctlError(
            f"node {name} reports no InternalIP", "the agent is reached at the node's InternalIP"
        )
    ca = _ca(c)
    host = f"[{ips[0]}]" if ":" in ips[0] else ips[0]
    return Node(name, f"https://{host}:{AGENT_PORT}", None, ca)


def agent_of(c: Cluster, node: str) -> Node:
    """The agent of the node named `node` (`agent_for` of the node as the API reads it now)."""
    return agent_for(c, c.serialize(call(f"node {node}", c.core.read_node, node)))


def workload_row(agent: Node, cid: str) -> workloads.WorkloadRow | None:
    """The agent's row for container `cid`: by the name it gives containers, or, for a job restored
    into a placeholder (which keeps the name it had on its first node), by its container."""
    from criuctl.client.agents import AgentClient
    from criuctl.container import containers

    rows: list[workloads.WorkloadRow] = AgentClient(agent, timeout=15).get("/v1/workloads")
    return next(
        (r for r in rows if containers.name_of(cid) == r.get("name") or r.get("container") == cid), None
    )


def container_id(pod: dict, container: str) -> str | None:
    """The runtime's ID of a running container of `pod` (without the `containerd://` scheme)."""
    for s in pod.get("status", {}).get("containerStatuses") or []:
        if s["name"] == container and "running" in (s.get("state") or {}):
            return (s.get("containerID") or "").partition("://")[2] or None
    return None


def delete_now(c: Cluster, pod: dict) -> None:
    """Delete this very pod (a UID precondition: never its successor) without a grace period: for
    a pod whose container runs no job any more (an empty placeholder, a source whose job lives in a
    kept bundle), so that its controller recreates it at once."""
    import contextlib

    from kubernetes import client

    meta = pod["metadata"]
    only = client.V1Preconditions(uid=meta["uid"])
    opts = client.V1DeleteOptions(grace_period_seconds=0, preconditions=only)
    with contextlib.suppress(NotFound):
        call(f"pod {meta['name']}", c.core.delete_namespaced_pod, meta["name"], meta["namespace"], body=opts)
