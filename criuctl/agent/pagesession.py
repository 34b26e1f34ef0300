"""The source's end of a page session with the target, opened before anything is frozen: it makes
this migration's key pair, hands the certificate to the target with a proof of the ticket that
covers it, and pins the certificate the target answers with once the target's signature over it
checks out (`tickets.checked_cert`). So CRIU's TLS on the page connection has each end pinned to
the other, and a man in the middle — another node, or anyone on the path under `--insecure` —
can swap neither certificate.

Two uses:
- a stop-and-copy whose memory pages go straight into the target's CRIU page server
  (`criuctl.net.directpages`): `open_at_target` answers what CRIU's dump needs (`criu.PagesTo`);
- post-copy, whose pages the target's lazy-pages daemon pulls from the source's page server
  after the restore: `pull_tls` answers the TLS the dump serves them with (`criu.PageTls`).

Synchronous and standard library (`conn`) for the HTTP, like `verdicts`: the agent calls it in a
thread. The answer is checked as hostile input: a port, one certificate, a signature.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from urllib.parse import urlsplit

from criuctl.agent.conn import connect
from criuctl.agent.protocol import Ticket, timeouts
from criuctl.agent.tickets import checked_cert, proof
from criuctl.core.errors import CriuctlError
from criuctl.engine import criu
from criuctl.net import pagetls

_MAX_ANSWER = 1 << 16  # a port and one certificate


def _open(ticket: Ticket, folder: Path) -> tuple[pagetls.Identity, Path, int]:
    """This end's identity, the target's certificate pinned (its path), the port the target named."""
    mine = pagetls.make_identity(folder, "source")
    where = f"node {ticket.node}"
    c = connect(ticket.base(), ticket.ca, timeouts().ask_target)
    path = urlsplit(ticket.base()).path + "/pages"
    body = json.dumps({"cert": mine.pem}).encode()
    header, nonce = proof(ticket, "POST", path, body)
    try:
        c.request(
            "POST", path, body=body, headers={"Authorization": header, "Content-Type": "application/json"}
        )
        resp = c.getresponse()
        raw = resp.read(_MAX_ANSWER)
        answer = json.loads(raw)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise CriuctlError(
            f"{where} did not open a page session for this migration: {exc}", "nothing was frozen"
        ) from None
    finally:
        c.close()
    if resp.status != 200 or not isinstance(answer, dict):
        what = answer.get("what", resp.reason) if isinstance(answer, dict) else resp.reason
        raise CriuctlError(f"{where} refused a page session for this migration: {what}", "nothing was frozen")
    port, cert = answer.get("port"), answer.get("cert")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port < 65536:
        raise CriuctlError(f"{where} answered no port for its page session", "nothing was frozen")
    if not isinstance(cert, str) or not checked_cert(ticket, nonce, cert, answer.get("sig")):
        raise CriuctlError(
            f"the page-session certificate from {where}'s address is not signed with the migration's key",
            "something else answers there, or changed the answer on the way; nothing was frozen",
        )
    peer, _ = pagetls.pin(folder, "target", cert)
    return mine, peer, port


def open_at_target(ticket: Ticket, folder: Path) -> criu.PagesTo:
    """The direct page session at the ticket's target; CriuctlError (nothing frozen yet) if it will not."""
    mine, peer, port = _open(ticket, folder)
    if not port:
        raise CriuctlError(f"node {ticket.node} answered no port for its page server", "nothing was frozen")
    host = urlsplit(ticket.url).hostname or ""
    return criu.PagesTo(host, port, pagetls.tls(mine, peer))


def pull_tls(ticket: Ticket, folder: Path) -> criu.PageTls:
    """Post-copy: the TLS this node's page server serves the job's memory with, pinned to the
    target's lazy-pages daemon alone; CriuctlError (nothing frozen yet) if the target will not."""
    mine, peer, _ = _open(ticket, folder)
    return pagetls.tls(mine, peer)
