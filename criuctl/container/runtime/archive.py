"""Kubelet/CRI checkpoint archives: read them, and import them as signed criuctl bundles.

The kubelet's checkpoint API (`POST /checkpoint/{ns}/{pod}/{container}`) and CRI
`CheckpointContainer` (containerd >= 2.0, CRI-O; `podman container checkpoint --export` writes the
same layout) leave a tar archive:

    checkpoint/          CRIU's image files (and, from containerd, descriptors.json)
    config.dump          the runtime's container record: id, name, image, times
    spec.dump            the container's OCI runtime spec: command, mounts, annotations (pod)
    rootfs-diff.tar      the writable layer's changes
    deleted.files        files the writable layer removed from the image (JSON list; CRI-O, podman)
    descriptors.json     the stdio of the container's PID 1 (at the top level in some versions)
    dump.log, status, status.dump, stats-dump, container.log, ...   for the record

criuctl never asks a runtime to restore such an archive (restore-via-create pulls the image again
and is off by default since the 2026 CVEs); it imports the archive as a bundle, signed by the node
that imports it, and restores that into a placeholder container like any container bundle.

This module is the public face and the walk through the archive; the mechanisms live beside it:
`archive_members` (every member checked, refused where a runtime never writes it, copied without
trusting a name), `archive_records` (what config.dump, spec.dump, descriptors.json, deleted.files
and rootfs-diff.tar's whiteouts say) and `criuctl.format.criuimages` (what the CRIU images say).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from criuctl.container.runtime import Runtime
from criuctl.container.runtime.archive_members import (
    ZSTD_MAGIC,
    ArchiveError,
    Member,
    bad,
    copy_into,
    members,
)
from criuctl.container.runtime.archive_records import (
    CHECKPOINT_DIR,
    DELETED_FILES,
    DESCRIPTORS,
    ROOTFS_DIFF,
    ArchiveFacts,
    OciMount,
    facts,
    read_small,
    scan_diff,
)
from criuctl.format import bundle, criuimages
from criuctl_hook import durable

__all__ = [
    "CHECKPOINT_DIR",
    "CRI_DIR",
    "DELETED_FILES",
    "DESCRIPTORS",
    "ROOTFS_DIFF",
    "RUNTIME",
    "ArchiveError",
    "ArchiveFacts",
    "OciMount",
    "import_archive",
    "imported",
    "is_archive",
    "read",
]

RUNTIME = "cri-archive"  # ContainerFacts.runtime of an imported archive
CRI_DIR = "cri"  # the archive's own records, kept in the bundle under this folder
# Top-level records copied into the bundle's cri/ folder; other top-level files are read-only
# history (logs, stats) and left out. dump.log becomes the bundle's dump.log.
_RECORDS = ("config.dump", "spec.dump", DESCRIPTORS, DELETED_FILES, "status.dump")
_DUMP_LOG = "dump.log"
_MAGICS = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", ZSTD_MAGIC)  # gzip, bzip2, xz, zstd
# Members whose bytes are parsed here (and so read into memory, bounded by RECORD_MAX).
_PARSED = {"config.dump", "spec.dump", DESCRIPTORS, DELETED_FILES, f"{CHECKPOINT_DIR}/{DESCRIPTORS}"}


def is_archive(path: Path) -> bool:
    """Whether `path` looks like a checkpoint archive rather than a criuctl bundle; never raises.

    A file that is a tar (or gzip/bzip2/xz/zstd data) counts: a bundle is always a folder, so a
    tar that turns out not to be a checkpoint archive is better told so by `read`/`import_archive`
    than as "not a bundle". A folder counts when it holds `checkpoint/` and a `config.dump` or
    `spec.dump` and no bundle manifest (an archive someone extracted).
    """
    try:
        st = path.stat()
        if stat.S_ISDIR(st.st_mode):
            return (
                (path / CHECKPOINT_DIR).is_dir()
                and ((path / "config.dump").is_file() or (path / "spec.dump").is_file())
                and not (path / bundle.MANIFEST).exists()
            )
        if not stat.S_ISREG(st.st_mode):
            return False
        with path.open("rb") as f:
            head = f.read(512)
    except OSError:
        return False
    return head.startswith(_MAGICS) or (len(head) >= 262 and head[257:262] == b"ustar")


def _place(path: Path, m: Member) -> str | None:
    """Where a member goes in a bundle ("images/core-1.img", "cri/spec.dump", ...), None when it is
    not carried, or ArchiveError for a layout no runtime writes.

    checkpoint/descriptors.json stays with the images: runc reads it from the images folder.
    """
    parts = m.name.split("/")
    if parts[0] == CHECKPOINT_DIR:
        if len(parts) == 1:
            if m.kind != "dir":
                raise bad(path, f"{CHECKPOINT_DIR!r} is a file, not the folder of CRIU images")
            return None
        if len(parts) > 2 or m.kind == "dir":
            raise bad(path, f"member {m.name!r}: CRIU's images folder has no subfolders")
        return f"{bundle.IMAGES_DIR}/{parts[1]}"
    if len(parts) == 1 and m.kind == "file":
        if m.name in _RECORDS:
            return f"{CRI_DIR}/{m.name}"
        if m.name == ROOTFS_DIFF:
            return ROOTFS_DIFF
        if m.name == _DUMP_LOG:
            return bundle.DUMP_LOG
    return None


def read(path: Path) -> ArchiveFacts:
    """What the archive (or extracted folder) at `path` holds, without extracting the images.

    Every member is checked as `import_archive` checks it, so a hostile archive is refused here too.
    """
    return _scan(path, None, 0)


def _scan(source: Path, root: Path | None, max_bytes: int) -> ArchiveFacts:
    """Check every member of `source`; with `root`, also copy those a bundle carries into it."""
    records: dict[str, bytes] = {}
    images: list[str] = []
    other: list[str] = []
    diff = False
    whiteouts: list[str] = []
    seen: set[str] = set()
    budget = [max_bytes]
    for m in members(source):
        if m.name in seen:
            raise bad(source, f"member {m.name!r} appears twice")
        seen.add(m.name)
        dest = _place(source, m)
        if dest is None:
            if m.kind == "file" and "/" not in m.name:
                other.append(m.name)
            continue
        if m.name in _PARSED:
            raw = read_small(source, m)
            records[m.name] = raw
            m = dataclasses.replace(m, size=len(raw), open=lambda raw=raw: io.BytesIO(raw))
        if root is not None:
            copy_into(root, dest, m, budget, source)
        if dest.startswith(bundle.IMAGES_DIR + "/") and m.name != f"{CHECKPOINT_DIR}/{DESCRIPTORS}":
            images.append(m.name.split("/", 1)[1])
        elif dest == ROOTFS_DIFF:
            diff = True
            if m.size:  # an empty file is an empty diff
                with (root / dest).open("rb") if root is not None else m.open() as f:
                    whiteouts = scan_diff(source, f)
    return facts(source, records, images, other, diff, whiteouts)


def checkpoint_via_runtime(rt: Runtime, ident: str, out: Path, key: bytes) -> bundle.Manifest:
    """A checkpoint taken the kubelet's way: the runtime's CRI `CheckpointContainer` (containerd
    >= 2.0, CRI-O) writes its archive next to `out`, which is imported as a signed bundle at `out`
    and removed. The container keeps running (the runtime checkpoints with leave-running)."""
    out = out.absolute()
    if out.exists():
        raise ArchiveError(f"{out} already exists", "pass a new directory to -o")
    with tempfile.TemporaryDirectory(prefix=".cri-checkpoint-", dir=out.parent) as tmp:
        os.chmod(tmp, 0o700)  # the archive holds every memory page of the job
        taken = Path(tmp) / "checkpoint.tar"
        rt.checkpoint(ident, str(taken))
        return import_archive(taken, out, key)


def import_archive(path: Path, out: Path, key: bytes, max_bytes: int | None = None) -> bundle.Manifest:
    """Turn the checkpoint archive (or extracted folder) at `path` into a signed bundle at `out`.

    `out` must not exist; it appears complete or not at all (built in a sibling folder, renamed).
    The bundle holds `images/` (the archive's `checkpoint/`), `rootfs-diff.tar`, `dump.log` and the
    archive's records under `cri/`; `manifest.container` says what a placeholder restore needs.
    It is signed with `key`: the node that imports an archive vouches for it from then on, so call
    this only on archives from a place only the runtime or kubelet writes. `max_bytes` caps what is
    written (default: the free space where `out` goes) — a small compressed archive can expand
    without bound.
    """
    out = out.absolute()
    if out.exists() or out.is_symlink():
        raise ArchiveError(f"{out} already exists", "pass a new folder for the imported bundle")
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if max_bytes is None:
        max_bytes = shutil.disk_usage(out.parent).free - (64 << 20)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.import-", dir=out.parent))
    try:
        facts = _scan(path, stage, max_bytes)
        try:
            img = criuimages.image_facts(stage)
        except criuimages.ImageError as exc:  # the archive's fault: refused as the archive
            raise ArchiveError(f"{path}: {exc.what}", exc.hint) from exc
        version, host, kernel = criuimages.dump_log_facts(stage)
        container = bundle.ContainerFacts(
            id=facts.container_id,
            name=facts.name,
            pod_name=facts.pod_name,
            pod_namespace=facts.pod_namespace,
            image=facts.image,
            runtime=RUNTIME,
            external_mounts=img.external_mounts,
            netns_external=img.netns_external,
            rootfs_diff=ROOTFS_DIFF if facts.rootfs_diff else None,
            deleted=facts.deleted,
            cgroup=facts.cgroup,
        )
        manifest = bundle.Manifest(
            workload=facts.name or facts.container_id[:12],
            command=facts.command,
            processes=img.processes,
            open_files=img.open_files,
            uses_gpu=any(f.startswith("/dev/nvidia") for f in img.open_files),
            criu_version=version or "unknown",
            stdio_pipes=facts.stdio_pipes,
            container=container,
        )
        if facts.checkpointed:
            manifest.created = facts.checkpointed
        if host:
            manifest.host, manifest.kernel = host, kernel
        bundle.seal(stage, manifest, key)
        durable.move(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return manifest


@contextlib.contextmanager
def imported(path: Path, key: bytes, under: Path) -> Iterator[tuple[Path, bundle.Manifest]]:
    """The archive at `path` imported as a bundle in a new folder under `under`, removed afterwards
    (for `inspect`, and for a restore that needs the bundle only while CRIU reads it)."""
    under.mkdir(parents=True, exist_ok=True, mode=0o700)
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", path.name)[:60] or "archive"
    slot = Path(tempfile.mkdtemp(prefix=f"import-{stem}-", dir=under))
    try:
        root = slot / "bundle"
        manifest = import_archive(path, root, key)
        yield root, manifest
    finally:
        shutil.rmtree(slot, ignore_errors=True)
