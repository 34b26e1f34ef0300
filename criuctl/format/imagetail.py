"""Hash CRIU's page images while CRIU writes them, so that sealing a bundle costs little after the dump.

Memory pages are nearly all of a bundle's bytes, and CRIU writes each `pages-N.img` strictly in
order (it splices page after page onto the end of the file; it never seeks back). So a thread can
follow the files as they grow: each new byte is read once, from the page cache it was just written
to, and fed to the bundle format's digest. The dump is on the CPU in the kernel and in CRIU, this
thread mostly in BLAKE3, which releases the GIL.

Starting the pages' writeback to disk here too (`sync_file_range`) was measured and dropped: it
made CRIU's own dump 2–3× slower (3.6–5.7 s against 0.9–2.3 s for 2 GiB), far more than the fsync
it saved at the seal (~0.5 s).

What the tail hashed counts only for a file whose final size is exactly what it read: a file that
shrank, was replaced or is not a page image is hashed again by `bundle.seal`. Anything going wrong
here (a read error, an unexpected name) only means the seal hashes more itself; the dump never
fails because of the tail. A wrong digest could only make the restore refuse the bundle, never
restore other bytes.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from criuctl.format import bundle

PATTERN = "pages-*.img"
_CHUNK = 8 << 20
_IDLE = 0.005  # seconds between looks at files that did not grow


@dataclass
class _Followed:
    fd: int
    ino: int
    hasher: bundle.Hasher = field(default_factory=bundle.hasher)
    done: int = 0


class Tail:
    """Follow the page images in `images` from `start` until `finish` (CRIU has returned)."""

    def __init__(self, images: Path) -> None:
        self.images = images
        self.files: dict[str, _Followed] = {}
        self.broken = False  # set on any error: the seal hashes everything itself
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="image-tail", daemon=True)

    def start(self) -> Tail:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._step():
                self._stop.wait(_IDLE)

    def _step(self) -> bool:
        """Read whatever the files gained since the last look; whether anything was read."""
        try:
            for path in self.images.glob(PATTERN):
                if path.name not in self.files:
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                    self.files[path.name] = _Followed(fd, os.fstat(fd).st_ino)
            return any([self._advance(f) for f in self.files.values()])
        except OSError:
            self.broken = True
            self._stop.set()
            return False

    def _advance(self, f: _Followed) -> bool:
        size = os.fstat(f.fd).st_size
        start = f.done
        while f.done < size:
            piece = os.pread(f.fd, min(_CHUNK, size - f.done), f.done)
            if not piece:
                break
            f.hasher.update(piece)
            f.done += len(piece)
        return f.done > start

    def finish(self) -> dict[str, tuple[str, int]]:
        """CRIU is done: read what is left; {path under the bundle root: (digest, bytes hashed)}."""
        self._stop.set()
        self._thread.join()
        if not self.broken:
            while self._step():
                pass
        out = {}
        for name, f in self.files.items():
            with contextlib.suppress(OSError):
                if not self.broken and os.stat(self.images / name).st_ino == f.ino:
                    out[f"{self.images.name}/{name}"] = (f.hasher.hexdigest(), f.done)
        self.close()
        return out

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        for f in self.files.values():
            with contextlib.suppress(OSError):
                os.close(f.fd)
        self.files.clear()
