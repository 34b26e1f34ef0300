"""How every side of criuctl asks again: doubling waits from one second up to a named cap.

One home for the ask-with-backoff loop (a frozen source asking a silent target, a thaw retried
until it completes, a redirect or a following rank waiting for the word): the caps are named in
`criuctl.agent.protocol.Timeouts`, never written where the loop is.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field


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

    def sleep(self) -> None:
        time.sleep(self.next())

    async def asleep(self) -> None:
        await asyncio.sleep(self.next())
