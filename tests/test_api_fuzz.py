"""The agent's HTTP API under hostile input: a clear 4xx, never a 500, nothing outside its folder.

The real `Agent` app runs in-process (aiohttp's test server) over a state dir of the test's own;
Hypothesis throws paths, ids, query strings, bodies and tickets at every route. No CRIU is needed:
everything here must be refused before anything is frozen.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from criuctl.agent.server import Agent, AgentOptions

ROUTES = [
    ("GET", "/v1/workloads/{x}/logs"),
    ("POST", "/v1/workloads/{x}/checkpoint"),
    ("POST", "/v1/workloads/{x}/brace"),
    ("GET", "/v1/bundles/{x}"),
    ("POST", "/v1/bundles/{x}/expect"),
    ("PUT", "/v1/bundles/{x}"),
    ("POST", "/v1/bundles/{x}/restore"),
    ("DELETE", "/v1/bundles/{x}"),
    ("PUT", "/v1/incoming/{x}/bundle"),
    ("POST", "/v1/incoming/{x}/restore"),
    ("POST", "/v1/incoming/{x}/commit"),
    ("GET", "/v1/incoming/{x}"),
    ("DELETE", "/v1/incoming/{x}"),
    ("POST", "/v1/outgoing/{x}/commit"),
    ("GET", "/v1/outgoing/{x}"),
    ("DELETE", "/v1/outgoing/{x}"),
    ("POST", "/v1/outgoing"),
    ("POST", "/v1/outgoing/settle"),  # the body names the workload; {x} has no place in it
    ("POST", "/v1/incoming"),
    ("DELETE", "/v1/incoming/{x}/cut"),
    ("POST", "/v1/redirects"),
    ("POST", "/v1/redirects/{x}/keep"),
    ("DELETE", "/v1/redirects/{x}"),
]

HOSTILE = st.sampled_from(
    [
        "..",
        "../..",
        "..%2F..%2F..%2Fetc%2Fpasswd",
        "..%2F..%2F..%2Fvar%2Flog%2Fdpkg",
        "%2e%2e",
        "a%00b",
        "/etc/passwd",
        "x" * 300,
        "mlp",
        "0" * 32,
        "f" * 31,
        "%252e%252e%252f",
        ".hidden",
        "a/b",
        "~root",
    ]
)
SEGMENT = st.one_of(HOSTILE, st.text(st.characters(codec="utf-8", exclude_characters="/?#"), max_size=40))
JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
BODY = st.one_of(
    st.none(),
    st.binary(max_size=2048),
    JSONISH.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {
            "workload": SEGMENT,
            "mode": st.sampled_from(["stop-and-copy", "post-copy", "bogus", ""]),
            "target": st.one_of(
                JSONISH,
                st.fixed_dictionaries(
                    {
                        "url": st.sampled_from(["http://127.0.0.1:9", "file:///etc/passwd", ""]),
                        "incoming": SEGMENT,
                        "secret": st.text(max_size=10),
                        "node": SEGMENT,
                    }
                ),
            ),
            "page_server": JSONISH,
            "name": SEGMENT,
            "leave_running": JSONISH,
            "cut": JSONISH,
            "readdress": JSONISH,
            "target_gpus": st.one_of(JSONISH, st.lists(JSONISH, max_size=3)),
            "boundary": JSONISH,
            "live": JSONISH,
            "rules": JSONISH,
            "ticket": JSONISH,
            "move": SEGMENT,
        }
    ).map(lambda v: json.dumps(v).encode()),
)


@pytest.fixture
def agent_app(tmp_path, state_dir):
    token, scrape = tmp_path / "token", tmp_path / "scrape-token"
    for f in (token, scrape):
        f.write_text(secrets.token_urlsafe(24))
        os.chmod(f, 0o600)
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    (state_dir / "bundle.key").write_text(secrets.token_bytes(32).hex())
    os.chmod(state_dir / "bundle.key", 0o600)
    agent = Agent(AgentOptions("127.0.0.1", 0, token, name="fuzz", metrics_token_file=scrape))
    return agent, token.read_text(), scrape.read_text()


def _everything_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


QUERIES = st.sampled_from(
    ["", "?tail=-1", "?tail=x", "?tail=99999999999999999999", "?tail=3", "?from=-5", "?from=x", "?from=tail",
     "?from=99999999999999999999", "?from=0&tail=2"]
)  # fmt: skip
AUTH = st.sampled_from(["token", "none", "bogus", "scrape"])  # scrape: the token that opens /metrics only


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(ROUTES), seg=SEGMENT, body=BODY, query=QUERIES, auth=AUTH)
def test_malformed_requests_get_a_clear_4xx_and_touch_nothing_outside(
    agent_app, tmp_path, route, seg, body, query, auth
):
    agent, token, scrape = agent_app
    method, pattern = route
    outside = tmp_path.parent / "fuzz-canary"
    outside.mkdir(exist_ok=True)
    before = _everything_under(outside)

    async def go() -> tuple[int, dict | str]:
        async with TestClient(TestServer(agent.app())) as client:
            headers = {
                "token": {"Authorization": f"Bearer {token}"},
                "none": {},
                "bogus": {"Authorization": "Bearer " + "z" * 40},
                "scrape": {"Authorization": f"Bearer {scrape}"},
            }[auth]
            path = pattern.replace("{x}", seg) + (query if "logs" in pattern else "")
            resp = await client.request(
                method, path, data=body, headers=headers, skip_auto_headers=["Content-Type"]
            )
            text = await resp.text()
            try:
                return resp.status, json.loads(text)
            except ValueError:
                return resp.status, text

    status, answer = asyncio.run(go())
    # a 5xx only as 503 with its line: a name shaped like a container ID sends the agent to the
    # container runtime, which the fuzzing agent has none of (a dependency down, not a crash)
    unavailable = status == 503 and isinstance(answer, dict) and "container runtime" in answer.get("what", "")
    assert status < 500 or unavailable, (method, seg, body, status, answer)
    if status >= 400 and isinstance(answer, dict):
        assert answer.get("what"), answer  # one line a person can read
    if auth != "token":
        assert status == 401, (status, answer)
    assert _everything_under(outside) == before
    if isinstance(answer, str):
        assert "root:" not in answer and "install " not in answer, "a file outside the state dir was served"


def test_the_scrape_token_opens_metrics_and_nothing_else(agent_app) -> None:
    """Prometheus holds the scrape token (`--metrics-token-file`), not the one that drives dumps."""
    agent, token, scrape = agent_app

    async def get(path: str, bearer: str | None, method: str = "GET") -> int:
        async with TestClient(TestServer(agent.app())) as client:
            headers = {"Authorization": f"Bearer {bearer}"} if bearer else {}
            return (await client.request(method, path, headers=headers)).status

    async def all_of_them() -> list[int]:
        return [
            await get("/metrics", scrape),
            await get("/metrics", token),
            await get("/metrics", None),
            await get("/v1/workloads", scrape),
            await get("/v1/info", scrape),
            await get("/metrics", scrape, "POST"),
        ]

    assert asyncio.run(all_of_them()) == [200, 200, 401, 401, 401, 401]


def test_logs_path_traversal_is_refused(agent_app):
    agent, token, _ = agent_app

    async def go() -> list[tuple[int, str]]:
        out = []
        async with TestClient(TestServer(agent.app())) as client:
            for name in ("..%2F..%2F..%2Fvar%2Flog%2Fdpkg", "..%2F..%2Fbundle.key", "%2e%2e%2fnodes"):
                resp = await client.get(
                    f"/v1/workloads/{name}/logs", headers={"Authorization": f"Bearer {token}"}
                )
                out.append((resp.status, await resp.text()))
        return out

    for status, text in asyncio.run(go()):
        assert status == 400, text
        assert "workload name" in json.loads(text)["what"]


def test_agent_starts_over_torn_and_hostile_records(agent_app, state_dir, caplog):
    """A record torn by a crash, or not a record at all, is reported and skipped, never a crash loop."""
    agent, token, _ = agent_app
    for kind in ("outgoing", "incoming"):
        spool = state_dir / kind
        spool.mkdir(parents=True, exist_ok=True, mode=0o700)
        (spool / f"{'a' * 32}.json").write_text('{"migration": "aaaa", "state": "se')  # torn mid-write
        (spool / f"{'b' * 32}.json").write_text("[1, 2, 3]")
        (spool / f"{'c' * 32}.json").write_bytes(b"\xff\xfe\x00garbage")

    async def go() -> int:
        async with TestClient(TestServer(agent.app())) as client:
            resp = await client.get("/v1/workloads", headers={"Authorization": f"Bearer {token}"})
            return resp.status

    with caplog.at_level("ERROR", logger="criuctl.agent"):
        assert asyncio.run(go()) == 200
    unreadable = [r for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(unreadable) == 6, [r.getMessage() for r in caplog.records]


def test_settle_is_refused_in_one_line_unless_a_sent_move_waits_on_a_silent_target(
    agent_app, monkeypatch
) -> None:
    """`POST /v1/outgoing/settle` (criuctl settle): no declaration, no such move, a move not
    waiting on its target, a target that answers — each refused with its line, nothing ordered."""
    from criuctl.agent import outgoing as outgoing_mod
    from criuctl.agent.protocol import SourceRecord, SourceState, Ticket, settle_order_path
    from criuctl.core import procinfo, statedir

    agent, token, _ = agent_app
    ticket = Ticket("https://10.0.0.9:7070", "i" * 32, "s" * 32, "b")
    records = statedir.OUTGOING.ensure()
    me = procinfo.Identity.of(os.getpid())  # a live "handoff": the agent's start leaves its record be
    rec = SourceRecord("m" * 32, "job", "stop-and-copy", SourceState.FROZEN, ticket, me.pid, me.boot)
    rec.hold_start = me.start
    path = records / f"{rec.migration}.json"
    answers = iter(["its address refuses connections: the node is up, its agent is not"])
    monkeypatch.setattr(outgoing_mod.verdicts, "heard", lambda _t: next(answers))

    async def settle(body: object) -> tuple[int, dict]:
        async with TestClient(TestServer(agent.app())) as client:
            resp = await client.post(
                "/v1/outgoing/settle", json=body, headers={"Authorization": f"Bearer {token}"}
            )
            return resp.status, await resp.json()

    said = asyncio.run(settle({"workload": "job"}))
    assert said[0] == 400 and "declared down" in said[1]["what"], said
    said = asyncio.run(settle({"workload": "job", "declared": "b is off"}))
    assert said[0] == 404 and "no move of job waits" in said[1]["what"], said
    outgoing_mod.records.write(path, rec.to_json())
    said = asyncio.run(settle({"workload": "job", "declared": "b is off"}))
    assert said[0] == 409 and "is frozen, not waiting" in said[1]["what"], said
    rec.state = SourceState.SENT
    outgoing_mod.records.write(path, rec.to_json())
    said = asyncio.run(settle({"workload": "job", "declared": "b is off"}))
    assert said[0] == 409 and said[1]["what"].startswith("node b answers for the move of job"), said
    assert "the node is up" in said[1]["what"], said
    assert not settle_order_path(path).exists(), "an order was written for a move its target settles"
