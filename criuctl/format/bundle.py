"""The checkpoint bundle: CRIU images + a signed manifest. The on-disk format lives here only.

A bundle is a directory (root-only, 0700/0600):

    manifest.json   what was checkpointed, and the BLAKE3 digest of every other file
    manifest.sig    keyed BLAKE3 of manifest.json's bytes (a key derived from the node's key)
    images/         CRIU's image files
    dump.log        CRIU's log of the dump

Restoring is running CRIU as root on these files, so a crafted image is code execution as root:
`verify` refuses a bundle whose signature or any checksum does not match, naming the bad file.
This module knows nothing of CRIU or Kubernetes; it only writes, reads and checks files.

Format 2 hashes with BLAKE3 (7–15 GB/s here, on one or both cores, against sha256's 2 GB/s: the
hashing that sat inside every dump, stream and restore). Format 1 bundles (sha256 digests, an
HMAC-SHA256 signature) still verify; criuctl only writes format 2.
"""

from __future__ import annotations

import errno
import hmac
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

from criuctl.core.procinfo import ProcessInfo as ProcessInfo
from criuctl.format.manifest import _UNSIGNED
from criuctl.format.manifest import DIRECT_PAGE_FILES as DIRECT_PAGE_FILES
from criuctl.format.manifest import FORMAT_VERSION as FORMAT_VERSION
from criuctl.format.manifest import MANIFEST as MANIFEST
from criuctl.format.manifest import READABLE_VERSIONS as READABLE_VERSIONS
from criuctl.format.manifest import SIGNATURE as SIGNATURE
from criuctl.format.manifest import BundleError as BundleError
from criuctl.format.manifest import ContainerFacts as ContainerFacts
from criuctl.format.manifest import DirectPages as DirectPages
from criuctl.format.manifest import GpuDevice as GpuDevice
from criuctl.format.manifest import GpuFacts as GpuFacts
from criuctl.format.manifest import MalformedManifest as MalformedManifest
from criuctl.format.manifest import Manifest as Manifest
from criuctl.format.manifest import StateFacts as StateFacts
from criuctl.format.manifest import StepBoundary as StepBoundary
from criuctl.format.manifest import Vouched as Vouched
from criuctl.format.signing import Hasher as Hasher
from criuctl.format.signing import file_digest as file_digest
from criuctl.format.signing import hasher as hasher
from criuctl.format.signing import load_key as load_key
from criuctl.format.signing import sign as _sign
from criuctl_hook.durable import fsync_dir, replace

IMAGES_DIR = "images"
DUMP_LOG = "dump.log"


# ------------------------------------------------------------------------------------------- writing


def _payload_files(root: Path) -> list[Path]:
    return sorted(
        p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() not in _UNSIGNED
    )


def lock_down(root: Path) -> None:
    """Images hold every memory page of the job, secrets included: root-only."""
    os.chmod(root, 0o700)
    for p in root.rglob("*"):
        os.chmod(p, 0o700 if p.is_dir() else 0o600)


def seal(
    root: Path,
    manifest: Manifest,
    key: bytes,
    durable: bool = True,
    known: dict[str, tuple[str, int]] | None = None,
) -> Manifest:
    """Checksum every file under `root`, write the manifest and its signature.

    `durable`: on disk before it returns, for a caller that kills the source tree next, so that a
    power loss cannot leave a bundle that looked complete but lost pages still in the page cache.
    The files are fsynced in a thread while this one hashes them (the disk and the CPU work side by
    side), then the folders, so their entries are on disk too; the caller fsyncs the folder it
    renames the bundle into. `known` holds digests taken while the files were written (`imagetail`):
    {path: (digest, bytes hashed)}, used for a file whose size is still exactly that.
    """
    files = _payload_files(root)
    known = known or {}
    syncing = _Syncer(files) if durable else None
    if syncing is not None:
        syncing.start()
    manifest.format_version = FORMAT_VERSION
    manifest.files = {}
    for p in files:
        rel = p.relative_to(root).as_posix()
        digest, hashed = known.get(rel, ("", -1))
        manifest.files[rel] = digest if hashed == p.stat().st_size else file_digest(p)
    if syncing is not None:
        syncing.join()
        if syncing.error is not None:
            raise syncing.error
    raw = manifest.to_json()
    _write(root / MANIFEST, raw, durable)
    _write(root / SIGNATURE, (_sign(key, raw) + "\n").encode(), durable)
    lock_down(root)
    if durable:
        for d in sorted({p.parent for p in files} | {root}, key=lambda d: -len(d.parts)):
            fsync_dir(d)  # deepest first: images/ before the bundle folder that holds it
    return manifest


class _Syncer(threading.Thread):
    def __init__(self, files: list[Path]) -> None:
        super().__init__(name="bundle-fsync", daemon=True)
        self.files = files
        self.error: OSError | None = None

    def run(self) -> None:
        try:
            for path in self.files:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        except OSError as exc:
            self.error = exc


def _write(path: Path, data: bytes, durable: bool) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        if durable:
            os.fsync(f.fileno())


def size_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------------- reading


MANIFEST_MAX = 64 << 20  # far above any real manifest (a few KiB per thousand files)


def _read_raw(root: Path) -> bytes:
    """manifest.json's bytes, read once; every reader checks and parses these same bytes."""
    hint = "pass the directory written by `criuctl dump --bundle DIR`"
    if not root.exists():
        raise BundleError(f"no bundle at {root}", hint)
    if not root.is_dir():
        raise BundleError(f"{root} is a file, not a bundle directory", hint)
    path = root / MANIFEST
    try:
        with path.open("rb") as f:
            raw = f.read(MANIFEST_MAX + 1)
    except FileNotFoundError:
        raise BundleError(f"{root} is not a criuctl bundle (no {MANIFEST})", hint) from None
    except OSError as exc:
        raise BundleError(
            f"cannot read {path}: {exc.strerror}", "the bundle cannot be trusted; take a new checkpoint"
        ) from exc
    if len(raw) > MANIFEST_MAX:
        raise BundleError(
            f"{path} is larger than {MANIFEST_MAX >> 20} MiB",
            "the bundle cannot be trusted; take a new checkpoint",
        )
    return raw


def _parse(root: Path, raw: bytes) -> Manifest:
    try:
        return Manifest.from_json(raw)
    except MalformedManifest as exc:
        raise BundleError(
            f"{root / MANIFEST} is corrupted: {exc}", "the bundle cannot be trusted; take a new checkpoint"
        ) from exc


def read_manifest(root: Path) -> Manifest:
    """The manifest, unverified (for `inspect`); use `verify` before acting on the images."""
    return _parse(root, _read_raw(root))


def _signed_version(root: Path, key: bytes, raw: bytes) -> int | None:
    """The format whose MAC of exactly `raw` manifest.sig holds; None if none does.

    Checked before `raw` is parsed, so the format is known from the key, not from what the bytes say;
    the caller then requires the parsed manifest to claim that same format.
    """
    try:
        with (root / SIGNATURE).open("rb") as f:
            sig = f.read(1024).strip()
    except OSError:
        return None
    for version in reversed(READABLE_VERSIONS):
        if sig and hmac.compare_digest(sig, _sign(key, raw, version).encode()):
            return version
    return None


def _bad_files(root: Path, manifest: Manifest, digests: dict[str, str] | None) -> list[str]:
    if manifest.format_version != FORMAT_VERSION:
        digests = None  # computed as the bundle arrived, with this format's hash: read the files again
    bad: list[str] = []
    for rel, digest in sorted(manifest.files.items()):
        path = root / rel
        try:
            mode = os.lstat(path).st_mode  # lstat: a symlink is not a bundle file, wherever it points
        except OSError as exc:
            gone = exc.errno in (errno.ENOENT, errno.ENOTDIR)
            bad.append(f"{rel}: missing" if gone else f"{rel}: unreadable ({exc.strerror})")
            continue
        if not stat.S_ISREG(mode):
            bad.append(f"{rel}: not a regular file")
            continue
        try:
            got = digests[rel] if digests and rel in digests else file_digest(path, manifest.format_version)
        except OSError as exc:
            bad.append(f"{rel}: unreadable ({exc.strerror})")
            continue
        if got != digest:
            bad.append(f"{rel}: checksum mismatch")
    direct = _direct_files(root) if manifest.direct_pages is not None else {}
    for path in _payload_files(root):
        rel = path.relative_to(root).as_posix()
        if rel not in manifest.files and rel not in direct:
            bad.append(f"{rel}: not listed in the manifest")
    return bad


def _direct_files(root: Path) -> dict[str, Path]:
    return {
        p.relative_to(root).as_posix(): p for pattern in DIRECT_PAGE_FILES for p in sorted(root.glob(pattern))
    }


def _bad_direct(root: Path, manifest: Manifest, vouched: Vouched | None) -> list[str]:
    """Pages that came straight from the source's dump: exactly the files this node's page server
    wrote (`vouched`), over the session the signed manifest names, holding as many pages as the
    source says it sent. Their digests, taken as the page server finished, are what this node
    records (as `digests` are for a streamed file: not read a second time here). No voucher, no
    restore: a bundle copied elsewhere has nobody left who saw those pages arrive."""
    d = manifest.direct_pages
    if d is None:
        return (
            ["images/: a page server vouches for pages the signed manifest does not name"] if vouched else []
        )
    if vouched is None:
        return [
            "images/: its memory pages came from a page server that only the agent which ran it can vouch for"
        ]
    if (vouched.source_cert, vouched.target_cert) != (d.source_cert, d.target_cert):
        return ["images/: its memory pages came over another TLS session than the signed manifest names"]
    bad = [f"{rel}: also listed in the manifest" for rel in vouched.files if rel in manifest.files]
    present = _direct_files(root)
    for rel in sorted(set(present) | set(vouched.files)):
        if rel not in vouched.files:
            bad.append(f"{rel}: not written by this node's page server")
        elif rel not in present:
            bad.append(f"{rel}: missing")
        elif not stat.S_ISREG(os.lstat(present[rel]).st_mode):
            bad.append(f"{rel}: not a regular file")
    if vouched.pages != d.pages:
        bad.append(f"images/: {vouched.pages} pages arrived where the source sent {d.pages}")
    return bad


@dataclass(frozen=True)
class Verification:
    signature_ok: bool
    bad_files: list[str]  # altered, missing or unexpected files, with the reason

    @property
    def ok(self) -> bool:
        return self.signature_ok and not self.bad_files


def check(
    root: Path, key: bytes, digests: dict[str, str] | None = None, vouched: Vouched | None = None
) -> Verification:
    """Check signature and checksums; report every problem (for `inspect`).

    `digests` are this format's digests, computed while the files arrived (an agent hashes a bundle
    as it streams in), so the files need not be read twice.
    """
    raw = _read_raw(root)
    manifest = _parse(root, raw)
    signed = _signed_version(root, key, raw) == manifest.format_version
    return Verification(signed, _bad_files(root, manifest, digests) + _bad_direct(root, manifest, vouched))


def verify(
    root: Path, key: bytes, digests: dict[str, str] | None = None, vouched: Vouched | None = None
) -> Manifest:
    """The manifest of a bundle that verifies; BundleError naming the first bad file otherwise."""
    return _verified(root, key, digests, vouched)[1]


def adopt(
    root: Path,
    key: bytes,
    own: bytes,
    digests: dict[str, str] | None = None,
    vouched: Vouched | None = None,
) -> Manifest:
    """A bundle another node sent, checked with the key of the one move or copy that brought it
    (`key`), then signed again with this node's own key (`own`) over the same manifest bytes.

    From then on it restores here, checked like a bundle of this node's. No node's own key leaves
    it: a node's key opens no other node's bundles, and a move's key no other move's.
    """
    raw, manifest = _verified(root, key, digests, vouched)
    # whole or not at all: a crash leaves the move's signature or this node's, never half of one
    replace(root / SIGNATURE, (_sign(own, raw, manifest.format_version) + "\n").encode())
    return manifest


def signed_for(root: Path, own: bytes, key: bytes) -> tuple[bytes, bytes]:
    """(manifest.json's bytes, a signature of them with `key`) for a kept bundle of this node's
    that goes to another node with a key that node gave for this one copy (`adopt` there). The
    signature is checked with this node's key first: an altered manifest goes nowhere; the
    receiver checks every file against it."""
    raw, manifest = _signed(root, own)
    return raw, (_sign(key, raw, manifest.format_version) + "\n").encode()


def _unsigned(root: Path) -> BundleError:
    return BundleError(
        f"{root / SIGNATURE}: signature does not verify",
        "the bundle was altered, or signed with another node's key (a node restores only its own "
        "bundles and those a move brought it); refusing to restore it",
    )


def _signed(root: Path, key: bytes) -> tuple[bytes, Manifest]:
    """manifest.json's bytes and what they say, once `key`'s signature of them is checked. The file
    is read once: the signature is checked on those bytes, and only then are the same bytes parsed —
    a file swapped between the check and a second read cannot slip through."""
    raw = _read_raw(root)
    signed = _signed_version(root, key, raw)
    if signed is None or (manifest := _parse(root, raw)).format_version != signed:
        raise _unsigned(root)
    return raw, manifest


def _verified(
    root: Path, key: bytes, digests: dict[str, str] | None, vouched: Vouched | None
) -> tuple[bytes, Manifest]:
    raw, manifest = _signed(root, key)
    bad = _bad_files(root, manifest, digests) + _bad_direct(root, manifest, vouched)
    if bad:
        raise BundleError(f"{root}/{bad[0]}", "the bundle was altered or damaged; refusing to restore it")
    return raw, manifest
