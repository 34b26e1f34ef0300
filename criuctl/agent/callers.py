"""Who is calling: the names (addresses and DNS names) a verified client certificate carries.

Agents present their node's certificate to each other (mutual TLS, `criuctl.agent.conn`) and the
server checks it against the agents' CA (`criuctl agent --peer-ca`). A name here is compared with
the address a client dials that node at: the same name a client checks the node's certificate
against when it is the server, so a node is the same party in both directions.

On Kubernetes no token is shared: a caller proves who it is by its certificate alone. The
controller's carries one URI name, `CONTROLLER`, which no node's can (its signer signs a node's
DNS name and addresses only: `criuctl.kube.identity`); alone it opens `READS`, and a move's routes
with the grant the controller signs for that move (`criuctl.agent.grants`). A node's opens on
another agent what a move that names both needs (`criuctl.kube.peerrules`), and everything on its
own.
"""

from __future__ import annotations

import ipaddress
from typing import Any


def address(raw: str) -> str:
    """A node's address (an IP, written the one way `names` writes it) or DNS name, lower case."""
    raw = str(raw).strip().lower()
    try:
        return str(ipaddress.ip_address(raw.strip("[]")))
    except ValueError:
        if not raw or len(raw) > 253 or not all(c.isalnum() or c in "-." for c in raw):
            raise ValueError(f"not an address or a DNS name: {raw!r}") from None
        return raw


CONTROLLER = "urn:criuctl:controller"  # the URI name of the controller's client certificate

# what any certificate of the agents' CA may read on any agent: what runs there (no memory, no logs);
# the controller places and plans with it, a node finds a job's ranks
READS = frozenset({("GET", "/v1/info"), ("GET", "/v1/workloads"), ("GET", "/v1/containers")})


def is_controller(peercert: dict[str, Any] | None) -> bool:
    """Whether a certificate the TLS layer verified is the controller's."""
    return ("URI", CONTROLLER) in tuple((peercert or {}).get("subjectAltName", ()))


def names(peercert: dict[str, Any] | None) -> frozenset[str]:
    """The subjectAltNames of a certificate the TLS layer verified (`SSLSocket.getpeercert()`):
    empty when the caller presented none."""
    out = set()
    for kind, value in (peercert or {}).get("subjectAltName", ()):
        if kind in ("IP Address", "DNS"):
            try:
                out.add(address(value))
            except ValueError:
                continue
    return frozenset(out)
