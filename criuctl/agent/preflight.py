"""Checks of `criuctl agent`'s options before it serves: the listen address, the port, TLS.

An agent is started by a DaemonSet or by hand, and a bad option found only inside the server's
start-up surfaces as an asyncio or OpenSSL traceback. Each check here turns one such failure into
one line that says what is wrong and what to do. They are checks, not reservations: the port is
bound, then released, and the server binds it again a moment later.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import ssl
import time
from dataclasses import dataclass
from pathlib import Path

from criuctl.core.errors import CriuctlError

LISTEN_EXAMPLE = "e.g. 0.0.0.0:7070, 10.0.0.2:7070 or [::1]:7070"
MAKE_CERT = "scripts/agent-cert.sh NODE ADDRESS makes them"
INSECURE_WARNING = (
    "serving plain HTTP (--insecure): the token, upload tickets and bundles (every memory page of a "
    "job) cross the network unencrypted, and clients cannot tell this agent from an impostor; "
    "use it only on a network you trust, and serve HTTPS with --tls-cert/--tls-key elsewhere"
)


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


def check_transport(cert: str | None, key: str | None, insecure: bool) -> None:
    """HTTPS unless `--insecure` says otherwise, loudly: the agent carries a bearer token and whole
    process images, so plain HTTP must be a choice someone typed, never what a missing flag gives."""
    if (cert is None) != (key is None):
        raise BadOption("--tls-cert and --tls-key go together", f"pass both ({MAKE_CERT})")
    if insecure and cert is not None:
        raise BadOption(
            "--insecure contradicts --tls-cert/--tls-key", "drop --insecure to serve HTTPS with them"
        )
    if not insecure and cert is None:
        raise BadOption(
            "the agent serves HTTPS and was given no certificate",
            f"pass --tls-cert FILE --tls-key FILE ({MAKE_CERT}, docs/deploy.md), "
            "or --insecure for plain HTTP on a network you trust",
        )


def check_peer_ca(ca: Path, served: bool) -> None:
    """The agents' CA loads as the server will load it; it is for checking callers of an HTTPS agent."""
    if not served:
        raise BadOption(
            "--peer-ca asks callers for a certificate, which needs HTTPS", "drop --peer-ca or --insecure"
        )
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_verify_locations(cafile=str(ca))
    except (OSError, ssl.SSLError) as exc:
        raise BadOption(
            f"cannot load --peer-ca {ca} ({getattr(exc, 'strerror', None) or exc.__class__.__name__})",
            "pass the PEM certificate of the CA that signs the agents' certificates",
        ) from exc


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


@dataclass(frozen=True)
class CertNames:
    """What a certificate says about where it may be served: its subjectAltName and its expiry."""

    ips: frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address]
    dns: frozenset[str]
    not_after: float  # seconds since the epoch

    @classmethod
    def read(cls, cert: Path) -> CertNames | None:
        """The names in a PEM certificate; None where this Python cannot decode one.

        `ssl` has no public decoder for a certificate file (only for a peer's, after a handshake),
        and criuctl carries no X.509 library: `_ssl._test_decode_cert` is CPython's own (its tests
        use it), and the check it feeds is a warning, so a Python without it loses only the warning.
        """
        decode = getattr(getattr(ssl, "_ssl", None), "_test_decode_cert", None)
        if decode is None:
            return None
        try:
            d = decode(str(cert))
        except (ssl.SSLError, OSError, ValueError):
            return None
        san = d.get("subjectAltName", ())
        ips = set()
        for kind, value in san:
            if kind == "IP Address":
                try:
                    ips.add(ipaddress.ip_address(value.strip()))
                except ValueError:
                    continue
        return cls(
            frozenset(ips),
            frozenset(v.lower() for k, v in san if k == "DNS"),
            ssl.cert_time_to_seconds(d["notAfter"]),
        )

    def describe(self) -> str:
        return ", ".join(sorted(map(str, self.ips)) + sorted(self.dns)) or "no subjectAltName"

    def names_host(self, name: str) -> bool:
        name = name.lower().rstrip(".")
        rest = name.partition(".")[2]  # a wildcard stands for the first label only
        return name in self.dns or (bool(rest) and f"*.{rest}" in self.dns)


def _local_ips(host: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses other hosts reach the agent by: `host` itself, or for a wildcard every
    interface's but loopback and link-local ones (a certificate naming only those serves no other
    host; a URL with a link-local address needs a zone no certificate names)."""
    if host not in ("0.0.0.0", "::"):
        try:
            return {ipaddress.ip_address(host)}
        except ValueError:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
            return {ipaddress.ip_address(str(a[4][0]).partition("%")[0]) for a in infos}
    import psutil

    every = {
        ipaddress.ip_address(a.address.partition("%")[0])
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family in (socket.AF_INET, socket.AF_INET6)
    }
    return {i for i in every if not (i.is_loopback or i.is_link_local)} or every


def cert_warnings(cert: Path, host: str, node: str, now: float | None = None) -> list[str]:
    """What is probably wrong with the agent's certificate for this node, as warnings.

    Warnings, not refusals: clients check the certificate against the address in their URL, and
    that address need not be one this host has (a NAT, a load balancer, a DNS alias), so only the
    clients can know for sure. A certificate that names none of this host's addresses or names is
    still, most often, another node's certificate copied here: the agent says so at start-up
    rather than at the first migration's TLS failure.
    """
    names = CertNames.read(cert)
    if names is None:
        return []
    out = []
    if names.not_after < (time.time() if now is None else now):
        out.append(f"the TLS certificate {cert} has expired: clients refuse it; issue a new one")
    local = _local_ips(host)
    if not names.ips & local and not any(names.names_host(n) for n in (node, socket.gethostname())):
        here = ", ".join(sorted(map(str, local))) or host
        out.append(
            f"the TLS certificate {cert} names {names.describe()}, none of this node's addresses "
            f"({here}) or names ({node}): clients that check it against this node's address refuse it; "
            "issue one for this node, unless clients reach it through an address this host lacks (NAT)"
        )
    return out
