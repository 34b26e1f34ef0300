"""The bundle's keys, digests and signature: BLAKE3 (format 2), sha256 + HMAC (format 1, read only).

sha256 ran at ~2 GB/s on one core here and sat inside every dump, stream and restore; BLAKE3 runs at
7–10 GB/s on one core, 14 GB/s on two from the page cache. The signature is BLAKE3 in keyed mode, with
a key derived from the node's key for this one purpose.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import typing
from pathlib import Path

import blake3

from criuctl.format.manifest import FORMAT_VERSION, BundleError
from criuctl_hook import durable


def load_key(path: Path, create: bool = True) -> bytes:
    """The node's signing key, created (root-only) on first use."""
    try:
        return bytes.fromhex(path.read_text().strip())
    except FileNotFoundError:
        if not create:
            raise BundleError(
                f"no signing key at {path}",
                "it is this node's own, made by its first dump: the bundle was not made here",
            ) from None
    except (OSError, ValueError) as exc:
        raise BundleError(
            f"cannot read signing key {path}: {exc}", "check its contents and permissions"
        ) from exc
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = secrets.token_bytes(32)
    if not durable.create(path, (key.hex() + "\n").encode()):  # another process made it first: use that one
        return bytes.fromhex(path.read_text().strip())
    return key


_MAC_CONTEXT = "criuctl 2026-12 bundle manifest signature"


def sign(key: bytes, manifest_bytes: bytes, version: int = FORMAT_VERSION) -> str:
    if version == 1:
        return hmac.new(key, manifest_bytes, hashlib.sha256).hexdigest()
    mac_key = blake3.blake3(key, derive_key_context=_MAC_CONTEXT).digest()
    return blake3.blake3(manifest_bytes, key=mac_key).hexdigest()


class Hasher(typing.Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...
    def hexdigest(self) -> str: ...


def hasher(version: int = FORMAT_VERSION) -> Hasher:
    """An incremental digest of the kind format `version` lists, on one thread.

    One thread on purpose: an incremental digest runs beside other work (CRIU writing, a socket
    receiving), and BLAKE3's worker threads, fighting that work for 2 cores, made it 3× slower.
    """
    if version == 1:
        return hashlib.sha256()
    return blake3.blake3()


def file_digest(path: Path, version: int = FORMAT_VERSION) -> str:
    """The digest format `version` lists for the file at `path` (on every core: nothing else runs)."""
    if version == 1:
        with path.open("rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest()
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    if path.stat().st_size:  # mmap of an empty file fails
        h.update_mmap(path)
    return h.hexdigest()
