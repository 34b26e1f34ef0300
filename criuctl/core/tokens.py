"""The bearer-token file rule, one place for both ends: the agent that reads its token file, and
`criuctl node add`, which must refuse a file the agent would refuse (or a user learns of it only
when a migration fails).

A token is a shared secret that lets its holder freeze, move and read every workload on a node,
so its file must be readable by its owner only, and the token long enough not to be guessed.
Standard library only: nothing here talks to an agent.
"""

from __future__ import annotations

from pathlib import Path

from criuctl.core.errors import CriuctlError

MIN_CHARS = 16


class BadTokenFile(CriuctlError):
    """The token file is missing, unreadable, readable by others, or holds too short a token."""

    exit_code = 2


def read_token(path: Path) -> str:
    """The bearer token, from a file nobody but its owner may read."""
    try:
        st = path.stat()
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not text"
        raise BadTokenFile(f"cannot read token file {path}: {why}", "create it with `chmod 600`") from exc
    if st.st_mode & 0o077:
        raise BadTokenFile(
            f"token file {path} is readable by others (mode {st.st_mode & 0o777:o})", f"chmod 600 {path}"
        )
    if len(token) < MIN_CHARS:
        raise BadTokenFile(
            f"token in {path} is too short ({len(token)} characters)",
            f"use at least {MIN_CHARS} random characters, e.g. `openssl rand -hex 32 > {path}`",
        )
    return token
