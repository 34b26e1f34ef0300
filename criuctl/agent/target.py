"""The target side of one migration as a state machine, without HTTP: the server drives it, tests too.

Every transition is written to the migration's record (`protocol.TargetRecord`) before it is acted
on; the record outlives the migration as a tombstone, so a source that asks late — after this
agent restarted, or after the entry was pruned — still gets the true verdict. The target handoff
writes the transitions it makes itself (RESTORED, RUNNING, ABORTED).

`verdict` is the one question a source may ask: abort unless the job runs here. A copy that has
never run is killed; a copy that runs (or ran) is never touched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from pathlib import Path

from criuctl.agent import points, protocol, records, verdicts
from criuctl.agent.handoffleases import HandoffFailed, HandoffLike
from criuctl.agent.protocol import (
    TARGET_FINAL,
    Command,
    Event,
    Mode,
    Outcome,
    Point,
    TargetRecord,
    TargetSpec,
    TargetState,
    Timeouts,
    Verdict,
    check_transition,
)
from criuctl.agent.tickets import SignedState, signed_state
from criuctl.container import placeholder
from criuctl.core import procinfo
from criuctl.core.errors import CriuctlError
from criuctl.format import bundle
from criuctl.net import directpages, pagetls
from criuctl_hook import durable

log = logging.getLogger("criuctl.agent")

Spawn = Callable[[TargetSpec, Path], Awaitable[HandoffLike]]
Vouch = Callable[[], Awaitable[bundle.Vouched | None]]  # the pages this node's page server received
# stream into a folder, verify (with what vouches for pages that came straight), return the digests
Receive = Callable[[Path, Vouch], Awaitable[dict[str, str]]]
VOUCHED = "vouched.json"  # beside the bundle: what this node's page server received, for the restore


class TargetMachine:
    """One incoming migration on this node: `dir` (in the spool) holds the bundle, `record_path` (in
    the state dir, on disk: it must outlive a reboot that empties a tmpfs spool) the record."""

    def __init__(
        self,
        rec: TargetRecord,
        folder: Path,
        record_path: Path,
        spawn: Spawn,
        timeouts: Timeouts | None = None,
    ) -> None:
        self.rec, self.dir, self.record_path, self._spawn = rec, folder, record_path, spawn
        self.t = timeouts or protocol.timeouts()  # read when the migration starts
        self.handoff: HandoffLike | None = None
        self.lock = asyncio.Lock()  # receive-done, restore, commit and abort never overlap
        # the images removed after a commit, in the background
        self.cleanup: asyncio.Future[None] | None = None
        self.pages: directpages.Session | None = None  # stop-and-copy straight into this node's page server
        self.vouched: bundle.Vouched | None = None  # what that page server received, once it ended

    @property
    def id(self) -> str:
        return self.rec.migration

    @property
    def state(self) -> TargetState:
        return self.rec.state

    @property
    def bundle_dir(self) -> Path:
        return self.dir / "bundle"

    def answer(self, nonce: str = "") -> SignedState:
        """This migration's state as the source may act on it: signed with this migration's key over
        the question's nonce, with this node's boot (a source's question is answered by what is true
        now, on this boot)."""
        return signed_state(self.rec.sign_key, self.id, str(self.state), procinfo.boot_id(), nonce)

    def _write(self, state: TargetState) -> None:
        self.rec.state = check_transition(self.rec.state, state)
        self.rec.updated = time.time()
        self.rec.history.append(f"{state}@{self.rec.updated:.3f}")
        records.write(self.record_path, self.rec.to_json())
        log.info("target state", extra={"id": self.id, "state": str(state)})

    def _reload(self) -> None:
        """The handoff advanced the record itself: read what it wrote."""
        rec = records.read(self.record_path, TargetRecord.from_json)
        if isinstance(rec, TargetRecord):
            self.rec = rec

    @classmethod
    def create(
        cls,
        migration: str,
        workload: str,
        mode: Mode,
        proof_key: str,
        spool: Path,
        records_dir: Path,
        spawn: Spawn,
        timeouts: Timeouts | None = None,
        placeholder: str | None = None,
        runtime: str | None = None,
        sign_key: str = "",
        source: str | None = None,
        seal_key: str = "",
    ) -> TargetMachine:
        rec = TargetRecord(
            migration,
            workload,
            str(mode),
            TargetState.NEW,
            proof_key,
            procinfo.boot_id(),
            updated=time.time(),
            history=[f"new@{time.time():.3f}"],
            placeholder=placeholder,
            runtime=runtime,
            sign_key=sign_key,
            source=source,
            seal_key=seal_key,
        )
        m = cls(rec, spool / migration, records_dir / f"{migration}.json", spawn, timeouts)
        m.dir.mkdir(mode=0o700)
        records.write(m.record_path, rec.to_json())
        return m

    # ----------------------------------------------------------------------------------- steps

    async def open_pages(self, source_cert: object) -> tuple[int, str]:
        """A page session with this migration's source, before anything is frozen: (the port of
        this node's page server, 0 for post-copy; this end's certificate). Stop-and-copy straight
        to this node: a page server for the source alone waits for the dump's pages
        (`criuctl.net.directpages`). Post-copy: this node's lazy-pages daemon will pull them from
        the source's page server over CRIU's TLS, each end pinning the other's certificate
        (`_pull_tls`, which the restore hands its handoff)."""
        if self.rec.mode == Mode.POST_COPY:
            return 0, await self._pull_identity(source_cert)
        async with self.lock:
            if self.state != TargetState.NEW or self.pages is not None:
                raise CriuctlError(
                    f"migration {self.id} ({self.rec.mode}, {self.state}) takes no page session now",
                    "a page session is opened once, before a stop-and-copy's bundle comes",
                )
            session = await asyncio.to_thread(
                directpages.Session,
                self.dir / "pages",
                self.bundle_dir / bundle.IMAGES_DIR,
                source_cert,
                self.t.freeze,
            )
            session.start(self.t.freeze + self.t.stall)
            self.pages = session
        await points.areach(Point.TARGET_PAGES_OPEN)
        return session.port, session.identity.pem

    async def _pull_identity(self, source_cert: object) -> str:
        async with self.lock:
            folder = self.dir / "pages"
            if self.state != TargetState.NEW or (folder / "source.crt").exists():
                raise CriuctlError(
                    f"migration {self.id} ({self.rec.mode}, {self.state}) takes no page session now",
                    "a page session is opened once, before anything is frozen",
                )
            mine = await asyncio.to_thread(pagetls.make_identity, folder, "target")
            await asyncio.to_thread(pagetls.pin, folder, "source", source_cert)
        await points.areach(Point.TARGET_PAGES_OPEN)
        return mine.pem

    def _pull_tls(self) -> dict[str, str] | None:
        """Post-copy's TLS for the restore's lazy-pages daemon: this end's pair and the source's
        certificate; None where the source opened no page session (agents under `--insecure`)."""
        folder = self.dir / "pages"
        paths = {
            "peer_cert": folder / "source.crt",
            "cert": folder / "target.crt",
            "key": folder / "target.key",
        }
        if self.rec.mode != Mode.POST_COPY or not all(p.exists() for p in paths.values()):
            return None
        return {k: str(v) for k, v in paths.items()}

    async def _vouch(self) -> bundle.Vouched | None:
        """The page server's word for the pages it wrote, which the bundle's verification asks
        for; kept on the machine for the restore handoff."""
        if self.pages is not None:
            self.vouched = await asyncio.to_thread(self.pages.vouched, self.t.stall)
        return self.vouched

    def close_pages(self) -> None:
        if self.pages is not None:
            self.pages.close()

    async def receive(self, receive: Receive) -> Outcome:
        async with self.lock:
            if self.state != TargetState.NEW:
                return Outcome(self.state, False, f"migration {self.id} already has a bundle ({self.state})")
            await asyncio.to_thread(self._write, TargetState.RECEIVING)
        try:
            digests = await receive(self.bundle_dir, self._vouch)
        except (CriuctlError, OSError) as exc:
            self.close_pages()
            await asyncio.to_thread(shutil.rmtree, self.bundle_dir, True)  # first: the disk may be full
            async with self.lock:
                if self.state == TargetState.RECEIVING:
                    await asyncio.to_thread(self._write, TargetState.FAILED)
            raise exc
        async with self.lock:
            if self.state != TargetState.RECEIVING:  # aborted while the bytes came in
                return Outcome(self.state, False, f"migration {self.id} was {self.state} meanwhile")
            await asyncio.to_thread(durable.replace_json, self.dir / "digests.json", digests)
            if self.vouched is not None:
                await asyncio.to_thread(durable.replace_json, self.dir / VOUCHED, asdict(self.vouched))
            await asyncio.to_thread(self._write, TargetState.RECEIVED)
        await points.areach(Point.TARGET_RECEIVED)
        return Outcome(self.state, True)

    async def restore(self, page_server: str | None, node: str) -> Outcome:
        async with self.lock:
            if self.state != TargetState.RECEIVED:
                return Outcome(self.state, False, f"migration {self.id} is {self.state}, not received")
            await asyncio.to_thread(self._write, TargetState.RESTORING)
            digests = json.loads((self.dir / "digests.json").read_text())
            vouched_path = self.dir / VOUCHED
            vouched = json.loads(vouched_path.read_text()) if vouched_path.exists() else None
            follow = self.rec.follow.to_json() if self.rec.follow else None
            spec = TargetSpec(
                self.id,
                str(self.bundle_dir),
                node,
                str(self.record_path),
                self.rec.workload,
                page_server,
                digests,
                self.rec.placeholder,
                self.rec.runtime,
                follow,
                vouched=vouched,
                page_tls=self._pull_tls(),
            )
            t0 = time.monotonic()
            try:
                self.handoff = await self._spawn(spec, self.dir)
                ev = await self.handoff.until({Event.RESTORED}, self.t.restore)
            except (HandoffFailed, TimeoutError) as exc:
                if self.handoff is not None:
                    await self.handoff.kill_group()
                self._reload()
                if self.state in (TargetState.RESTORING, TargetState.RESTORED):
                    await asyncio.to_thread(self._write, TargetState.FAILED)
                what = exc.what if isinstance(exc, HandoffFailed) else "the restore took too long"
                return Outcome(self.state, False, what, getattr(exc, "hint", ""))
            self._reload()
        phases = {**ev.get("phases", {}), "handoff": time.monotonic() - t0}
        return Outcome(
            self.state, True, facts={"pid": ev["pid"], "criu_seconds": ev["criu_seconds"], "phases": phases}
        )

    async def commit(self) -> Outcome:
        async with self.lock:
            out, now = await self._commit_locked()
        if now:
            await points.areach(Point.TARGET_RUNNING)
        return out

    async def _commit_locked(self) -> tuple[Outcome, bool]:
        """Let the restored tree run; (the outcome, whether this call made it run)."""
        self._reload()
        if self.state == TargetState.RUNNING:
            return Outcome(self.state, True), False
        if self.state != TargetState.RESTORED or self.handoff is None:
            return Outcome(self.state, False, f"migration {self.id} is {self.state}, not restored"), False
        try:
            ev = await self.handoff.ask(Command.COMMIT, {Event.RUNNING}, self.t.target_commit)
        except (HandoffFailed, TimeoutError) as exc:
            self._reload()  # RUNNING is written before the tree runs: the record says what happened
            return Outcome(self.state, self.state == TargetState.RUNNING, f"commit failed: {exc}"), False
        self._reload()
        await self.handoff.close()
        if self.rec.mode != Mode.POST_COPY:  # post-copy: the lazy-pages daemon still reads the images
            # after the answer, not before: deleting GiBs of images took 0.3 s of every downtime
            self.cleanup = asyncio.ensure_future(asyncio.to_thread(shutil.rmtree, self.bundle_dir, True))
        return Outcome(self.state, True, facts={"pid": ev["pid"], "phases": ev.get("phases", {})}), True

    async def verdict(self) -> Verdict:
        """Abort unless the job runs here; the answer a source acts on.

        A rank that follows another (`TargetRecord.follow`) and waits restored is not this agent's
        to abort alone: the client commits the first moved rank of a job first, so that one running
        means the whole move was decided — this rank runs too — and that one undecided means ask
        again (the ranks' connections already point at each other's new nodes).
        """
        async with self.lock:
            self._reload()
            if self.state == TargetState.RUNNING:
                return Verdict.RUNNING
            self.close_pages()  # a page server still waiting for this migration's dump takes nothing more
            h = self.handoff
            if (
                self.rec.follow is not None
                and self.state == TargetState.RESTORED
                and h is not None
                and h.alive
            ):
                leader = await asyncio.to_thread(verdicts.ask_state, self.rec.follow)
                if leader == TargetState.RUNNING:
                    out, _ = await self._commit_locked()
                    return Verdict.RUNNING if out.ok else Verdict.UNKNOWN
                if leader not in (TargetState.ABORTED, TargetState.FAILED):
                    return Verdict.UNKNOWN
            if h is not None and h.alive:
                try:
                    await h.ask(Command.ABORT, {Event.ABORTED}, self.t.handoff_settle)
                except (HandoffFailed, TimeoutError):
                    await h.kill_group()
                await h.close()
                self._reload()
            if self.state == TargetState.RUNNING:
                return Verdict.RUNNING
            if (
                h is None
                and self.state not in (TargetState.ABORTED, TargetState.FAILED)
                and self._handoff_lives()
            ):
                return Verdict.UNKNOWN  # a handoff of a previous agent still settles it: ask again soon
            if not await asyncio.to_thread(self._copy_dead):
                return Verdict.UNKNOWN
            await asyncio.to_thread(shutil.rmtree, self.dir, True)  # first: the disk may be full
            if self.state != TargetState.ABORTED:
                await asyncio.to_thread(self._write, TargetState.ABORTED)
        return Verdict.ABORTED

    def _copy_dead(self) -> bool:
        """Kill a restored copy that never ran (its handoff is gone); True once none is left.

        Only the very processes the record names: a PID handed out again since (the copy ended,
        the node rebooted) belongs to someone else and is left alone."""
        if self.state not in (TargetState.RESTORED, TargetState.RESTORING):
            return True
        tree = self.rec.tree()
        if tree and tree.alive():
            procinfo.kill_tree(tree.pid)
            deadline = time.monotonic() + 10
            while tree.alive():
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
        # The copy may be dead already (ended with its handoff, or a zombie nobody reaped yet):
        # the placeholder still waits to hear, whoever ended the copy.
        ph = self.rec.placeholder_init()
        if ph and ph.alive():
            placeholder.tell_pid(ph.pid, "aborted: the agent restarted first")
        return True

    def _handoff_lives(self) -> bool:
        """The record's handoff process (of this agent or a previous one) is still there."""
        h = self.rec.handoff()
        return h is not None and h.alive()

    # ----------------------------------------------------------------------------------- restart

    def recover(self) -> None:
        """After an agent restart: settle a record whose handoff is gone (level-triggered, idempotent).

        RUNNING stays RUNNING (the job runs, or ran and died with its node: either way the source
        must end). Anything short of RUNNING whose handoff is gone has never run: its copy is killed
        and the record says ABORTED, which is what the source will hear.
        """
        if self.state in TARGET_FINAL:
            return
        if self._handoff_lives():
            return  # its lease broke: it kills its copy and writes ABORTED itself (or RUNNING, if told)
        if self._copy_dead():
            self._write(TargetState.ABORTED)
            shutil.rmtree(self.dir, ignore_errors=True)
