"""One way for an agent (or its handoff) to open a connection to another agent: plain HTTP, or HTTPS
verified against the CA the upload ticket carries (the system's store when it carries none).

Standard library only, and nothing else imported: a handoff process opens these on a migration's
clock, and `requests`, `asyncio` or `aiohttp` cost it tens of milliseconds to import.

Over HTTPS the caller presents its node's certificate ($CRIUCTL_AGENT_IDENTITY, which the agent
sets for itself and its handoffs): the target checks that it names the move's source
(`criuctl.agent.incoming`, `peer_refusal`), so a ticket's proofs work from the source's node alone.
"""

from __future__ import annotations

import http.client
import socket
import ssl
from urllib.parse import urlsplit

from criuctl.core import env


def connect(url: str, ca_pem: str | None, timeout: float) -> http.client.HTTPConnection:
    """An (unconnected) connection to the agent at `url`; `timeout` bounds every socket operation."""
    u = urlsplit(url)
    if u.scheme == "https":
        ctx = ssl.create_default_context(cadata=ca_pem or None)
        if (mine := env.AGENT_IDENTITY.get()) is not None:
            ctx.load_cert_chain(*mine)
        return http.client.HTTPSConnection(u.hostname or "", u.port or 443, timeout=timeout, context=ctx)
    return http.client.HTTPConnection(u.hostname or "", u.port or 80, timeout=timeout)


def free_port() -> int:
    """A TCP port nothing listens on now, for CRIU's page server (which takes a port, not a socket)."""
    with socket.socket() as s:
        s.bind(("", 0))
        port: int = s.getsockname()[1]
        return port
