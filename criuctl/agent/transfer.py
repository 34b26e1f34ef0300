"""Bundles on the wire: a tar stream, moved in 4 MiB pieces, hashed as it arrives.

The sender puts manifest.json and its signature first, then every other file, as plain ustar
records with an exact Content-Length (no chunked encoding to parse). The receiver takes regular
files with relative names only (a crafted stream must not write outside its folder or plant a
link), hashes each file while writing it, and hands the digests to `bundle.verify`: a bundle is
read from the network once and never again before the restore.

Both ends pipeline: the next piece is read from the file (or the socket) while the previous one is
sent (or hashed and written) in a thread; BLAKE3 and file I/O release the GIL on pieces this big.
Neither side trusts the network to say it broke: no progress for `TIMEOUTS.stall` seconds ends the transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import http.client
import json
import os
import socket
import ssl
import tarfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlsplit

from criuctl import bundle
from criuctl.agent.protocol import TIMEOUTS
from criuctl.errors import CriuctlError

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
    started: float = 0.0


def _order(root: Path) -> list[Path]:
    first = [root / bundle.MANIFEST, root / bundle.SIGNATURE]
    rest = sorted(p for p in root.rglob("*") if p.is_file() and p not in first)
    return [p for p in first if p.exists()] + rest


def _header(root: Path, path: Path) -> bytes:
    info = tarfile.TarInfo(path.relative_to(root).as_posix())
    info.size, info.mode = path.stat().st_size, 0o600
    return info.tobuf(format=tarfile.USTAR_FORMAT)


def _pad(size: int) -> int:
    return -size % _BLOCK


def stream_size(root: Path) -> int:
    """Exact length of the stream for `root`: it goes out as Content-Length."""
    return 2 * _BLOCK + sum(_BLOCK + p.stat().st_size + _pad(p.stat().st_size) for p in _order(root))


async def tar_pieces(root: Path, counter: Counter | None = None) -> AsyncIterator[bytes]:
    """The bundle at `root` as a tar stream; the next piece is read while this one is sent."""
    for path in _order(root):
        yield _header(root, path)
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


def _safe_name(name: str) -> PurePosixPath:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise TransferError(
            f"refused a bundle stream with the path {name!r}", "the sender is not a criuctl agent"
        )
    return p


async def _exactly(read: Read, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = await read(n - got)
        if not part:
            raise TransferError("the bundle stream broke off before its end", "retry the migration")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


async def receive(read: Read, dest: Path, counter: Counter | None = None) -> dict[str, str]:
    """Write the tar stream `read` yields under `dest` (root-only); return each file's digest."""
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    digests: dict[str, str] = {}
    while True:
        header = await _exactly(read, _BLOCK)
        if header == bytes(_BLOCK):
            return digests
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except (tarfile.TarError, ValueError) as exc:
            raise TransferError(f"the bundle stream is damaged ({exc})", "retry the migration") from exc
        rel = _safe_name(info.name)
        if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
            raise TransferError(
                f"refused a bundle stream with {info.name!r}, which is not a regular file",
                "the sender is not a criuctl agent",
            )
        if info.size < 0:  # base-256 size fields can be negative
            raise TransferError(
                f"refused a bundle stream with {info.name!r} of size {info.size}",
                "the sender is not a criuctl agent",
            )
        target = dest / rel
        h = bundle.hasher()
        try:  # a name twice, a file where a folder must go, a name too long: refused, not a crash
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise  # this node's disk, not the stream: the agent says "disk full"
            raise TransferError(
                f"refused a bundle stream with {info.name!r}: cannot create it ({exc.strerror})",
                "the sender is not a criuctl agent",
            ) from exc
        try:
            left, pending = info.size, None
            while left:
                parts, got = [], 0
                while got < min(left, PIECE):  # gather a whole piece: one thread hop per 4 MiB
                    part = await read(min(left, PIECE) - got)
                    if not part:
                        raise TransferError(
                            "the bundle stream broke off before its end", "retry the migration"
                        )
                    parts.append(part)
                    got += len(part)
                if pending is not None:
                    await pending
                data = b"".join(parts)  # hashed and written at once, in two threads
                pending = asyncio.gather(
                    asyncio.to_thread(h.update, data), asyncio.to_thread(_write_all, fd, data)
                )
                left -= got
                if counter is not None:
                    counter.done += got
            if pending is not None:
                await pending
        finally:
            os.close(fd)
        digests[rel.as_posix()] = h.hexdigest()
        await _exactly(read, _pad(info.size)) if _pad(info.size) else None


async def watchdog(counter: Counter, task: asyncio.Future, what: str) -> None:
    """Cancel `task` when `counter` has not moved for `TIMEOUTS.stall` s (a cut link sends no RST)."""
    last, since = counter.done, time.monotonic()
    while not task.done():
        await asyncio.sleep(0.5)
        if counter.done != last:
            last, since = counter.done, time.monotonic()
        elif time.monotonic() - since > TIMEOUTS.stall:
            task.cancel()
            stalled = f"{what} stalled: no progress for {TIMEOUTS.stall:.0f} s"
            raise TransferError(stalled, "check the network")


class _Put:
    """One PUT of a bundle over a plain socket: headers, then each file with `sendfile` (no copy
    through Python: the kernel moves page-cache pages to the socket), then the answer.

    Blocking, in a thread: aiohttp's client copies every piece through Python and the event loop,
    which capped the stream at a fraction of the wire. Over TLS `sendfile` falls back to reads
    (`socket.sendfile` does that for an SSL socket by itself).
    """

    def __init__(self, root: Path, url: str, token: str, ca_pem: str | None, counter: Counter) -> None:
        self.root, self.url, self.token, self.ca_pem, self.counter = root, url, token, ca_pem, counter
        self.conn: http.client.HTTPConnection | None = None

    def _connect(self) -> http.client.HTTPConnection:
        u = urlsplit(self.url)
        if u.scheme == "https":
            ctx = (
                ssl.create_default_context(cadata=self.ca_pem)
                if self.ca_pem
                else ssl.create_default_context()
            )
            return http.client.HTTPSConnection(u.hostname or "", u.port or 443, timeout=5, context=ctx)
        return http.client.HTTPConnection(u.hostname or "", u.port or 80, timeout=5)

    def run(self) -> tuple[int, dict]:
        conn = self.conn = self._connect()
        try:
            conn.connect()  # within 5 s, as before
            conn.sock.settimeout(TIMEOUTS.stall)  # a send or the answer that stalls this long fails
            u = urlsplit(self.url)
            conn.putrequest("PUT", u.path + (f"?{u.query}" if u.query else ""), skip_accept_encoding=True)
            conn.putheader("Authorization", f"Bearer {self.token}")
            conn.putheader("Content-Type", "application/x-tar")
            conn.putheader("Content-Length", str(stream_size(self.root)))
            conn.endheaders()
            with contextlib.suppress(OSError):  # the target may have answered early (a refusal): read it
                self._body(conn.sock)
            resp = conn.getresponse()
            raw = resp.read(1 << 20)
            try:
                return resp.status, json.loads(raw)
            except ValueError:
                return resp.status, {"what": raw[:200].decode(errors="replace")}
        finally:
            conn.close()

    def _body(self, sock: socket.socket) -> None:
        for path in _order(self.root):
            sock.sendall(_header(self.root, path))
            with path.open("rb") as f:
                size, offset = os.fstat(f.fileno()).st_size, 0
                while offset < size:
                    sent = sock.sendfile(f, offset, min(4 * PIECE, size - offset))
                    if not sent:
                        raise TransferError(f"{path.name} shrank while it was sent", "retry the migration")
                    offset += sent
                    self.counter.done += sent
            if _pad(size):
                sock.sendall(bytes(_pad(size)))
        sock.sendall(bytes(2 * _BLOCK))

    def cut(self) -> None:
        """From another thread: end a stalled transfer now (its blocked send returns an error)."""
        with contextlib.suppress(OSError, AttributeError):
            self.conn.sock.shutdown(socket.SHUT_RDWR)


async def send(root: Path, url: str, token: str, ca_pem: str | None, counter: Counter, node: str) -> dict:
    """PUT the bundle at `root` to another agent as one tar stream; its JSON answer, or TransferError."""
    put = _Put(root, url, token, ca_pem, counter)
    job = asyncio.ensure_future(asyncio.to_thread(put.run))
    dog = asyncio.ensure_future(watchdog(counter, job, f"sending the bundle to node {node}"))
    try:
        status, answer = await asyncio.shield(job)
    except (OSError, http.client.HTTPException, asyncio.CancelledError) as exc:
        put.cut()
        if dog.done() and dog.exception() is not None:
            raise dog.exception() from exc
        raise TransferError(
            f"lost the connection to node {node} while sending the bundle ({exc.__class__.__name__})",
            "check the network between the nodes",
        ) from exc
    finally:
        dog.cancel()
        with contextlib.suppress(asyncio.CancelledError, TransferError):
            await dog
    if status >= 400:
        raise TransferError(answer.get("what", f"node {node} answered {status}"), answer.get("hint", ""))
    return answer
