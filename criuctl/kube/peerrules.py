"""What another node's agent may ask of this one on Kubernetes, where no token is shared.

Agents call each other for the successor path of a controller-owned pod (criuctl.kube.prestop,
criuctl.kube.successors, criuctl.kube.jobmoves), showing their node's certificate. A node whose
root is taken must not thereby hold every other node: its certificate opens here only what a
pending move (criuctl.kube.moves, the records in the API server) needs of a node it names:

    GET  /v1/info, /v1/workloads, /v1/containers   any agent: what runs here, no memory, no logs
    POST /v1/bundles/ID/page-client               any agent: a page-client certificate (public;
                                                 its key stays here) asked before the move's
                                                 record names the bundle (prestop._lazy); at most
                                                 pageserving.MOST_UNUSED wait unused, a day each
    POST /v1/bundles/ID/expect, PUT /v1/bundles/ID,   a move whose bundle is ID names both nodes
    DELETE /v1/bundles/ID                        (source, target or holder): its copy coming
                                                 here, its deletion. Reading a bundle (its
                                                 stream, manifest, pages) and restoring it are
                                                 the node's own calls alone: every copy is sent
                                                 by the node that holds it
    POST /v1/workloads/NAME/brace, /v1/redirects   a move names the caller, and every connection
                                                 the body bounds or re-points is one to that
                                                 move's rank at the address it was dumped at (a
                                                 redirect: and follows that move's bundle)
    POST /v1/redirects/ID/keep, DELETE …/ID      the move the redirect follows (its `move`: that
                                                 move's bundle) names the caller: a redirect made
                                                 for it kept or taken back, no other

Everything else (checkpoint, restore, run, logs, migrations) is the controller's, or the node's
own; a move's ticket routes are the ticket's (criuctl.agent.tickets).

The records these rules read are judged at each write by criuctl's webhook on the writer's node
(criuctl.kube.recordrules): a node begins a move only from itself, for its own pod being deleted,
and a move's identity (its nodes, bundle, address) never changes after. So a record that names a
caller is one the controller asked for or that move's source wrote (docs/deploy.md, "Who holds
what").
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from aiohttp import web

from criuctl.agent import callers, redirects
from criuctl.core.errors import CriuctlError
from criuctl.kube import moves
from criuctl.kube.cluster import Cluster

_CLIENT = re.compile(r"^/v1/bundles/[0-9a-f]{32}/page-client$")
_BUNDLE = re.compile(r"^/v1/bundles/([0-9a-f]{32})(/expect)?$")
_JOB = re.compile(r"^(/v1/workloads/[^/]+/brace|/v1/redirects(/[0-9a-f]{32}(/keep)?)?)$")
_AIMED = re.compile(r"^(/v1/workloads/[^/]+/brace|/v1/redirects)$")  # their bodies name the connections
_BY_ID = re.compile(r"^/v1/redirects/([0-9a-f]{32})(/keep)?$")  # the redirect names the move it follows


class PeerRules:
    """`criuctl.agent.server.PeerRules` for node `me`, from the move records."""

    def __init__(self, c: Cluster, me: str) -> None:
        self.c, self.me = c, me

    async def __call__(self, names: frozenset[str], request: web.Request) -> str | None:
        method, path = request.method, request.path
        who = f"node {'/'.join(sorted(names)) or '(no name)'}"
        if (method, path) in callers.READS or (method == "POST" and _CLIENT.match(path)):
            return None
        bundle = _BUNDLE.match(path) if method in ("POST", "PUT", "DELETE") else None
        if bundle is not None and (method == "POST") != bool(bundle.group(2)):
            bundle = None  # POST is expect's alone; PUT and DELETE the bundle's
        if bundle is None and not _JOB.match(path):
            return f"{who} may not call {method} {path} here: that is the controller's, or this node's own"
        aimed = None
        if bundle is None and method == "POST" and _AIMED.match(path):
            try:
                aimed = await request.json()
            except ValueError:
                return f"{who}'s call {method} {path} has no JSON body to check"
        follows = None
        if bundle is None and (by_id := _BY_ID.match(path)):
            rec = await asyncio.to_thread(redirects.load, by_id.group(1))
            if rec is None or not rec.move:
                return f"{who} may not call {method} {path} here: no redirect of a pod's move has that id"
            follows = rec.move
        try:
            records = await asyncio.to_thread(moves.every, self.c)
        except CriuctlError as exc:
            return f"cannot read the pending moves to check {who}'s call: {exc.what}"
        except (KeyError, ValueError, TypeError) as exc:  # a record not as criuctl writes them
            return f"cannot read the pending moves to check {who}'s call: a malformed record ({exc!r})"
        for m in records:
            nodes = {m.source, m.target, m.holder} - {""}
            if not nodes & names:
                continue
            if bundle is not None:
                if m.bundle == bundle.group(1) and self.me in nodes:
                    return None
            elif follows is not None:
                if m.bundle == follows:
                    return None
            elif aimed is not None and _aims_at(m, aimed, path):
                return None
        if follows is not None:
            why = f"the move it follows (bundle {follows}) is not pending or does not name it"
        elif bundle is not None:
            why = f"no pending move of bundle {bundle.group(1)} names it and node {self.me}"
        else:
            why = "no pending move naming it is of a job's rank whose old address these connections name"
        return f"{who} may not call {method} {path} here: {why}"


def _aims_at(m: moves.Move, body: Any, path: str) -> bool:
    """Whether a brace or a new redirect asks only about move `m`'s rank: every connection it
    bounds or re-points is one to the address the rank had when it was dumped (`m.address`), and a
    redirect names `m`'s bundle as the move it follows. Nothing else a staying rank holds."""
    if not isinstance(body, dict) or not m.address:
        return False
    if path == "/v1/redirects":
        rows, follows = body.get("rules"), body.get("move") == m.bundle
    else:
        rows, follows = body.get("connections"), True
    if not follows or not isinstance(rows, list) or not rows:
        return False
    return all(isinstance(r, list) and len(r) >= 4 and r[2] == m.address for r in rows)
