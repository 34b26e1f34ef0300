"""Send a bundle while CRIU is still writing it: the dump and the transfer overlap, as in CRIU's
page-server migration, but over the agents' authenticated channel and into a signed bundle.

CRIU writes each page image strictly in order (see `criuctl.format.imagetail`), so whatever a
`pages-*.img` holds so far can go out at once. Until the source handoff says the bundle is sealed
(`Live.sealed`), this sends the page images' new bytes as they appear, and a keep-alive record when
nothing new came for a second (CRIU gathering a big tree, or a slow page); then the rest of each
page image, every other file (they may still change until the seal: `files.img` is re-addressed
for a job's rank), and the manifest and its signature last. The target hashes everything as it
arrives and verifies the whole bundle against the signed manifest before anything may restore it,
so a file that changed after it was sent only fails that check: the source then thaws, as on any
failure before SENT. Record framing: `criuctl.agent.receiver`.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

from criuctl.agent.receiver import DATA, END, KEEPALIVE, MAGIC, RECORD
from criuctl.agent.transfer import PIECE, Counter, TransferError
from criuctl.format import bundle, imagetail

_CHUNK = 4 * PIECE  # one record: well under receiver.MAX_RECORD
_IDLE = 0.01
_KEEPALIVE = 1.0


class Live:
    """The bundle folder a source handoff is dumping into; `sealed` is set once it is complete."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.sealed = threading.Event()
        self.stopped = threading.Event()  # the freeze failed: end the stream, unfinished
        self.sent: dict[str, int] = {}  # path under root -> bytes sent so far

    def headers(self) -> dict[str, str]:
        return {"Content-Type": "application/x-criuctl-stream", "Transfer-Encoding": "chunked"}

    def body(self, sock: socket.socket, counter: Counter) -> None:
        _chunk(sock, MAGIC)
        quiet_since = time.monotonic()
        while not self.sealed.is_set():
            if self.stopped.is_set():
                raise TransferError("the freeze failed while its bundle was streaming", "nothing was sent")
            if self._pages(sock, counter):
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > _KEEPALIVE:
                _chunk(sock, RECORD.pack(KEEPALIVE, 0, 0, 0))
                counter.beats += 1
                quiet_since = time.monotonic()
            else:
                self.sealed.wait(_IDLE)
        signed = [self.root / bundle.MANIFEST, self.root / bundle.SIGNATURE]
        rest = sorted(p for p in self.root.rglob("*") if p.is_file() and p not in signed)
        for path in [*rest, *signed]:
            self._send(sock, counter, path, path.stat().st_size)
        _chunk(sock, RECORD.pack(END, 0, 0, 0))
        sock.sendall(b"0\r\n\r\n")

    def _pages(self, sock: socket.socket, counter: Counter) -> bool:
        """Send what the page images gained; whether there was anything."""
        moved = False
        for path in sorted((self.root / bundle.IMAGES_DIR).glob(imagetail.PATTERN)):
            size = path.stat().st_size
            if size > self.sent.get(path.relative_to(self.root).as_posix(), 0):
                self._send(sock, counter, path, size)
                moved = True
        return moved

    def _send(self, sock: socket.socket, counter: Counter, path: Path, upto: int) -> None:
        rel = path.relative_to(self.root).as_posix()
        name = rel.encode()
        offset = self.sent.get(rel, 0)
        if offset == 0 and upto == 0:  # an empty file still has to exist on the target
            _chunk(sock, RECORD.pack(DATA, len(name), 0, 0) + name)
        with path.open("rb") as f:
            while offset < upto:
                n = min(_CHUNK, upto - offset)
                head = RECORD.pack(DATA, len(name), offset, n) + name
                sock.sendall(f"{len(head) + n:x}\r\n".encode() + head)
                done = 0
                while done < n:
                    sent = sock.sendfile(f, offset + done, n - done)
                    if not sent:
                        raise TransferError(f"{rel} shrank while it was sent", "retry the migration")
                    done += sent
                sock.sendall(b"\r\n")
                offset += n
                counter.done += n
        self.sent[rel] = offset


def _chunk(sock: socket.socket, data: bytes) -> None:
    sock.sendall(f"{len(data):x}\r\n".encode() + data + b"\r\n")
