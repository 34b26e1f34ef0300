"""The source side of one migration as a state machine, without HTTP: the server drives it, tests too.

It owns a source handoff (`criuctl.agent.handoff source`), which holds the frozen tree, and moves
through `protocol.SourceState`. The seams (`spawn`, `send`, `thaw`) are parameters so that unit
tests drive it with fakes that fail loudly on any call they do not expect.

Before SENT, a failure anywhere thaws the tree (the target never had a whole bundle). From SENT on,
this class never decides: `commit`, `abort` and the lease are all requests to the handoff, which
asks the target and acts on its verdict (see `criuctl.agent.handoff`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from criuctl.agent import livesend, points, protocol, records, transfer
from criuctl.agent.handoffleases import HandoffEvent, HandoffFailed, HandoffLike
from criuctl.agent.messages import Frozen, OutgoingEvent, Transferring
from criuctl.agent.protocol import (
    INCOMPLETE,
    SOURCE_FINAL,
    Command,
    Event,
    Facts,
    Outcome,
    Point,
    SourceRecord,
    SourceSpec,
    SourceState,
    Timeouts,
    UploadAnswer,
    check_transition,
)
from criuctl.core.errors import CriuctlError
from criuctl.core.retry import Backoff
from criuctl.local import checkpoint

log = logging.getLogger("criuctl.agent")


Spawn = Callable[[SourceSpec, Path], Awaitable[HandoffLike]]
Send = Callable[[Path | transfer.Source, transfer.Counter], Awaitable[UploadAnswer]]
Say = Callable[[OutgoingEvent], Awaitable[None]]  # one event of the client's stream
# one thaw of a tree from its hold record (its handoff is gone), which the record then says
ThawFromRecord = Callable[[SourceRecord], checkpoint.Thaw]


async def thaw_until_done(attempt: Callable[[], checkpoint.Thaw], backoff_max: float) -> None:
    """Try `attempt` (in a thread) until a thaw completes: the tree already runs, what is left (its
    network lock, say) is retried with a backoff for as long as it takes."""
    backoff = Backoff(backoff_max)
    while not (await asyncio.to_thread(attempt)).complete:
        await backoff.asleep()


class SourceMachine:
    """One outgoing migration on this node."""

    def __init__(
        self,
        spec: SourceSpec,
        spawn: Spawn,
        send: Send,
        thaw: ThawFromRecord,
        timeouts: Timeouts | None = None,
    ) -> None:
        self.spec, self._spawn, self._send, self._thaw = spec, spawn, send, thaw
        self.t = timeouts or protocol.timeouts()  # read when the migration starts
        self.state = SourceState.FREEZING
        self.handoff: HandoffLike | None = None
        self.freeze_started = 0.0  # monotonic
        self.pages_seconds: float | None = None
        self.downtime: float | None = None
        self.downtime_measured = False  # a caller's commit ended it; a lease's commit only bounds it
        self.lock = asyncio.Lock()  # commit, abort and the lease never overlap
        self.lease: asyncio.Task[None] | None = None
        # after a commit: until DONE; after a thaw: until THAWED
        self.finisher: asyncio.Task[None] | None = None
        self.thaw_left: str | None = None  # THAW_INCOMPLETE: what is left
        self.client_gone = False  # set by the server when the client's event stream broke

    @property
    def id(self) -> str:
        return self.spec.migration

    @property
    def final(self) -> bool:
        return self.state in SOURCE_FINAL

    def _to(self, state: SourceState) -> None:
        self.state = check_transition(self.state, state)
        log.info("source state", extra={"id": self.id, "state": str(state)})

    # ----------------------------------------------------------------------------------- run

    async def run(self, say: Say) -> Outcome:
        """Freeze, stream the bundle to the target, and hand the tree to the target's verdict.

        With `spec.live` the stream starts as CRIU starts writing (the handoff says DUMPING): page
        images go out while the dump runs, the rest once the bundle is sealed. Nothing changes for
        the protocol: the target can restore nothing before the signed manifest, which comes last,
        and any failure before SENT thaws the tree here.
        """
        started = time.monotonic()
        counter = transfer.Counter(started=time.monotonic())
        live: livesend.Live | None = None
        job: asyncio.Future[UploadAnswer] | None = None
        try:
            self.handoff = await self._spawn(self.spec, Path(self.spec.parent))
            async with asyncio.timeout(self.t.freeze):
                frozen = await self.handoff.until({Event.DUMPING, Event.FROZEN})
                if frozen["event"] == Event.DUMPING and self.spec.live:
                    live = livesend.Live(Path(frozen["bundle"]))
                    job = asyncio.ensure_future(self._send(live, counter))
                    await points.areach(Point.SOURCE_STREAMING)
                if frozen["event"] == Event.DUMPING:
                    frozen = await self.handoff.until({Event.FROZEN})
        except HandoffFailed as exc:
            await self._stop_stream(live, job)
            self._to(SourceState.FAILED)
            return Outcome(self.state, False, exc.what, exc.hint, {"thawed": True, "ended": exc.ended})
        except TimeoutError:
            await self._stop_stream(live, job)
            return await self._failed_before_sent(
                CriuctlError("freezing took too long", f"more than {self.t.freeze:.0f} s"), kill=True
            )
        self.freeze_started = time.monotonic() - frozen["started_ago"]
        self._to(SourceState.FROZEN)
        bdir = Path(frozen["bundle"])
        counter.total = await asyncio.to_thread(transfer.stream_size, bdir)
        if live is not None:
            live.sealed.set()
        await say(
            Frozen(
                event="frozen",
                freeze_seconds=frozen["freeze_seconds"],
                bytes=counter.total,
                page_server_port=self.spec.lazy_port,
                phases=frozen.get("phases", {}),
                streamed=counter.done,
            )
        )
        await points.areach(Point.SOURCE_FROZEN)
        self._to(SourceState.SENDING)
        sending = time.monotonic()
        if job is None:
            job = asyncio.ensure_future(self._send(bdir, counter))
        try:
            while not job.done():
                await asyncio.wait([job], timeout=0.25)
                await say(Transferring(event="transfer", done=counter.done, total=counter.total))
            answer = job.result()
            if self.client_gone:  # nobody will restore or commit the target: keep the job here
                raise CriuctlError("the client went away during the transfer", "nothing was committed")
            await self.handoff.ask(Command.SENT, {Event.SENT}, self.t.handoff_settle)
        except (CriuctlError, OSError, TimeoutError) as exc:
            err = exc if isinstance(exc, CriuctlError) else CriuctlError(str(exc) or exc.__class__.__name__)
            return await self._failed_before_sent(err, kill=isinstance(exc, TimeoutError))
        self._to(SourceState.SENT)
        await points.areach(Point.SOURCE_SENT_RECORDED)
        return Outcome(
            self.state,
            True,
            facts={
                "bytes": counter.done,
                "seconds": time.monotonic() - sending,
                "target": answer,
                "started": started,
                "stream_seconds": time.monotonic() - counter.started,
            },
        )

    async def _stop_stream(
        self, live: livesend.Live | None, job: asyncio.Future[UploadAnswer] | None
    ) -> None:
        """The freeze failed while its bundle was streaming: end the stream (the target drops the
        partial bundle, which has no manifest). The sender sees `stopped` within ~10 ms; a sender
        stuck on the network is cut."""
        if live is not None:
            live.stopped.set()
        if job is not None:
            await asyncio.wait([job], timeout=self.t.handoff_settle)
            job.cancel()
            with contextlib.suppress(asyncio.CancelledError, CriuctlError, OSError):
                await job

    async def _failed_before_sent(self, exc: CriuctlError, kill: bool) -> Outcome:
        """The target never had a whole bundle: the tree runs on here."""
        thawed = await self._thaw_before_sent(kill)
        facts = Facts(thawed=thawed if thawed is not False else "unconfirmed")
        if thawed == INCOMPLETE:
            facts["left"] = self.thaw_left
        return Outcome(self.state, False, exc.what, exc.hint, facts)

    async def _thaw_before_sent(self, kill: bool) -> bool | str:
        """True once the tree runs here again; INCOMPLETE when it runs but its thaw is not complete
        (retried in the background until it is); False when it cannot be told."""
        h = self.handoff
        if h is not None and h.alive and not kill:
            with contextlib.suppress(HandoffFailed, TimeoutError):
                ev = await h.ask(Command.ABORT, {Event.THAWED, Event.THAW_INCOMPLETE}, self.t.handoff_settle)
                return await self._thawed(ev)
        if h is not None:
            await h.kill_group()  # it overran or would not answer: end it, then thaw from its record
        rec = records.read(Path(self.spec.record), SourceRecord.from_json)
        if isinstance(rec, SourceRecord) and rec.root_pid and rec.state != SourceState.SENT:
            # a handoff that died or overran: from its record
            thaw = await asyncio.to_thread(self._thaw, rec)
            if thaw.complete:
                self._to(SourceState.THAWED)
                return True
            self._incomplete(thaw.line(), functools.partial(self._thaw, rec))
            return INCOMPLETE
        return False

    async def _thawed(self, ev: HandoffEvent) -> bool | str:
        """The handoff thawed the tree (THAWED), or it runs with its thaw not complete yet: then
        the handoff retries, and says THAWED once done."""
        assert self.handoff is not None
        if ev["event"] == Event.THAWED:
            self._to(SourceState.THAWED)
            await self.handoff.close()
            return True
        self._incomplete(ev.get("left", ""), None)
        return INCOMPLETE

    def _incomplete(self, left: str, attempt: Callable[[], checkpoint.Thaw] | None) -> None:
        """THAW_INCOMPLETE, and the task that ends it: the handoff's THAWED, or `attempt` retried."""
        self._to(SourceState.THAW_INCOMPLETE)
        self.thaw_left = left
        log.error("thaw incomplete", extra={"id": self.id, "left": left})
        self.finisher = asyncio.ensure_future(self._until_thawed(attempt))

    def _incomplete_outcome(self) -> Outcome:
        return Outcome(
            self.state,
            False,
            "the job runs here again, but its thaw did not complete",
            self.thaw_left or "",
            {"thawed": INCOMPLETE, "left": self.thaw_left},
        )

    async def _until_thawed(self, attempt: Callable[[], checkpoint.Thaw] | None) -> None:
        """The handoff retries and says THAWED once done; a handoff that dies meanwhile leaves its
        record, from which this agent goes on trying (`attempt`)."""
        if attempt is None:
            assert self.handoff is not None
            try:
                await self.handoff.until({Event.THAWED})
            except HandoffFailed:
                rec = records.read(Path(self.spec.record), SourceRecord.from_json)
                if isinstance(rec, SourceRecord) and rec.state == SourceState.THAW_INCOMPLETE:
                    attempt = functools.partial(self._thaw, rec)
            finally:
                await self.handoff.close()
        if attempt is not None:
            await thaw_until_done(attempt, self.t.thaw_retry_max)
        self.thaw_left = None
        self._to(SourceState.THAWED)

    # ----------------------------------------------------------------------------------- settle

    async def commit(self) -> Outcome:
        """The client says the target runs the job: the handoff checks with the target, then ends the tree."""
        told = time.monotonic()  # the job runs on the target from here at the latest: downtime ends
        async with self.lock:
            if self.state in (SourceState.COMMITTED, SourceState.DONE):  # the lease settled it first
                return Outcome(self.state, True, facts={"downtime_seconds": self.downtime})
            if self.state != SourceState.SENT or self.handoff is None:
                return Outcome(self.state, False, f"outgoing migration {self.id} is {self.state}, not sent")
            try:
                ev = await self.handoff.ask(
                    Command.COMMIT, {Event.COMMITTED, Event.REFUSED}, self.t.source_commit
                )
            except (HandoffFailed, TimeoutError) as exc:
                return Outcome(self.state, False, f"the source handoff did not answer ({exc})")
            if ev["event"] == Event.REFUSED:
                return Outcome(
                    self.state,
                    False,
                    f"the target says the job does not run there ({ev.get('target_state')})",
                    "the source stays frozen until the target settles it",
                )
            self._committed(told)
            return Outcome(self.state, True, facts={"downtime_seconds": self.downtime, "now": True})

    def _committed(self, told: float | None = None) -> None:
        """The target runs the job (it said so): `told` is when we first heard, which ends the downtime."""
        self.downtime = (told or time.monotonic()) - self.freeze_started
        self.downtime_measured = told is not None
        self._to(SourceState.COMMITTED)
        if self.lease is not None and self.lease is not asyncio.current_task():
            self.lease.cancel()
        self.finisher = asyncio.ensure_future(self._finish())

    async def _finish(self) -> None:
        assert self.handoff is not None
        with contextlib.suppress(HandoffFailed, TimeoutError):
            ev = await self.handoff.until({Event.DONE}, self.t.pages)
            self.pages_seconds = ev.get("pages_seconds")
        await self.handoff.close()
        self._to(SourceState.DONE)

    async def abort(self) -> Outcome:
        """Abort: before SENT the tree thaws; from SENT on only if the target confirms its copy is dead."""
        return await self._ask_handoff(Command.ABORT)

    async def settle(self) -> Outcome:
        """A person declared the target down (the order is on disk beside the record): the handoff
        asks the target once more — its signed answer wins — and thaws only if it stays silent."""
        return await self._ask_handoff(Command.SETTLE)

    async def _ask_handoff(self, cmd: Command) -> Outcome:
        async with self.lock:
            if self.state == SourceState.THAW_INCOMPLETE:
                return self._incomplete_outcome()
            if self.final or self.state == SourceState.COMMITTED:
                return Outcome(self.state, self.state != SourceState.COMMITTED)
            if self.state != SourceState.SENT or self.handoff is None:
                return Outcome(self.state, False, f"outgoing migration {self.id} is {self.state}")
            try:
                ev = await self.handoff.ask(
                    cmd,
                    {Event.THAWED, Event.THAW_INCOMPLETE, Event.COMMITTED, Event.IN_DOUBT},
                    self.t.handoff_settle,
                )
            except (HandoffFailed, TimeoutError) as exc:
                return Outcome(
                    self.state,
                    False,
                    f"the source handoff did not answer ({exc})",
                    facts={"thawed": "unconfirmed"},
                )
            if ev["event"] in (Event.THAWED, Event.THAW_INCOMPLETE):
                if await self._thawed(ev) is True:
                    return Outcome(self.state, True, facts={"thawed": True})
                return self._incomplete_outcome()
            if ev["event"] == Event.COMMITTED:
                self._committed()
                return Outcome(self.state, False, "the job already runs on the target")
            return Outcome(
                self.state,
                False,
                "the target did not answer",
                "the source stays frozen and asks again",
                {"thawed": "unconfirmed"},
            )

    async def lease_loop(self, seconds: float) -> None:
        """No word from the client in time: settle with the target, asking again while it is silent."""
        await asyncio.sleep(seconds)
        backoff = Backoff(self.t.ask_backoff_max)
        while self.state == SourceState.SENT:
            out = await self.abort()
            log.warning("lease expired", extra={"id": self.id, "state": str(out.state), "what": out.what})
            if self.state == SourceState.SENT:
                await backoff.asleep()
