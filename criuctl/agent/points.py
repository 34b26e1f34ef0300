"""Named stopping points for tests: stop the protocol at an exact instant instead of sleeping for it.

With `CRIUCTL_PAUSE_AT=client.sent` (any `protocol.Point`, comma-separated) and
`CRIUCTL_PAUSE_DIR=DIR` in its environment, a process that reaches that point writes
`DIR/<point>` (its PID) and waits until `DIR/<point>.go` exists — or until the test kills it. The
test then kills whichever party it wants, cuts a link, or lets it go on. Without the variables,
`reach` is one dictionary lookup.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from criuctl.agent.protocol import Point

ENV_PAUSE_AT = "CRIUCTL_PAUSE_AT"
ENV_PAUSE_DIR = "CRIUCTL_PAUSE_DIR"


def _armed(point: Point) -> Path | None:
    wanted = os.environ.get(ENV_PAUSE_AT)
    if not wanted or str(point) not in wanted.split(","):
        return None
    folder = Path(os.environ.get(ENV_PAUSE_DIR, "/tmp"))
    (folder / str(point)).write_text(str(os.getpid()))
    return folder / f"{point}.go"


def reach(point: Point) -> None:
    go = _armed(point)
    while go is not None and not go.exists():
        time.sleep(0.05)


async def areach(point: Point) -> None:
    go = _armed(point)
    while go is not None and not go.exists():
        await asyncio.sleep(0.05)
