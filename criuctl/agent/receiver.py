"""The receiving end of a bundle stream: files written root-only, each hashed as it is written.

Two framings arrive here. A *tar* stream (a sealed bundle, manifest first, every size known) and a
*record* stream (`livesend`: page images sent while CRIU still writes them, so sizes are not known
in advance, and the manifest comes last). The record stream starts with `MAGIC`; then records of
`kind, name length, offset, data length`, a name, and data:

    D   bytes of a file at an offset, which must be exactly where that file ends so far
    K   keep-alive while CRIU has written nothing new (the stall watchdog counts it)
    E   the end

Either way the receiver takes regular files with relative names only (a crafted stream must not
write outside its folder or plant a link), and hands the digests to `bundle.verify`: a bundle is
read from the network once and never again before the restore. Nothing here trusts the stream: a
name twice, an offset that skips or rewinds, a record larger than `MAX_RECORD` are refused.
"""

from __future__ import annotations

import errno
import os
import struct
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from criuctl.agent.transfer import Counter, Read, TransferError
from criuctl.agent.wire import SpliceWire, StreamWire, Wire
from criuctl.format import bundle

MAGIC = b"CRIUCTL\x02"
RECORD = struct.Struct("!cHQI")  # kind, name length, offset, data length
DATA, KEEPALIVE, END = b"D", b"K", b"E"
MAX_RECORD = 64 << 20
MAX_OPEN = 4096
_BLOCK = tarfile.BLOCKSIZE
_NOT_AGENT = "the sender is not a criuctl agent"


def _refused(what: str) -> TransferError:
    return TransferError(f"refused a bundle stream {what}", _NOT_AGENT)


async def _exactly(wire: Wire, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        part = await wire.read(n - got)
        if not part:
            raise TransferError("the bundle stream broke off before its end", "retry the migration")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


@dataclass
class _Open:
    fd: int
    hasher: bundle.Hasher = field(default_factory=bundle.hasher)
    size: int = 0


class _Files:
    """The files of one stream under `dest`: created once each, appended to, hashed as written."""

    def __init__(self, dest: Path, counter: Counter | None) -> None:
        self.dest, self.counter = dest, counter
        self.open: dict[str, _Open] = {}
        self.digests: dict[str, str] = {}

    def create(self, name: str) -> _Open:
        p = PurePosixPath(name)
        if p.is_absolute() or ".." in p.parts or not p.parts:
            raise _refused(f"with the path {name!r}")
        rel = p.as_posix()
        if rel in self.digests or rel in self.open or len(self.open) >= MAX_OPEN:
            raise _refused(f"with {name!r}: cannot create it (twice, or too many files)")
        target = self.dest / p
        try:  # a name twice, a file where a folder must go, a name too long: refused, not a crash
            target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise  # this node's disk, not the stream: the agent says "disk full"
            raise _refused(f"with {name!r}: cannot create it ({exc.strerror})") from exc
        self.open[rel] = f = _Open(fd)
        return f

    async def copy(self, wire: Wire, f: _Open, n: int) -> None:
        """Move `n` bytes from the stream onto the end of `f`, hashed as written (`criuctl.agent.wire`)."""
        await wire.copy(f.fd, f.size, n, f.hasher, self.counter)
        f.size += n

    def close(self, rel: str) -> None:
        f = self.open.pop(rel)
        os.close(f.fd)
        self.digests[rel] = f.hasher.hexdigest()

    def close_all(self) -> None:
        for rel in list(self.open):
            self.close(rel)


async def receive(
    body: SpliceWire | StreamWire | Read, dest: Path, counter: Counter | None = None
) -> dict[str, str]:
    """Write the stream `body` yields (a wire, or a `read` callable) under `dest` (root-only);
    return each file's digest."""
    wire: Wire = body if isinstance(body, (SpliceWire, StreamWire)) else StreamWire(body)
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    files = _Files(dest, counter)
    try:
        first = await _exactly(wire, len(MAGIC))
        if first == MAGIC:
            await _records(wire, files)
        else:
            await _tar(wire, files, first)
    finally:
        for f in files.open.values():
            os.close(f.fd)
    return files.digests


async def _records(wire: Wire, files: _Files) -> None:
    while True:
        kind, name_len, offset, length = RECORD.unpack(await _exactly(wire, RECORD.size))
        name = (await _exactly(wire, name_len)).decode("utf-8", "surrogateescape") if name_len else ""
        if kind == END:
            files.close_all()
            return
        if kind == KEEPALIVE:
            if files.counter is not None:
                files.counter.beats += 1
            continue
        if kind != DATA or length > MAX_RECORD:
            raise TransferError(
                "the bundle stream is damaged (a record of an unknown kind or size)", "retry the migration"
            )
        rel = PurePosixPath(name).as_posix() if name else name
        f = files.open.get(rel) or files.create(name)
        if offset != f.size:
            raise _refused(f"with {name!r} at offset {offset}, where it ends at {f.size}")
        await files.copy(wire, f, length)


async def _tar(wire: Wire, files: _Files, first: bytes) -> None:
    header = first + await _exactly(wire, _BLOCK - len(first))
    while header != bytes(_BLOCK):
        try:
            info = tarfile.TarInfo.frombuf(header, "utf-8", "surrogateescape")
        except (tarfile.TarError, ValueError) as exc:
            raise TransferError(f"the bundle stream is damaged ({exc})", "retry the migration") from exc
        if info.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
            raise _refused(f"with {info.name!r}, which is not a regular file")
        if info.size < 0:  # base-256 size fields can be negative
            raise _refused(f"with {info.name!r} of size {info.size}")
        f = files.create(info.name)
        await files.copy(wire, f, info.size)
        files.close(PurePosixPath(info.name).as_posix())
        if pad := -info.size % _BLOCK:
            await _exactly(wire, pad)
        header = await _exactly(wire, _BLOCK)
