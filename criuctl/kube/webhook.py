"""`criuctl webhook`: the mutating admission webhook that makes opted-in pods migratable at creation.

The API server sends every pod CREATE that the MutatingWebhookConfiguration selects
(manifests/webhook.yaml: the pod or its namespace labelled criuctl.io/migratable=true) as an
AdmissionReview; the answer is a JSONPatch that wraps the containers' commands in criuctl's init
(criuctl.kube.mutate.wrap). The server holds no state and needs no Kubernetes credentials: all it
knows comes in the review, except the pending moves of controller-owned pods (criuctl.kube.moves),
which it reads through the API server when given credentials (`--kubeconfig`, or in-cluster).
docs/webhook.md has the selectors, TLS and failure policy.
"""

from __future__ import annotations

import asyncio
import base64
import datetime
import json
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from criuctl.agent import preflight
from criuctl.core import env
from criuctl.core.errors import CriuctlError
from criuctl.kube import api, cluster, identity, jobfailures, moves, mutate, owners, recordrules

log = logging.getLogger("criuctl.webhook")

API_VERSION = "admission.k8s.io/v1"
# A pod's JSON is bounded by etcd's request limit (1.5 MiB); aiohttp's default (1 MiB) is not enough.
MAX_BODY = 8 * 1024 * 1024
GRACE_MARGIN = 10.0  # s past a leaving pod's grace period after which it holds its successor no more


class Malformed(ValueError):
    """A review this webhook cannot read: not one the API server would send."""


class MovesUnknown(Exception):
    """The pending moves could not be read (the API server failed, or did not answer within
    criuctl.kube.api's admission timeouts): whether the pod is a move's successor is unknown."""


@dataclass
class Options:
    """What the webhook adds beyond the wrap: criuctl's preStop hook (the node agents' hook port),
    and the pending moves it reads to make a controller's new pod its predecessor's placeholder
    (None: no credentials, no pending moves seen; docs/kubernetes.md)."""

    prestop_port: int | None = None
    prestop_on_host: bool = False  # the hook calls the agent's loopback (`host`), not the pod's IP
    image: str | None = None  # criuctl's image, for the wrapped pods' init container (mutate.wrap)
    pending: Callable[[str, str], moves.Move | None] | None = None
    # the name of a pod of this identity being deleted whose preStop may be checkpointing its job
    # (a JobSet's pod: its successor has another name, so the two can exist together)
    leaving: Callable[[str, str, str], str | None] | None = None
    # a pod about to be evicted (a drain): what was done to keep it out of its Job's failure count
    untrack: Callable[[str, str], str] | None = None
    # a write of a move record (the review's request): why it is refused, None if it is not
    # (criuctl.kube.recordrules); raises MovesUnknown when the API server cannot tell
    record_write: Callable[[dict[str, Any]], str | None] | None = None


def review(request: dict[str, Any], opts: Options | None = None) -> dict[str, Any]:
    """An AdmissionReview v1 request → its response: allowed, with a JSONPatch when the pod changes.

    A malformed review is refused (allowed false, with the reason), not admitted: only the API
    server talks to this endpoint, so a review that cannot be read is a version skew or a bug, and
    admitting the pod anyway would start a job its owner asked to be migratable as one that is not,
    silently. Refused, the reason reaches whoever created the pod. A review the webhook does not
    care about (not a pod CREATE, a placeholder, a pod already wrapped) is allowed unchanged."""
    return _admit(request, opts or Options())[0]


def _admit(body: Any, opts: Options) -> tuple[dict[str, Any], str]:
    """`review`, plus the one log line that says what was done to which pod."""
    uid = ""
    try:
        req = _request(body)
        uid = req["uid"]
        kind, operation = req.get("kind") or {}, req.get("operation")
        what = f"{operation} {kind.get('group') or 'core'}/{kind.get('kind')}"
        if (kind.get("group"), kind.get("kind")) != ("", "Pod") or req.get("subResource"):
            return _response(uid), f"{what}: not a pod, left alone"
        pod = req.get("object")
        if operation != "CREATE":  # a DELETE has no object: only a creation is ever mutated
            return _response(uid), f"{what} {_who(req, pod)}: not a creation, left alone"
        if not isinstance(pod, dict):
            raise Malformed(f"the {what} review has no object")
        who = _who(req, pod)
        if mutate.is_placeholder(pod):
            return _response(uid), f"{who}: a placeholder, left alone"
        namespace = req.get("namespace") or (pod.get("metadata") or {}).get("namespace")
        name = mutate.identity(pod)  # what a predecessor's move record is keyed by
        try:
            move = opts.pending(namespace, name) if opts.pending and namespace and name else None
        except MovesUnknown as exc:
            return _unsure(uid, who, pod, exc)
        if move is not None and move.phase not in (moves.Phase.DUMPING, moves.Phase.KEPT):
            move = None
        if move is None and (held := _hold(uid, who, pod, opts, namespace, name)) is not None:
            return held
        try:
            new = mutate.wrap(pod, opts.prestop_port, namespace, opts.image, opts.prestop_on_host)
            if move is not None:
                node = move.holder or move.target
                new = mutate.successor(new, node, f"{namespace}/{name}@{move.source}")
            ops = mutate.patch(pod, new)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise Malformed(f"pod {who} is not a pod this webhook can read ({exc!r})") from exc
        if move is not None:
            line = f"{who}: its predecessor's placeholder, pinned to node {node} (bundle {move.bundle})"
            return _response(uid, ops), line
        if not ops:
            return _response(uid), f"{who}: already injected, not mutated"
        wrapped = [c["name"] for c in new["spec"]["containers"] if mutate.is_wrapped(c)]
        skipped = sorted(mutate.not_wrapped(new))
        return _response(uid, ops), (
            f"{who}: mutated (wrapped: {', '.join(wrapped) or 'none'}; "
            f"not wrapped: {', '.join(skipped) or 'none'})"
        )
    except Malformed as exc:
        message = f"criuctl's admission webhook refused the request: {exc}"
        return _response(uid, allowed=False, message=message), f"refused: {exc}"


def review_eviction(request: dict[str, Any], opts: Options | None = None) -> dict[str, Any]:
    """An AdmissionReview of an eviction (`pods/eviction` CREATE: what `kubectl drain` sends for
    each pod) → always allowed. Before the API server deletes the pod, a Job's pod under criuctl's
    preStop leaves its Job's failure count (criuctl.kube.jobfailures.untrack): its move is then no
    failure of the Job, and the Job makes the successor at once. A dry run changes nothing."""
    return _evict(request, opts or Options())[0]


def _evict(body: Any, opts: Options) -> tuple[dict[str, Any], str]:
    uid = ""
    try:
        req = _request(body)
        uid = req["uid"]
    except Malformed as exc:  # allowed all the same: this webhook never stands between a drain and a pod
        return _response(uid), f"eviction: not read ({exc}), allowed"
    resource = req.get("resource") or {}
    who = f"{req.get('namespace') or '?'}/{req.get('name') or '?'}"
    if (resource.get("group"), resource.get("resource"), req.get("subResource"), req.get("operation")) != (
        "",
        "pods",
        "eviction",
        "CREATE",
    ):
        return _response(uid), f"{who}: not an eviction, left alone"
    if req.get("dryRun"):
        return _response(uid), f"eviction of {who}: a dry run, nothing done"
    if opts.untrack is None or not req.get("namespace") or not req.get("name"):
        return _response(uid), f"eviction of {who}: allowed (no credentials: its Job counts it)"
    return _response(uid), f"eviction of {who}: {opts.untrack(req['namespace'], req['name'])}"


def review_record(request: dict[str, Any], opts: Options | None = None) -> dict[str, Any]:
    """An AdmissionReview of a write of a ConfigMap labelled a move record → allowed, or refused
    with why (criuctl.kube.recordrules). Fail closed: a write that cannot be judged (no
    credentials, the API server not answering, a review not read) is refused, and its writer tries
    again; a ConfigMap of another namespace is none of criuctl's."""
    return _record(request, opts or Options())[0]


def _record(body: Any, opts: Options) -> tuple[dict[str, Any], str]:
    uid = ""
    try:
        req = _request(body)
        uid = req["uid"]
        kind, namespace = req.get("kind") or {}, req.get("namespace")
        what = f"{req.get('operation')} configmap {namespace}/{req.get('name') or '?'}"
        if (kind.get("group"), kind.get("kind")) != ("", "ConfigMap") or namespace != moves.SYSTEM_NS:
            return _response(uid), f"{what}: no move record, left alone"
        if opts.record_write is None:
            why: str | None = "criuctl's webhook has no API credentials to judge it with"
        else:
            try:
                why = opts.record_write(req)
            except MovesUnknown as exc:
                why = str(exc)
    except Malformed as exc:
        why, what = str(exc), "a move record's write"
    if why is None:
        return _response(uid), f"{what} by {_user(body)}: allowed"
    message = f"criuctl's admission webhook refused the write of a move record: {why}"
    return _response(
        uid, allowed=False, message=message, code=403
    ), f"{what} by {_user(body)}: refused, {why}"


def _user(body: Any) -> str:
    req = body.get("request") if isinstance(body, dict) else None
    return str(((req or {}).get("userInfo") or {}).get("username") or "?") if isinstance(req, dict) else "?"


def record_judge(kubeconfig: str | None) -> Callable[[dict[str, Any]], str | None]:
    """`Options.record_write` through the API server, bounded as `pending_moves`: the writer as the
    API server authenticated it (an agent's node from its pod), the record before and after, the
    pod it names, and the other records for a bundle id, judged by criuctl.kube.recordrules."""
    c = cluster.connect(kubeconfig, api.timeouts().admission())

    def pod_of(namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return c.serialize(cluster.call(f"pod {name}", c.core.read_namespaced_pod, name, namespace))
        except cluster.NotFound:
            return None

    def judge(req: dict[str, Any]) -> str | None:
        user = req.get("userInfo") or {}
        who = recordrules.Writer(str(user.get("username") or ""))
        if not (who.is_agent or who.is_controller):
            return None  # RBAC's to judge
        try:
            op = recordrules.Operation(req.get("operation"))
            old = moves.from_object(req.get("oldObject"))
            new = moves.from_object(req.get("object")) if op != recordrules.Operation.DELETE else None
        except (KeyError, ValueError, TypeError) as exc:
            return f"not a move record as criuctl writes them ({exc!r})"
        if old is None and new is None:
            return None  # no record before or after: a ConfigMap of criuctl's own
        if new is None:
            op = recordrules.Operation.DELETE  # a record's label taken off: it is one no more
        try:
            if who.is_agent:
                node, why = identity.agent_node(c, user.get("extra") or {}, live=False)
                if not node:
                    return f"criuctl's agent: {why}"
                who = recordrules.Writer(who.user, node)
            return recordrules.judge(op, who, old, new, pod_of, lambda: moves.every(c))
        except CriuctlError as exc:
            raise MovesUnknown(f"the API server did not answer what the write needs ({exc.what})") from exc

    return judge


def _hold(
    uid: str, who: str, pod: dict[str, Any], opts: Options, namespace: str, ident: str
) -> tuple[dict[str, Any], str] | None:
    """The refusal of an Indexed Job's pod (a JobSet's, or its own) created while a predecessor of
    its index is being deleted and no record says its job is in a bundle (`dumping`, `kept`):
    none, one only requested, or one
    of an earlier pod or a failed checkpoint (the job then runs on in the predecessor until its
    container ends). A recent Job controller replaces a pod as soon as it is deleted
    (`podReplacementPolicy: TerminatingOrFailed`, the default), before the predecessor's preStop
    has written `dumping`; admitted then, it would start its rank beside the one still running.
    Refused, the Job controller retries (its API backoff: 1 s, doubling); once the record says
    `dumping` the retry becomes the placeholder, and once the predecessor is gone an ordinary pod.
    A predecessor past its grace period (a dead node's pod stays Terminating) holds nothing: its
    preStop, if it ever ran, has ended. None: nothing to wait for."""
    if opts.leaving is None or not mutate.indexed(pod):
        return None
    try:
        old = opts.leaving(namespace, ident, mutate.same_index(pod))
    except MovesUnknown as exc:
        return _unsure(uid, who, pod, exc)
    if old is None:
        return None
    message = (
        f"pod {ident}'s predecessor {old} is being deleted and criuctl may be checkpointing its job: "
        "its successor is admitted once that is decided (its controller retries)"
    )
    return _response(uid, allowed=False, message=message), f"{who}: held back ({old} is leaving)"


def _unsure(uid: str, who: str, pod: dict[str, Any], exc: MovesUnknown) -> tuple[dict[str, Any], str]:
    """The answer when the pod's pending move is unknown: what the failurePolicy of the webhook
    entry the pod came through does when the webhook cannot answer (manifests/webhook.yaml). A pod
    labelled criuctl.io/migratable=true itself (`pods.criuctl.io`, Fail) is refused: its controller
    retries, and once the lookup works a successor becomes its predecessor's placeholder. A pod
    opted in only by its namespace (`namespaces.criuctl.io`, Ignore) is admitted unchanged.

    Never a guess: a placeholder made without the record would be pinned to a node that may not
    hold the bundle. Either answer keeps the job running once: a successor admitted unchanged
    starts its job over, and the holder's moves loop then fails the move with the bundle kept,
    never restoring it beside (criuctl.kube.successors)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if labels.get(mutate.LABEL) == "true":
        message = (
            f"criuctl's admission webhook refused the request: pod {who} may be the successor of a "
            f"pending move, and {exc}; it is admitted once the API server answers (its controller retries)"
        )
        return _response(uid, allowed=False, message=message, code=503), f"{who}: refused, {exc}"
    return _response(uid), f"{who}: admitted unchanged (opted in by its namespace), {exc}"


def _request(body: Any) -> dict[str, Any]:
    """The `request` of an AdmissionReview v1, checked as far as `_admit` relies on it."""
    if not isinstance(body, dict):
        raise Malformed("the body is not a JSON object")
    if (body.get("apiVersion"), body.get("kind")) != (API_VERSION, "AdmissionReview"):
        raise Malformed(
            f"not an {API_VERSION} AdmissionReview (apiVersion {body.get('apiVersion')!r}, "
            f"kind {body.get('kind')!r}): set admissionReviewVersions to [v1]"
        )
    req = body.get("request")
    if not isinstance(req, dict) or not isinstance(req.get("uid"), str) or not req["uid"]:
        raise Malformed("the AdmissionReview has no request with a uid")
    return req


def _who(req: dict[str, Any], pod: Any) -> str:
    """NAMESPACE/NAME for the log; a pod created with generateName has no name yet."""
    meta = (pod.get("metadata") if isinstance(pod, dict) else None) or {}
    namespace = req.get("namespace") or meta.get("namespace") or "?"
    return f"{namespace}/{meta.get('name') or meta.get('generateName') or req.get('name') or '?'}"


def _response(
    uid: str,
    ops: list[dict[str, Any]] | None = None,
    *,
    allowed: bool = True,
    message: str = "",
    code: int = 400,
) -> dict[str, Any]:
    response: dict[str, Any] = {"uid": uid, "allowed": allowed}
    if ops:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
    if message:
        response["status"] = {"code": code, "message": message}
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def _endpoint(answer: Callable[[Any, Options], tuple[dict[str, Any], str]]):
    """An aiohttp handler for AdmissionReviews that `answer` decides (`_admit`, `_evict`), off the
    event loop (it may call the API server), with its one log line."""

    async def handle(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            body = None  # answered as a malformed review: said why, not a bare 400
        response, line = await asyncio.to_thread(answer, body, request.app[OPTIONS])
        log.info(line)
        return web.json_response(response)

    return handle


async def _healthz(_request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


OPTIONS = web.AppKey("options", Options)


def app(opts: Options | None = None) -> web.Application:
    """POST /mutate (pod creations), POST /evict (evictions), POST /records (move records' writes)
    and GET /healthz (the readiness probe)."""
    application = web.Application(client_max_size=MAX_BODY)
    application[OPTIONS] = opts or Options()
    application.router.add_post("/mutate", _endpoint(_admit))
    application.router.add_post("/evict", _endpoint(_evict))
    application.router.add_post("/records", _endpoint(_record))
    application.router.add_get("/healthz", _healthz)
    return application


def pending_moves(kubeconfig: str | None) -> Callable[[str, str], moves.Move | None]:
    """The lookup of pending moves, through the API server (in-cluster credentials or a kubeconfig),
    bounded by the admission timeouts (criuctl.kube.api): it ends in time for the webhook to answer
    before the API server's own timeout. A lookup that fails raises MovesUnknown (`_unsure`)."""
    c = cluster.connect(kubeconfig, api.timeouts().admission())

    def pending(namespace: str, name: str) -> moves.Move | None:
        try:
            return moves.read(c, namespace, name)
        except CriuctlError as exc:
            raise MovesUnknown(f"criuctl's pending moves cannot be read: {exc.what}") from exc

    return pending


def _in_grace(deletion: str | None, now: float) -> bool:
    """Being deleted, its grace period (which the deletion timestamp ends) not over."""
    if not deletion:
        return False
    ends = datetime.datetime.fromisoformat(deletion.replace("Z", "+00:00")).timestamp()
    return now < ends + GRACE_MARGIN


def leaving_pods(kubeconfig: str | None) -> Callable[[str, str, str], str | None]:
    """The lookup of a JobSet pod's predecessor still leaving (`Options.leaving`), through the API
    server, bounded as `pending_moves`: a pod of the identity (among those of the selector: its
    index's) with a deletion timestamp, not ended, that carries criuctl's preStop hook."""
    c = cluster.connect(kubeconfig, api.timeouts().admission())

    def leaving(namespace: str, ident: str, selector: str) -> str | None:
        try:
            found = owners.pods_of(c, namespace, ident, selector)
        except CriuctlError as exc:
            raise MovesUnknown(f"the pods of {ident} cannot be read: {exc.what}") from exc
        now = time.time()
        for p in found:
            ended = (p.get("status") or {}).get("phase") in ("Succeeded", "Failed")
            hooked = any(mutate.has_prestop(ctr) for ctr in p["spec"]["containers"])
            if hooked and not ended and _in_grace(p["metadata"].get("deletionTimestamp"), now):
                return str(p["metadata"]["name"])
        return None

    return leaving


def own_image(kubeconfig: str | None) -> str | None:
    """The image of the webhook's own pod (env CRIUCTL_POD, NAMESPACE/NAME): the one the wrapped
    pods' init container copies criuctl's files from, so that a kustomize `images` override (the
    one line a user changes) reaches it too. None outside a pod. A pod that cannot be read stops
    the webhook at start, in one line: wrapping without the image would give every training pod a
    hostPath, which Pod Security baseline refuses."""
    own = env.OWN_POD.get()
    if not own:
        return None
    namespace, _, name = own.partition("/")
    c = cluster.connect(kubeconfig, api.timeouts().admission())
    read = c.core.read_namespaced_pod
    pod = c.serialize(cluster.call(f"the webhook's own pod {own}", read, name, namespace))
    images = [ctr["image"] for ctr in pod["spec"]["containers"] if (ctr.get("args") or [""])[0] == "webhook"]
    return images[0] if images else str(pod["spec"]["containers"][0]["image"])


def untracker(kubeconfig: str | None) -> Callable[[str, str], str]:
    """`Options.untrack` through the API server, bounded as `pending_moves`: the pod read, and a
    Job's pod under criuctl's preStop untracked. Never raises: an eviction is never held up."""
    c = cluster.connect(kubeconfig, api.timeouts().admission())

    def untrack(namespace: str, name: str) -> str:
        try:
            pod = c.serialize(cluster.call(f"pod {name}", c.core.read_namespaced_pod, name, namespace))
        except CriuctlError as exc:
            return f"allowed, the pod not read ({exc.what}): its Job counts it"
        if (owners.controller_ref(pod) or {}).get("kind") != "Job":
            return "allowed (not a Job's pod)"
        if not any(mutate.has_prestop(ctr) for ctr in pod["spec"]["containers"]):
            return "allowed (no criuctl preStop: it ends with its pod)"
        if jobfailures.untrack(c, pod):
            return "allowed, out of its Job's failure count (its preStop moves it)"
        return "allowed, its Job's tracking finalizer kept (the API server refused): its Job counts it"

    return untrack


def serve(listen: str, cert: str, key: str, opts: Options | None = None) -> None:
    """Serve HTTPS on `listen` ("HOST:PORT") until SIGTERM or SIGINT.

    The API server talks to admission webhooks over HTTPS only, verifying the certificate against
    the configuration's caBundle (scripts/webhook-cert.sh makes both). The files are read once:
    a new certificate takes a restart (`kubectl -n criuctl-system rollout restart deploy/criuctl-webhook`).
    Bad options fail here in one line each (criuctl.agent.preflight), before anything listens."""
    host, port = preflight.parse_listen(listen)
    preflight.check_tls(Path(cert), Path(key))
    preflight.check_bind(host, port)
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert, key)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True)
    log.info("listening on https://%s:%d (/mutate, /evict, /records)", host, port)
    web.run_app(app(opts), host=host, port=port, ssl_context=ctx, print=None, access_log=None)
