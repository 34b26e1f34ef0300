"""Bundles on the wire: a tar stream, written and read one chunk at a time, hashed as it arrives.

The sender puts manifest.json and its signature first, so the receiver knows what to expect; the
receiver accepts regular files and folders with relative names only (a crafted tar must not write
outside its directory), hashes each file while writing it, and hands the digests to
`bundle.verify`, so a bundle is read from the network once and never again before the restore.
"""

from __future__ import annotations

import hashlib
import io
import os
import queue
import tarfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from criuctl import bundle
from criuctl.errors import CriuctlError

CHUNK = 1 << 20
_BLOCK = tarfile.BLOCKSIZE


class TransferError(CriuctlError):
    """The stream broke, or what arrived is not an acceptable bundle stream."""


@dataclass
class Counter:
    """Bytes moved so far, updated by the thread that moves them, read by whoever reports progress."""

    total: int = 0
    done: int = 0
    started: float = 0.0

    def rate(self) -> float:
        return self.done / max(time.monotonic() - self.started, 1e-9)


def _order(root: Path) -> list[Path]:
    first = [root / bundle.MANIFEST, root / bundle.SIGNATURE]
    rest = sorted(p for p in root.rglob("*") if p.is_file() and p not in first)
    return [p for p in first if p.exists()] + rest


def stream_size(root: Path) -> int:
    """Exact length of `tar_chunks(root)`: lets the receiver see a truncated stream for what it is."""
    size = 2 * _BLOCK
    for p in _order(root):
        size += len(_header(root, p)) + -(-p.stat().st_size // _BLOCK) * _BLOCK
    return size


def _header(root: Path, path: Path) -> bytes:
    info = tarfile.TarInfo(path.relative_to(root).as_posix())
    info.size = path.stat().st_size
    info.mode = 0o600
    return info.tobuf(format=tarfile.PAX_FORMAT)


def tar_chunks(root: Path, counter: Counter | None = None) -> Iterator[bytes]:
    """The bundle at `root` as a tar stream, in chunks of about 1 MiB."""
    for path in _order(root):
        yield _header(root, path)
        size = 0
        with path.open("rb") as f:
            while chunk := f.read(CHUNK):
                size += len(chunk)
                if counter is not None:
                    counter.done += len(chunk)
                yield chunk
        if size % _BLOCK:
            yield bytes(_BLOCK - size % _BLOCK)
    yield bytes(2 * _BLOCK)


def _safe_name(name: str) -> PurePosixPath:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or not p.parts:
        raise TransferError(
            f"refused a bundle stream with the path {name!r}", "the sender is not a criuctl agent"
        )
    return p


def receive(
    reader: io.RawIOBase | io.BufferedIOBase, dest: Path, counter: Counter | None = None
) -> dict[str, str]:
    """Write the tar stream from `reader` under `dest` (root-only); return each file's sha256."""
    dest.mkdir(mode=0o700, parents=True, exist_ok=True)
    digests: dict[str, str] = {}
    try:
        with tarfile.open(fileobj=reader, mode="r|", bufsize=CHUNK) as tar:
            for member in tar:
                rel = _safe_name(member.name)
                if member.isdir():
                    continue
                if not member.isfile():
                    raise TransferError(
                        f"refused a bundle stream with {member.name!r}, which is not a regular file",
                        "the sender is not a criuctl agent",
                    )
                target = dest / rel
                target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                h = hashlib.sha256()
                src = tar.extractfile(member)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb") as out:
                    while chunk := src.read(CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        if counter is not None:
                            counter.done += len(chunk)
                digests[rel.as_posix()] = h.hexdigest()
    except (tarfile.TarError, EOFError) as exc:
        raise TransferError(
            f"the bundle stream broke off or is damaged ({exc})", "retry the migration"
        ) from exc
    return digests


class QueueReader(io.RawIOBase):
    """A file-like view of chunks another thread (the HTTP handler) puts into a queue; None ends it."""

    def __init__(self, maxsize: int = 64) -> None:
        self.q: queue.Queue[bytes | BaseException | None] = queue.Queue(maxsize)
        self._buf = memoryview(b"")
        self._eof = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:
        while not self._buf and not self._eof:
            item = self.q.get()
            if item is None:
                self._eof = True
            elif isinstance(item, BaseException):
                raise item
            else:
                self._buf = memoryview(item)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def send(root: Path, url: str, token: str, ca: Path | None, counter: Counter, node: str) -> dict:
    """PUT the bundle at `root` to another agent as one tar stream; its answer, or TransferError."""
    import requests  # here: the receiving side of this module must not need it

    headers = {"Authorization": f"Bearer {token}", "X-Bundle-Size": str(stream_size(root))}
    try:
        resp = requests.put(
            url,
            data=tar_chunks(root, counter),
            headers=headers,
            verify=str(ca) if ca else True,
            timeout=(5, 20),
        )
    except requests.RequestException as exc:
        raise TransferError(
            f"lost the connection to node {node} while sending the bundle ({exc.__class__.__name__})",
            "check the network between the nodes",
        ) from exc
    try:
        answer = resp.json()
    except ValueError:
        answer = {"what": resp.text[:200]}
    if not resp.ok:
        raise TransferError(
            answer.get("what", f"node {node} answered {resp.status_code}"), answer.get("hint", "")
        )
    return answer
