"""The checkpoint bundle: CRIU images + a signed manifest. The on-disk format lives here only.

A bundle is a directory (root-only, 0700/0600):

    manifest.json   what was checkpointed, and the sha256 of every other file
    manifest.sig    HMAC-SHA256 of manifest.json's bytes with the node's key
    images/         CRIU's image files
    dump.log        CRIU's log of the dump

Restoring is running CRIU as root on these files, so a crafted image is code execution as root:
`verify` refuses a bundle whose signature or any checksum does not match, naming the bad file.
This module knows nothing of CRIU or Kubernetes; it only writes, reads and checks files.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from criuctl.errors import CriuctlError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
IMAGES_DIR = "images"
DUMP_LOG = "dump.log"
_UNSIGNED = {MANIFEST, SIGNATURE}


class BundleError(CriuctlError):
    """The bundle is missing, unreadable, altered or signed with another key."""


@dataclass
class ProcessInfo:
    pid: int  # host PID at checkpoint time
    ns_pid: int  # PID inside the workload's PID namespace (what CRIU restores)
    ppid: int
    name: str
    cmdline: list[str]
    cwd: str
    rss_bytes: int
    threads: int


@dataclass
class Manifest:
    """Everything a reader (inspect, restore, an agent) needs to know before touching the images."""

    workload: str
    command: list[str]
    processes: list[ProcessInfo]
    open_files: list[str]
    uses_gpu: bool
    criu_version: str
    stdio_pipes: dict[str, str] = field(default_factory=dict)  # "stdout" -> "pipe:[inode]"
    freeze_seconds: float = 0.0
    lazy_pages: bool = False  # post-copy: memory pages are not in the bundle, a page server has them
    format_version: int = FORMAT_VERSION
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.time)
    host: str = field(default_factory=socket.gethostname)
    kernel: str = field(default_factory=lambda: os.uname().release)
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256, all but manifest/sig

    @property
    def rss_bytes(self) -> int:
        return sum(p.rss_bytes for p in self.processes)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        data = json.loads(raw)
        if data.get("format_version") != FORMAT_VERSION:
            raise BundleError(
                f"bundle format {data.get('format_version')} is not supported",
                f"this criuctl reads format {FORMAT_VERSION}; use a matching criuctl",
            )
        data["processes"] = [ProcessInfo(**p) for p in data["processes"]]
        return cls(**data)


# ---------------------------------------------------------------------------------------------- keys


def load_key(path: Path, create: bool = True) -> bytes:
    """The node's signing key, created (root-only) on first use."""
    try:
        return bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        if not create:
            raise BundleError(
                f"no signing key at {path}", "copy the cluster key there (it is created on first dump)"
            ) from None
    except (OSError, ValueError) as exc:
        raise BundleError(
            f"cannot read signing key {path}: {exc}", "check its contents and permissions"
        ) from exc
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_bytes(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return key


def _sign(key: bytes, manifest_bytes: bytes) -> str:
    return hmac.new(key, manifest_bytes, hashlib.sha256).hexdigest()


# ------------------------------------------------------------------------------------------- writing


def sha256_file(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _payload_files(root: Path) -> list[Path]:
    return sorted(
        p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() not in _UNSIGNED
    )


def lock_down(root: Path) -> None:
    """Images hold every memory page of the job, secrets included: root-only."""
    os.chmod(root, 0o700)
    for p in root.rglob("*"):
        os.chmod(p, 0o700 if p.is_dir() else 0o600)


def seal(root: Path, manifest: Manifest, key: bytes) -> Manifest:
    """Checksum every file under `root`, write the manifest and its signature."""
    manifest.files = {p.relative_to(root).as_posix(): sha256_file(p) for p in _payload_files(root)}
    raw = manifest.to_json()
    (root / MANIFEST).write_bytes(raw)
    (root / SIGNATURE).write_text(_sign(key, raw) + "\n")
    lock_down(root)
    return manifest


def size_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------------- reading


def read_manifest(root: Path) -> Manifest:
    """The manifest, unverified (for `inspect`); use `verify` before acting on the images."""
    try:
        raw = (root / MANIFEST).read_bytes()
    except FileNotFoundError:
        raise BundleError(
            f"{root} is not a criuctl bundle (no {MANIFEST})",
            "pass the directory written by `criuctl dump -o DIR`",
        ) from None
    try:
        return Manifest.from_json(raw)
    except (ValueError, TypeError, KeyError) as exc:
        raise BundleError(
            f"{root / MANIFEST} is corrupted ({exc.__class__.__name__})",
            "the bundle cannot be trusted; take a new checkpoint",
        ) from exc


@dataclass(frozen=True)
class Verification:
    signature_ok: bool
    bad_files: list[str]  # altered, missing or unexpected files, with the reason

    @property
    def ok(self) -> bool:
        return self.signature_ok and not self.bad_files


def check(root: Path, key: bytes, digests: dict[str, str] | None = None) -> Verification:
    """Check signature and checksums; report every problem (for `inspect`).

    `digests` are sha256s already computed while the files arrived (an agent hashes a bundle as it
    streams in), so the files need not be read twice.
    """
    manifest = read_manifest(root)
    try:
        sig = (root / SIGNATURE).read_text().strip()
    except FileNotFoundError:
        sig = ""
    signature_ok = bool(sig) and hmac.compare_digest(sig, _sign(key, (root / MANIFEST).read_bytes()))
    bad: list[str] = []
    for rel, digest in sorted(manifest.files.items()):
        path = root / rel
        if not path.is_file():
            bad.append(f"{rel}: missing")
        elif (digests.get(rel) if digests and rel in digests else sha256_file(path)) != digest:
            bad.append(f"{rel}: checksum mismatch")
    for path in _payload_files(root):
        rel = path.relative_to(root).as_posix()
        if rel not in manifest.files:
            bad.append(f"{rel}: not listed in the manifest")
    return Verification(signature_ok, bad)


def verify(root: Path, key: bytes, digests: dict[str, str] | None = None) -> Manifest:
    """The manifest of a bundle that verifies; BundleError naming the first bad file otherwise."""
    if not root.is_dir():
        raise BundleError(f"no bundle at {root}", "pass the directory written by `criuctl dump -o DIR`")
    manifest = read_manifest(root)
    result = check(root, key, digests)
    if not result.signature_ok:
        raise BundleError(
            f"{root / SIGNATURE}: signature does not verify",
            "the bundle was altered or signed with another node's key; refusing to restore it",
        )
    if result.bad_files:
        raise BundleError(
            f"{root}/{result.bad_files[0]}", "the bundle was altered or damaged; refusing to restore it"
        )
    return manifest
