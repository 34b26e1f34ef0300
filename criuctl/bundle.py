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

import dataclasses
import errno
import hashlib
import hmac
import json
import os
import secrets
import socket
import stat
import threading
import time
import types
import typing
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

import blake3

from criuctl.errors import CriuctlError

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
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
class ContainerFacts:
    """What a restore into a placeholder container needs besides the images (`criuctl.containers`)."""

    id: str  # the source container's ID
    name: str = ""  # container name in its pod
    pod_name: str = ""
    pod_namespace: str = ""
    image: str = ""
    runtime: str = ""  # "containerd 1.6.20", or "cri-archive" for an imported kubelet/CRI checkpoint
    external_mounts: list[str] = field(default_factory=list)  # CRIU's external mount keys (mount points)
    netns_external: bool = False  # the job's network namespace was the pod's, not the node's
    rootfs_diff: str | None = None  # tar of the writable layer's changes, in the bundle
    deleted: list[str] = field(default_factory=list)  # paths the writable layer removed from the image
    volumes: dict[str, str] = field(default_factory=dict)  # mount point -> tar of an emptyDir, in the bundle
    cgroup: str = ""  # the source container's cgroup (for the record)


@dataclass
class StepBoundary:
    """Where the trainers stood when frozen (`criuctl.stepboundary`): at a step's end, or not."""

    request_id: str
    trainers: int  # processes that had run optimizer steps
    held: int  # of them, those stopped at a step boundary (the rest were caught inside a step)
    step: int | None  # optimizer steps done by the first trainer
    waited_s: float
    cuda_bytes: int = 0  # device memory the held trainers still had allocated
    why: str = ""  # why not every trainer stopped at a boundary


@dataclass
class GpuDevice:
    index: int
    uuid: str  # "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
    name: str  # the model, e.g. "NVIDIA H200"
    memory_total: int  # bytes


@dataclass
class GpuFacts:
    """The GPUs the job used, for the target's check and the driver's UUID map (`criuctl.gpus`)."""

    driver: str  # e.g. "580.65.06"
    devices: list[GpuDevice]  # every GPU of the node the job could see
    pids: list[int]  # host PIDs whose CUDA state the driver checkpointed
    ns_pids: list[int]  # the same processes' PIDs in the job's namespace (stable across restore)
    checkpoint_s: float = 0.0  # lock + checkpoint (device memory to host)


@dataclass
class StateFacts:
    """A state bundle (the CUDA-aware pre-dump): no CRIU images; the command starts again and loads these."""

    files: dict[str, str]  # rank -> state file in the bundle
    bytes: int
    step: int | None
    env: dict[str, str]  # the job's environment, to start it again the same way
    cwd: str


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
    container: ContainerFacts | None = None  # a container's tree: restore only into a placeholder
    control_dir: str = ""  # where the job's hook looks for criuctl's requests (its environment says)
    boundary: StepBoundary | None = None  # None: no step boundary was asked for
    gpu: GpuFacts | None = None  # set when the driver checkpointed CUDA state
    state: StateFacts | None = None  # set for a state bundle (no CRIU images)
    format_version: int = FORMAT_VERSION
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: float = field(default_factory=time.time)
    host: str = field(default_factory=socket.gethostname)
    kernel: str = field(default_factory=lambda: os.uname().release)
    files: dict[str, str] = field(default_factory=dict)  # relative path -> digest, all but manifest/sig

    @property
    def rss_bytes(self) -> int:
        return sum(p.rss_bytes for p in self.processes)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), indent=2, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        """Parse and type-check `raw`; MalformedManifest saying the first thing that is wrong.

        Every field is checked against its annotation, because what a manifest holds is used as
        paths, numbers and argv later: a wrong type must stop here, not as a traceback there.
        """
        try:
            data = json.loads(raw)
        except RecursionError as exc:
            raise MalformedManifest("nested too deeply") from exc
        except ValueError as exc:  # UnicodeDecodeError included
            raise MalformedManifest(f"not JSON ({exc})") from exc
        if not isinstance(data, dict):
            raise MalformedManifest(f"{_json_type(data)}, not a JSON object")
        if "format_version" not in data:
            raise MalformedManifest("it has no format_version")
        version = data["format_version"]
        if not isinstance(version, int) or isinstance(version, bool):
            raise MalformedManifest(f"format_version is {_json_type(version)}, not an integer")
        if version not in READABLE_VERSIONS:
            raise BundleError(
                f"bundle format {version} is not supported",
                f"this criuctl reads formats {READABLE_VERSIONS}; use a matching criuctl",
            )
        manifest = _conform(data, cls, "manifest")
        for rel in manifest.files:
            if not _inside(rel):
                raise MalformedManifest(f"files lists {rel[:80]!r}, which is not a file inside the bundle")
        return manifest


class MalformedManifest(ValueError):
    """What is wrong with a manifest's bytes; the reader turns it into a BundleError naming the file."""


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number"}.get(
        type(value), type(value).__name__
    )


def _conform(value: object, tp: object, where: str) -> object:
    """`value` (parsed JSON) as type `tp` — str, int, float, bool, list[X], dict[str, X], X | None,
    or a dataclass of these — or MalformedManifest naming `where` it went wrong."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in args:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return _conform(value, tp, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise MalformedManifest(f"{where} is {_json_type(value)}, not an object")
        fields = {f.name: f for f in dataclasses.fields(tp)}
        for key in value:
            if key not in fields:
                raise MalformedManifest(f"{where} has an unknown field {key[:40]!r}")
        hints = typing.get_type_hints(tp)
        kw = {}
        for name, f in fields.items():
            if name in value:
                kw[name] = _conform(value[name], hints[name], f"{where}.{name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MalformedManifest(f"{where} has no field {name!r}")
        return tp(**kw)
    if origin is list:
        if not isinstance(value, list):
            raise MalformedManifest(f"{where} is {_json_type(value)}, not a list")
        return [_conform(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise MalformedManifest(f"{where} is {_json_type(value)}, not an object")
        return {k: _conform(v, args[1], f"{where}[{k[:40]!r}]") for k, v in value.items()}
    ok = {
        str: lambda v: isinstance(v, str),
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63,
        float: lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    }[tp]
    if not ok(value):
        want = {str: "a string", bool: "a boolean", int: "an integer", float: "a number"}[tp]
        if tp is int and isinstance(value, int) and not isinstance(value, bool):
            raise MalformedManifest(f"{where} is an integer out of range")
        raise MalformedManifest(f"{where} is {_json_type(value)}, not {want}")
    return value


def _inside(rel: str) -> bool:
    """A manifest's file name is a plain relative path in the bundle, never `..`, `/x` or itself."""
    p = PurePosixPath(rel)
    return (
        bool(rel)
        and not p.is_absolute()
        and ".." not in p.parts
        and p.as_posix() == rel
        and rel not in _UNSIGNED
        and "\0" not in rel
    )


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


_MAC_CONTEXT = "criuctl 2026-12 bundle manifest signature"


def _sign(key: bytes, manifest_bytes: bytes, version: int = FORMAT_VERSION) -> str:
    if version == 1:
        return hmac.new(key, manifest_bytes, hashlib.sha256).hexdigest()
    mac_key = blake3.blake3(key, derive_key_context=_MAC_CONTEXT).digest()
    return blake3.blake3(manifest_bytes, key=mac_key).hexdigest()


# ------------------------------------------------------------------------------------------ digests


class Hasher(typing.Protocol):
    def update(self, data: bytes, /) -> object: ...
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
    syncing = _sync_in_background(files) if durable else None
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
        self.files, self.error = files, None

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


def _sync_in_background(files: list[Path]) -> _Syncer:
    syncer = _Syncer(files)
    syncer.start()
    return syncer


def _write(path: Path, data: bytes, durable: bool) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        if durable:
            os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    """Put a folder's entries (files created, renamed, removed in it) on disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def size_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# ------------------------------------------------------------------------------------------- reading


MANIFEST_MAX = 64 << 20  # far above any real manifest (a few KiB per thousand files)


def _read_raw(root: Path) -> bytes:
    """manifest.json's bytes, read once; every reader checks and parses these same bytes."""
    hint = "pass the directory written by `criuctl dump -o DIR`"
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
    for path in _payload_files(root):
        rel = path.relative_to(root).as_posix()
        if rel not in manifest.files:
            bad.append(f"{rel}: not listed in the manifest")
    return bad


@dataclass(frozen=True)
class Verification:
    signature_ok: bool
    bad_files: list[str]  # altered, missing or unexpected files, with the reason

    @property
    def ok(self) -> bool:
        return self.signature_ok and not self.bad_files


def check(root: Path, key: bytes, digests: dict[str, str] | None = None) -> Verification:
    """Check signature and checksums; report every problem (for `inspect`).

    `digests` are this format's digests, computed while the files arrived (an agent hashes a bundle
    as it streams in), so the files need not be read twice.
    """
    raw = _read_raw(root)
    manifest = _parse(root, raw)
    signed = _signed_version(root, key, raw) == manifest.format_version
    return Verification(signed, _bad_files(root, manifest, digests))


def verify(root: Path, key: bytes, digests: dict[str, str] | None = None) -> Manifest:
    """The manifest of a bundle that verifies; BundleError naming the first bad file otherwise.

    manifest.json is read once: the signature is checked on those bytes, and only then are the same
    bytes parsed — a file swapped between the check and a second read cannot slip through.
    """
    raw = _read_raw(root)
    signed = _signed_version(root, key, raw)
    if signed is None or (manifest := _parse(root, raw)).format_version != signed:
        raise BundleError(
            f"{root / SIGNATURE}: signature does not verify",
            "the bundle was altered or signed with another node's key; refusing to restore it",
        )
    bad = _bad_files(root, manifest, digests)
    if bad:
        raise BundleError(f"{root}/{bad[0]}", "the bundle was altered or damaged; refusing to restore it")
    return manifest
