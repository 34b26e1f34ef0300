"""A source asks the target what became of its copy: the only way a source in SENT may settle.

Synchronous (`conn`), because the handoff process calls it with no event loop, and the agent calls
it in a thread. The question carries a proof of the ticket, never its secret, and the answer must
be the target's own: signed over the question's nonce with the key only the target holds, checked
with the public key in the ticket (`criuctl.agent.tickets`). Anything else — no answer, a 503, a 404 from
whatever else listens at that address, an answer about another migration, a forged or unsigned
state — is UNKNOWN: the source stays frozen and asks again. A source that thawed on a 404 while the
real target ran the job would run it twice.
"""

from __future__ import annotations

import http.client
import json
import ssl
from urllib.parse import urlsplit

from criuctl.agent.conn import connect
from criuctl.agent.protocol import TargetState, Ticket, Verdict, timeouts
from criuctl.agent.tickets import checked_state, proof

_MAX_ANSWER = 1 << 16  # a verdict is a few hundred bytes; nothing at that address may make us read more


def _ask(c: http.client.HTTPConnection, method: str, ticket: Ticket) -> tuple[http.client.HTTPResponse, str]:
    """Send `method` about the ticket's migration with a fresh proof: (the response, its nonce)."""
    path = urlsplit(ticket.base()).path
    header, nonce = proof(ticket, method, path)
    c.request(method, path, headers={"Authorization": header})
    return c.getresponse(), nonce


def _signed_state(method: str, ticket: Ticket) -> str | None:
    """The target's signed state of the ticket's migration, after a GET or DELETE; None otherwise."""
    c = connect(ticket.base(), ticket.ca, timeouts().ask_target)
    try:
        resp, nonce = _ask(c, method, ticket)
        return checked_state(ticket, json.loads(resp.read(_MAX_ANSWER)), nonce)
    except (OSError, http.client.HTTPException, ValueError):  # (ssl.SSLError is an OSError)
        return None
    finally:
        c.close()


def ask_abort(ticket: Ticket) -> Verdict:
    """Ask the target to abort its copy unless it runs: ABORTED once it is dead or never ran."""
    state = _signed_state("DELETE", ticket)
    if state == TargetState.ABORTED:
        return Verdict.ABORTED
    if state == TargetState.RUNNING:
        return Verdict.RUNNING
    return Verdict.UNKNOWN


def ask_state(ticket: Ticket) -> str | None:
    """The target's state of the migration, or None when it does not answer, signed, clearly."""
    return _signed_state("GET", ticket)


def heard(ticket: Ticket) -> str | None:
    """What answers at the target's address, in words; None when nothing does (no route to it, no
    reply in time): the one case where a person's word that the target is down may stand in for
    its verdict (`protocol.SettleOrder`). An unsigned answer, a refused connection (the node is
    up, its agent is not) or a stranger's TLS server all mean the node may still run the job."""
    c = connect(ticket.base(), ticket.ca, timeouts().ask_target)
    try:
        resp, nonce = _ask(c, "GET", ticket)
        raw = resp.read(_MAX_ANSWER)
        try:
            state = checked_state(ticket, json.loads(raw), nonce)
        except ValueError:
            state = None
        return f"its copy is {state}" if state else f"something answers there (HTTP {resp.status}, unsigned)"
    except ConnectionRefusedError:
        return "its address refuses connections: the node is up, its agent is not"
    except ssl.SSLError as exc:
        return f"a TLS server answers there that is not its agent ({exc.__class__.__name__})"
    except (ConnectionResetError, http.client.HTTPException) as exc:
        return f"something answers there ({exc.__class__.__name__})"
    except OSError:  # no route, no reply in time: silent
        return None
    finally:
        c.close()
