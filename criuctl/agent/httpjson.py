"""Small HTTP helpers shared by the agent's route modules: JSON errors, bodies, ids, outcomes."""

from __future__ import annotations

import json
import re
from typing import Any, Unpack

from aiohttp import web

from criuctl.agent.messages import ErrorAnswer, Refusal, StepAnswer
from criuctl.agent.protocol import Outcome

_ID = re.compile(r"^[0-9a-f]{32}$")


def fail(status: int, what: str, hint: str = "", **extra: Unpack[Refusal]) -> web.Response:
    """One JSON error; `what` and `hint` become the client's one line."""
    return web.json_response(ErrorAnswer(what=what, hint=hint, **extra), status=status)


_ERRORS: dict[int, type[web.HTTPException]] = {
    400: web.HTTPBadRequest,
    404: web.HTTPNotFound,
    409: web.HTTPConflict,
    413: web.HTTPRequestEntityTooLarge,
}


def error(status: int, what: str, hint: str = "", **extra: Unpack[Refusal]) -> web.HTTPException:
    """The same JSON error as `fail`, as an exception a handler can raise from deep inside."""
    return _ERRORS[status](
        text=json.dumps(ErrorAnswer(what=what, hint=hint, **extra)), content_type="application/json"
    )


class BadInto(ValueError):
    pass


def container_id(raw: object) -> str | None:
    """A placeholder container the client named: None, or 1-64 lowercase hex digits."""
    if raw is None:
        return None
    if not isinstance(raw, str) or not 0 < len(raw) <= 64 or raw.strip("0123456789abcdef"):
        raise BadInto(f"{str(raw)[:80]!r} is not a container ID")
    return raw


def valid_id(value: str) -> bool:
    """Migration and bundle ids are ours (uuid4 hex): anything else never reaches a path."""
    return bool(_ID.match(value))


async def body_json(r: web.Request) -> Any:
    """The request's JSON object (empty when there is no body); a 400 for anything else.

    Any JSON object: a route annotates it with its request's type (`criuctl.agent.messages`), so
    that the names of its fields are checked against the client's, and still checks each field."""
    # read whole and cached by aiohttp: the auth middleware may have read it first (a grant's check)
    raw = await r.read() if r.body_exists else b""
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise error(400, "the request body is not JSON", "send a JSON object") from None
    if not isinstance(body, dict):
        raise error(400, "the request body is not a JSON object", "send {...}")
    return body


def outcome_response(out: Outcome, state: str | None = None) -> web.Response:
    """A step's answer: its state (or `state`, where the machine's own is newer) and its facts; a
    409 with the same for a step that did not go through."""
    if out.ok:
        return web.json_response(StepAnswer(state=state or out.state, **out.facts))
    return fail(409, out.what, out.hint, state=out.state, **out.facts)
