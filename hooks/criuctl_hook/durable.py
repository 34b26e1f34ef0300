"""The one way criuctl replaces a file: a crash, a full disk or a second writer leaves the old file or
the new one, never half of either, and never a stray temp file.

    write a temp file with a unique name in the same folder (mode set before any byte is written)
    → fsync it → rename it over the path → fsync the folder (so the rename itself is on disk)

Every record, key, node list, mark and request criuctl writes goes through `replace`, and every
folder it moves into place through `move`; a fix to how a file is written durably is then one diff
(`tests/test_answers.py` fails on an `os.rename`, `os.replace` or `mkstemp` anywhere else). A unique
temp name matters as much as the fsyncs: two processes replacing the same file at once (two
`criuctl node add`) each write their own temp file, and one of the two whole files wins.

Here, in the hook's package, because both sides write files: the in-process hook (which runs in the
job's interpreter with only `hooks/` on its path, and never imports criuctl) and criuctl itself,
which imports it from here. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO


def fsync_dir(path: Path) -> None:
    """Put a folder's entries (files created, renamed, removed in it) on disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace(path: Path, data: bytes, mode: int = 0o600, sync: bool = True) -> None:
    """Replace `path` with `data` atomically; durably unless `sync` is False (a file whose loss in a
    power cut changes nothing, such as a test's stopping point, still must never be read half-written)."""
    replace_with(path, lambda f: f.write(data), mode, sync)


def replace_with(
    path: Path, write: Callable[[BinaryIO], object], mode: int = 0o600, sync: bool = True
) -> None:
    """`replace` for contents too large to hold twice in memory: `write` streams them into the temp
    file (`torch.save` of a training state)."""
    path = Path(path)
    tmp = _temp(path, write, mode, sync)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync:
        fsync_dir(path.parent)


def move(src: Path, dst: Path) -> None:
    """Rename `src` (a folder made whole beside it: a sealed bundle, staged files) to `dst`, and put
    the rename on disk: after a power cut the folder is at one name or the other, not lost."""
    os.rename(src, dst)
    fsync_dir(Path(dst).parent)
    if Path(src).parent != Path(dst).parent:
        fsync_dir(Path(src).parent)


def _temp(path: Path, write: Callable[[BinaryIO], object], mode: int, sync: bool) -> str:
    """A new temp file beside `path` that `write` filled (synced if `sync`); removed again on error."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


def create(path: Path, data: bytes, mode: int = 0o600) -> bool:
    """Create `path` holding `data` unless it exists (then leave it: True only if this call made it).

    For a file made once and never replaced (a signing key): two processes creating it at once
    agree on one, and a reader never sees it empty — it appears whole, by a hard link of a synced
    temp file, or not at all.
    """
    path = Path(path)
    tmp = _temp(path, lambda f: f.write(data), mode, sync=True)
    try:
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_dir(path.parent)
    return True


def replace_json(path: Path, data: Any, mode: int = 0o600) -> None:
    """`replace` with `data` as JSON (keys sorted: a record diffs cleanly)."""
    replace(path, json.dumps(data, indent=1, sort_keys=True).encode(), mode)
