"""The checks of `criuctl migrate POD NODE`, and the plan they produce: everything decided before
anything in the cluster changes (criuctl.kube.podmigrate carries it out). Each refusal is one line
that says what to do; the order is the order in which a user can fix them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from criuctl.client.agents import Node
from criuctl.core.errors import CriuctlError
from criuctl.kube import events, moves, mutate, owners, podvolumes
from criuctl.kube.cluster import Cluster, NotFound, agent_for, call, workload_row

# labels a controller selects its pods by: a placeholder keeps none, or the controller adopts it
CONTROLLER_LABELS = (
    "pod-template-hash",
    "controller-revision-hash",
    "controller-uid",
    "job-name",
    "statefulset.kubernetes.io/pod-name",
    "apps.kubernetes.io/pod-index",
)


class NotMigratable(CriuctlError):
    exit_code = 2


@dataclass
class PodPlan:
    namespace: str
    pod: str
    source: str
    target: str
    container: str
    workload: str  # the agents' name for the container: ctr-<12 hex>
    placeholder_name: str
    memory_needed: int
    memory_free: int
    src: Node
    dst: Node
    source_pod: dict
    placeholder: dict | None  # None: a controller's pod, whose successor is the placeholder
    owner: str = ""  # "KIND NAME" of that controller
    identity: str = ""  # what its successor shares with it (criuctl.kube.owners.identity)

    def summary(self) -> dict[str, Any]:
        keys = (
            "namespace",
            "pod",
            "source",
            "target",
            "container",
            "workload",
            "placeholder_name",
            "memory_needed",
            "memory_free",
            "owner",
            "identity",
        )
        return {k: getattr(self, k) for k in keys}


def ready(node: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))


def _bytes(q: str | None) -> int:
    from kubernetes.utils import parse_quantity

    return int(parse_quantity(q)) if q else 0


def pod_amount(pod: dict, resource: str) -> int:
    """What the pod's containers request of `resource` (a limit alone counts as the request, as the
    API server defaults it)."""
    total = 0
    for c in pod["spec"]["containers"]:
        r = c.get("resources") or {}
        total += _bytes((r.get("requests") or {}).get(resource) or (r.get("limits") or {}).get(resource))
    return total


def pod_memory(pod: dict) -> int:
    return pod_amount(pod, "memory")


def devices(pod: dict) -> list[str]:
    """The extended resources the pod asks for (nvidia.com/gpu, amd.com/gpu, …): a device plugin's,
    which a placeholder made from the pod's spec asks the target node for too."""
    keys = set()
    for c in pod["spec"]["containers"]:
        r = c.get("resources") or {}
        keys |= {k for part in ("requests", "limits") for k in (r.get(part) or {}) if "/" in k}
    return sorted(k for k in keys if pod_amount(pod, k) > 0)


def free_allocatable(node: dict, pods: list[dict], resources: list[str]) -> dict[str, int]:
    """Of each resource, what the node can still give: its allocatable less what its pods request."""
    allocatable = node["status"].get("allocatable") or {}
    return {r: _bytes(allocatable.get(r)) - sum(pod_amount(p, r) for p in pods) for r in resources}


def free_on(c: Cluster, node: dict, resources: list[str]) -> dict[str, int]:
    name = node["metadata"]["name"]
    pods = call(
        f"pods on node {name}",
        c.core.list_pod_for_all_namespaces,
        field_selector=f"spec.nodeName={name},status.phase!=Succeeded,status.phase!=Failed",
    ).items
    return free_allocatable(node, [c.serialize(p) for p in pods], resources)


def free_memory(c: Cluster, node: dict) -> int:
    return free_on(c, node, ["memory"])["memory"]


def next_name(name: str) -> str:
    """The placeholder's name: NAME-m1, then -m2 on the next move (a bare pod's name cannot be
    reused while its source exists; the lineage stays readable)."""
    m = re.fullmatch(r"(.*)-m(\d+)", name)
    base, k = (m[1], int(m[2]) + 1) if m else (name, 1)
    return f"{base[: 63 - len(str(k)) - 2]}-m{k}"


def _owned(c: Cluster, pod: dict, ctr: dict) -> owners.Owner | None:
    """The controller that recreates the pod under its name (it moves through its successor), None
    for a bare pod; any other controller is refused in one line. A multi-worker job's pod moves like
    any (its connections follow it: criuctl.kube.jobmoves)."""
    meta = pod["metadata"]
    ref = owners.controller_ref(pod)
    if ref is None:
        return None
    supported = (
        f"criuctl moves bare pods, the pods of {', '.join(owners.SAME_NAME)}s, and those of Indexed Jobs "
        "(a JobSet's, a TrainJob's) that have a subdomain"
    )
    if ref["kind"] in owners.SAME_INDEX and not owners.indexed(pod):
        # a Job that is not Indexed replaces its pod under another name and no other index: nothing
        # tells the successor apart; an Indexed one without a subdomain gives its pods no DNS name
        raise NotMigratable(
            f"pod {meta['name']} is owned by {ref['kind']} {ref['name']}, not by an Indexed Job whose pods "
            "have a stable DNS name (hostname and subdomain): nothing could tell its successor apart",
            f"nothing was changed; {supported}",
        )
    if ref["kind"] not in owners.KINDS:
        raise NotMigratable(
            f"pod {meta['name']} is owned by {ref['kind']} {ref['name']}, which replaces it with a pod "
            "of another name: nothing could tell its successor apart, so it does not move",
            f"nothing was changed; {supported}",
        )
    o = owners.owner(c, pod)
    if o is None or not o.wants_back:
        raise NotMigratable(f"pod {meta['name']}: {o.why if o else 'no owner'}", "nothing was changed")
    if not mutate.has_prestop(ctr):
        raise NotMigratable(
            f"pod {meta['name']} of {o.kind} {o.name} has no criuctl preStop hook (it was created before "
            "the webhook added one): its job would end with it",
            "recreate the pod (delete it: its controller makes a new one); nothing was changed",
        )
    pending = moves.read(c, meta["namespace"], owners.identity(pod))
    if pending is not None and pending.phase in (moves.Phase.DUMPING, moves.Phase.KEPT):
        raise CriuctlError(
            f"pod {meta['name']} is already moving (bundle {pending.bundle})",
            "wait for it: `kubectl get events`",
        )
    return o


def _wrapped_container(pod: dict) -> dict:
    meta = pod["metadata"]
    # a placeholder pod is a job's pod once a job was restored into it; an empty one the agent
    # reports as such (why_not) below
    wrapped = [c for c in pod["spec"]["containers"] if mutate.is_wrapped(c)]
    if not wrapped:
        why = mutate.not_wrapped(pod)
        detail = "; ".join(f"{k}: {v}" for k, v in why.items()) or "it was created without criuctl's webhook"
        raise NotMigratable(
            f"pod {meta['name']} is not migratable: no container runs under criuctl's init ({detail})",
            f"label it {mutate.LABEL}=true (with the webhook installed: manifests/webhook.yaml) and "
            "recreate it; nothing was changed",
        )
    if len(wrapped) > 1:
        raise NotMigratable(
            f"pod {meta['name']} has {len(wrapped)} checkpointable containers; criuctl moves pods with one",
            "nothing was changed",
        )
    return wrapped[0]


def _refuse_foreign(c: Cluster, name: str, row: dict) -> None:
    """A job's rank follows its peers' pods (criuctl.kube.jobmoves): a connection to anything else
    (a database outside, a node's address) could not follow it to its successor's address."""
    import ipaddress

    conns = [
        x for x in (row.get("tcp") or {}).get("connections", []) if not ipaddress.ip_address(x[2]).is_loopback
    ]
    if not conns:
        return
    pods = call("the pods", c.core.list_pod_for_all_namespaces, field_selector="status.phase=Running").items
    ips = {p.status.pod_ip for p in pods if p.status.pod_ip and not p.spec.host_network}
    for _, _, ra, rp in conns:
        if ra not in ips:
            raise NotMigratable(
                f"pod {name} has a TCP connection to {ra}:{rp}, which is no pod of the cluster: it "
                "could not follow the pod to its new address",
                "nothing was changed; end that connection first (a job's ranks may talk to each other)",
            )


_DNS1123 = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


def check_name(kind: str, name: str) -> None:
    """Kubernetes' own rule for object names, checked before any name reaches a URL."""
    if len(name) > 253 or not _DNS1123.fullmatch(name):
        raise CriuctlError(
            f"{name!r} is not a valid {kind} name",
            "Kubernetes names are lower-case letters, digits, '-' and '.' (RFC 1123)",
        )


def plan(c: Cluster, namespace: str, name: str, target: str) -> PodPlan:
    """Every check, in the order a user can fix them; raises one line, changes nothing."""
    for kind, value in (("pod", name), ("namespace", namespace), ("node", target)):
        check_name(kind, value)
    try:
        pod = c.serialize(call(f"pod {namespace}/{name}", c.core.read_namespaced_pod, name, namespace))
    except NotFound as exc:
        raise NotFound(
            f"no pod {name!r} in namespace {namespace}", "see `kubectl get pods -n NAMESPACE`"
        ) from exc
    try:
        node = c.serialize(call(f"node {target}", c.core.read_node, target))
    except NotFound as exc:
        raise NotFound(f"no node {target!r} in the cluster", "see `kubectl get nodes`") from exc
    source = pod["spec"].get("nodeName")
    if source == target:
        raise CriuctlError(f"pod {name} already runs on node {target}", "nothing to move: pick another node")
    if pod["metadata"].get("deletionTimestamp") or pod["status"].get("phase") != "Running":
        state = "terminating" if pod["metadata"].get("deletionTimestamp") else pod["status"].get("phase")
        raise NotMigratable(f"pod {name} is {state}, not running", "only a running pod moves")
    if not ready(node):
        raise CriuctlError(f"node {target} is NotReady", "pick a Ready node: `kubectl get nodes`")
    if node["spec"].get("unschedulable"):
        raise CriuctlError(f"node {target} is cordoned (unschedulable)", "uncordon it or pick another node")
    ctr = _wrapped_container(pod)
    owner = _owned(c, pod, ctr)
    if (r := podvolumes.check(pod, node, *podvolumes.fetch(c, pod))) is not None:
        raise NotMigratable(f"pod {name}: volume {r.volume} {r.what}", f"nothing was changed; {r.hint}")
    wanted = devices(pod)
    free_now = free_on(c, node, ["memory", *wanted])
    needed, free = pod_memory(pod), free_now["memory"]
    for key in wanted:  # the placeholder asks for them too: it would stay Pending without
        if (asked := pod_amount(pod, key)) > free_now[key]:
            raise CriuctlError(
                f"node {target} has {max(0, free_now[key])} {key} free; pod {name} needs {asked}",
                f"pick a node with a free {key} (`kubectl describe node`) or free one there; "
                "nothing was changed",
            )
    status = {s["name"]: s for s in pod["status"].get("containerStatuses", [])}
    cid = (status.get(ctr["name"], {}).get("containerID") or "").partition("://")[2]
    if not cid:
        raise NotMigratable(f"container {ctr['name']} of pod {name} has not started", "wait until it runs")
    src_node = call(f"node {source}", c.core.read_node, source)
    src, dst = agent_for(c, c.serialize(src_node)), agent_for(c, node)
    row = workload_row(src, cid)
    if row is None:
        raise CriuctlError(
            f"node {source}'s agent does not see container {cid[:12]} of pod {name}",
            "is the agent on that node healthy? `kubectl -n criuctl-system logs`",
        )
    if row.get("why_not"):
        raise NotMigratable(f"pod {name}: {row['why_not']}", "nothing was changed")
    workload = row["name"]
    if owner is not None:
        _refuse_foreign(c, name, row)
    needed = max(needed, int(row.get("rss_bytes") or 0))
    if needed > free:
        raise CriuctlError(
            f"node {target} has {free >> 20} MiB of allocatable memory free; "
            f"pod {name} needs {needed >> 20} MiB",
            "free memory there or pick another node; nothing was changed",
        )
    if owner is not None:  # its successor is the placeholder: same name, made by its controller
        return PodPlan(
            namespace,
            name,
            source,
            target,
            ctr["name"],
            workload,
            name,
            needed,
            free,
            src,
            dst,
            pod,
            None,
            f"{owner.kind} {owner.name}",
            owners.identity(pod),
        )
    body = mutate.placeholder(pod, target, f"{namespace}/{name}")
    taken = {
        q.metadata.name for q in call(f"pods in {namespace}", c.core.list_namespaced_pod, namespace).items
    }
    new = next_name(name)
    while new in taken:  # a placeholder an interrupted move left behind (docs/kubernetes.md)
        new = next_name(new)
    body["metadata"]["name"] = new
    for k in CONTROLLER_LABELS:
        body["metadata"].get("labels", {}).pop(k, None)
    notes = body["metadata"].setdefault("annotations", {})
    notes.pop(events.MIGRATED_AT, None)  # set once the job runs in it: until then it is a placeholder
    notes[events.MIGRATED_FROM] = f"{namespace}/{name}@{source}"
    return PodPlan(
        namespace, name, source, target, ctr["name"], workload, new, needed, free, src, dst, pod, body
    )
