"""A container's writable layer, carried in a bundle: the files the job wrote outside its volumes.

The overlay upperdir holds what the job changed in its image (a log in /workspace, the
DataLoader's /tmp/pymp-* folders): tarred into the bundle while the tree is frozen, so every file
CRIU saw open has the size CRIU recorded. Files the job deleted show in the upperdir as whiteouts
(0:0 character devices) and directories it replaced as opaque ones; both become the `deleted` list,
removed from the placeholder's rootfs before the tar is unpacked into it.

Unpacking happens in a child chrooted into the placeholder's rootfs: images are full of absolute
symlinks (/var/run -> /run), and followed from the host they would write into the host.
"""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
from pathlib import Path

# criuctl's own control files in a placeholder: never carried to another placeholder.
SKIP = ("run/criuctl",)


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


def apply(tar_path: Path | None, deleted: list[str], rootfs: Path) -> None:
    """Remove `deleted`, then unpack `tar_path`, inside `rootfs` (as a chroot would see it)."""
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
                        tar.extractall("/", filter="tar")
                code = 0
            except BaseException as exc:  # reported through the exit status, in the parent's words
                os.write(2, f"criuctl: cannot apply the writable layer: {exc}\n".encode())
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    if status != 0:
        raise OSError(f"applying the container's writable layer into {rootfs} failed")


def _remove(deleted: list[str]) -> None:
    for rel in deleted:
        target = "/" + rel.lstrip("/")
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target, ignore_errors=True)
        elif os.path.lexists(target):
            os.unlink(target)
