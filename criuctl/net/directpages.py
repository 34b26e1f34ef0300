"""Memory pages straight into the target: the receiving end of a stop-and-copy whose dump sends its
pages to CRIU's page server on the target (`criuctl.engine.criu.PagesTo`) instead of writing them
on the source.

Why: the source then never writes the pages into its own page cache, which on these machines is
fresh memory to touch (docs/benchmarks.md); the target's page server writes them once, where the
restore reads them. What vouches for them (docs/architecture.md, "Pages straight to the target"):
the session is CRIU's TLS pinned to certificates made for this migration (`criuctl.net.pagetls`);
the source signs, in its manifest, both certificates' fingerprints and how many pages its dump
sent; the target counts what its page server wrote, hashes it for its own record, and restores
nothing unless the count matches the signed one and the page server ended cleanly.

The listening socket is ours, not CRIU's: its port is known before anything connects (an ephemeral
one), the wait for the source is bounded, and exactly one connection is taken, then handed to
`criu page-server --ps-socket`, which does the handshake and refuses any other certificate.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from criuctl.core.errors import CriuctlError
from criuctl.engine import criu
from criuctl.format import bundle, criuimages
from criuctl.net import pagetls

PAGE = 4096
PAGES = "pages-*.img"
PATTERNS = ("pagemap-*.img", PAGES)  # what CRIU's page server writes (bundle.DIRECT_PAGE_FILES)


@dataclass(frozen=True)
class Received:
    """What the page server wrote: each file's BLAKE3, and the pages the pagemaps list."""

    files: dict[str, str]  # file name in the images folder -> digest
    pages: int
    page_bytes: int  # the page images' size: `pages` pages, no more, no less

    def vouched(self, source_cert: str, target_cert: str) -> bundle.Vouched:
        """What this node vouches for when it verifies the bundle these pages belong to."""
        files = {f"{bundle.IMAGES_DIR}/{name}": digest for name, digest in self.files.items()}
        return bundle.Vouched(files, self.pages, source_cert, target_cert)


@dataclass
class PageReceiver:
    """One migration's page server on the target: `listen`, tell the source `port`, then `receive`."""

    address: str
    images_dir: Path
    work_dir: Path
    tls: criu.PageTls
    sock: socket.socket | None = None
    proc: subprocess.Popen[bytes] | None = None
    _closed: threading.Event = field(default_factory=threading.Event)

    def listen(self) -> int:
        family = socket.AF_INET6 if ":" in self.address else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.sock.bind((self.address, 0))
        self.sock.listen(1)
        return self.port

    @property
    def port(self) -> int:
        assert self.sock is not None, "listen first"
        return int(self.sock.getsockname()[1])

    def receive(self, connect_timeout: float, receive_timeout: float) -> Received:
        """Take the one connection (within `connect_timeout`), let CRIU's page server receive the
        dump over it (within `receive_timeout`), then count and hash what it wrote."""
        assert self.sock is not None, "listen first"
        self.sock.settimeout(connect_timeout)
        try:
            conn, _ = self.sock.accept()
        except TimeoutError:
            raise CriuctlError(
                f"the source's dump did not reach this node's page server in {connect_timeout:.0f} s",
                "nothing was received; the job stays on its source",
            ) from None
        except OSError as exc:
            if self._closed.is_set():
                raise CriuctlError("the page server was closed before the source connected") from None
            raise CriuctlError(f"the page server could not take the source's connection: {exc}") from None
        finally:
            self.sock.close()
        with conn:
            conn.settimeout(None)
            proc = criu.page_server(self.images_dir, self.work_dir, conn, self.tls)
            self.proc = proc
        criu.wait_page_server(proc, self.work_dir, receive_timeout)
        got = received(self.images_dir)
        if got.page_bytes != got.pages * PAGE:
            raise CriuctlError(
                f"this node's page server wrote {got.page_bytes} bytes of pages for {got.pages} pages",
                "the page images are damaged; nothing was restored from them, the job stays on its source",
            )
        return got

    def close(self) -> None:
        """Stop waiting for the source (an abort): a pending `receive` fails, a running page server
        is killed."""
        self._closed.set()
        if self.sock is not None:
            with contextlib.suppress(OSError):  # never connected, or already closed
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()


def received(images_dir: Path) -> Received:
    """Count and hash the page server's files (BLAKE3 on every core, as a bundle's files are)."""
    files: dict[str, str] = {}
    page_bytes = 0
    for pattern in PATTERNS:
        for path in sorted(images_dir.glob(pattern)):
            files[path.name] = bundle.file_digest(path)
            if pattern == PAGES:
                page_bytes += path.stat().st_size
    pages = sum(criuimages.pagemap_pages(images_dir / name) for name in files if name.startswith("pagemap-"))
    return Received(files, pages, page_bytes)


class Session:
    """The target's end of one migration's page session: its certificate, the source's pinned, the
    page server waiting in a thread. `open` answers what the source needs (port, certificate);
    `vouched` is what this node then says of the pages, once the dump has sent them all."""

    def __init__(self, folder: Path, images_dir: Path, source_pem: object, connect_timeout: float) -> None:
        self.identity = pagetls.make_identity(folder, "target")
        peer, self.source_cert = pagetls.pin(folder, "source", source_pem)
        images_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.rx = PageReceiver("", images_dir, folder / "work", pagetls.tls(self.identity, peer))
        self.port = self.rx.listen()
        self._connect_timeout = connect_timeout
        self._done = threading.Event()
        self._result: Received | CriuctlError | None = None

    def start(self, receive_timeout: float) -> None:
        threading.Thread(target=self._run, args=(receive_timeout,), daemon=True, name="page-server").start()

    def _run(self, receive_timeout: float) -> None:
        try:
            self._result = self.rx.receive(self._connect_timeout, receive_timeout)
        except CriuctlError as exc:
            self._result = exc
        except OSError as exc:
            self._result = CriuctlError(f"the page server failed: {exc}")
        finally:
            self._done.set()

    def vouched(self, timeout: float) -> bundle.Vouched:
        """Once the page server has ended (the source's dump closed the session before it sealed the
        bundle, so this is at most a moment): what it wrote, vouched for; its error otherwise."""
        if not self._done.wait(timeout):
            self.close()
            raise CriuctlError(
                f"this node's page server was still receiving {timeout:.0f} s after the bundle came",
                "nothing was restored; the job stays on its source",
            )
        got = self._result
        if isinstance(got, CriuctlError):
            raise got
        assert got is not None
        return got.vouched(self.source_cert, self.identity.fingerprint)

    def close(self) -> None:
        self.rx.close()
