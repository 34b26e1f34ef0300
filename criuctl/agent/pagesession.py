"""The source's end of a stop-and-copy whose memory pages go straight into the target's CRIU page
server (`criuctl.net.directpages`): before anything is frozen, it makes this migration's key pair,
hands the certificate to the target with the upload ticket, and pins the certificate the target
answers with. What comes back is what CRIU's dump needs (`criu.PagesTo`).

Synchronous and standard library (`conn`) for the HTTP, like `verdicts`: the agent calls it in a
thread. The answer is the target's, over the ticket's authenticated channel, and still checked as
hostile input: a port, one certificate.
"""

from __future__ import annotations

import http.client
import json
from pathlib import Path
from urllib.parse import urlsplit

from criuctl.agent.conn import connect
from criuctl.agent.protocol import Ticket, timeouts
from criuctl.agent.tickets import proof
from criuctl.core.errors import CriuctlError
from criuctl.engine import criu
from criuctl.net import pagetls

_MAX_ANSWER = 1 << 16  # a port and one certificate


def open_at_target(ticket: Ticket, folder: Path) -> criu.PagesTo:
    """Open the page session at the ticket's target; CriuctlError (nothing frozen yet) if it will not."""
    mine = pagetls.make_identity(folder, "source")
    where = f"node {ticket.node}"
    c = connect(ticket.base(), ticket.ca, timeouts().ask_target)
    path = urlsplit(ticket.base()).path + "/pages"
    try:
        c.request(
            "POST",
            path,
            body=json.dumps({"cert": mine.pem}),
            headers={"Authorization": proof(ticket, "POST", path)[0], "Content-Type": "application/json"},
        )
        resp = c.getresponse()
        raw = resp.read(_MAX_ANSWER)
        answer = json.loads(raw)
    except (OSError, http.client.HTTPException, ValueError) as exc:
        raise CriuctlError(
            f"{where} did not open a page server for this migration: {exc}", "nothing was frozen"
        ) from None
    finally:
        c.close()
    if resp.status != 200 or not isinstance(answer, dict):
        what = answer.get("what", resp.reason) if isinstance(answer, dict) else resp.reason
        raise CriuctlError(f"{where} refused a page server for this migration: {what}", "nothing was frozen")
    port = answer.get("port")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise CriuctlError(f"{where} answered no port for its page server", "nothing was frozen")
    peer, _ = pagetls.pin(folder, "target", answer.get("cert"))
    host = urlsplit(ticket.url).hostname or ""
    return criu.PagesTo(host, port, pagetls.tls(mine, peer))
