"""Talking to agents: the node list (`criuctl node add/ls`) and an HTTP client for one agent.

Nodes are agent addresses with a token file each, kept in STATE_DIR/nodes.json (root-only, like the
rest of the state dir). Every failure to reach or convince an agent becomes one `CriuctlError` line
that names the node.
"""

from __future__ import annotations

import contextlib
import contextvars
import fcntl
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import requests

from criuctl.agent.grants import GRANT_HEADER, Mint
from criuctl.agent.messages import SEAL_HEADER, BundleExpected, BundleKept, ErrorAnswer, LogChunk
from criuctl.core import env, statedir, tokens, workloads, worklogs
from criuctl.core.errors import CriuctlError
from criuctl.core.workloads import WorkloadRow
from criuctl_hook import durable

# the move this thread's calls are for, as the controller carries it: its grant goes with each call
# (criuctl.agent.grants); unset for everyone else (a person's CLI, an agent calling another)
GRANT: contextvars.ContextVar[Mint | None] = contextvars.ContextVar("criuctl_grant", default=None)


@contextlib.contextmanager
def granted(mint: Mint | None) -> Iterator[None]:
    """Every agent call made in this context shows the grant `mint` signs."""
    token = GRANT.set(mint)
    try:
        yield
    finally:
        GRANT.reset(token)


class UnknownNode(CriuctlError):
    exit_code = 3


class NodeUnreachable(CriuctlError):
    """No answer at all: connection refused, timed out, or broken before a response."""


class AgentError(CriuctlError):
    """The agent answered with an HTTP error: its status, and its JSON answer (`what`, `hint`,
    where it is about a migration its state)."""

    def __init__(self, what: str, hint: str, status: int, body: ErrorAnswer) -> None:
        super().__init__(what, hint)
        self.status, self.body = status, body


class TokenRefused(AgentError):
    """The agent answered, and refused our token (HTTP 401/403): up, but not ours to use."""


class CertificateRefused(NodeUnreachable):
    """We refused the agent: its TLS certificate is not from the CA we trust for it, or does not
    name the address in its URL. It may well be up; what answers may also not be our agent."""


@dataclass
class Node:
    name: str
    url: str
    token_file: str | None  # None: the agent takes a certificate instead ($CRIUCTL_AGENT_IDENTITY)
    ca_file: str | None = None  # PEM of the CA that signed the agent's TLS certificate

    @property
    def host(self) -> str:
        return urlparse(self.url).hostname or ""

    def token(self) -> str:
        if self.token_file is None:
            raise CriuctlError(
                f"node {self.name} was added with no token file", "criuctl node add NAME URL --token-file F"
            )
        try:
            return Path(self.token_file).read_text().strip()
        except OSError as exc:
            raise CriuctlError(
                f"cannot read the token file of node {self.name} ({self.token_file}): {exc.strerror}",
                f"criuctl node add {self.name} URL --token-file F",
            ) from exc

    def ca_pem(self) -> str | None:
        return Path(self.ca_file).read_text() if self.ca_file else None

    @property
    def tls(self) -> bool:
        return urlparse(self.url).scheme == "https"

    def transport(self) -> str:
        """How a client reaches this node's agent, for `node ls`: plain HTTP is said in capitals."""
        if not self.tls:
            return "NONE: plain HTTP"
        return f"verified ({Path(self.ca_file).name})" if self.ca_file else "verified (system CAs)"


def _config() -> Path:
    return statedir.NODES.path()


def all_nodes() -> dict[str, Node]:
    try:
        raw = json.loads(_config().read_text())
    except FileNotFoundError:
        return {}
    return {name: Node(**n) for name, n in raw.items()}


@contextlib.contextmanager
def _editing() -> Iterator[dict[str, Node]]:
    """The node list, to change and write back whole: one editor at a time (two `node add`s at once
    each keep their node), and a reader sees the old list or the new one."""
    statedir.ensure_state_dir()
    with open(statedir.NODES_LOCK.path(), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        nodes = all_nodes()
        yield nodes
        durable.replace_json(_config(), {k: asdict(v) for k, v in nodes.items()})


def add_node(node: Node) -> None:
    if urlparse(node.url).scheme not in ("http", "https"):
        raise CriuctlError(f"{node.url} is not an http(s) URL", "e.g. https://10.0.0.2:7070")
    if node.ca_file and not node.tls:
        raise CriuctlError(
            f"--ca is for an https URL, and {node.url} is plain HTTP",
            f"add it as https://{urlparse(node.url).netloc} if its agent serves HTTPS, or drop --ca",
        )
    if node.ca_file:
        _check_ca(Path(node.ca_file))
    node.token()  # readable now, or say so now
    tokens.read_token(Path(str(node.token_file)))  # and a file the agent would accept, or say so now
    with _editing() as nodes:
        nodes[node.name] = node


def _check_ca(path: Path) -> None:
    """The CA file loads as the clients will load it (requests and the source agent's `ssl`)."""
    import ssl

    try:
        ssl.create_default_context(cafile=str(path))
    except (OSError, ssl.SSLError) as exc:
        # an SSLError is an OSError too, with OpenSSL's code as its strerror
        why = "not a PEM certificate" if isinstance(exc, ssl.SSLError) else exc.strerror
        raise CriuctlError(
            f"cannot use --ca {path}: {why}",
            "pass the PEM certificate of the CA that signed the agent's (ca.crt of scripts/agent-cert.sh)",
        ) from exc


def remove_node(name: str) -> None:
    with _editing() as nodes:
        nodes.pop(get_node(name).name)


def get_node(name: str) -> Node:
    nodes = all_nodes()
    if name not in nodes:
        known = ", ".join(sorted(nodes)) or "none yet"
        raise UnknownNode(
            f"no node named {name!r} (known: {known})", "add it: criuctl node add NAME URL --token-file F"
        )
    return nodes[name]


def running_here(rows: list[WorkloadRow], name: str) -> bool:
    """Whether an agent's workload list (`GET /v1/workloads`) has `name` alive and running."""
    return any(r.get("name") == name and r.get("state") == "running" and r.get("alive") for r in rows)


@dataclass(frozen=True)
class Survey:
    """Where a workload runs, as every node's agent answered; `silent`: nodes that could not be
    asked (down, or a wrong token) — the workload may run there too."""

    running_on: list[Node]
    silent: list[str]
    refused: dict[str, str] = field(default_factory=dict)  # node -> why its container `name` cannot move


SURVEY_TIMEOUT = 10.0  # seconds each node gets to list its workloads
# A node silent in the first round is asked again, this long, when no other runs the workload: an
# agent busy with many migrations at once on a small node (eight on 2 cores, beside a training
# job or two) can take longer to list than the first round waits, and without its answer the
# move would fail saying nothing runs the job. A node that is down costs this only then.
SURVEY_PATIENCE = 45.0


def list_everywhere(
    nodes: list[Node], again: Callable[[list[list[WorkloadRow] | None]], bool] = lambda _: False
) -> list[list[WorkloadRow] | None]:
    """Each node's workload rows, all nodes asked at once; None for a node that did not answer.
    A node silent in the first round is asked again, SURVEY_PATIENCE long, when `again(answers)`
    says its answer could change what the caller concludes."""

    def ask(node: Node, timeout: float) -> list[WorkloadRow] | None:
        try:
            rows: list[WorkloadRow] = AgentClient(node, timeout=timeout).get("/v1/workloads", timeout=timeout)
            return rows
        except CriuctlError:
            return None

    with ThreadPoolExecutor(max_workers=min(16, len(nodes) or 1)) as pool:
        answers = list(pool.map(lambda n: ask(n, SURVEY_TIMEOUT), nodes))
        if None in answers and again(answers):
            silent = [i for i, a in enumerate(answers) if a is None]
            for i, a in zip(silent, pool.map(lambda i: ask(nodes[i], SURVEY_PATIENCE), silent), strict=True):
                answers[i] = a
    return answers


def survey(name: str, nodes: list[Node] | None = None) -> Survey:
    """Ask every node (all at once) whether its agent runs workload `name`."""
    workloads.validate_name(name)
    nodes = list(all_nodes().values()) if nodes is None else nodes
    answers = list_everywhere(
        nodes, again=lambda got: not any(running_here(rows, name) for rows in got if rows is not None)
    )
    why: dict[str, str] = {}
    for node, rows in zip(nodes, answers, strict=True):
        for r in rows or []:
            if r.get("name") == name and isinstance(why_not := r.get("why_not"), str):
                why[node.name] = why_not
    return Survey(
        running_on=[n for n, a in zip(nodes, answers, strict=True) if a and running_here(a, name)],
        silent=[n.name for n, a in zip(nodes, answers, strict=True) if a is None],
        refused=why,
    )


def locate(name: str) -> list[Node]:
    """The nodes whose agents run workload `name`; nodes that do not answer are left out."""
    return survey(name).running_on


class AgentClient:
    """Synchronous calls to one agent; errors name the node and say what to do."""

    def __init__(self, node: Node, timeout: float = 30.0) -> None:
        self.node, self.timeout = node, timeout
        self.s = requests.Session()
        if node.token_file is not None:
            self.s.headers["Authorization"] = f"Bearer {node.token()}"
        # per request, not on the session: requests lets REQUESTS_CA_BUNDLE override Session.verify
        self.verify: str | bool = node.ca_file or True
        # an agent calling another (a kept bundle carried on Kubernetes) presents its node's
        # certificate, as it does for a move (criuctl.agent.conn); a person's CLI has none
        mine = env.AGENT_IDENTITY.get()
        self.s.cert = (str(mine[0]), str(mine[1])) if mine is not None and node.tls else None

    def _call(
        self, method: str, path: str, body: Any = None, timeout: float | None = None, **kw: Any
    ) -> requests.Response:
        url = self.node.url.rstrip("/") + path
        if (mint := GRANT.get()) is not None and self.s.cert is not None and (shown := mint()):
            kw["headers"] = {**kw.get("headers", {}), GRANT_HEADER: shown}
        try:
            resp = self.s.request(
                method, url, json=body, timeout=(5, timeout or self.timeout), verify=self.verify, **kw
            )
        except requests.exceptions.SSLError as exc:
            raise CertificateRefused(
                f"node {self.node.name} ({self.node.url}) failed the TLS check: {_tls_reason(exc)}",
                f"give the CA that signed its certificate (criuctl node add {self.node.name} {self.node.url} "
                "--token-file F --ca CA.pem), and a certificate that names this address",
            ) from exc
        except requests.RequestException as exc:
            raise NodeUnreachable(
                f"node {self.node.name} ({self.node.url}) did not answer ({exc.__class__.__name__})",
                "check that its agent runs and the network between here and there"
                + ("" if self.node.tls else ", and whether it serves HTTPS (then add it as https://)"),
            ) from exc
        if resp.status_code in (401, 403) and self.node.token_file is not None:
            what = (
                f"node {self.node.name} ({self.node.url}) refused the token in {self.node.token_file} "
                f"(HTTP {resp.status_code}: wrong token)"
            )
            hint = (
                f"use the token its agent was started with: criuctl node add {self.node.name} "
                f"{self.node.url} --token-file F"
            )
            raise TokenRefused(what, hint, resp.status_code, {"what": what, "hint": hint})
        if not resp.ok:
            err: ErrorAnswer
            try:
                err = resp.json()
            except ValueError:
                err = {"what": f"node {self.node.name} answered HTTP {resp.status_code}: {resp.text[:200]}"}
            raise AgentError(
                err.get("what", f"HTTP {resp.status_code}"), err.get("hint", ""), resp.status_code, err
            )
        return resp

    def get(self, path: str, **kw: Any) -> Any:
        return self._call("GET", path, **kw).json()

    def post(self, path: str, body: Any = None, **kw: Any) -> Any:
        return self._call("POST", path, body, **kw).json()

    def delete(self, path: str) -> Any:
        return self._call("DELETE", path).json()

    def copy_bundle(self, bid: str, to: AgentClient, timeout: float = 3600) -> int:
        """Stream kept bundle `bid` from this agent to agent `to`, which verifies it before keeping
        it (every checksum, and its signature with the key `to` gave for this one copy, which this
        agent signs its manifest with as it sends: no node's own key leaves it); the bytes kept there."""
        expected: BundleExpected = to.post(f"/v1/bundles/{bid}/expect")
        sealed = {SEAL_HEADER: expected["seal"]}
        src = self._call("GET", f"/v1/bundles/{bid}", timeout=timeout, stream=True, headers=sealed)
        try:
            headers = {"Content-Type": "application/x-tar"}  # sent chunked: a generator has no length
            pieces = src.iter_content(1 << 20)
            kept = to._call("PUT", f"/v1/bundles/{bid}", timeout=timeout, data=pieces, headers=headers)
        finally:
            src.close()
        answer: BundleKept = kept.json()
        return int(answer.get("bytes", 0))

    def text(self, path: str) -> str:
        return self._call("GET", path).text

    def log_chunk(self, name: str, offset: int | None, tail: int = 0) -> worklogs.Chunk:
        """A workload's log on this node from `offset` (None: its last `tail` lines) and its state."""
        start = "tail" if offset is None else str(offset)
        got: LogChunk = self._call("GET", f"/v1/workloads/{name}/logs?from={start}&tail={tail}").json()
        text = got["text"].encode()
        return worklogs.Chunk(text, got["end"], got["state"], got.get("moved_to"), got.get("exit_code"))

    def events(self, path: str, body: Any, timeout: float = 3600) -> Iterator[Any]:
        """POST, then yield the JSON events the agent streams back, one per line (as sent: the
        caller names their type, e.g. `criuctl.agent.messages.OutgoingEvent`)."""
        resp = self._call("POST", path, body, timeout=timeout, stream=True)
        try:
            for line in resp.iter_lines():
                if line:
                    yield json.loads(line)
        except requests.RequestException as exc:
            raise NodeUnreachable(
                f"lost node {self.node.name}'s agent mid-migration ({exc.__class__.__name__})",
                "check that its agent runs",
            ) from exc


def _tls_reason(exc: BaseException) -> str:
    """OpenSSL's own words for a refused handshake, dug out of requests' and urllib3's wrappers."""
    import ssl

    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        e = todo.pop(0)
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ssl.SSLCertVerificationError):
            return str(e.verify_message).rstrip(".")
        if isinstance(e, ssl.SSLError) and e.reason:
            return str(e.reason)
        todo += [*e.args, getattr(e, "reason", None), e.__cause__, e.__context__]
    return exc.__class__.__name__
