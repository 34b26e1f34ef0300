"""A source asks the target what became of its copy: the only way a source in SENT may settle.

Synchronous (requests), because the handoff process calls it with no event loop, and the agent
calls it in a thread. The upload ticket authenticates the question; a target that answers
anything but a clear word is UNKNOWN, and the source stays frozen and asks again.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import TYPE_CHECKING

from criuctl.agent.protocol import TIMEOUTS, TargetState, Ticket, Verdict

if TYPE_CHECKING:
    import requests


def _call(method: str, ticket: Ticket) -> requests.Response | None:
    import requests  # here: a handoff that never asks (most restores) starts 50 ms sooner

    ca_file = None
    try:
        if ticket.ca:
            fd, ca_file = tempfile.mkstemp(prefix="criuctl-ca-", suffix=".pem")
            with os.fdopen(fd, "w") as f:
                f.write(ticket.ca)
        return requests.request(
            method,
            ticket.base(),
            headers={"Authorization": f"Bearer {ticket.secret}"},
            verify=ca_file or True,
            timeout=(5, TIMEOUTS.ask_target),
        )
    except requests.RequestException:
        return None
    finally:
        if ca_file:
            with contextlib.suppress(OSError):
                os.unlink(ca_file)


def ask_abort(ticket: Ticket) -> Verdict:
    """Ask the target to abort its copy unless it runs: ABORTED once it is dead or never ran."""
    resp = _call("DELETE", ticket)
    if resp is None:
        return Verdict.UNKNOWN
    if resp.status_code == 404:  # never heard of it (no record, no tombstone): nothing ever ran there
        return Verdict.ABORTED
    if resp.status_code == 409:
        return Verdict.RUNNING
    if resp.ok:
        with contextlib.suppress(ValueError):
            state = resp.json().get("state")
            if state == TargetState.ABORTED:
                return Verdict.ABORTED
            if state == TargetState.RUNNING:
                return Verdict.RUNNING
    return Verdict.UNKNOWN


def ask_state(ticket: Ticket) -> str | None:
    """The target's state of the migration, or None when it does not answer clearly."""
    resp = _call("GET", ticket)
    if resp is None:
        return None
    if resp.status_code == 404:
        return str(TargetState.ABORTED)
    with contextlib.suppress(ValueError):
        if resp.ok:
            return resp.json().get("state")
    return None
