"""The members of a checkpoint archive, read without trusting it: names, types, sizes, copies.

An archive is input from elsewhere, and what is made of it is read by CRIU running as root: every
member is refused, with one line, where a runtime never writes it — outside the archive (`..`,
absolute names), a link, a device file, more members than any images folder holds. A member is
never extracted by name into an existing tree: `copy_into` creates each file (O_EXCL, O_NOFOLLOW)
in a folder made for it, and counts its bytes against a budget, since a small compressed archive
can expand without bound.

Both forms a checkpoint comes in read the same way: a (compressed) tar, and the folder someone
extracted it into (where a link is refused, never followed).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any, NoReturn

from criuctl.core.errors import CriuctlError

MEMBERS_MAX = 100_000  # a CRIU images folder holds ~10 files per process
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_ZSTD_DONE = (0, -13, -15)  # finished; or SIGPIPE, SIGTERM: we stopped reading once the tar ended


class ArchiveError(CriuctlError):
    """The archive is not a checkpoint archive, is damaged, or holds something a runtime never writes."""


def bad(path: Path, what: str) -> ArchiveError:
    """The error for something no runtime writes: the archive is refused as a whole."""
    return ArchiveError(
        f"{path}: {what}",
        "a container runtime never writes that; refusing this archive (nothing was restored)",
    )


def one_line(exc: BaseException) -> str:
    """An exception's text as one short line (tarfile's list every compression it tried)."""
    lines = str(exc).strip().splitlines()
    return (lines[0] if lines else type(exc).__name__)[:200]


@dataclass
class Member:
    """One archive member, its name checked: where it goes, and how to read its bytes."""

    name: str  # normalised: no leading "./", no trailing "/"
    kind: str  # "dir" or "file"
    size: int
    open: Any  # () -> binary file object (files only)


def members(path: Path) -> Iterator[Member]:
    """Every member of the archive (or extracted folder) at `path`, checked, in archive order."""
    if not path.exists():
        raise ArchiveError(
            f"no archive at {path}", "pass a checkpoint archive (.tar) or its extracted folder"
        )
    return _dir_members(path) if path.is_dir() else _tar_members(path)


def _norm(path: Path, raw: str) -> str:
    """A member name as a plain relative path, or ArchiveError: absolute, `..`, NUL, empty."""
    shown = raw[:120]
    if "\0" in raw:
        raise bad(path, f"member {shown!r} has a NUL byte in its name")
    if raw.startswith("/"):
        raise bad(path, f"member {shown!r} has an absolute path")
    parts = [p for p in PurePosixPath(raw).parts if p != "."]
    if ".." in parts:
        raise bad(path, f"member {shown!r} points outside the archive (..)")
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
    raise bad(path, f"member {name!r} is {what}")


def _refuse_link(path: Path, name: str, what: str, target: str) -> NoReturn:
    escapes = target.startswith("/") or ".." in PurePosixPath(target).parts
    where = " outside the archive" if escapes else ""
    raise bad(path, f"member {name!r} is {what} to {target[:120]!r}{where}")


def _zstd_stream(path: Path) -> subprocess.Popen[bytes]:
    zstd = shutil.which("zstd")
    if zstd is None:
        raise ArchiveError(
            f"{path} is zstd-compressed and there is no zstd here",
            "install zstd (apt-get install zstd), or decompress it with `zstd -d` first",
        )
    return subprocess.Popen([zstd, "-dcq", "--", str(path)], stdout=subprocess.PIPE)


def _tar_members(path: Path) -> Iterator[Member]:
    """The members of a (compressed) tar, each name and type checked, in archive order.

    Random access for plain, gzip, bzip2 and xz files (skipping the data of a member not read is
    a seek for a plain tar); zstd through `zstd -dc` as a stream. Either way each member's bytes can
    be read only until the next member is asked for.
    """
    proc: subprocess.Popen[bytes] | None = None
    try:
        with path.open("rb") as f:
            zstd = f.read(4) == ZSTD_MAGIC
        if zstd:
            proc = _zstd_stream(path)
            tar = tarfile.open(fileobj=proc.stdout, mode="r|")  # noqa: SIM115 (closed below, in finally)
        else:
            tar = tarfile.open(path, mode="r:*")  # noqa: SIM115
    except tarfile.TarError as exc:
        _reap(proc)
        raise ArchiveError(
            f"{path} is not a tar archive ({one_line(exc)})", "pass a checkpoint archive"
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
                    f"{path} is damaged after {count} members ({one_line(exc)})",
                    "take or copy the archive again",
                ) from exc
            if info is None:
                break
            count += 1
            if count > MEMBERS_MAX:
                raise bad(path, f"more than {MEMBERS_MAX} members")
            name = _norm(path, info.name)
            kind = _kind(path, name or ".", info)
            if not name:
                continue  # the archive's "./" itself
            yield Member(name, kind, info.size, lambda info=info: tar.extractfile(info))
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


def _dir_members(path: Path) -> Iterator[Member]:
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
                raise bad(path, f"more than {MEMBERS_MAX} files")
            st = e.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                _refuse_link(path, name, "a symbolic link", os.readlink(e.path))
            if stat.S_ISDIR(st.st_mode):
                stack.append(name)
                yield Member(name, "dir", 0, None)
            elif stat.S_ISREG(st.st_mode):
                yield Member(name, "file", st.st_size, lambda p=e.path, n=name: _open_nofollow(path, n, p))
            else:
                what = "a device file" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "special"
                raise bad(path, f"{name!r} is {what}")


def _open_nofollow(path: Path, name: str, p: str) -> IO[bytes]:
    """A file of an extracted archive, opened only if it is still a regular file (not swapped for a
    link since the folder was listed)."""
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise bad(path, f"{name!r} cannot be opened as a plain file ({exc.strerror})") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise bad(path, f"{name!r} is no longer a regular file")
    return os.fdopen(fd, "rb")


def copy_into(root: Path, rel: str, m: Member, budget: list[int], source: Path) -> None:
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
        raise bad(source, f"member {m.name!r} appears twice") from None
    written = 0
    with os.fdopen(fd, "wb") as out, m.open() as src:
        while chunk := src.read(1 << 20):
            written += len(chunk)
            if written > m.size:
                raise bad(source, f"{m.name} holds more bytes than its header says")
            out.write(chunk)
    budget[0] -= written
