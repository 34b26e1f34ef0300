"""The agent's side of a handoff process (`criuctl.agent.handoff`): spawn it, read its events, lease it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

from criuctl.errors import CriuctlError


class HandoffFailed(CriuctlError):
    """The handoff process reported an error, or died without a word."""


class Handoff:
    """One running `python -m criuctl.agent.handoff ROLE ...`; its stdin is the lease."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.proc, self.log = proc, log

    @classmethod
    async def spawn(cls, args: list[str], log: Path) -> Handoff:
        with log.open("ab") as err:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "criuctl.agent.handoff",
                *args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=err,
                start_new_session=True,  # a signal to the agent's group must not reach the workload
                env=dict(os.environ),
            )
        return cls(proc, log)

    async def event(self, timeout: float | None = None) -> dict:
        """The next event; HandoffFailed for an error event or a process that ended."""
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            await self.proc.wait()
            raise HandoffFailed(
                f"the handoff process ended without reporting (exit {self.proc.returncode})",
                f"see {self.log}",
            )
        ev = json.loads(line)
        if ev["event"] == "error":
            raise HandoffFailed(ev["what"], ev.get("hint", ""), ev.get("detail", ""))
        return ev

    async def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(ConnectionError):
            self.proc.stdin.write(command.encode() + b"\n")
            await self.proc.stdin.drain()

    async def settle(self, command: str, expect: str, timeout: float | None = None) -> dict:
        """Send `command` and wait for the event named `expect`."""
        await self.send(command)
        while True:
            ev = await self.event(timeout)
            if ev["event"] == expect:
                return ev
