"""Named stopping points for tests: stop the protocol at an exact instant instead of sleeping for it.

A process reaches a point armed by `CRIUCTL_PAUSE_AT=client.sent` (any `protocol.Point`,
comma-separated) or listed, one per line, in the file `DIR/armed` where `CRIUCTL_PAUSE_DIR=DIR` (a
test re-arms that file between cases without restarting anything). It writes `DIR/<point>` (its
PID) and waits until `DIR/<point>.go` exists — or until the test kills it. The test then kills
whichever party it wants, cuts a link, or lets it go on. With neither variable set, `reach` is two
dictionary lookups.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from criuctl.agent.protocol import Point
from criuctl.core import env
from criuctl_hook import durable

ARMED = "armed"


def _armed(point: Point) -> Path | None:
    wanted, folder = env.PAUSE_AT.get(), env.PAUSE_DIR.get()
    if not wanted and not folder:
        return None
    armed = set(wanted.split(","))
    if folder:
        with contextlib.suppress(OSError):
            armed |= set((folder / ARMED).read_text().split())
    if str(point) not in armed:
        return None
    here = folder or Path("/tmp")
    # whole or absent: a test that sees the file reads the PID, never an empty file being written
    durable.replace(here / str(point), str(os.getpid()).encode(), 0o644, sync=False)
    return here / f"{point}.go"


def reach(point: Point) -> None:
    go = _armed(point)
    while go is not None and not go.exists():
        time.sleep(0.05)


async def areach(point: Point) -> None:
    import asyncio  # here: handoffs, which start on a migration's clock, never wait asynchronously

    go = _armed(point)
    while go is not None and not go.exists():
        await asyncio.sleep(0.05)
