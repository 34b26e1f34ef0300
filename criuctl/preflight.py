"""Checks of `criuctl agent`'s options before it serves: the listen address, the port, TLS files.

An agent is started by a DaemonSet or by hand, and a bad option found only inside the server's
start-up surfaces as an asyncio or OpenSSL traceback. Each check here turns one such failure into
one line that says what is wrong and what to do. They are checks, not reservations: the port is
bound, then released, and the server binds it again a moment later.
"""

from __future__ import annotations

import errno
import socket
import ssl
from pathlib import Path

from criuctl.errors import CriuctlError

LISTEN_EXAMPLE = "e.g. 0.0.0.0:7070, 10.0.0.2:7070 or [::1]:7070"


class BadOption(CriuctlError):
    """An option the agent cannot start with."""

    exit_code = 2


def parse_listen(listen: str) -> tuple[str, int]:
    """`HOST:PORT` (HOST may be empty: all addresses; an IPv6 address in brackets) → host, port."""
    text = listen.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep or not host:
            raise BadOption(f"--listen {listen!r} is not [IPv6]:PORT", LISTEN_EXAMPLE)
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise BadOption(f"--listen {listen!r} is not HOST:PORT (no port)", LISTEN_EXAMPLE)
        if ":" in host:
            raise BadOption(f"--listen {listen!r}: write an IPv6 address in brackets", LISTEN_EXAMPLE)
    if not port.isascii() or not port.isdigit():
        raise BadOption(f"the port {port!r} in --listen {listen!r} is not a number", LISTEN_EXAMPLE)
    if not 1 <= int(port) <= 65535:
        raise BadOption(f"the port {int(port)} in --listen {listen!r} is not in 1-65535", LISTEN_EXAMPLE)
    return host or "0.0.0.0", int(port)


def check_bind(host: str, port: int) -> None:
    """Bind every address `host` names, as the server will (SO_REUSEADDR), and let them go."""
    where = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise BadOption(
            f"cannot listen on {where}: no address for {host!r} ({getattr(exc, 'strerror', exc)})",
            f"give an address or name of this host, or 0.0.0.0 for all ({LISTEN_EXAMPLE})",
        ) from exc
    for family, kind, proto, addr in dict.fromkeys((f, k, p, a) for f, k, p, _, a in infos):
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                raise _bind_error(where, port, exc) from exc


def _bind_error(where: str, port: int, exc: OSError) -> CriuctlError:
    if exc.errno == errno.EADDRINUSE:
        return CriuctlError(
            f"cannot listen on {where}: the port is in use (another agent?)",
            f"stop what listens there (`ss -ltnp 'sport = :{port}'`), or pass another --listen",
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return BadOption(
            f"cannot listen on {where}: not an address of this host",
            "pass one of this host's addresses (`ip -br addr`), or 0.0.0.0 for all",
        )
    return CriuctlError(f"cannot listen on {where}: {exc.strerror}", "pass another --listen")


def check_tls(cert: Path, key: Path) -> None:
    """The certificate and key load as the server will load them (PEM, matching, unencrypted)."""
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            with path.open("rb") as f:
                f.read(1)
        except OSError as exc:
            raise BadOption(
                f"cannot read {flag} {path}: {exc.strerror}",
                "pass the PEM files of this node's certificate and its private key",
            ) from exc

    def no_password() -> bytes:
        raise BadOption(
            f"the key in --tls-key {key} is encrypted", "give the agent an unencrypted key (mode 0600)"
        )

    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key, password=no_password)
    except ssl.SSLError as exc:
        raise BadOption(
            f"--tls-cert {cert} and --tls-key {key} are not a PEM certificate and its key "
            f"({exc.reason or exc.strerror or exc.__class__.__name__})",
            "pass the certificate and the private key it was issued for, both PEM",
        ) from exc
