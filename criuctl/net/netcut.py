"""Per-connection nftables rules of a multi-node move: the cut, and the redirect of a peer that stays.

When one rank of a distributed job moves to another node its address changes, and each of its
connections must be re-pointed on both ends without either end seeing a reset:

- **The cut** (on the moved rank's new node, before it is restored): drop, both ways, every packet
  of the rank's connections in their *new* form. Until the restored rank runs, a peer's
  retransmission reaching the new node would find no socket there and be answered with a reset
  that kills the peer's connection; dropped, it is simply retransmitted later. Lifted once the
  rank runs there (or, after an abort, once no peer sends there any more).
- **The redirect** (on the node of every rank that stays): a stateless address translation of each
  of its connections to the moved rank. Its kernel socket keeps the old peer address; outgoing
  packets get the new destination (in a `route` chain, so that the kernel routes them again),
  incoming ones get the old source back (in prerouting, before the socket lookup). The rank that
  stays is never stopped: its TCP simply retransmits into the gap, and then reaches the new node.
  A later move of the same rank stacks another redirect *after* this one (out: oldest first;
  prerouting: newest first), written in the addresses the previous one already translates to.

Tables are `inet criuctl-cut-<id>` and `inet criuctl-nat-<id>` in the caller's network namespace,
or, given `pid`, in that process's (a pod's: `criuctl.net.netns`; they end with it); IPv4 on the
wire (v4-mapped IPv6 sockets send IPv4). Below the agent; talks to the kernel through `netlock.Nft`
(libnftables).
"""

from __future__ import annotations

import ipaddress
import re

from criuctl.net import netns
from criuctl.net.netlock import FAMILY, NetlockError, Nft

CUT, NAT = "criuctl-cut-", "criuctl-nat-"
_ID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
_PRIO_ROUTE_OUT, _PRIO_PRE = -150, -300  # mangle (route) and raw priorities

Tuple = tuple[str, int, str, int]  # (local address, port, remote address, port)
Redirect = tuple[str, int, str, int, str]  # (local, port, old remote, port, new remote)


def parse(raw: object, shape: str) -> list[tuple]:
    """Rows of addresses and ports from a request, checked: `shape` says each row's fields ("a"
    an IPv4 address, "p" a port), e.g. "apap" for a `Tuple`, "apapa" for a `Redirect`."""
    if not isinstance(raw, list) or len(raw) > 4096:
        raise ValueError(
            f"expected a list of [{', '.join('address' if c == 'a' else 'port' for c in shape)}]"
        )
    out = []
    for row in raw:
        if not (isinstance(row, list) and len(row) == len(shape)):
            raise ValueError(f"bad entry {str(row)[:80]}")
        for kind, v in zip(shape, row, strict=True):
            if kind == "p" and not (type(v) is int and 0 < v < 65536):
                raise ValueError(f"bad port {str(v)[:20]} in {str(row)[:80]}")
            if kind == "a" and not (
                isinstance(v, str) and isinstance(ipaddress.ip_address(v), ipaddress.IPv4Address)
            ):
                raise ValueError(f"bad address {str(v)[:80]} (IPv4 only)")
        out.append(tuple(row))
    return out


def _match(src: str, sport: int, dst: str, dport: int) -> str:
    return f"ip saddr {src} tcp sport {sport} ip daddr {dst} tcp dport {dport}"


def _run(nft: Nft, commands: str, what: str) -> None:
    ok, _, err = nft.run(commands)
    if not ok:
        raise NetlockError(f"cannot {what}: {err.strip()}", "run the agent as root, with nf_tables available")


def _table(prefix: str, ident: str) -> str:
    if not _ID.match(ident):
        raise ValueError(f"bad rule-set id {ident!r}")
    return prefix + ident


def cut(ident: str, conns: list[Tuple], pid: int | None = None) -> str:
    """Drop every packet of `conns` (as seen from this node), both ways; the table's name."""
    if pid is not None:
        return str(netns.run_in(pid, cut, ident, [list(c) for c in conns]))
    table = _table(CUT, ident)
    lines = [  # asked again (a restarted agent's step), the same table gets exactly these rules
        f"add table {FAMILY} {table}",
        f"flush table {FAMILY} {table}",
        f"add chain {FAMILY} {table} in {{ type filter hook input priority 0; }}",
        f"add chain {FAMILY} {table} out {{ type filter hook output priority 0; }}",
    ]
    for la, lp, ra, rp in conns:
        lines.append(f"add rule {FAMILY} {table} in {_match(ra, rp, la, lp)} drop")
        lines.append(f"add rule {FAMILY} {table} out {_match(la, lp, ra, rp)} drop")
    with Nft() as nft:
        _run(nft, "\n".join(lines), f"cut {len(conns)} connections off")
    return table


def redirect(ident: str, rules: list[Redirect], pid: int | None = None) -> str:
    """Translate each connection's old remote address to its new one, stacked after earlier ones."""
    if pid is not None:
        return str(netns.run_in(pid, redirect, ident, [list(r) for r in rules]))
    table = _table(NAT, ident)
    depth = len(tables(NAT))  # redirects already here: this one acts after them
    lines = [
        f"add table {FAMILY} {table}",
        f"add chain {FAMILY} {table} out "
        f"{{ type route hook output priority {_PRIO_ROUTE_OUT + depth + 1}; }}",
        f"add chain {FAMILY} {table} pre {{ type filter hook prerouting priority {_PRIO_PRE - depth - 1}; }}",
    ]
    for la, lp, old, rp, new in rules:
        lines.append(f"add rule {FAMILY} {table} out {_match(la, lp, old, rp)} ip daddr set {new}")
        lines.append(f"add rule {FAMILY} {table} pre {_match(new, rp, la, lp)} ip saddr set {old}")
    with Nft() as nft:
        _run(nft, "\n".join(lines), f"redirect {len(rules)} connections")
    return table


def remove(table: str, pid: int | None = None) -> bool:
    """Delete one of our tables; True if it was there. Idempotent."""
    if not table.startswith((CUT, NAT)):
        raise ValueError(f"{table!r} is not a criuctl rule set")
    if pid is not None:
        return bool(netns.run_in(pid, remove, table))
    with Nft() as nft:
        ok, _, err = nft.run(f"delete table {FAMILY} {table}")
    if ok or "No such file or directory" in err:
        return ok
    raise NetlockError(
        f"cannot delete nftables table {FAMILY} {table}: {err.strip()}",
        f"delete it by hand: nft delete table {FAMILY} {table}",
    )


def tables(prefix: str, pid: int | None = None) -> list[str]:
    """Our tables of one kind (`CUT` or `NAT`) in this network namespace (or `pid`'s)."""
    if pid is not None:
        return list(netns.run_in(pid, tables, prefix))
    with Nft() as nft:
        ok, out, err = nft.run(f"list tables {FAMILY}")
    if not ok:
        raise NetlockError(f"cannot list nftables tables: {err.strip()}", "run the agent as root")
    return re.findall(rf"^table {FAMILY} ({re.escape(prefix)}\S+)$", out, re.M)
