"""Give a dumped tree's TCP sockets new addresses: the moved ranks of a multi-node job live elsewhere.

A rank of a distributed job that moves to another node gets that node's address. Its established
connections are restored by CRIU from `files.img`, where each inet socket names its source and
destination (address, port). Rewriting them before the restore is all CRIU needs: it binds the
socket to the new source address and re-creates the connection to the new destination in repair
mode, with the sequence numbers and queues of the dump, so the peer sees the same stream go on.

The map is by *endpoint*: `(old address, port) → new address`, one entry for every local endpoint
(listening or connected) of every rank that moves. Applied to both ends of every socket, it moves
the rank's own sockets (source side) and its connections to other moved ranks (destination side),
and leaves everything else alone — a rank that stays on a node another rank leaves keeps its
address. Sockets bound to the wildcard address stay so. IPv4-mapped IPv6 addresses (a dual-stack
listener's connections) are matched and written in that form.

Below `checkpoint` (which calls it on the staging images before the bundle is sealed); imports
only `errors`.
"""

from __future__ import annotations

import io
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from criuctl.core.errors import CriuctlError
from criuctl_hook import durable

Endpoint = tuple[str, int]  # (address, port): IPv4 spelled as IPv4, v4-mapped IPv6 too


class ReaddressError(CriuctlError):
    """The images could not be read or written back."""


def canonical(addr: str) -> str:
    """One spelling per address: an IPv4-mapped IPv6 address as its IPv4 form."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return addr
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


@dataclass(frozen=True)
class EndpointMap:
    """`(old address, port) → new address` for every endpoint that moves."""

    moves: dict[Endpoint, str]

    @classmethod
    def from_json(cls, raw: Any) -> EndpointMap:
        """From `[[old, port, new], ...]` (the form it travels in); ValueError for anything else."""
        if not isinstance(raw, list):
            raise ValueError("an endpoint map is a list of [old address, port, new address]")
        moves: dict[Endpoint, str] = {}
        for item in raw:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[1], int)):
                raise ValueError(f"bad endpoint map entry {item!r}")
            old, port, new = str(item[0]), item[1], str(item[2])
            for a in (old, new):
                ipaddress.ip_address(a)  # ValueError for anything that is not an address
            if not 0 < port < 65536:
                raise ValueError(f"bad port {port}")
            moves[(canonical(old), port)] = canonical(new)
        return cls(moves)

    def to_json(self) -> list[list[str | int]]:
        return [[a, p, n] for (a, p), n in sorted(self.moves.items())]

    def new_address(self, addr: str, port: int) -> str | None:
        """The endpoint's new address in the spelling of `addr`; None when it does not move."""
        new = self.moves.get((canonical(addr), port))
        if new is None:
            return None
        ip = ipaddress.ip_address(addr)
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            return f"::ffff:{new}"
        return new


def _decode(words: list) -> str | None:
    """An image's address (pycriu's raw form: 1 or 4 uint32 in network order) as text."""
    if len(words) == 1 and isinstance(words[0], str):  # already text (a pretty-printed image)
        return words[0]
    if len(words) not in (1, 4) or not all(isinstance(w, int) for w in words):
        return None
    raw = b"".join(socket.ntohl(w).to_bytes(4, "big") for w in words)
    return str(ipaddress.ip_address(raw))


def _encode(addr: str) -> list[int]:
    packed = ipaddress.ip_address(addr).packed
    return [socket.htonl(int.from_bytes(packed[i : i + 4], "big")) for i in range(0, len(packed), 4)]


def apply(images_dir: Path, endpoints: EndpointMap) -> int:
    """Rewrite every inet socket of `images_dir/files.img` through `endpoints`; the count changed."""
    path = images_dir / "files.img"
    try:
        import pycriu

        with path.open("rb") as f:
            img = pycriu.images.load(f)
    except FileNotFoundError:
        return 0  # a tree without files has no sockets
    except Exception as exc:  # pycriu raises anything on a damaged image
        raise ReaddressError(f"cannot read {path}: {exc}", "the dump is damaged; nothing was moved") from exc
    changed = 0
    for entry in img["entries"]:
        isk = entry.get("isk")
        if not isk:
            continue
        for addr_key, port_key in (("src_addr", "src_port"), ("dst_addr", "dst_port")):
            addr = _decode(isk.get(addr_key) or [])
            if addr is None:
                continue
            new = endpoints.new_address(addr, int(isk.get(port_key, 0)))
            if new is not None and new != addr:
                isk[addr_key] = _encode(new)
                changed += 1
    if changed:
        try:
            out = io.BytesIO()
            pycriu.images.dump(img, out)
            durable.replace(path, out.getvalue(), sync=False)  # sealed, and synced, with the bundle
        except Exception as exc:
            raise ReaddressError(f"cannot write {path}: {exc}", "nothing was moved") from exc
    return changed
