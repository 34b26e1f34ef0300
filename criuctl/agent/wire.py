"""The receiving socket of a bundle upload: bytes go from the socket into the files by `splice`.

Through aiohttp every byte of a bundle was copied four times on the target (the event loop's
`recv` into a new `bytes`, the StreamReader's join, the hash, the `write` into the page cache),
on the same cores that run the sender and the network: the stream moved at a tenth of raw TCP.
Here the upload's socket is taken from aiohttp once the request is authorised, and its body
goes from the socket through a pipe into the file (`splice`: the kernel's one copy into the
page cache, none through Python), while a second thread hashes what is already in the page
cache (`preadv` into one reused buffer, BLAKE3 without the GIL). The hash is still of what was
written, byte for byte, and still checked against the signed manifest before anything restores.

The socket is taken only when nothing has been read from the body yet: the sender asks
`Expect: 100-continue` and sends the body after the "100 Continue" that `take` writes, once
aiohttp's reading is paused. A sender that does not ask (an older agent), and TLS (whose bytes
must be decrypted in user space), keep aiohttp's stream (`StreamWire`). Either framing the
sender uses (Content-Length, chunked) is read here; the connection is closed after the answer,
so aiohttp never parses what it did not see.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import select
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from criuctl.agent.transfer import PIECE, Counter, Read, TransferError
from criuctl.format import bundle

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("criuctl.agent")

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_F_SETPIPE_SZ, _F_GETPIPE_SZ = 1031, 1032
_NONBLOCK_MOVE = os.SPLICE_F_MOVE | os.SPLICE_F_NONBLOCK
_POLL_MS = 500  # how often a blocked read looks whether it was told to stop
_MAX_LINE = 4096  # a chunk's size line, or a trailer line
_BROKE = ("the bundle stream broke off before its end", "retry the migration")


def _damaged(what: str) -> TransferError:
    return TransferError(f"the bundle stream is damaged ({what})", "retry the migration")


class Wire(Protocol):
    """A request body as the receiver reads it: small reads, and whole runs of bytes into a file."""

    async def read(self, n: int) -> bytes:
        """Up to `n` bytes; b"" at the end."""
        ...

    async def copy(
        self, fd: int, offset: int, n: int, hasher: bundle.Hasher, counter: Counter | None
    ) -> None:
        """Exactly `n` bytes into `fd` at `offset`, each hashed as it was written."""
        ...


def _parts_hash(hasher: bundle.Hasher, parts: list[bytes]) -> None:
    for part in parts:
        hasher.update(part)


def _pwritev_all(fd: int, parts: list[bytes], offset: int) -> None:
    views = [memoryview(p) for p in parts]
    while views:
        done = os.pwritev(fd, views[:1024], offset)  # IOV_MAX
        offset += done
        while views and done >= len(views[0]):
            done -= len(views.pop(0))
        if done:
            views[0] = views[0][done:]


class StreamWire:
    """aiohttp's StreamReader (TLS, or a sender that did not ask to continue): the pieces the socket
    gave, hashed and written in two threads while the next piece is read."""

    def __init__(self, read: Read) -> None:
        self._read = read

    async def read(self, n: int) -> bytes:
        return await self._read(n)

    async def parts(self, n: int) -> list[bytes]:
        """Exactly `n` bytes, as the pieces the socket gave (not joined: no extra copy)."""
        parts, got = [], 0
        while got < n:
            part = await self.read(n - got)
            if not part:
                raise TransferError(*_BROKE)
            parts.append(part)
            got += len(part)
        return parts

    async def copy(
        self, fd: int, offset: int, n: int, hasher: bundle.Hasher, counter: Counter | None
    ) -> None:
        pending = None
        while n:
            size = min(n, PIECE)
            parts = await self.parts(size)  # a whole piece: one thread hop per 4 MiB
            if pending is not None:
                await pending
            pending = asyncio.gather(
                asyncio.to_thread(_parts_hash, hasher, parts),
                asyncio.to_thread(_pwritev_all, fd, parts, offset),
            )
            n -= size
            offset += size
            if counter is not None:
                counter.done += size
        if pending is not None:
            await pending


class _Follower:
    """Hashes a file from the page cache, behind the thread that splices into it."""

    def __init__(self, fd: int, offset: int, hasher: bundle.Hasher) -> None:
        self.fd, self.pos, self.hasher = fd, offset, hasher
        self.written = offset
        self.closed = False
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="criuctl-hash", daemon=True)
        self.thread.start()

    def advance(self, to: int) -> None:
        with self.cond:
            self.written = to
            self.cond.notify()

    def finish(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify()
        self.thread.join()
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        buf = memoryview(bytearray(PIECE))
        try:
            while True:
                with self.cond:
                    while self.written <= self.pos and not self.closed:
                        self.cond.wait()
                    end, closed = self.written, self.closed
                while self.pos < end:
                    got = os.preadv(self.fd, [buf[: min(end - self.pos, PIECE)]], self.pos)
                    if not got:
                        raise OSError("a file shrank while it was hashed")
                    self.hasher.update(buf[:got])
                    self.pos += got
                if closed:
                    return
        except BaseException as exc:  # handed to the splicing thread by finish()
            self.error = exc


class SpliceWire:
    """The upload's own socket (aiohttp's reading paused): the body's bytes spliced into files."""

    def __init__(self, sock: socket.socket, chunked: bool, length: int | None) -> None:
        self.sock = sock  # a duplicate of aiohttp's socket, non-blocking as aiohttp left it
        self.chunked = chunked
        self.left = 0 if chunked else (length or 0)  # body bytes left (Content-Length), or in this chunk
        self.crlf = False  # a chunk's data is done: its CRLF comes next
        self.ended = False
        self.stop = threading.Event()
        self.deadline = float("inf")  # a drain's: no byte until then ends it
        self.busy = threading.Lock()  # one thread on the socket at a time (a copy, then a drain)
        self.pipe_r, self.pipe_w = os.pipe2(os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # the default (64 KiB) still works, in more calls
            fcntl.fcntl(self.pipe_w, _F_SETPIPE_SZ, 1 << 20)
        self.pipe_size = fcntl.fcntl(self.pipe_w, _F_GETPIPE_SZ)

    def close(self) -> None:
        for fd in (self.pipe_r, self.pipe_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.sock.close()

    # --------------------------------------------------------------------------- raw socket

    def _wait(self) -> None:
        """Until the socket has something to read, or the receiver is told to stop."""
        poller = select.poll()
        poller.register(self.sock.fileno(), select.POLLIN | select.POLLERR | select.POLLHUP)
        while not poller.poll(_POLL_MS):
            if self.stop.is_set() or time.monotonic() > self.deadline:
                raise TransferError("the bundle stream was stopped", "retry the migration")

    def _recv(self, n: int, flags: int = 0) -> bytes:
        while True:
            try:
                got = self.sock.recv(n, flags)
            except BlockingIOError:
                self._wait()
                continue
            except ConnectionError as exc:
                raise TransferError(*_BROKE) from exc
            if not got:
                raise TransferError(*_BROKE)
            return got

    def _exact(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            out += self._recv(n - len(out))
        return out

    def _line(self) -> bytes:
        """One CRLF-ended line, read without taking a byte past it."""
        while True:
            peek = self._recv(_MAX_LINE, socket.MSG_PEEK)
            if (end := peek.find(b"\r\n")) >= 0:
                return self._exact(end + 2)[:-2]
            if len(peek) >= _MAX_LINE:
                raise _damaged("a chunk line too long")
            self._wait()  # part of a line: wait for the rest (poll returns at once while data is queued)
            time.sleep(0.001)

    # ------------------------------------------------------------------------- body framing

    def _available(self) -> int:
        """Body bytes that may be read now without crossing a chunk's edge; 0 at the body's end."""
        if not self.chunked or self.left or self.ended:
            return 0 if self.ended else self.left
        if self.crlf:
            if self._exact(2) != b"\r\n":
                raise _damaged("a chunk without its end")
            self.crlf = False
        size_line = self._line().split(b";")[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise _damaged("a bad chunk size") from None
        if size == 0:
            while self._line():  # trailers, then the empty line
                pass
            self.ended = True
            return 0
        self.left, self.crlf = size, True
        return size

    def read_blocking(self, n: int) -> bytes:
        with self.busy:
            if not (k := min(n, self._available())):
                return b""
            got = self._recv(k)
            self.left -= len(got)
            return got

    def copy_blocking(
        self, fd: int, offset: int, n: int, hasher: bundle.Hasher, counter: Counter | None
    ) -> None:
        with self.busy:
            self._copy(fd, offset, n, hasher, counter)

    def _copy(self, fd: int, offset: int, n: int, hasher: bundle.Hasher, counter: Counter | None) -> None:
        follower = _Follower(fd, offset, hasher)
        try:
            while n:
                if not (k := min(n, self._available(), self.pipe_size)):
                    raise TransferError(*_BROKE)
                try:
                    moved = os.splice(self.sock.fileno(), self.pipe_w, k, flags=_NONBLOCK_MOVE)
                except BlockingIOError:
                    self._wait()
                    continue
                except ConnectionError as exc:  # the sender went away mid-file
                    raise TransferError(*_BROKE) from exc
                if not moved:
                    raise TransferError(*_BROKE)
                self.left -= moved
                while moved:
                    put = os.splice(self.pipe_r, fd, moved, offset_dst=offset, flags=os.SPLICE_F_MOVE)
                    moved -= put
                    n -= put
                    offset += put
                    if counter is not None:
                        counter.done += put
                follower.advance(offset)
        finally:
            follower.finish()

    def drain_blocking(self, quiet: float, most: float) -> None:
        """Once any copy or read has given up: read and drop what is left of the body (until `quiet`
        seconds pass without a byte, `most` in all, as aiohttp lingers), so that closing the socket
        sends the answer, not a reset that would lose it."""
        end = time.monotonic() + most
        with self.busy, contextlib.suppress(TransferError, OSError):
            self.stop.clear()
            while time.monotonic() < end:
                self.deadline = min(end, time.monotonic() + quiet)
                if not (k := min(PIECE, self._available())):
                    return
                self.left -= len(self._recv(k))

    # ---------------------------------------------------------------------------- the wire

    async def read(self, n: int) -> bytes:
        return await asyncio.to_thread(self.read_blocking, n)

    async def copy(
        self, fd: int, offset: int, n: int, hasher: bundle.Hasher, counter: Counter | None
    ) -> None:
        await asyncio.to_thread(self.copy_blocking, fd, offset, n, hasher, counter)


async def defer_continue(_r: web.Request) -> None:
    """The routes' `Expect` handler: no "100 Continue" yet; `take` says it once the upload is let in."""


def take(r: web.Request) -> SpliceWire | StreamWire:
    """The upload's body as a wire: its own socket where the sender waits to continue on plain TCP,
    else aiohttp's stream (a "100 Continue" said there too, for a sender that waits for it)."""
    transport, asked = r.transport, r.headers.get("Expect", "").lower() == "100-continue"
    if transport is None:  # the sender is gone already: the stream says so at its first read
        return StreamWire(r.content.read)
    chunked = "chunked" in r.headers.get("Transfer-Encoding", "").lower()
    length = r.content_length
    raw = transport.get_extra_info("socket")
    plain = raw is not None and transport.get_extra_info("sslcontext") is None
    if not asked or raw is None or not plain or (not chunked and length is None):
        if asked:
            transport.write(CONTINUE)
        return StreamWire(r.content.read)
    transport.pause_reading()  # aiohttp reads no byte of the body from here on
    sock = socket.socket(fileno=os.dup(raw.fileno()))
    transport.write(CONTINUE)
    log.info("upload spliced from its socket", extra={"path": r.path, "chunked": chunked})
    return SpliceWire(sock, chunked, length)


@contextlib.asynccontextmanager
async def taken(r: web.Request) -> AsyncIterator[SpliceWire | StreamWire]:
    """The upload's body as a wire (`take`) for the block's time; then the connection ends with the
    answer (aiohttp saw none of the body and must not read on), the body's rest drained first so
    that the sender reads the answer (a refusal's too), not a reset."""
    body, failed = take(r), True
    try:
        yield body
        failed = False
    finally:
        if isinstance(body, SpliceWire):
            if failed:
                body.stop.set()  # a copy still blocked on the socket gives up (the drain clears this)
            await asyncio.to_thread(body.drain_blocking, 2.0, 10.0)  # a tar's last zero block, a chunk's end
            body.close()
            r.content.feed_eof()
            r.protocol.close()  # no keep-alive: close once the answer is out
