"""A container's writable layer, carried in a bundle: the files the job wrote outside its volumes.

The overlay upperdir holds what the job changed in its image (a log in /workspace, the
DataLoader's /tmp/pymp-* folders): tarred into the bundle while the tree is frozen, so every file
CRIU saw open has the size CRIU recorded. Files the job deleted show in the upperdir as whiteouts
(0:0 character devices) and directories it replaced as opaque ones; both become the `deleted` list,
removed from the placeholder's rootfs before the tar is unpacked into it.

Unpacking happens in a child chrooted into the placeholder's rootfs: images are full of absolute
symlinks (/var/run -> /run), and followed from the host they would write into the host.

A tar written by a runtime (a kubelet/CRI archive's rootfs-diff.tar, from containerd) carries the
overlay's deletions in the tar itself, as AUFS-style whiteout entries: `D/.wh.NAME` (NAME was
deleted: the archive reader lists it in `deleted`) and `D/.wh..wh..opq` (D is opaque: nothing the
image had below D is left; the tar's own entries below D are its content now). No `.wh.*` entry is
ever extracted as a file; an opaque D is emptied in the rootfs before anything is unpacked.
"""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
from pathlib import Path, PurePosixPath

# criuctl's own control files in a placeholder: never carried to another placeholder.
SKIP = ("run/criuctl",)
WHITEOUT = ".wh."  # a tar entry named so is a deletion marker, never a file of the container
OPAQUE = ".wh..wh..opq"  # the marker of an opaque folder: the folder holding it


def _whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _opaque(path: str) -> bool:
    for attr in ("trusted.overlay.opaque", "user.overlay.opaque"):
        try:
            if os.getxattr(path, attr, follow_symlinks=False) == b"y":
                return True
        except OSError:
            continue
    return False


def write(upperdir: Path, out: Path) -> list[str]:
    """Tar `upperdir`'s changes into `out`; return the paths (relative) the layer deleted."""
    deleted: list[str] = []
    with tarfile.open(out, "w") as tar:
        for dirpath, dirnames, filenames in os.walk(upperdir):
            rel_dir = os.path.relpath(dirpath, upperdir)
            if rel_dir != "." and _opaque(dirpath):
                deleted.append(rel_dir)
            for name in sorted(dirnames) + sorted(filenames):
                full = os.path.join(dirpath, name)
                rel = os.path.normpath(os.path.join(rel_dir, name))
                if rel.startswith(SKIP):
                    if name in dirnames:
                        dirnames.remove(name)
                    continue
                st = os.lstat(full)
                if _whiteout(st):
                    deleted.append(rel)
                elif stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    tar.add(full, arcname=rel, recursive=False)
                # FIFOs, sockets and devices are not carried: a job recreates them, CRIU restores
                # the ones it holds open
    return deleted


# tarfile's "tar" extraction filter where this Python has it (3.11.4 and later; Debian 12's 3.11.2,
# the agent image's, has none): it refuses what a chroot already confines (absolute names, links
# out of the tree) and drops set-id bits. Without it the chroot alone keeps every entry inside.
_TAR_FILTER = {"filter": "tar"} if hasattr(tarfile, "tar_filter") else {}


def apply(tar_path: Path | None, deleted: list[str], rootfs: Path, keep_equal: bool = False) -> None:
    """Remove `deleted`, empty the tar's opaque folders, then unpack `tar_path` but its whiteout
    entries, inside `rootfs` (as a chroot would see it). `keep_equal`: a folder already there, and a
    file with the same content, are left as they are (a volume both nodes share holds the very file
    a frozen job has open: rewriting it would be a needless risk to it)."""
    with open(tar_path or os.devnull, "rb") as archive:  # opened here: its path is not visible inside
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                os.chroot(rootfs)
                os.chdir("/")
                _remove(deleted)
                if tar_path is not None:
                    with tarfile.open(fileobj=archive) as tar:
                        members = _content(tar)
                        if keep_equal:
                            members = [m for m in members if not _same(tar, m)]
                        tar.extractall("/", members=members, **_TAR_FILTER)
                code = 0
            except BaseException as exc:  # reported through the exit status, in the parent's words
                os.write(2, f"criuctl: cannot apply the writable layer: {exc}\n".encode())
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    if status != 0:
        raise OSError(f"applying the container's writable layer into {rootfs} failed")


def _same(tar: tarfile.TarFile, info: tarfile.TarInfo) -> bool:
    """Member `info` is there already: a folder, or a regular file of the same bytes (in the chroot)."""
    target = "/" + info.name.lstrip("/")
    try:
        st = os.lstat(target)
    except OSError:
        return False
    if info.isdir():
        return stat.S_ISDIR(st.st_mode)
    if not (info.isreg() and stat.S_ISREG(st.st_mode) and st.st_size == info.size):
        return False
    src = tar.extractfile(info)
    if src is None:
        return False
    with src, open(target, "rb") as have:
        while chunk := src.read(1 << 20):
            if have.read(len(chunk)) != chunk:
                return False
    return True


def _remove(deleted: list[str]) -> None:
    for rel in deleted:
        target = "/" + rel.lstrip("/")
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target, ignore_errors=True)
        elif os.path.lexists(target):
            os.unlink(target)


def _content(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    """The entries of `tar` to extract: all but the whiteouts. Every opaque folder is emptied here
    first (in the chroot), so that none of the tar's own entries below it is lost to it."""
    kept = []
    for info in tar:
        path = PurePosixPath(info.name)
        if not path.name.startswith(WHITEOUT):
            kept.append(info)
        elif path.name == OPAQUE and path.parent.parts:
            # A marker at the top would empty the whole rootfs; the overlay never marks its root
            # opaque (and `write` never records it), so one there is ignored.
            _empty("/".join(path.parent.parts))
    return kept


def _empty(rel: str) -> None:
    """Make `rel` an empty folder's place: its children removed, or itself when it is not a folder
    (a link the image had there is replaced, never followed: the tar brings the folder). criuctl's
    control files in the placeholder (`SKIP`) stay."""
    if any(rel == s or rel.startswith(s + "/") for s in SKIP):
        return
    target = "/" + rel
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(target)
        return
    for name in os.listdir(target):
        child = f"{rel}/{name}"
        if any(s == child or s.startswith(child + "/") for s in SKIP):
            _empty(child)  # is or holds criuctl's own files: emptied around them
        else:
            _remove([child])
