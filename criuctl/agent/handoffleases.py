"""The agent's side of a handoff process (`criuctl.agent.handoff`): spawn it, read its events, lease it.

Events come on a pipe of their own (`--events-fd`), not the process's stdout: CRIU, pycriu, torch
or any library the handoff loads may print to stdout, and a stray line there must neither pass
for an event nor crash the state machine reading them. The handoff's stdout and stderr go to its
log. A line on the events pipe that is not an event is the handoff's failure (`HandoffFailed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from criuctl.agent import warmstart
from criuctl.agent.protocol import Command, Event
from criuctl.core import env
from criuctl.core.errors import CriuctlError
from criuctl_hook import durable

# one line of a handoff's stdout: {"event": Event, ...that event's fields} (`criuctl.agent.handoff`)
HandoffEvent = dict[str, Any]


class HandoffFailed(CriuctlError):
    """The handoff process reported an error, or died without a word."""

    ended = False  # the workload ended on its own while the handoff froze it (WorkloadEnded)


class HandoffLike(Protocol):
    """What the state machines need of a handoff; unit tests pass fakes that fail loudly."""

    @property
    def alive(self) -> bool: ...
    async def event(self, timeout: float | None = None) -> HandoffEvent: ...
    async def until(self, wanted: set[Event], timeout: float | None = None) -> HandoffEvent: ...
    async def send(self, command: Command) -> None: ...
    async def ask(
        self, command: Command, wanted: set[Event], timeout: float | None = None
    ) -> HandoffEvent: ...
    async def close(self) -> None: ...
    async def kill_group(self) -> None: ...


@dataclass
class _Process:
    """A started handoff process and the read end of its events pipe."""

    proc: asyncio.subprocess.Process
    events: asyncio.StreamReader
    transport: asyncio.ReadTransport


class Handoff:
    """One running `python -m criuctl.agent.handoff ROLE SPEC`; its stdin is the lease."""

    def __init__(self, started: _Process, log: Path) -> None:
        self.proc, self.events, self._transport, self.log = (
            started.proc,
            started.events,
            started.transport,
            log,
        )

    @classmethod
    async def spawn(cls, role: str, spec_json: str, folder: Path, log: Path) -> Handoff:
        """Write the spec (root-only: a source spec holds the upload ticket) and start the process:
        the warm one started ahead if there is one (`warmstart`), else a new one."""
        spec = folder / f"{role}-spec.json"
        durable.replace(spec, spec_json.encode())
        started = _WARM.take()
        if started is not None:
            assert started.proc.stdin is not None
            started.proc.stdin.write(warmstart.job_line(role, spec, log))
            await started.proc.stdin.drain()
        else:
            with log.open("ab") as out:
                started = await _start(role, str(spec), out)
        _WARM.refill()
        return cls(started, log)

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    async def event(self, timeout: float | None = None) -> HandoffEvent:
        """The next event; HandoffFailed for an error event, a line that is not an event, or a
        process that ended."""
        try:
            line = await asyncio.wait_for(self.events.readline(), timeout)
        except ValueError:  # a line longer than the reader's limit: not one of ours
            line = b"<an overlong line>"
        if not line:
            await self.proc.wait()
            raise HandoffFailed(
                f"the handoff process ended without reporting (exit {self.proc.returncode})",
                f"see {self.log}",
            )
        try:
            ev = json.loads(line)
            if not isinstance(ev, dict) or ev.get("event") not in set(Event):
                raise ValueError("not an event")
        except (ValueError, UnicodeDecodeError):
            raise HandoffFailed(
                f"the handoff process sent something that is not an event: {line[:80]!r}", f"see {self.log}"
            ) from None
        if ev["event"] == Event.ERROR:
            failed = HandoffFailed(ev["what"], ev.get("hint", ""), ev.get("detail", ""))
            failed.ended = ev.get("ended") is True
            raise failed
        return ev

    async def until(self, wanted: set[Event], timeout: float | None = None) -> HandoffEvent:
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

    async def ask(self, command: Command, wanted: set[Event], timeout: float | None = None) -> HandoffEvent:
        """Send `command` and wait for one of the events in `wanted`."""
        await self.send(command)
        return await self.until(wanted, timeout)

    async def close(self) -> None:
        """Close the lease and our ends of the pipes (the process may go on, e.g. as a supervisor)."""
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
            with contextlib.suppress(ConnectionError, BrokenPipeError):
                await self.proc.stdin.wait_closed()
        self._transport.close()
        self.events.feed_eof()

    async def kill_group(self) -> None:
        """A handoff that overran its phase's timeout: end it and everything it started (CRIU)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        await self.proc.wait()
        await self.close()


async def _start(role: str, spec: str, out: int | IO[bytes]) -> _Process:
    """Start a handoff: stdin its lease, stdout and stderr to `out` (its log), events on a pipe."""
    r, w = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "criuctl.agent.handoff",
            role,
            spec,
            "--events-fd",
            str(w),
            stdin=asyncio.subprocess.PIPE,
            stdout=out,
            stderr=out,
            pass_fds=(w,),
            start_new_session=True,  # a signal to the agent's group must not reach the workload
            env=dict(os.environ),
        )
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)  # the child's copy is the only writer: its end closes when the handoff ends
    events = asyncio.StreamReader(limit=_EVENT_MAX)
    transport, _ = await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(events), os.fdopen(r, "rb", buffering=0)
    )
    return _Process(proc, events, transport)


_EVENT_MAX = 1 << 20  # an event with a CRIU log tail is a few KiB


class _Warm:
    """At most one handoff process started ahead, waiting for its role (`criuctl.agent.warmstart`)."""

    def __init__(self) -> None:
        self.proc: _Process | None = None
        self.starting: asyncio.Task[None] | None = None

    def take(self) -> _Process | None:
        """The warm process, if one is up (one still starting is left: a cold start is no slower)."""
        started, self.proc = self.proc, None
        if started is not None and started.proc.returncode is None:
            return started
        if started is not None:
            started.transport.close()
        return None

    def refill(self) -> None:
        busy = self.starting is not None and not self.starting.done()
        if env.NO_WARM_HANDOFF.get() or self.proc is not None or busy:
            return

        async def start() -> None:
            with contextlib.suppress(OSError):
                self.proc = await _start(warmstart.WARM, warmstart.blank(), asyncio.subprocess.DEVNULL)

        self.starting = asyncio.ensure_future(start())


_WARM = _Warm()


def warm_up() -> None:
    """Start the handoff process the next migration will take (from a running event loop)."""
    _WARM.refill()
