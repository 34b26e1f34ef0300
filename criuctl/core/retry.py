"""How every side of criuctl asks again: doubling waits from one second up to a named cap.

One home for the ask-with-backoff loop (a frozen source asking a silent target, a thaw retried
until it completes, a redirect or a following rank waiting for the word): the caps are named in
`criuctl.agent.protocol.Timeouts`, never written where the loop is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

_LOOK = 0.5  # seconds between looks at a wait's `until`


@dataclass
class Backoff:
    """Waits of `first`, 2 × `first`, … up to `cap` seconds; `sleep`/`asleep` wait the next one."""

    cap: float
    first: float = 1.0
    _next: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._next = min(self.first, self.cap)

    def next(self) -> float:
        """The next wait, in seconds (and the one after doubles, up to the cap)."""
        wait, self._next = self._next, min(self._next * 2, self.cap)
        return wait

    def sleep(self, until: Callable[[], bool] | None = None) -> None:
        """Wait the next wait, or less once `until()` holds (looked at twice a second): a loop
        asking a silent party still hears at once of what ends its asking (a settle order)."""
        for part in self._parts(until):
            if until is not None and until():
                return
            time.sleep(part)

    async def asleep(self, until: Callable[[], bool] | None = None) -> None:
        for part in self._parts(until):
            if until is not None and until():
                return
            await asyncio.sleep(part)

    def _parts(self, until: Callable[[], bool] | None) -> list[float]:
        """The next wait, whole, or cut in slices between looks at `until`."""
        wait = self.next()
        if until is None:
            return [wait]
        whole, rest = divmod(wait, _LOOK)
        return [_LOOK] * int(whole) + ([rest] if rest else [])
