"""The one way criuctl replaces a file: a crash, a full disk or a second writer leaves the old file or
the new one, never half of either, and never a stray temp file.

    write a temp file with a unique name in the same folder (mode set before any byte is written)
    → fsync it → rename it over the path → fsync the folder (so the rename itself is on disk)

Every record, key, node list, mark and request criuctl writes goes through `replace`; a fix to how
a file is written durably is then one diff. A unique temp name matters as much as the fsyncs: two
processes replacing the same file at once (two `criuctl node add`) each write their own temp file,
and one of the two whole files wins. Standard library only: the `migrator` API inside user scripts
and the agent's records use it alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


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
    path = Path(path)
    tmp = _temp(path, data, mode, sync)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if sync:
        fsync_dir(path.parent)


def _temp(path: Path, data: bytes, mode: int, sync: bool) -> str:
    """A new temp file beside `path` holding `data` (synced if `sync`); removed again on error."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
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
    tmp = _temp(path, data, mode, sync=True)
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
