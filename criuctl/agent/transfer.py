"""Bundles on the wire, sending side: a tar stream of a sealed bundle, or a live one (`livesend`).

A sealed bundle goes out as plain ustar records, manifest.json and its signature first, with an
exact Content-Length; a bundle CRIU is still writing goes out as a record stream (chunked), its
manifest last. Either way the bytes leave with `sendfile` from the page cache, and the receiver
(`criuctl.agent.receiver`) hashes each file as it writes it. Neither side trusts the network to
say it broke: no progress for `Timeouts.stall` seconds ends the transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import socket
import ssl
import tarfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from criuctl.agent import conn as conn_mod
from criuctl.agent.messages import ErrorAnswer
from criuctl.agent.protocol import UploadAnswer, timeouts
from criuctl.core.errors import CriuctlError
from criuctl.format import bundle

PIECE = 4 << 20
_BLOCK = tarfile.BLOCKSIZE

Read = Callable[[int], Awaitable[bytes]]  # up to n bytes; b"" at the end


class TransferError(CriuctlError):
    """The stream broke, stalled, or is not an acceptable bundle stream."""


@dataclass
class Counter:
    """Bytes moved so far, for progress reports and the stall watchdog."""

    total: int = 0
    done: int = 0
    beats: int = 0  # keep-alives of a live stream while CRIU wrote nothing new: progress too
    started: float = 0.0


def _order(root: Path) -> list[Path]:
    first = [root / bundle.MANIFEST, root / bundle.SIGNATURE]
    rest = sorted(p for p in root.rglob("*") if p.is_file() and p not in first)
    return [p for p in first if p.exists()] + rest


def _header(root: Path, path: Path, size: int) -> bytes:
    info = tarfile.TarInfo(path.relative_to(root).as_posix())
    info.size, info.mode = size, 0o600
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def _pad(size: int) -> int:
    return -size % _BLOCK


def _given(root: Path, path: Path, given: dict[str, bytes]) -> bytes | None:
    return given.get(path.name) if path.parent == root else None


def _size(root: Path, path: Path, given: dict[str, bytes]) -> int:
    held = _given(root, path, given)
    return len(held) if held is not None else path.stat().st_size


def stream_size(root: Path, given: dict[str, bytes] | None = None) -> int:
    """Exact length of the stream for `root`: it goes out as Content-Length."""
    given = given or {}
    return 2 * _BLOCK + sum(_BLOCK + (n := _size(root, p, given)) + _pad(n) for p in _order(root))


async def tar_pieces(
    root: Path, counter: Counter | None = None, given: dict[str, bytes] | None = None
) -> AsyncIterator[bytes]:
    """The bundle at `root` as a tar stream; the next piece is read while this one is sent.
    `given`: the bytes to send for top-level files (manifest.json as checked, its signature for
    the one node that takes it: `bundle.signed_for`) instead of what is on disk."""
    given = given or {}
    for path in _order(root):
        held = _given(root, path, given)
        if held is not None:
            yield _header(root, path, len(held))
            yield held + bytes(_pad(len(held)))
            continue
        yield _header(root, path, path.stat().st_size)
        with path.open("rb", buffering=0) as f:
            nxt = asyncio.ensure_future(asyncio.to_thread(f.read, PIECE))
            size = 0
            while piece := await nxt:
                nxt = asyncio.ensure_future(asyncio.to_thread(f.read, PIECE))
                size += len(piece)
                if counter is not None:
                    counter.done += len(piece)
                yield piece
        if _pad(size):
            yield bytes(_pad(size))
    yield bytes(2 * _BLOCK)


async def watchdog(counter: Counter, task: asyncio.Future[Any], what: str) -> None:
    """Cancel `task` when `counter` has not moved for `Timeouts.stall` s (a cut link sends no RST)."""
    last, since = counter.done + counter.beats, time.monotonic()
    while not task.done():
        await asyncio.sleep(0.5)
        if counter.done + counter.beats != last:
            last, since = counter.done + counter.beats, time.monotonic()
        elif time.monotonic() - since > timeouts().stall:
            task.cancel()
            stalled = f"{what} stalled: no progress for {timeouts().stall:.0f} s"
            raise TransferError(stalled, "check the network")


class Source(Protocol):
    """What goes out in one PUT: its headers, then its body written straight onto the socket."""

    def headers(self) -> dict[str, str]: ...
    def body(self, sock: socket.socket, counter: Counter) -> None: ...


class Sealed:
    """A sealed bundle as a tar stream of known length, the manifest and its signature first."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def headers(self) -> dict[str, str]:
        return {"Content-Type": "application/x-tar", "Content-Length": str(stream_size(self.root))}

    def body(self, sock: socket.socket, counter: Counter) -> None:
        for path in _order(self.root):
            sock.sendall(_header(self.root, path, path.stat().st_size))
            with path.open("rb") as f:
                size, offset = os.fstat(f.fileno()).st_size, 0
                while offset < size:
                    sent = sock.sendfile(f, offset, min(4 * PIECE, size - offset))
                    if not sent:
                        raise TransferError(f"{path.name} shrank while it was sent", "retry the migration")
                    offset += sent
                    counter.done += sent
            if _pad(size):
                sock.sendall(bytes(_pad(size)))
        sock.sendall(bytes(2 * _BLOCK))


def _continued(sock: socket.socket) -> bool:
    """Wait for the target's interim "100 Continue" and take it off the socket; False when its final
    answer came instead (a refusal, before any of the body was sent)."""
    interim = b"HTTP/1.1 100 "
    while True:
        head = sock.recv(256, socket.MSG_PEEK)  # blocks up to the stall timeout
        if not head or not (head.startswith(interim) or interim.startswith(head)):
            return False
        if (end := head.find(b"\r\n\r\n")) >= 0:
            sock.recv(end + 4)
            return True
        time.sleep(0.001)  # part of it: the rest is on its way


class _Put:
    """One PUT over a plain socket: headers, then the files with `sendfile` (no copy through Python:
    the kernel moves page-cache pages to the socket), then the answer.

    Blocking, in a thread: aiohttp's client copies every piece through Python and the event loop,
    which capped the stream at a fraction of the wire. Over TLS `sendfile` falls back to reads
    (`socket.sendfile` does that for an SSL socket by itself).
    """

    def __init__(self, source: Source, url: str, auth: str, ca_pem: str | None, counter: Counter) -> None:
        self.source, self.url, self.auth, self.ca_pem, self.counter = source, url, auth, ca_pem, counter
        self.conn: http.client.HTTPConnection | None = None

    def run(self) -> tuple[int, Any]:
        """The answer's HTTP status and its JSON, as sent."""
        conn = self.conn = conn_mod.connect(self.url, self.ca_pem, 5)
        try:
            conn.connect()  # within 5 s, as before
            conn.sock.settimeout(timeouts().stall)  # a send or the answer that stalls this long fails
            u = urlsplit(self.url)
            conn.putrequest("PUT", u.path + (f"?{u.query}" if u.query else ""), skip_accept_encoding=True)
            conn.putheader("Authorization", self.auth)
            plain = not isinstance(conn.sock, ssl.SSLSocket)
            if plain:  # the target takes the socket for `splice` only if the body waits for its word
                conn.putheader("Expect", "100-continue")
            for k, v in self.source.headers().items():
                conn.putheader(k, v)
            conn.endheaders()
            if not plain or _continued(conn.sock):
                with contextlib.suppress(OSError):  # the target may have answered early (a refusal): read it
                    self.source.body(conn.sock, self.counter)
            resp = conn.getresponse()
            raw = resp.read(1 << 20)
            try:
                return resp.status, json.loads(raw)
            except ValueError:
                return resp.status, {"what": raw[:200].decode(errors="replace")}
        finally:
            conn.close()

    def cut(self) -> None:
        """From another thread: end a stalled transfer now (its blocked send returns an error)."""
        with contextlib.suppress(OSError, AttributeError):
            if self.conn is not None:
                self.conn.sock.shutdown(socket.SHUT_RDWR)


async def send(
    source: Path | Source, url: str, auth: str, ca_pem: str | None, counter: Counter, node: str
) -> UploadAnswer:
    """PUT a bundle (a sealed folder, or a `livesend.Live` one) to another agent, `auth` its
    Authorization header (a ticket's proof); its JSON answer, or TransferError."""
    put = _Put(Sealed(source) if isinstance(source, Path) else source, url, auth, ca_pem, counter)
    job = asyncio.ensure_future(asyncio.to_thread(put.run))
    dog = asyncio.ensure_future(watchdog(counter, job, f"sending the bundle to node {node}"))
    try:
        status, answer = await asyncio.shield(job)
    except (OSError, http.client.HTTPException, asyncio.CancelledError) as exc:
        put.cut()
        if dog.done() and (stalled := dog.exception()) is not None:
            raise stalled from exc
        raise TransferError(
            f"lost the connection to node {node} while sending the bundle ({exc.__class__.__name__})",
            "check the network between the nodes",
        ) from exc
    finally:
        dog.cancel()
        with contextlib.suppress(asyncio.CancelledError, TransferError):
            await dog
    if status >= 400:
        refused: ErrorAnswer = answer
        raise TransferError(refused.get("what", f"node {node} answered {status}"), refused.get("hint", ""))
    kept: UploadAnswer = answer
    return kept
