"""The agent's side of a handoff process (`criuctl.agent.handoff`): spawn it, read its events, lease it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import IO, Protocol

from criuctl import durable
from criuctl.agent import warmstart
from criuctl.agent.protocol import Command, Event
from criuctl.errors import CriuctlError


class HandoffFailed(CriuctlError):
    """The handoff process reported an error, or died without a word."""


class HandoffLike(Protocol):
    """What the state machines need of a handoff; unit tests pass fakes that fail loudly."""

    @property
    def alive(self) -> bool: ...
    async def event(self, timeout: float | None = None) -> dict: ...
    async def until(self, wanted: set[Event], timeout: float | None = None) -> dict: ...
    async def send(self, command: Command) -> None: ...
    async def ask(self, command: Command, wanted: set[Event], timeout: float | None = None) -> dict: ...
    async def close(self) -> None: ...
    async def kill_group(self) -> None: ...


class Handoff:
    """One running `python -m criuctl.agent.handoff ROLE SPEC`; its stdin is the lease."""

    def __init__(self, proc: asyncio.subprocess.Process, log: Path) -> None:
        self.proc, self.log = proc, log

    @classmethod
    async def spawn(cls, role: str, spec_json: str, folder: Path, log: Path) -> Handoff:
        """Write the spec (root-only: a source spec holds the upload ticket) and start the process:
        the warm one started ahead if there is one (`warmstart`), else a new one."""
        spec = folder / f"{role}-spec.json"
        durable.replace(spec, spec_json.encode())
        proc = _WARM.take()
        if proc is not None:
            assert proc.stdin is not None
            proc.stdin.write(warmstart.job_line(role, spec, log))
            await proc.stdin.drain()
        else:
            with log.open("ab") as err:
                proc = await _start(role, str(spec), err)
        _WARM.refill()
        return cls(proc, log)

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

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
        if ev["event"] == Event.ERROR:
            raise HandoffFailed(ev["what"], ev.get("hint", ""), ev.get("detail", ""))
        return ev

    async def until(self, wanted: set[Event], timeout: float | None = None) -> dict:
        """Events until one named in `wanted` (all within `timeout`)."""
        async with asyncio.timeout(timeout):
            while True:
                ev = await self.event()
                if ev["event"] in wanted:
                    return ev

    async def send(self, command: Command) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(ConnectionError, RuntimeError):
            self.proc.stdin.write(f"{command}\n".encode())
            await self.proc.stdin.drain()

    async def ask(self, command: Command, wanted: set[Event], timeout: float | None = None) -> dict:
        """Send `command` and wait for one of the events in `wanted`."""
        await self.send(command)
        return await self.until(wanted, timeout)

    async def close(self) -> None:
        """Close the lease and our ends of the pipes (the process may go on, e.g. as a supervisor)."""
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
            with contextlib.suppress(ConnectionError, BrokenPipeError):
                await self.proc.stdin.wait_closed()
        if self.proc.stdout is not None:
            self.proc.stdout.feed_eof()

    async def kill_group(self) -> None:
        """A handoff that overran its phase's timeout: end it and everything it started (CRIU)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()
        await self.close()


async def _start(role: str, spec: str, stderr: int | IO[bytes]) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "criuctl.agent.handoff", role, spec,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=stderr,
        start_new_session=True,  # a signal to the agent's group must not reach the workload
        env=dict(os.environ),
    )  # fmt: skip


ENV_NO_WARM = "CRIUCTL_NO_WARM_HANDOFF"  # set: every handoff starts cold (for comparisons)


class _Warm:
    """At most one handoff process started ahead, waiting for its role (`criuctl.agent.warmstart`)."""

    def __init__(self) -> None:
        self.proc: asyncio.subprocess.Process | None = None
        self.starting: asyncio.Task | None = None

    def take(self) -> asyncio.subprocess.Process | None:
        """The warm process, if one is up (one still starting is left: a cold start is no slower)."""
        proc, self.proc = self.proc, None
        return proc if proc is not None and proc.returncode is None else None

    def refill(self) -> None:
        busy = self.starting is not None and not self.starting.done()
        if os.environ.get(ENV_NO_WARM) or self.proc is not None or busy:
            return

        async def start() -> None:
            with contextlib.suppress(OSError):
                self.proc = await _start(warmstart.WARM, warmstart.blank(), asyncio.subprocess.DEVNULL)

        self.starting = asyncio.ensure_future(start())


_WARM = _Warm()


def warm_up() -> None:
    """Start the handoff process the next migration will take (from a running event loop)."""
    _WARM.refill()
