"""What the admission webhook does to a pod, as pure functions on the API server's JSON (camelCase).

A pod is migratable when its containers' PID 1 is criuctl's init and criuctl's files are mounted
(docs/containers.md, "What a pod needs"). Writing that by hand is error-prone, so the webhook does
it at creation (`wrap`), and `criuctl migrate` derives the restore target's pod from the wrapped
source (`placeholder`). No I/O and no Kubernetes client here: the webhook, the migrate command and
the tests all call the same functions on plain dicts.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from criuctl.container import containers  # cheap: standard library and psutil, nothing of torch or kubernetes
from criuctl.core import env, nsinit

Pod = dict[str, Any]

LABEL = "criuctl.io/migratable"  # on a pod or a namespace: "true" opts in, on a pod "false" opts out
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"  # a JobSet's pod (Kubeflow Trainer's TrainJob runs on one)
JOB_LABEL = "job-name"  # a Job's pod (the API server puts it in the Job's template)
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"  # an Indexed Job's pod: annotation, and label
INJECTED = "criuctl.io/injected"  # "true" once the webhook has seen the pod: never wrapped twice
PYTHON_ANNOTATION = "criuctl.io/python"  # the image's Python 3, when it is not `python3` on PATH
NOT_WRAPPED = "criuctl.io/not-wrapped"  # JSON {container: why it was left alone}
PLACEHOLDER_FOR = "criuctl.io/placeholder-for"  # "NAMESPACE/POD": the pod whose job is restored here
DEFAULT_PYTHON = "python3"

VOLUME = "criuctl-inject"
# The init/pod contract is the init's own (criuctl.core.nsinit): where the inject dir is mounted,
# the init's file there, the placeholder's FIFO folder, the variable naming the pod to the init.
MOUNT = nsinit.INJECT_MOUNT
INJECT_DIR = str(containers.INJECT_DIR)  # where the node agent writes nsinit.py and the hook
INIT = f"{MOUNT}/{nsinit.INJECT_NAME}"
INJECT_CONTAINER = "criuctl-inject"  # the init container copying the files from criuctl's image
INJECT_VERB = "inject"  # `criuctl inject DIR` (the image's entrypoint is criuctl)
INJECT_UID = 65532  # the image's unprivileged user (manifests: the webhook's and controller's too)
RUN_VOLUME = "criuctl-run"  # an emptyDir for the init's FIFOs and the hook's boundary on a read-only rootfs
RUN_DIR = nsinit.CONTROL_DIR

NO_COMMAND = "the image's entrypoint is not in the pod spec; give the container a command"
PROBES = ("livenessProbe", "readinessProbe", "startupProbe")
# The spec fields the webhook rewrites: `patch` replaces these whole and nothing else.
PATCHED = (
    ("metadata", "annotations"),
    ("spec", "initContainers"),
    ("spec", "containers"),
    ("spec", "volumes"),
    ("spec", "nodeName"),
    ("spec", "terminationGracePeriodSeconds"),
    ("spec", "nodeSelector"),
    ("spec", "affinity"),
)
PRESTOP_PATH = "/v1/prestop"  # + /NAMESPACE/POD: criuctl.kube.prestop, the agent's listener in the pod
# on a pod, by its node's agent: the container ID in whose network namespace its preStop listener
# is (criuctl.kube.nodeside.PodHooks), or TAKEN + that ID where a process of the pod holds the port
LISTENER = "criuctl.io/prestop-listener"
TAKEN = "taken:"
# a preStop checkpoint (freeze, dump, copy to another node) must fit in the pod's grace period
PRESTOP_GRACE = 300


def is_wrapped(container: dict[str, Any]) -> bool:
    """The container's command starts criuctl's init (`PYTHON [-I] /.criuctl/nsinit.py ...`), put
    there by `wrap` or by hand as docs/containers.md shows."""
    return INIT in (container.get("command") or [])[1:3]


def is_placeholder(pod: Pod) -> bool:
    """A restore target made by `placeholder`: it must be admitted as it is, never wrapped again."""
    return PLACEHOLDER_FOR in _annotations(pod)


def not_wrapped(pod: Pod) -> dict[str, str]:
    """The containers `wrap` left alone and why (what `criuctl migrate` tells the user)."""
    text = _annotations(pod).get(NOT_WRAPPED)
    return json.loads(text) if text else {}


def indexed(pod: Pod) -> bool:
    """A pod of an Indexed Job (a JobSet's, a TrainJob's, or a Job of its own) with the stable DNS
    name that Job gives it: hostname `<job>-<index>` and the subdomain of its template."""
    spec, meta = pod.get("spec") or {}, pod.get("metadata") or {}
    labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
    of_job = labels.get(JOBSET_LABEL) or (labels.get(JOB_LABEL) and COMPLETION_INDEX in {**labels, **notes})
    return bool(of_job and spec.get("hostname") and spec.get("subdomain"))


# labels an Indexed Job's pod shares with its successor, narrowest last: the completion index is a
# label only where the Job controller writes it (PodIndexLabel, on by default since Kubernetes 1.28)
INDEX_LABELS = (
    "jobset.sigs.k8s.io/replicatedjob-name",
    "jobset.sigs.k8s.io/job-index",
    JOB_LABEL,
    COMPLETION_INDEX,
)


def same_index(pod: Pod) -> str:
    """A label selector for the pods of an Indexed Job pod's index (it, its predecessor, its
    successor): a lookup of one index, not of every pod of the namespace's Jobs (hundreds for one
    job)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    parts = [f"{JOBSET_LABEL}={labels[JOBSET_LABEL]}"] if labels.get(JOBSET_LABEL) else []
    return ",".join([*parts, *(f"{k}={labels[k]}" for k in INDEX_LABELS if labels.get(k))]) or JOB_LABEL


def identity(pod: Pod) -> str:
    """What the pod's successor shares with it (criuctl.kube.owners): `HOSTNAME.SUBDOMAIN` for an
    Indexed Job's pod (its name is random, and an admission webhook sees none yet: generateName),
    else its name ("" for none)."""
    if indexed(pod):
        return f"{pod['spec']['hostname']}.{pod['spec']['subdomain']}"
    return (pod.get("metadata") or {}).get("name") or ""


def prestop_hook(port: int, namespace: str, name: str, on_host: bool = False) -> dict[str, Any]:
    """The preStop hook that checkpoints the job when the pod is deleted (drain, eviction, `criuctl
    migrate` of a controller's pod): an httpGet the kubelet itself makes to its node's agent.

    Without `host` (the default) the kubelet calls the pod's own IP: the agent listens on `port`
    inside each wrapped pod's network namespace (criuctl.kube.nodeside.PodHooks), from a socket it
    made there, so that no process joins the pod; the Pod Security Standard `baseline` refuses a
    hook's `host` from Kubernetes v1.34. `on_host`: `host: 127.0.0.1`, the agent's loopback
    listener (for a job that itself listens on `port`). An exec hook would run a process inside the
    container, in the job's PID namespace, where CRIU would find a stranger in the tree it must
    dump. Kubernetes 1.20's kubelet makes a lifecycle httpGet over plain HTTP without headers,
    whatever `scheme` says: either listener acts only on a pod the API server says is being
    deleted on its node."""
    get: dict[str, Any] = {"port": port, "path": f"{PRESTOP_PATH}/{namespace}/{name}"}
    if on_host:
        get["host"] = "127.0.0.1"
    return {"preStop": {"httpGet": get}}


def inject_container(image: str) -> dict[str, Any]:
    """The init container that puts criuctl's init and hook into the pod's own emptyDir, from
    criuctl's image: no hostPath, nothing privileged, so the pod passes the `baseline` Pod Security
    Standard (and, this container, `restricted`: it runs as a non-root user with no capability, a
    read-only root and no privilege escalation, whatever the pod's own settings). The files are the
    image's, so they match the agents' criuctl; the agent still writes the moved marker there
    (criuctl.container.containers.mark_moved), from the node's side of the volume."""
    return {
        "name": INJECT_CONTAINER,
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "args": [INJECT_VERB, MOUNT],
        "env": [{"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}],
        "resources": {
            "requests": {"cpu": "10m", "memory": "32Mi"},
            "limits": {"cpu": "1", "memory": "128Mi"},
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "runAsUser": INJECT_UID,
            "runAsGroup": INJECT_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [{"name": VOLUME, "mountPath": MOUNT}],
    }


def wrap(
    pod: Pod,
    prestop_port: int | None = None,
    namespace: str | None = None,
    image: str | None = None,
    prestop_on_host: bool = False,
) -> Pod:
    """The pod with every container that has a `command` started by criuctl's init, and criuctl's
    files mounted read-only: transparent, because Kubernetes appends `args` to `command`, so the
    job's argv is the same. A container without a command runs the image's ENTRYPOINT, which the
    pod spec does not show, so it cannot be wrapped here; it is named in NOT_WRAPPED instead. The
    user's init containers are never wrapped: they run to completion before the job, there is
    nothing to move.

    The files come from criuctl's `image` into an emptyDir by an init container (`inject_container`)
    that runs first; without an image, from the node's copy by hostPath (which the `baseline` Pod
    Security Standard refuses: a webhook outside a cluster, or a test)."""
    new = copy.deepcopy(pod)
    if _annotations(pod).get(INJECTED) == "true":
        return new
    meta = new.setdefault("metadata", {})
    annotations = meta["annotations"] = meta.get("annotations") or {}
    python = annotations.get(PYTHON_ANNOTATION) or DEFAULT_PYTHON
    spec = new.get("spec") or {}
    skipped: dict[str, str] = {}
    for c in spec.get("containers", []):
        if not c.get("command"):
            skipped[c["name"]] = NO_COMMAND
            continue
        if not is_wrapped(c):
            c["command"] = [python, "-I", INIT, "--", *c["command"]]
        # the pod's UID, for the init to tell a container the kubelet restarted after its job moved
        # away from one it must start (criuctl.core.nsinit.moved_to)
        if not any(e.get("name") == env.POD_UID for e in c.get("env") or []):
            c.setdefault("env", []).append(
                {"name": env.POD_UID, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}
            )
        # a hand-wrapped container may mount the files under another volume name: one mount is enough
        if not _mounts(c, MOUNT):
            c.setdefault("volumeMounts", []).append({"name": VOLUME, "mountPath": MOUNT, "readOnly": True})
    used = any(m.get("name") == VOLUME for c in spec.get("containers", []) for m in _mounts(c))
    if used and not any(v.get("name") == VOLUME for v in spec.get("volumes", [])):
        if image:
            spec.setdefault("volumes", []).append({"name": VOLUME, "emptyDir": {"sizeLimit": "64Mi"}})
            spec["initContainers"] = [inject_container(image), *spec.get("initContainers", [])]
        else:  # no image to copy from: the node's copy, which the agent made (missing means no agent)
            host_path = {"path": INJECT_DIR, "type": "Directory"}
            spec.setdefault("volumes", []).append({"name": VOLUME, "hostPath": host_path})
    _run_dirs(spec)
    name, namespace = identity(new), namespace or meta.get("namespace")
    if prestop_port and name and namespace:  # a generateName pod's successor shares nothing: no use
        hooked = False
        for c in spec.get("containers", []):
            if is_wrapped(c) and not (c.get("lifecycle") or {}).get("preStop"):
                # a pod on the host's network has the node's IP: only the loopback listener is there
                hook = prestop_hook(
                    prestop_port, namespace, name, prestop_on_host or bool(spec.get("hostNetwork"))
                )
                c["lifecycle"] = {**(c.get("lifecycle") or {}), **hook}
                hooked = True
        if hooked:
            grace = spec.get("terminationGracePeriodSeconds")
            spec["terminationGracePeriodSeconds"] = max(30 if grace is None else grace, PRESTOP_GRACE)
    if skipped:
        annotations[NOT_WRAPPED] = json.dumps(skipped, sort_keys=True)
    annotations[INJECTED] = "true"
    return new


def has_prestop(container: dict[str, Any]) -> bool:
    """The container carries criuctl's preStop hook (`wrap` with a port)."""
    get = ((container.get("lifecycle") or {}).get("preStop") or {}).get("httpGet") or {}
    return str(get.get("path", "")).startswith(PRESTOP_PATH + "/")


def unheard(pod: Pod, container: str) -> tuple[str, bool] | None:
    """Why deleting `pod` now would checkpoint nothing, its preStop hook reaching no listener, and
    whether that lasts for the container's life (None: it reaches one). A hook at the pod's IP
    needs the listener the agent makes in the pod's network namespace after the container starts:
    a pod deleted before it (within seconds of its start, a restored pod's too) would end and start
    over, so a move waits for the agent's word, read from the pod, for the container that runs
    now. A hook at the agent's loopback needs nothing."""
    ctr = next((c for c in pod["spec"]["containers"] if c["name"] == container), None)
    get = ((((ctr or {}).get("lifecycle") or {}).get("preStop") or {}).get("httpGet")) or {}
    if ctr is None or not has_prestop(ctr):
        return f"container {container} has no criuctl preStop hook (the webhook did not wrap it)", True
    if get.get("host") or pod["spec"].get("hostNetwork"):
        return None
    running = next(
        (s for s in (pod.get("status") or {}).get("containerStatuses") or [] if s["name"] == container), {}
    )
    cid = (running.get("containerID") or "").partition("://")[2]
    said = ((pod.get("metadata") or {}).get("annotations") or {}).get(LISTENER, "")
    if cid and said == cid:
        return None
    if cid and said == TAKEN + cid:
        return (
            f"a process of the pod listens on port {get.get('port')}, where its preStop hook calls the agent",
            True,
        )
    return f"the agent has not yet made its preStop listener in the pod (port {get.get('port')})", False


def successor(pod: Pod, node: str, source: str) -> Pod:
    """A controller's new pod (already `wrap`ped) turned into the placeholder of its predecessor's
    pending move: pinned to `node`, where the bundle is kept; its identity (name, labels, owner) and
    criuctl's preStop hook kept, so that once the job runs in it, it moves on a delete again."""
    new = copy.deepcopy(pod)
    new["metadata"]["annotations"] = {**_annotations(pod), PLACEHOLDER_FOR: source}
    spec = new["spec"]
    spec["nodeName"] = node
    # the node was chosen for it (by `criuctl migrate NODE`, or a drain): the kubelet there would
    # refuse a pod whose node selector or node affinity names another (NodeAffinity), and the
    # controller would recreate it again and again. Pod (anti-)affinity stays.
    spec.pop("nodeSelector", None)
    affinity = {k: v for k, v in (spec.get("affinity") or {}).items() if k != "nodeAffinity"}
    if affinity:
        spec["affinity"] = affinity
    else:
        spec.pop("affinity", None)
    _placeholder_containers(spec, keep=("lifecycle",))
    return new


def placeholder(pod: Pod, node: str, source: str) -> Pod:
    """The restore target's pod, from the wrapped source pod: the same spec (volumes, resources,
    image, security context: the restored job finds the same mounts and limits), pinned to `node`,
    each container running the init's `--placeholder` mode, which waits for the agent's restore.

    Dropped: what the API server sets on a pod it stores (identity, status, the service-account token
    volume it adds again, the priority its admission computes again), ephemeral containers (refused
    on create), and what would act before the job is there (args, lifecycle hooks, probes: a
    liveness probe would kill the waiting placeholder). The caller names the pod."""
    meta = pod.get("metadata") or {}
    bad = [c["name"] for c in pod.get("spec", {}).get("containers", []) if not is_wrapped(c)]
    if bad:
        raise ValueError(
            f"pod {source}: container(s) {', '.join(bad)} do not run under criuctl's init, so their "
            "job cannot be checkpointed; give each a command and recreate the pod with the "
            f"{LABEL}=true label (docs/webhook.md)"
        )
    annotations = {**(meta.get("annotations") or {}), PLACEHOLDER_FOR: source}
    new_meta = {"namespace": meta.get("namespace"), "labels": meta.get("labels"), "annotations": annotations}
    spec = copy.deepcopy(pod.get("spec", {}))
    for key in ("ephemeralContainers", "priority", "preemptionPolicy"):
        spec.pop(key, None)
    spec["nodeName"] = node
    _drop_token_volume(spec)
    _placeholder_containers(spec)
    return {
        "apiVersion": pod.get("apiVersion", "v1"),
        "kind": pod.get("kind", "Pod"),
        "metadata": {k: copy.deepcopy(v) for k, v in new_meta.items() if v is not None},
        "spec": spec,
    }


def _placeholder_containers(spec: dict[str, Any], keep: tuple[str, ...] = ()) -> None:
    """Every (wrapped) container runs the init's `--placeholder` mode, which waits for the restore;
    what would act before the job is there goes (args; probes: a liveness probe would kill the
    waiting placeholder), unless kept."""
    for c in spec["containers"]:
        c["command"] = [c["command"][0], "-I", INIT, "--placeholder"]
        for key in ("args", "lifecycle", *PROBES):
            if key not in keep:
                c.pop(key, None)
    _run_dirs(spec)


def _run_dirs(spec: dict[str, Any]) -> None:
    """An emptyDir at RUN_DIR for each wrapped container whose root filesystem is read-only: the
    init makes its control FIFOs there (a placeholder), and the hook its step boundary's control
    directory (a job); a read-only rootfs refuses both."""
    needs = False
    for c in spec.get("containers", []):
        read_only = (c.get("securityContext") or {}).get("readOnlyRootFilesystem")
        if is_wrapped(c) and read_only and not _mounts(c, RUN_DIR):
            c.setdefault("volumeMounts", []).append({"name": RUN_VOLUME, "mountPath": RUN_DIR})
            needs = True
    if needs and not any(v.get("name") == RUN_VOLUME for v in spec.get("volumes", [])):
        spec.setdefault("volumes", []).append({"name": RUN_VOLUME, "emptyDir": {}})


def _drop_token_volume(spec: dict[str, Any]) -> None:
    """Remove the service-account token volume and its mounts: the ServiceAccount admission plugin
    adds its own to the new pod, and a copied one would either duplicate its mount path or name a
    token Secret of the source (`<sa>-token-xxxxx`, before 1.22) or a projected volume
    (`kube-api-access-xxxxx`, from 1.22) that the plugin did not make for this pod."""
    sa = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
    dropped = {
        v["name"]
        for v in spec.get("volumes", [])
        if (v["name"].startswith(f"{sa}-token-") and "secret" in v)
        or (v["name"].startswith("kube-api-access-") and "projected" in v)
    }
    if not dropped:
        return
    spec["volumes"] = [v for v in spec["volumes"] if v["name"] not in dropped]
    for c in (*spec.get("initContainers", []), *spec.get("containers", [])):
        if "volumeMounts" in c:
            c["volumeMounts"] = [m for m in c["volumeMounts"] if m["name"] not in dropped]


def patch(old: Pod, new: Pod) -> list[dict[str, Any]]:
    """An RFC 6902 JSONPatch turning `old` into `new`, whole fields at a time (PATCHED): what `wrap`
    changes. A difference anywhere else raises ValueError rather than yielding a patch that would
    silently lose it."""
    if _without(old) != _without(new):
        raise ValueError("the pods differ outside " + ", ".join("/".join(p) for p in PATCHED))
    ops: list[dict[str, Any]] = []
    for parent in dict.fromkeys(p for p, _ in PATCHED):
        keys = [k for p, k in PATCHED if p == parent]
        before, after = old.get(parent), new.get(parent) or {}
        if not isinstance(before, dict):  # no object to add members to: add the whole one
            if any(k in after for k in keys):
                ops.append({"op": "add", "path": f"/{parent}", "value": after})
            continue
        for key in keys:
            path = f"/{parent}/{key}"
            if key not in after:
                if key in before:
                    ops.append({"op": "remove", "path": path})
            elif key not in before:
                ops.append({"op": "add", "path": path, "value": after[key]})
            elif before[key] != after[key]:
                ops.append({"op": "replace", "path": path, "value": after[key]})
    return ops


def _without(pod: Pod) -> Pod:
    """The pod less the PATCHED fields; `metadata` and `spec` themselves are always present in a pod
    the API server sends, so an empty one stands for a missing one."""
    out = dict(pod)
    for parent, key in PATCHED:
        out[parent] = {k: v for k, v in (out.get(parent) or {}).items() if k != key}
    return out


def _mounts(container: dict[str, Any], path: str | None = None) -> list[dict[str, Any]]:
    """The container's volume mounts, or those at `path`."""
    found = container.get("volumeMounts") or []
    return [m for m in found if path is None or m.get("mountPath") == path]


def _annotations(pod: Pod) -> dict[str, str]:
    return (pod.get("metadata") or {}).get("annotations") or {}
