"""`PodMigration` objects (criuctl.io/v1alpha1, manifests/podmigration-crd.yaml): one pod's move,
asked for by creating the object and carried out by the controller in the cluster
(criuctl.kube.controller). Its status is the move's durable record: the controller writes each phase
there *before* it acts on it, so a controller that restarts (or a second replica that takes the
Lease over) reads where the move is and takes it up from there (docs/architecture.md, "The
controller's phases").

    Pending      created; no controller has looked at it yet
    Checking     the checks of `criuctl migrate` run (criuctl.kube.podplan): nothing is changed
    Placing      the placeholder pod (or, for a controller's pod, the move record) is being made;
                 the job has not been touched
    Migrating    the agents' migration (or the preStop checkpoint) runs: `incomingId`/`outgoingId`
                 name it, so the agents can be asked how it ended
    HandingOver  the job runs on the target: the source pod is being deleted (or the successor
                 restored)
    Succeeded    the job runs on the target (or, for `dryRun`, the checks passed)
    Failed       it runs where it ran, whole; `reason` says why in one line
    InDoubt      the agents have not settled yet which side runs it; the controller keeps asking

Each write is a merge patch of the status subresource; the spec is read once, at Checking, into
the status (`source`, `target`): a spec changed later changes nothing.
"""

from __future__ import annotations

import datetime
from enum import StrEnum
from typing import Any

from criuctl.core.errors import CriuctlError
from criuctl.kube.cluster import Cluster, NotFound, call

GROUP, VERSION, PLURAL, KIND = "criuctl.io", "v1alpha1", "podmigrations", "PodMigration"
API_VERSION = f"{GROUP}/{VERSION}"
CRD = f"{PLURAL}.{GROUP}"


class Phase(StrEnum):
    PENDING = "Pending"
    CHECKING = "Checking"
    PLACING = "Placing"
    MIGRATING = "Migrating"
    HANDING_OVER = "HandingOver"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    IN_DOUBT = "InDoubt"

    @property
    def final(self) -> bool:
        return self in (Phase.SUCCEEDED, Phase.FAILED)


# the conditions a status carries, each True once reached (Kubernetes' style: a type, True, the
# reason in CamelCase, a message, when it became True, and the generation it was about); a move
# that ended has Succeeded or Failed True, as a Job has Complete or Failed
CHECKED, COMMITTED, SUCCEEDED, FAILED = "Checked", "Committed", "Succeeded", "Failed"


STAMP = "%Y-%m-%dT%H:%M:%SZ"  # RFC 3339 in UTC, as the API server writes its own times


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime(STAMP)


def phase_of(obj: dict) -> Phase:
    return Phase((obj.get("status") or {}).get("phase") or Phase.PENDING)


def body(
    namespace: str,
    pod: str,
    node: str,
    mode: str | None = None,
    dry_run: bool = False,
    name: str | None = None,
    origin: str = "",
    ttl: int | None = None,
) -> dict[str, Any]:
    """A PodMigration moving `pod` to `node`: named `name`, or generated from the pod's name."""
    meta: dict[str, Any] = {"namespace": namespace}
    if name:
        meta["name"] = name
    else:  # the API server appends 5 characters; a name is at most 253
        meta["generateName"] = f"{pod[:200]}-to-{node[:40]}-"
    if origin:
        meta["annotations"] = {ORIGIN: origin}
    spec: dict[str, Any] = {"pod": pod, "node": node}
    if mode:
        spec["mode"] = mode
    if dry_run:
        spec["dryRun"] = True
    if ttl is not None:
        spec["ttlSecondsAfterFinished"] = ttl
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta, "spec": spec}


ORIGIN = f"{GROUP}/origin"  # who asked: "criuctl migrate", "prestop" (a drain or eviction), or none (kubectl)
SOURCE_UID = f"{GROUP}/source-uid"  # a preStop's record: the deleted pod's UID
SOURCE_NODE = f"{GROUP}/source-node"
SOURCE_IDENTITY = f"{GROUP}/source-identity"  # what its successor shares (criuctl.kube.owners.identity)
PRESTOP = "prestop"
# a person's cancel (`criuctl cancel`, or `kubectl annotate`): its value says who asked. A move not
# begun ends Failed (Cancelled); one in doubt whose target is deleted or tainted out-of-service is
# settled on the source; one under way is not cut short (it ends by itself, undone if it fails)
CANCEL = f"{GROUP}/cancel"


def cancelled(obj: dict) -> str | None:
    """Who cancelled the PodMigration, if anyone did."""
    return ((obj.get("metadata") or {}).get("annotations") or {}).get(CANCEL) or None


def cancel(c: Cluster, namespace: str, name: str, who: str) -> dict:
    """Ask the controller to cancel the move (an annotation: the spec is immutable)."""
    return call(
        _what(namespace, name),
        c.custom.patch_namespaced_custom_object,
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        name,
        {"metadata": {"annotations": {CANCEL: who}}},
    )


def record_drain(
    c: Cluster, namespace: str, pod: str, uid: str, source: str, target: str, identity: str = ""
) -> dict:
    """The PodMigration of a move a pod's preStop hook started (a drain, an eviction): so that every
    move in a cluster is listed in one place. The controller follows it to its end; it runs no
    check and makes no step of its own (the agents carry it: criuctl.kube.prestop)."""
    obj = body(namespace, pod, target, name=f"{pod[:200]}-prestop-{uid[:8]}", origin=PRESTOP)
    obj["metadata"]["annotations"].update(
        {SOURCE_UID: uid, SOURCE_NODE: source, SOURCE_IDENTITY: identity or pod}
    )
    return create(c, obj)


def _what(namespace: str, name: str = "") -> str:
    return f"podmigration {namespace}/{name}" if name else f"podmigrations in namespace {namespace}"


def create(c: Cluster, obj: dict, server_dry_run: bool = False) -> dict:
    """Create `obj`; with `server_dry_run`, only the API server's checks (schema, RBAC), stored nowhere."""
    ns = obj["metadata"]["namespace"]
    kw = {"dry_run": "All"} if server_dry_run else {}
    try:
        return call(
            _what(ns), c.custom.create_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, obj, **kw
        )
    except NotFound as exc:  # the resource itself is unknown: the CRD is not installed
        raise CriuctlError(
            f"the cluster has no {CRD} resource",
            "install criuctl: `kubectl apply -k manifests/` (docs/deploy.md)",
        ) from exc


def read(c: Cluster, namespace: str, name: str) -> dict:
    try:
        return call(
            _what(namespace, name),
            c.custom.get_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
        )
    except NotFound as exc:
        raise NotFound(f"no podmigration {name!r} in namespace {namespace}", "see `criuctl get`") from exc


def every(c: Cluster, namespace: str | None = None) -> list[dict]:
    """Every PodMigration of `namespace`, or of the cluster."""
    if namespace is None:
        out = call("podmigrations", c.custom.list_cluster_custom_object, GROUP, VERSION, PLURAL)
    else:
        out = call(
            _what(namespace), c.custom.list_namespaced_custom_object, GROUP, VERSION, namespace, PLURAL
        )
    return list(out.get("items") or [])


def delete(c: Cluster, namespace: str, name: str) -> None:
    import contextlib

    with contextlib.suppress(NotFound):
        call(
            _what(namespace, name),
            c.custom.delete_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
        )


def patch_status(
    c: Cluster, namespace: str, name: str, status: dict[str, Any], version: str | None = None
) -> dict:
    """Merge `status` into the object's status (the status subresource): returns the object. An
    empty string is left out: the client sends it as null, which a string field refuses. With
    `version` (the resourceVersion the writer read), only if nobody wrote the object since:
    Conflict otherwise (the API server checks a resourceVersion in a patch as a precondition)."""
    status = {k: v for k, v in status.items() if v != ""}
    body: dict[str, Any] = {"status": status}
    if version:
        body["metadata"] = {"resourceVersion": version}
    return call(
        _what(namespace, name),
        c.custom.patch_namespaced_custom_object_status,
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        name,
        body,
    )


def condition(obj: dict, kind: str, reason: str, message: str) -> list[dict]:
    """The object's conditions with `kind` set True (its transition time kept if it already was)."""
    out = [dict(c) for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") != kind]
    old = next((c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), None)
    since = old["lastTransitionTime"] if old and old.get("status") == "True" else now()
    out.append(
        {
            "type": kind,
            "status": "True",
            "reason": reason,
            "message": message[:1000],
            "lastTransitionTime": since,
            "observedGeneration": generation(obj),
        }
    )
    return out


def expired(obj: dict, at: float) -> bool:
    """A move that ended more than its `spec.ttlSecondsAfterFinished` ago (as a Job's TTL: the
    controller deletes it then; unset, it is kept)."""
    ttl = (obj.get("spec") or {}).get("ttlSecondsAfterFinished")
    status = obj.get("status") or {}
    if ttl is None or not phase_of(obj).final or not status.get("finishedAt"):
        return False
    ended = datetime.datetime.strptime(status["finishedAt"], STAMP).replace(tzinfo=datetime.UTC)
    return at >= ended.timestamp() + int(ttl)


def generation(obj: dict) -> int | None:
    """The object's `metadata.generation` (the API server bumps it on each change of the spec)."""
    return (obj.get("metadata") or {}).get("generation")


def downtime_text(seconds: float | None) -> str:
    """The DOWNTIME column: a string, since a printer column cannot format a number."""
    return "" if seconds is None else f"{seconds:.2f}s"


class Unfinished(CriuctlError):
    """`follow` gave up on an object no controller took up, or that is in doubt."""


def follow(c: Cluster, namespace: str, name: str, progress, pending_timeout: float = 60.0) -> dict:
    """The object once it ended (Succeeded, Failed), passing each step of its status to `progress`
    (render.migration_progress). Raises Unfinished if no controller took it up within
    `pending_timeout` (the object is then deleted: nothing was changed), or once it is InDoubt
    (exit status 5, as a migration in doubt; the controller goes on settling it)."""
    import time

    created = time.monotonic()
    shown: tuple[str, Any] = ("", None)
    while True:
        obj = read(c, namespace, name)
        st = obj.get("status") or {}
        phase = phase_of(obj)
        step = st.get("step") or ""
        if step and (step, st.get("stepDone")) != shown:
            progress(step, done=st.get("stepDone"), total=st.get("stepTotal"))
            shown = (step, st.get("stepDone"))
        if phase.final:
            return obj
        if phase == Phase.IN_DOUBT:
            err = Unfinished(
                f"podmigration {name}: {st.get('reason') or 'in doubt'}",
                "the controller keeps asking the agents; follow it with "
                f"`kubectl -n {namespace} get podmigration {name} -w`",
            )
            err.exit_code = 5
            raise err
        if phase == Phase.PENDING and time.monotonic() - created > pending_timeout:
            delete(c, namespace, name)
            try:  # a controller that took it up meanwhile holds it (its finalizer): follow on
                read(c, namespace, name)
                created = time.monotonic()
                continue
            except NotFound:
                pass
            raise Unfinished(
                f"no controller took podmigration {namespace}/{name} up within {pending_timeout:.0f} s; "
                "it was deleted, nothing was changed",
                "is criuctl's controller running (it leads once criuctl's signer gave it its certificate)? "
                "`kubectl -n criuctl-system get deploy criuctl-controller criuctl-signer`",
            )
        time.sleep(0.25)
