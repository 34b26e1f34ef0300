"""Where criuctl keeps its state on this node, and the check that it can be a folder there.

Standard library only: `criuctl` checks the state dir before any verb runs, and some verbs must
still be able to say "needs root" on a machine without criuctl's dependencies
(`workloads` imports psutil). `workloads` re-exports these names; import them from there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from criuctl.core.errors import CriuctlError

ENV_STATE_DIR = "CRIUCTL_STATE_DIR"
DEFAULT_STATE_DIR = Path("/var/lib/criuctl")


def state_dir() -> Path:
    return Path(os.environ.get(ENV_STATE_DIR) or DEFAULT_STATE_DIR)


class StateDirError(CriuctlError):
    """The state dir cannot be a folder: it, or a folder above it, is a file; or it is not ours
    to write."""


def check_state_dir() -> None:
    """Refuse a state dir that names a file (or lies under one) before any verb touches it."""
    d = state_dir()
    for p in (d, *d.parents):
        try:
            mode = os.stat(p).st_mode
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet (it is created), or under a file (found further up)
        except OSError:
            return  # cannot look (not root): the verb itself says what it needs
        if not stat.S_ISDIR(mode):
            where = "is a file" if p == d else f"lies under {p}, which is a file"
            raise StateDirError(
                f"the state dir {d} {where}",
                "pass --state-dir a folder (it is created if missing), or set CRIUCTL_STATE_DIR",
            )
        return


def ensure(d: Path) -> Path:
    """`d` as a root-only folder; one error line when it cannot be."""
    try:
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise StateDirError(
            f"cannot create {d}: {exc.strerror}",
            "pass --state-dir (or CRIUCTL_STATE_DIR) a folder root can write",
        ) from exc
    return d
