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

An archive is input from elsewhere, and restoring is CRIU running as root on its images: everything
here refuses, with one line, what a runtime never writes — members outside the archive (`..`,
absolute names), links, device files, duplicate names, archives larger than the disk — and reads
the images it parses with bounded sizes. Nothing is ever extracted by name into an existing tree:
each file is created (O_EXCL, O_NOFOLLOW) in a folder this module just made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import shutil
import stat
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import IO, Any, NoReturn

from criuctl import bundle
from criuctl.errors import CriuctlError

RUNTIME = "cri-archive"  # ContainerFacts.runtime of an imported archive
CHECKPOINT_DIR = "checkpoint"
CRI_DIR = "cri"  # the archive's own records, kept in the bundle under this folder
ROOTFS_DIFF = "rootfs-diff.tar"
DELETED_FILES = "deleted.files"
DESCRIPTORS = "descriptors.json"
# Top-level records copied into the bundle's cri/ folder; other top-level files are read-only
# history (logs, stats) and left out. dump.log becomes the bundle's dump.log.
_RECORDS = ("config.dump", "spec.dump", DESCRIPTORS, DELETED_FILES, "status.dump")
_DUMP_LOG = "dump.log"

RECORD_MAX = 16 << 20  # a config/spec/descriptors file: a few KiB in practice
IMAGE_PARSE_MAX = 64 << 20  # an image parsed here (pstree, core, fs, files, mountpoints, pagemap)
MEMBERS_MAX = 100_000  # a CRIU images folder holds ~10 files per process
DELETED_MAX = 100_000
_PAGE = os.sysconf("SC_PAGE_SIZE")
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ZSTD_DONE = (0, -13, -15)  # finished; or SIGPIPE, SIGTERM: we stopped reading once the tar ended
_MAGICS = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", _ZSTD_MAGIC)  # gzip, bzip2, xz, zstd


class ArchiveError(CriuctlError):
    """The archive is not a checkpoint archive, is damaged, or holds something a runtime never writes."""


@dataclass
class OciMount:
    """One mount of the container's OCI spec (`spec.dump`), as the runtime set it up."""

    destination: str
    type: str = ""
    source: str = ""
    options: list[str] = field(default_factory=list)


@dataclass
class ArchiveFacts:
    """What a checkpoint archive says about its container, read without extracting the images."""

    container_id: str
    name: str  # the container's name in its pod ("counter"), else the runtime's full name
    runtime_name: str = ""  # the runtime's own name for it ("counter_trainer-0_ml_<uid>_0")
    pod_name: str = ""
    pod_namespace: str = ""
    pod_uid: str = ""
    sandbox_id: str = ""
    image: str = ""
    image_ref: str = ""
    cgroup: str = ""  # the OCI spec's cgroupsPath
    oci_runtime: str = ""  # "io.containerd.runc.v2", "runc", "crun"
    command: list[str] = field(default_factory=list)
    mounts: list[OciMount] = field(default_factory=list)
    rootfs_diff: bool = False
    deleted: list[str] = field(default_factory=list)
    stdio: list[str] = field(default_factory=list)  # descriptors.json: what fds 0, 1, 2 were
    checkpointed: float = 0.0  # epoch seconds, 0 when the archive does not say
    images: list[str] = field(default_factory=list)  # file names under checkpoint/
    other: list[str] = field(default_factory=list)  # top-level members criuctl does not use

    @property
    def stdio_pipes(self) -> dict[str, str]:
        """stdout/stderr that were pipes ("pipe:[N]"): restore hands the placeholder's over them."""
        return {
            which: self.stdio[i]
            for i, which in ((1, "stdout"), (2, "stderr"))
            if i < len(self.stdio) and re.fullmatch(r"pipe:\[\d+\]", self.stdio[i])
        }


# ------------------------------------------------------------------------------------ recognising


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


# ------------------------------------------------------------------------------------- members


@dataclass
class _Member:
    """One archive member, its name checked: where it goes, and how to read its bytes."""

    name: str  # normalised: no leading "./", no trailing "/"
    kind: str  # "dir" or "file"
    size: int
    open: Any  # () -> binary file object (files only)


def _bad(path: Path, what: str) -> ArchiveError:
    return ArchiveError(
        f"{path}: {what}",
        "a container runtime never writes that; refusing this archive (nothing was restored)",
    )


def _norm(path: Path, raw: str) -> str:
    """A member name as a plain relative path, or ArchiveError: absolute, `..`, NUL, empty."""
    shown = raw[:120]
    if "\0" in raw:
        raise _bad(path, f"member {shown!r} has a NUL byte in its name")
    if raw.startswith("/"):
        raise _bad(path, f"member {shown!r} has an absolute path")
    parts = [p for p in PurePosixPath(raw).parts if p != "."]
    if ".." in parts:
        raise _bad(path, f"member {shown!r} points outside the archive (..)")
    if not parts:
        return ""
    return "/".join(parts)


def _kind(path: Path, name: str, info: tarfile.TarInfo) -> str:
    if info.isdir():
        return "dir"
    if info.isreg():
        return "file"
    if info.issym():
        _refuse_link(path, name, "a symbolic link", info.linkname)
    if info.islnk():
        _refuse_link(path, name, "a hard link", info.linkname)
    what = "a device file" if info.isdev() else "a FIFO" if info.isfifo() else "not a regular file"
    raise _bad(path, f"member {name!r} is {what}")


def _refuse_link(path: Path, name: str, what: str, target: str) -> NoReturn:
    escapes = target.startswith("/") or ".." in PurePosixPath(target).parts
    where = " outside the archive" if escapes else ""
    raise _bad(path, f"member {name!r} is {what} to {target[:120]!r}{where}")


def _zstd_stream(path: Path) -> subprocess.Popen[bytes]:
    zstd = shutil.which("zstd")
    if zstd is None:
        raise ArchiveError(
            f"{path} is zstd-compressed and there is no zstd here",
            "install zstd (apt-get install zstd), or decompress it with `zstd -d` first",
        )
    return subprocess.Popen([zstd, "-dcq", "--", str(path)], stdout=subprocess.PIPE)


def _tar_members(path: Path) -> Iterator[_Member]:
    """The members of a (compressed) tar, each name and type checked, in archive order.

    Random access for plain, gzip, bzip2 and xz files (skipping the data of a member not read is
    a seek for a plain tar); zstd through `zstd -dc` as a stream. Either way each member's bytes can
    be read only until the next member is asked for.
    """
    proc: subprocess.Popen[bytes] | None = None
    try:
        with path.open("rb") as f:
            zstd = f.read(4) == _ZSTD_MAGIC
        if zstd:
            proc = _zstd_stream(path)
            tar = tarfile.open(fileobj=proc.stdout, mode="r|")  # noqa: SIM115 (closed below, in finally)
        else:
            tar = tarfile.open(path, mode="r:*")  # noqa: SIM115
    except tarfile.TarError as exc:
        _reap(proc)
        raise ArchiveError(
            f"{path} is not a tar archive ({_one_line(exc)})", "pass a checkpoint archive"
        ) from exc
    except OSError as exc:
        _reap(proc)
        raise ArchiveError(
            f"cannot read {path}: {exc.strerror}", "check the path and its permissions"
        ) from exc
    try:
        count = 0
        while True:
            try:
                info = tar.next()
            except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
                raise ArchiveError(
                    f"{path} is damaged after {count} members ({_one_line(exc)})",
                    "take or copy the archive again",
                ) from exc
            if info is None:
                break
            count += 1
            if count > MEMBERS_MAX:
                raise _bad(path, f"more than {MEMBERS_MAX} members")
            name = _norm(path, info.name)
            kind = _kind(path, name or ".", info)
            if not name:
                continue  # the archive's "./" itself
            yield _Member(name, kind, info.size, lambda info=info: tar.extractfile(info))
    finally:
        tar.close()
        _reap(proc)
    if proc is not None and proc.returncode not in _ZSTD_DONE:
        raise ArchiveError(f"zstd could not decompress {path}", "take or copy the archive again")


def _reap(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None:
        return
    if proc.stdout:
        proc.stdout.close()
    if proc.poll() is None:
        proc.terminate()
    proc.wait()


def _dir_members(path: Path) -> Iterator[_Member]:
    """The files of an extracted archive, with the same checks as a tar's members (lstat: a link in
    the folder is refused, never followed)."""
    count = 0
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            entries = sorted(os.scandir(path / rel) if rel else os.scandir(path), key=lambda e: e.name)
        except OSError as exc:
            raise ArchiveError(f"cannot read {path / rel}: {exc.strerror}", "check its permissions") from exc
        for e in entries:
            name = f"{rel}/{e.name}" if rel else e.name
            count += 1
            if count > MEMBERS_MAX:
                raise _bad(path, f"more than {MEMBERS_MAX} files")
            st = e.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                _refuse_link(path, name, "a symbolic link", os.readlink(e.path))
            if stat.S_ISDIR(st.st_mode):
                stack.append(name)
                yield _Member(name, "dir", 0, None)
            elif stat.S_ISREG(st.st_mode):
                yield _Member(name, "file", st.st_size, lambda p=e.path, n=name: _open_nofollow(path, n, p))
            else:
                what = "a device file" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "special"
                raise _bad(path, f"{name!r} is {what}")


def _open_nofollow(path: Path, name: str, p: str) -> IO[bytes]:
    """A file of an extracted archive, opened only if it is still a regular file (not swapped for a
    link since the folder was listed)."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise _bad(path, f"{name!r} cannot be opened as a plain file ({exc.strerror})") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _bad(path, f"{name!r} is no longer a regular file")
    return os.fdopen(fd, "rb")


def _members(path: Path) -> Iterator[_Member]:
    if not path.exists():
        raise ArchiveError(
            f"no archive at {path}", "pass a checkpoint archive (.tar) or its extracted folder"
        )
    return _dir_members(path) if path.is_dir() else _tar_members(path)


def _place(path: Path, m: _Member) -> str | None:
    """Where a member goes in a bundle ("images/core-1.img", "cri/spec.dump", ...), None when it is
    not carried, or ArchiveError for a layout no runtime writes.

    checkpoint/descriptors.json stays with the images: runc reads it from the images folder.
    """
    parts = m.name.split("/")
    if parts[0] == CHECKPOINT_DIR:
        if len(parts) == 1:
            if m.kind != "dir":
                raise _bad(path, f"{CHECKPOINT_DIR!r} is a file, not the folder of CRIU images")
            return None
        if len(parts) > 2 or m.kind == "dir":
            raise _bad(path, f"member {m.name!r}: CRIU's images folder has no subfolders")
        return f"{bundle.IMAGES_DIR}/{parts[1]}"
    if len(parts) == 1 and m.kind == "file":
        if m.name in _RECORDS:
            return f"{CRI_DIR}/{m.name}"
        if m.name == ROOTFS_DIFF:
            return ROOTFS_DIFF
        if m.name == _DUMP_LOG:
            return bundle.DUMP_LOG
    return None


# -------------------------------------------------------------------------------------- reading


def _read_small(path: Path, m: _Member) -> bytes:
    if m.size > RECORD_MAX:
        raise _bad(
            path, f"{m.name} is {m.size} bytes, larger than any runtime writes ({RECORD_MAX >> 20} MiB)"
        )
    with m.open() as f:
        return f.read(RECORD_MAX + 1)[:RECORD_MAX]


def _json(path: Path, name: str, raw: bytes | None, want: type) -> Any:
    if raw is None:
        return want()
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ArchiveError(
            f"{path}: {name} is not JSON ({_one_line(exc)})", "the archive is damaged"
        ) from exc
    if not isinstance(value, want):
        raise ArchiveError(f"{path}: {name} is not a JSON {want.__name__}", "the archive is damaged")
    return value


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _time(value: Any) -> float:
    """RFC 3339 with nanoseconds ("2026-11-30T11:11:13.282355023Z") as epoch seconds, 0 if unknown."""
    if not isinstance(value, str) or value.startswith("0001-"):
        return 0.0
    m = re.fullmatch(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", value)
    if not m:
        return 0.0
    try:
        base = datetime.fromisoformat(m[1] + ("+00:00" if m[3] == "Z" else m[3])).timestamp()
    except ValueError:
        return 0.0
    return base + (float(f"0.{m[2]}") if m[2] else 0.0)


def _facts(
    path: Path,
    records: dict[str, bytes],
    images: list[str],
    other: list[str],
    diff: bool,
    whiteouts: list[str],
) -> ArchiveFacts:
    config = _json(path, "config.dump", records.get("config.dump"), dict)
    spec = _json(path, "spec.dump", records.get("spec.dump"), dict)
    raw_desc = records.get(f"{CHECKPOINT_DIR}/{DESCRIPTORS}") or records.get(DESCRIPTORS)
    stdio = _json(path, DESCRIPTORS, raw_desc, list)
    deleted = _json(path, DELETED_FILES, records.get(DELETED_FILES), list)
    if not config and not spec:
        raise ArchiveError(
            f"{path} is not a checkpoint archive (no config.dump or spec.dump)",
            "pass the archive the kubelet or the runtime's CheckpointContainer wrote",
        )
    if not images:
        raise ArchiveError(
            f"{path} has no CRIU images (nothing under {CHECKPOINT_DIR}/)",
            "pass a complete checkpoint archive",
        )
    for p in deleted:
        if not isinstance(p, str) or "\0" in p or ".." in PurePosixPath(p).parts:
            raise _bad(path, f"{DELETED_FILES} lists {str(p)[:80]!r}, not a path inside the container")
    if len(deleted) > DELETED_MAX:
        raise _bad(path, f"{DELETED_FILES} lists more than {DELETED_MAX} paths")
    annotations = spec.get("annotations") if isinstance(spec.get("annotations"), dict) else {}
    ann = {k: v for k, v in annotations.items() if isinstance(k, str) and isinstance(v, str)}
    runtime_name = _str(config.get("name"))
    # The kubelet names a CRI container NAME_POD_NAMESPACE_UID_ATTEMPT (no part holds "_").
    from_name = runtime_name.split("_") if runtime_name.count("_") == 4 else ["", "", "", "", ""]
    name = (
        ann.get("io.kubernetes.cri.container-name")  # containerd
        or ann.get("io.kubernetes.container.name")  # CRI-O
        or from_name[0]
        or runtime_name
    )
    linux = spec.get("linux") if isinstance(spec.get("linux"), dict) else {}
    process = spec.get("process") if isinstance(spec.get("process"), dict) else {}
    args = process.get("args") if isinstance(process.get("args"), list) else []
    mounts = []
    for mt in spec.get("mounts") or []:
        if isinstance(mt, dict) and isinstance(mt.get("destination"), str):
            opts = mt.get("options") if isinstance(mt.get("options"), list) else []
            mounts.append(
                OciMount(
                    mt["destination"], _str(mt.get("type")), _str(mt.get("source")), [_str(o) for o in opts]
                )
            )
    return ArchiveFacts(
        container_id=_str(config.get("id")) or ann.get("io.kubernetes.cri.container-id", ""),
        name=name,
        runtime_name=runtime_name,
        pod_name=ann.get("io.kubernetes.cri.sandbox-name")
        or ann.get("io.kubernetes.pod.name")
        or from_name[1],
        pod_namespace=ann.get("io.kubernetes.cri.sandbox-namespace")
        or ann.get("io.kubernetes.pod.namespace")
        or from_name[2],
        pod_uid=ann.get("io.kubernetes.cri.sandbox-uid") or ann.get("io.kubernetes.pod.uid") or from_name[3],
        sandbox_id=ann.get("io.kubernetes.cri.sandbox-id") or ann.get("io.kubernetes.cri-o.SandboxID", ""),
        image=_str(config.get("rootfsImageName"))
        or _str(config.get("rootfsImage"))
        or ann.get("io.kubernetes.cri.image-name", ""),
        image_ref=_str(config.get("rootfsImageRef")),
        oci_runtime=_str(config.get("runtime")) or _str(config.get("ociRuntime")),
        command=[a for a in args if isinstance(a, str)],
        cgroup=_str(linux.get("cgroupsPath")),
        mounts=mounts,
        rootfs_diff=diff,
        deleted=list(dict.fromkeys([*deleted, *whiteouts])),
        stdio=[_str(s) for s in stdio],
        checkpointed=_time(config.get("checkpointedTime")),
        images=sorted(images),
        other=sorted(other),
    )


def read(path: Path) -> ArchiveFacts:
    """What the archive (or extracted folder) at `path` holds, without extracting the images.

    Every member is checked as `import_archive` checks it, so a hostile archive is refused here too.
    """
    return _scan(path, None, 0)


# Members whose bytes are parsed here (and so read into memory, bounded by RECORD_MAX).
_PARSED = {"config.dump", "spec.dump", DESCRIPTORS, DELETED_FILES, f"{CHECKPOINT_DIR}/{DESCRIPTORS}"}


def _scan(source: Path, root: Path | None, max_bytes: int) -> ArchiveFacts:
    """Check every member of `source`; with `root`, also copy those a bundle carries into it."""
    records: dict[str, bytes] = {}
    images: list[str] = []
    other: list[str] = []
    diff = False
    whiteouts: list[str] = []
    seen: set[str] = set()
    budget = [max_bytes]
    for m in _members(source):
        if m.name in seen:
            raise _bad(source, f"member {m.name!r} appears twice")
        seen.add(m.name)
        dest = _place(source, m)
        if dest is None:
            if m.kind == "file" and "/" not in m.name:
                other.append(m.name)
            continue
        if m.name in _PARSED:
            raw = _read_small(source, m)
            records[m.name] = raw
            m = dataclasses.replace(m, size=len(raw), open=lambda raw=raw: io.BytesIO(raw))
        if root is not None:
            _copy_into(root, dest, m, budget, source)
        if dest.startswith(bundle.IMAGES_DIR + "/") and m.name != f"{CHECKPOINT_DIR}/{DESCRIPTORS}":
            images.append(m.name.split("/", 1)[1])
        elif dest == ROOTFS_DIFF:
            diff = True
            if m.size:  # an empty file is an empty diff
                with (root / dest).open("rb") if root is not None else m.open() as f:
                    whiteouts = _scan_diff(source, f)
    return _facts(source, records, images, other, diff, whiteouts)


# ------------------------------------------------------------------------------------ importing


def _copy_into(root: Path, rel: str, m: _Member, budget: list[int], source: Path) -> None:
    """Write member `m` as `root/rel`, a new file in a folder made here; count it against `budget`."""
    if m.size > budget[0]:
        raise ArchiveError(
            f"{source}: {m.name} ({m.size} bytes) does not fit: the archive is larger than the "
            f"room left for it ({max(budget[0], 0)} bytes more)",
            "free disk space where bundles are written, or check that the archive is what you think",
        )
    dest = root / rel
    dest.parent.mkdir(mode=0o700, exist_ok=True)
    try:
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        raise _bad(source, f"member {m.name!r} appears twice") from None
    written = 0
    with os.fdopen(fd, "wb") as out, m.open() as src:
        while chunk := src.read(1 << 20):
            written += len(chunk)
            if written > m.size:
                raise _bad(source, f"{m.name} holds more bytes than its header says")
            out.write(chunk)
    budget[0] -= written


_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"


def _scan_diff(source: Path, f: IO[bytes]) -> list[str]:
    """Check rootfs-diff.tar (read as a stream from `f`); the paths its whiteouts delete.

    Refused: names outside the container's root, and hard links out of it. Symbolic links inside
    it are the container's own files (absolute targets are normal there and mean the container's
    root): whoever applies the diff must extract it confined to the rootfs. containerd writes a
    deletion as an overlay whiteout (`bin/.wh.cat`), CRI-O and podman list them in deleted.files;
    both end up in ContainerFacts.deleted ("/bin/cat"). An opaque folder (`.wh..wh..opq`) is kept
    in the tar only: it means "nothing of the image below this folder", not one path.
    """
    deleted: list[str] = []
    try:
        with tarfile.open(fileobj=f, mode="r|*") as tar:
            for count, info in enumerate(tar, 1):
                if count > 10 * MEMBERS_MAX:
                    raise _bad(source, f"{ROOTFS_DIFF} has more than {10 * MEMBERS_MAX} members")
                name = info.name
                if name.startswith("/") or ".." in PurePosixPath(name).parts or "\0" in name:
                    raise _bad(source, f"{ROOTFS_DIFF} member {name[:120]!r} points outside the container")
                if info.islnk():
                    target = info.linkname
                    if target.startswith("/") or ".." in PurePosixPath(target).parts:
                        raise _bad(source, f"{ROOTFS_DIFF} hard-links {name[:80]!r} outside the container")
                path = PurePosixPath("/", name)
                if path.name.startswith(_WHITEOUT) and path.name != _OPAQUE:
                    deleted.append(str(path.parent / path.name[len(_WHITEOUT) :]))
    except (tarfile.TarError, EOFError) as exc:
        raise ArchiveError(
            f"{source}: {ROOTFS_DIFF} is not a tar ({_one_line(exc)})", "the archive is damaged"
        ) from exc
    return deleted


def _one_line(exc: BaseException) -> str:
    """An exception's text as one short line (tarfile's list every compression it tried)."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:200]


def _load_image(root: Path, name: str) -> list[dict[str, Any]]:
    """Entries of one CRIU image in the bundle, parsed by pycriu; ArchiveError when it is not one."""
    path = root / bundle.IMAGES_DIR / name
    try:
        import pycriu.images
    except ImportError as exc:
        raise ArchiveError(
            "pycriu is not installed in this Python", "run `make install` (it installs CRIU and pycriu)"
        ) from exc
    try:
        size = path.stat().st_size
        if size > IMAGE_PARSE_MAX:
            raise _bad(root, f"{name} is {size} bytes, larger than CRIU writes for it")
        with path.open("rb") as f:
            entries = pycriu.images.load(f)["entries"]
    except ArchiveError:
        raise
    except Exception as exc:  # pycriu raises anything on a crafted file: magic, protobuf, struct
        raise ArchiveError(
            f"{name} in the archive is not a CRIU image pycriu can read "
            f"({type(exc).__name__}: {_one_line(exc)})",
            "the archive is damaged or was not written by CRIU; refusing it",
        ) from exc
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ArchiveError(f"{name} in the archive has no entries", "the archive is damaged")
    return entries


def _images_present(root: Path) -> set[str]:
    return {p.name for p in (root / bundle.IMAGES_DIR).iterdir()}


@dataclass
class ImageFacts:
    """What the CRIU images themselves say: the process tree, files, mounts and network."""

    processes: list[bundle.ProcessInfo]
    open_files: list[str]
    external_mounts: list[str]
    netns_external: bool


def image_facts(root: Path) -> ImageFacts:
    """Read the process tree, open files, external mounts and network namespace of the CRIU images
    under `root/images` (a bundle being imported)."""
    present = _images_present(root)
    if "pstree.img" not in present:
        raise ArchiveError(f"{root}: the archive's images have no pstree.img", "the archive is incomplete")
    files: dict[int, dict[str, Any]] = {}
    if "files.img" in present:
        files = {e.get("id", 0): e for e in _load_image(root, "files.img")}
    processes = []
    for e in _load_image(root, "pstree.img"):
        pid = int(e.get("pid", 0))
        ppid = int(e.get("ppid", 0))
        comm = ""
        if f"core-{pid}.img" in present:
            core = _load_image(root, f"core-{pid}.img")
            comm = _str((core[0].get("tc") or {}).get("comm")) if core else ""
        cwd = ""
        if f"fs-{pid}.img" in present:
            fs = _load_image(root, f"fs-{pid}.img")
            cwd = _file_name(files.get(fs[0].get("cwd_id", -1))) if fs else ""
        rss, cmdline = 0, []
        if f"pagemap-{pid}.img" in present:
            pagemap = _load_image(root, f"pagemap-{pid}.img")
            rss = sum(int(p.get("nr_pages", 0)) for p in pagemap[1:]) * _PAGE
            cmdline = _cmdline(root, pid, pagemap, present)
        # The images hold PIDs of the container's PID namespace only; the host PIDs are gone.
        processes.append(
            bundle.ProcessInfo(
                pid=pid,
                ns_pid=pid,
                ppid=ppid,
                name=comm,
                cmdline=cmdline,
                cwd=cwd,
                rss_bytes=rss,
                threads=len(e.get("threads") or [pid]),
            )
        )
    open_files = sorted({n for f in files.values() if (n := _file_name(f))})
    external: list[str] = []
    netns_external = False
    for name in sorted(present):
        if re.fullmatch(r"mountpoints-\d+\.img", name):
            for mnt in _load_image(root, name):
                key = _str(mnt.get("ext_key")) or (
                    _str(mnt.get("mountpoint")) if mnt.get("ext_mount") else ""
                )
                if key and key not in external:
                    external.append(key)
        elif re.fullmatch(r"netns-\d+\.img", name):
            netns_external = netns_external or any(_str(n.get("ext_key")) for n in _load_image(root, name))
    return ImageFacts(processes, open_files, external, netns_external)


_PE_PARENT, _PE_PRESENT = 1 << 0, 1 << 2  # CRIU's pagemap entry flags (images/pagemap.proto)
_ARGS_MAX = 64 << 10


def _cmdline(root: Path, pid: int, pagemap: list[dict[str, Any]], present: set[str]) -> list[str]:
    """A process's argv read back from its dumped memory ([] when it cannot be): the archive keeps
    no command line but the spec's, which is only PID 1's, and only before any exec.

    `mm-PID.img` says where argv lies (mm_arg_start..mm_arg_end, on the stack, always dumped); the
    pagemap lists the dumped ranges in the order their pages follow each other in `pages-ID.img`.
    """
    if f"mm-{pid}.img" not in present or not pagemap:
        return []
    mm = _load_image(root, f"mm-{pid}.img")
    if not mm:
        return []
    start, end = int(mm[0].get("mm_arg_start", 0)), int(mm[0].get("mm_arg_end", 0))
    if not 0 < end - start <= _ARGS_MAX:
        return []
    pages = root / bundle.IMAGES_DIR / f"pages-{pagemap[0].get('pages_id', -1)}.img"
    out = bytearray()
    offset = 0  # bytes into the pages file
    try:
        with pages.open("rb") as f:
            for entry in pagemap[1:]:
                flags, vaddr, n = (
                    int(entry.get("flags", 0)),
                    int(entry.get("vaddr", 0)),
                    int(entry.get("nr_pages", 0)),
                )
                if flags & _PE_PARENT or not flags & _PE_PRESENT:
                    continue
                lo, hi = max(start + len(out), vaddr), min(end, vaddr + n * _PAGE)
                if lo < hi and lo == start + len(out):
                    f.seek(offset + lo - vaddr)
                    out += f.read(hi - lo)
                offset += n * _PAGE
                if start + len(out) >= end:
                    break
    except OSError:
        return []
    if start + len(out) != end:
        return []
    return [a.decode(errors="replace") for a in bytes(out).rstrip(b"\0").split(b"\0")]


def _file_name(f: dict[str, Any] | None) -> str:
    """A files.img entry as `inspect` lists open files: a path, or "pipe:[N]", "unixsk", ..."""
    if not f:
        return ""
    kind = _str(f.get("type"))
    if kind == "REG":
        return _str((f.get("reg") or {}).get("name"))
    if kind == "PIPE":
        return f"pipe:[{(f.get('pipe') or {}).get('pipe_id', '?')}]"
    return kind.lower()


def _dump_log_facts(root: Path) -> tuple[str, str, str]:
    """(CRIU version, host, kernel) from the head of dump.log, "" for what it does not say."""
    version = host = kernel = ""
    try:
        with (root / bundle.DUMP_LOG).open("rb") as f:
            head = f.read(8192).decode(errors="replace")
    except OSError:
        return version, host, kernel
    if m := re.search(r"\) Version: (\S+)", head):
        version = m[1]
    if m := re.search(r"\) Running on (\S+) Linux (\S+)", head):
        host, kernel = m[1], m[2]
    return version, host, kernel


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
        img = image_facts(stage)
        version, host, kernel = _dump_log_facts(stage)
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
        os.rename(stage, out)
        bundle.fsync_dir(out.parent)
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


def inspect(path: Path, as_json: bool) -> int:
    """`criuctl inspect ARCHIVE`: import into the state dir, describe the bundle, remove it."""
    from rich.markup import escape

    from criuctl import render, statedir, workloads

    statedir.ensure(workloads.state_dir())  # one line, not a traceback, where it cannot be written
    key = bundle.load_key(workloads.key_path())
    started = time.monotonic()
    with imported(path, key, workloads.state_dir() / "imports") as (root, manifest):
        c = manifest.container
        assert c is not None
        if not as_json:
            pod = f"pod {c.pod_namespace}/{c.pod_name}, " if c.pod_name else ""
            render.out.print(
                escape(
                    f"{path}: kubelet/CRI checkpoint archive of container {c.name!r} ({c.id[:12]}), "
                    f"{pod}image {c.image}; imported in {time.monotonic() - started:.2f} s, "
                    f"signed by this node"
                )
            )
            render.out.print(
                escape(
                    f"external mounts: {', '.join(c.external_mounts) or 'none'}; network: "
                    f"{'the pod’s (external)' if c.netns_external else 'the node’s or none'}; rootfs diff: "
                    f"{'yes' if c.rootfs_diff else 'no'}; deleted files: {len(c.deleted)}; "
                    f"stdio pipes: {', '.join(manifest.stdio_pipes) or 'none'}"
                )
            )
        return render.inspect(root, as_json=as_json)
