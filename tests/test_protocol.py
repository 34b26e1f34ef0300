"""The migration protocol without CRIU or HTTP: the tables, both state machines, the source handoff's rule.

The machines are driven with `ScriptedHandoff`, a fake that knows the exact calls it expects, in
order, and fails the test on any other — so a machine that thaws, commits or asks when it should
not cannot pass by accident.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from criuctl.agent import handoff as handoff_mod
from criuctl.agent import livesend, records, tickets
from criuctl.agent.handoffleases import HandoffFailed
from criuctl.agent.protocol import (
    SOURCE_FINAL,
    SOURCE_TRANSITIONS,
    TARGET_TRANSITIONS,
    BadTransition,
    Command,
    Event,
    Mode,
    SourceRecord,
    SourceSpec,
    SourceState,
    TargetRecord,
    TargetState,
    Ticket,
    Timeouts,
    Verdict,
    check_transition,
)
from criuctl.agent.source import SourceMachine
from criuctl.agent.target import TargetMachine
from criuctl.core.env import PAUSE_AT, PAUSE_DIR
from criuctl.local.checkpoint import Thaw

TICKET = Ticket("http://10.0.0.3:7070", "f" * 32, "secret-secret-secret", "b")
FAST = Timeouts(freeze=2, restore=2, handoff_settle=2, target_commit=2, source_commit=2, pages=2)


class ScriptedHandoff:
    """Answers exactly the calls in `script` (("until"|"ask", wanted-or-command, reply)), in order."""

    def __init__(self, script: list[tuple], on_reply=None) -> None:
        self.script, self.alive, self.killed, self.closed = list(script), True, False, False
        self.on_reply = on_reply or (lambda ev: None)

    def _next(self, kind: str, arg: object) -> dict:
        assert self.script, f"unexpected call {kind}({arg}): the script is over"
        want_kind, want_arg, reply = self.script.pop(0)
        assert (kind, arg) == (want_kind, want_arg), f"expected {want_kind}({want_arg}), got {kind}({arg})"
        if isinstance(reply, BaseException):
            raise reply
        self.on_reply(reply)
        return reply

    async def event(self, timeout: float | None = None) -> dict:
        raise AssertionError("event() must not be called")

    async def until(self, wanted: set[Event], timeout: float | None = None) -> dict:
        return self._next("until", frozenset(wanted))

    async def send(self, command: Command) -> None:
        raise AssertionError(f"send({command}) must not be called: use ask")

    async def ask(self, command: Command, wanted: set[Event], timeout: float | None = None) -> dict:
        return self._next("ask", command)

    async def close(self) -> None:
        self.closed = True

    async def kill_group(self) -> None:
        self.killed, self.alive = True, False

    def done(self) -> None:
        assert not self.script, f"calls never made: {self.script}"


# ------------------------------------------------------------------------------------------ tables


def test_tables_cover_every_state_and_finals_are_dead_ends():
    assert set(SOURCE_TRANSITIONS) == set(SourceState)
    assert set(TARGET_TRANSITIONS) == set(TargetState)
    for s in SOURCE_FINAL:
        assert not SOURCE_TRANSITIONS[s]
    # the rule: from SENT the source can only end or thaw (on the target's word); a running target stays
    assert SOURCE_TRANSITIONS[SourceState.SENT] == {
        SourceState.COMMITTED,
        SourceState.THAWED,
        SourceState.THAW_INCOMPLETE,
    }
    assert not TARGET_TRANSITIONS[TargetState.RUNNING]
    assert TargetState.ABORTED not in TARGET_TRANSITIONS[TargetState.RUNNING]
    with pytest.raises(BadTransition):
        check_transition(SourceState.SENT, SourceState.FROZEN)
    with pytest.raises(BadTransition):
        check_transition(TargetState.RUNNING, TargetState.ABORTED)
    assert check_transition(TargetState.RESTORED, TargetState.RUNNING) == TargetState.RUNNING


def test_records_are_atomic_and_a_torn_one_is_reported_not_raised(tmp_path):
    path = tmp_path / "m.json"
    rec = SourceRecord("m", "w", "stop-and-copy", SourceState.SENT, TICKET, 1, "boot", root_pid=5)
    records.write(path, rec.to_json())
    assert records.read(path, SourceRecord.from_json) == rec
    path.write_text('{"migration": "m", "state": "sen')  # torn
    bad = records.read(path, SourceRecord.from_json)
    assert isinstance(bad, records.Unreadable) and "JSONDecodeError" in bad.why
    path.write_text('{"migration": "m", "state": "no-such-state", "ticket": {}}')
    assert isinstance(records.read(path, SourceRecord.from_json), records.Unreadable)
    (tmp_path / ".m.json.tmp123").write_text("half")  # a temp file of a write that died
    assert [p.name for p, _ in records.scan(tmp_path, "*.json", SourceRecord.from_json)] == ["m.json"]
    assert records.read(tmp_path / "none.json", SourceRecord.from_json) is None


# ------------------------------------------------------------------------------------------ source


def _source(tmp_path: Path, h: ScriptedHandoff, send=None, thawed: list | None = None) -> SourceMachine:
    spec = SourceSpec("a" * 32, "w", "stop-and-copy", str(tmp_path / "rec.json"), str(tmp_path), "b", TICKET)
    bundle = tmp_path / "bundle"
    bundle.mkdir(exist_ok=True)
    (bundle / "manifest.json").write_text("{}")

    async def spawn(_spec, _folder):
        return h

    async def ok_send(_bdir, counter):
        counter.done = 7
        return {"bytes": 7}

    def thaw(rec: SourceRecord) -> Thaw:
        (thawed if thawed is not None else []).append(rec.root_pid)
        return Thaw()

    return SourceMachine(spec, spawn, send or ok_send, thaw, FAST)


FROZEN = {"event": "frozen", "bundle": "", "freeze_seconds": 0.1, "started_ago": 0.1}
FIRST = frozenset({Event.DUMPING, Event.FROZEN})  # a source waits for either: the stream may start early


async def _quiet_say(*_a, **_k) -> None:
    return None


def test_source_happy_path_commits_only_through_the_handoff(tmp_path):
    async def go():
        h = ScriptedHandoff(
            [
                ("until", FIRST, {**FROZEN, "bundle": str(tmp_path / "bundle")}),
                ("ask", Command.SENT, {"event": "sent"}),
                ("ask", Command.COMMIT, {"event": "committed"}),
                ("until", frozenset({Event.DONE}), {"event": "done", "pages_seconds": 0.0}),
            ]
        )
        m = _source(tmp_path, h)
        out = await m.run(_quiet_say)
        assert out.ok and m.state == SourceState.SENT and out.facts["bytes"] == 7
        out = await m.commit()
        assert out.ok and m.state == SourceState.COMMITTED and out.facts["downtime_seconds"] > 0
        await m.finisher
        assert m.state == SourceState.DONE and h.closed
        h.done()

    asyncio.run(go())


def test_source_streams_while_the_handoff_dumps_and_seals_the_stream_at_frozen(tmp_path):
    """DUMPING starts the send with a live source at once; FROZEN seals it; SENT only after both."""

    async def go():
        seen: list = []
        sealed_before_frozen: list[bool] = []

        async def live_send(source, counter):
            seen.append(source)
            sealed_before_frozen.append(source.sealed.is_set())
            await asyncio.to_thread(source.sealed.wait, 5)
            counter.done = 9
            return {"bytes": 9}

        h = ScriptedHandoff(
            [
                ("until", FIRST, {"event": "dumping", "bundle": str(tmp_path / "bundle")}),
                ("until", frozenset({Event.FROZEN}), {**FROZEN, "bundle": str(tmp_path / "bundle")}),
                ("ask", Command.SENT, {"event": "sent"}),
            ]
        )
        m = _source(tmp_path, h, send=live_send)
        out = await m.run(_quiet_say)
        assert out.ok and m.state == SourceState.SENT and out.facts["bytes"] == 9
        assert isinstance(seen[0], livesend.Live) and seen[0].root == tmp_path / "bundle"
        assert sealed_before_frozen == [False] and seen[0].sealed.is_set()
        h.done()

    asyncio.run(go())


def test_a_freeze_that_fails_while_streaming_ends_the_stream(tmp_path):
    async def go():
        stopped: list[bool] = []

        async def live_send(source, counter):
            try:
                await asyncio.sleep(30)
            finally:
                stopped.append(source.stopped.is_set())

        h = ScriptedHandoff(
            [
                ("until", FIRST, {"event": "dumping", "bundle": str(tmp_path / "bundle")}),
                ("until", frozenset({Event.FROZEN}), HandoffFailed("CRIU failed", "see the log")),
            ]
        )
        m = _source(tmp_path, h, send=live_send)
        out = await m.run(_quiet_say)
        assert not out.ok and m.state == SourceState.FAILED and out.what == "CRIU failed"
        assert stopped == [True], "the stream was not ended"
        h.done()

    asyncio.run(go())


def test_source_transfer_failure_thaws_before_sent(tmp_path):
    async def go():
        async def broken_send(_bdir, _counter):
            raise OSError("link cut")

        h = ScriptedHandoff(
            [
                ("until", FIRST, {**FROZEN, "bundle": str(tmp_path / "bundle")}),
                ("ask", Command.ABORT, {"event": "thawed"}),
            ]
        )
        m = _source(tmp_path, h, send=broken_send)
        out = await m.run(_quiet_say)
        assert not out.ok and m.state == SourceState.THAWED and out.facts["thawed"] is True
        assert "link cut" in out.what
        h.done()

    asyncio.run(go())


def test_source_freeze_that_overruns_is_killed_and_thawed_from_its_record(tmp_path):
    async def go():
        h = ScriptedHandoff([("until", FIRST, TimeoutError())])
        thawed: list[int] = []
        m = _source(tmp_path, h, thawed=thawed)
        rec = SourceRecord(m.id, "w", "stop-and-copy", SourceState.FROZEN, TICKET, 1, "x", root_pid=4242)
        records.write(Path(m.spec.record), rec.to_json())
        out = await m.run(_quiet_say)
        assert h.killed and thawed == [4242] and m.state == SourceState.THAWED and out.facts["thawed"] is True
        h.done()

    asyncio.run(go())


@pytest.mark.parametrize(
    ("reply", "state", "thawed"),
    [
        ({"event": "thawed"}, SourceState.THAWED, True),
        ({"event": "in-doubt"}, SourceState.SENT, "unconfirmed"),  # target silent: stays frozen
        ({"event": "committed"}, SourceState.COMMITTED, None),  # target already runs it
    ],
)
def test_source_abort_after_sent_follows_the_handoffs_verdict(tmp_path, reply, state, thawed):
    async def go():
        script = [
            ("until", FIRST, {**FROZEN, "bundle": str(tmp_path / "bundle")}),
            ("ask", Command.SENT, {"event": "sent"}),
            ("ask", Command.ABORT, reply),
        ]
        if state == SourceState.COMMITTED:
            script.append(("until", frozenset({Event.DONE}), {"event": "done"}))
        h = ScriptedHandoff(script)
        m = _source(tmp_path, h)
        await m.run(_quiet_say)
        out = await m.abort()
        assert m.state == state and out.facts.get("thawed") == thawed
        if m.finisher:
            await m.finisher
        h.done()

    asyncio.run(go())


def test_source_commit_refused_by_the_target_stays_frozen(tmp_path):
    async def go():
        h = ScriptedHandoff(
            [
                ("until", FIRST, {**FROZEN, "bundle": str(tmp_path / "bundle")}),
                ("ask", Command.SENT, {"event": "sent"}),
                ("ask", Command.COMMIT, {"event": "refused", "target_state": "restored"}),
            ]
        )
        m = _source(tmp_path, h)
        await m.run(_quiet_say)
        out = await m.commit()
        assert not out.ok and m.state == SourceState.SENT and "restored" in out.what
        h.done()

    asyncio.run(go())


# ------------------------------------------------------------------------------------------ target


def _target(tmp_path: Path, h: ScriptedHandoff) -> TargetMachine:
    async def spawn(_spec, _folder):
        return h

    records_dir = tmp_path / "records"
    records_dir.mkdir(exist_ok=True)
    return TargetMachine.create(
        "c" * 32, "w", Mode.STOP_AND_COPY, tickets.proof_key("s"), tmp_path, records_dir, spawn, FAST
    )


def _handoff_writes(m_box: list, state: TargetState, **fields):
    """What the real target handoff does on its side: advance the record itself."""

    def write(_reply):
        m = m_box[0]
        rec = TargetRecord.from_json(records.read(m.record_path, lambda d: d))
        rec.state = state
        for k, v in fields.items():
            setattr(rec, k, v)
        records.write(m.record_path, rec.to_json())

    return write


def test_target_runs_then_refuses_to_abort_and_its_tombstone_says_so(tmp_path):
    async def go():
        box: list = []
        h = ScriptedHandoff(
            [
                ("until", frozenset({Event.RESTORED}), {"event": "restored", "pid": 1, "criu_seconds": 0.1}),
                ("ask", Command.COMMIT, {"event": "running", "pid": 1}),
            ]
        )
        m = _target(tmp_path, h)
        box.append(m)

        async def receive(dest, _vouch):
            dest.mkdir()
            return {"x": "y"}

        assert (await m.receive(receive)).ok and m.state == TargetState.RECEIVED
        h.on_reply = _handoff_writes(box, TargetState.RESTORED, root_pid=os.getpid())
        assert (await m.restore(None, "b")).ok and m.state == TargetState.RESTORED
        h.on_reply = _handoff_writes(box, TargetState.RUNNING)
        assert (await m.commit()).ok and m.state == TargetState.RUNNING
        assert await m.verdict() == Verdict.RUNNING
        # a restarted agent (or a pruned entry) answers from the record on disk
        rec = TargetRecord.from_json(records.read(m.record_path, lambda d: d))
        again = TargetMachine(rec, m.dir, m.record_path, None)
        again.recover()
        assert await again.verdict() == Verdict.RUNNING
        h.done()

    asyncio.run(go())


def test_target_aborts_a_restored_copy_that_never_ran(tmp_path):
    async def go():
        box: list = []
        h = ScriptedHandoff(
            [
                ("until", frozenset({Event.RESTORED}), {"event": "restored", "pid": 1, "criu_seconds": 0.1}),
                ("ask", Command.ABORT, {"event": "aborted"}),
            ]
        )
        m = _target(tmp_path, h)
        box.append(m)

        async def receive(dest, _vouch):
            dest.mkdir()
            return {}

        await m.receive(receive)
        h.on_reply = _handoff_writes(box, TargetState.RESTORED, root_pid=None)
        await m.restore(None, "b")
        h.on_reply = _handoff_writes(box, TargetState.ABORTED)
        assert await m.verdict() == Verdict.ABORTED and m.state == TargetState.ABORTED
        assert not m.dir.exists() and m.record_path.exists()  # the tombstone stays
        h.done()

    asyncio.run(go())


def test_target_restore_failure_is_failed_and_then_aborted(tmp_path):
    async def go():
        h = ScriptedHandoff([("until", frozenset({Event.RESTORED}), HandoffFailed("CRIU restore failed"))])
        m = _target(tmp_path, h)

        async def receive(dest, _vouch):
            dest.mkdir()
            return {}

        await m.receive(receive)
        out = await m.restore(None, "b")
        assert not out.ok and m.state == TargetState.FAILED and "CRIU restore failed" in out.what
        assert await m.verdict() == Verdict.ABORTED
        h.done()

    asyncio.run(go())


def test_restarted_target_aborts_a_restored_record_whose_handoff_is_gone(tmp_path):
    rec = TargetRecord(
        "d" * 32,
        "w",
        "stop-and-copy",
        TargetState.RESTORED,
        "x",
        "another-boot",
        handoff_pid=1 << 22,
        root_pid=1 << 22,
    )
    (tmp_path / rec.migration).mkdir()
    m = TargetMachine(rec, tmp_path / rec.migration, tmp_path / f"{rec.migration}.json", None)
    records.write(m.record_path, rec.to_json())
    m.recover()
    assert m.state == TargetState.ABORTED
    assert records.read(m.record_path, TargetRecord.from_json).state == TargetState.ABORTED


# ------------------------------------------------------------------------------------------ handoff


class FakeFrozen:
    """Stands for checkpoint.Frozen: records whether the tree was thawed or ended, never both."""

    def __init__(self, thaws: list[Thaw] | None = None) -> None:
        self.fate: list[str] = []
        self.bundle_dir = Path("/nonexistent")
        self.thaws = thaws or [Thaw()]  # how each try goes: the first is `thaw`, the rest retries

    def thaw(self) -> Thaw:
        self.fate.append("thaw")
        return self.thaws.pop(0)

    def retry_thaw(self) -> Thaw:
        self.fate.append("retry")
        return self.thaws.pop(0)

    def commit(self, *_a, **_k) -> None:
        self.fate.append("end")


def _sent_source(
    tmp_path: Path, monkeypatch, commands: list[str], verdicts: list, states: list | None = None
):
    spec = SourceSpec("e" * 32, "w", "stop-and-copy", str(tmp_path / "rec.json"), str(tmp_path), "b", TICKET)
    src = handoff_mod._Source(spec)
    src.frozen = FakeFrozen()  # type: ignore[assignment]
    src.rec = SourceRecord(spec.migration, "w", "stop-and-copy", SourceState.SENT, TICKET, 1, "x", root_pid=9)
    monkeypatch.setattr(handoff_mod, "_command", lambda: commands.pop(0))
    monkeypatch.setattr(handoff_mod.verdicts, "ask_abort", lambda _t: verdicts.pop(0))
    monkeypatch.setattr(handoff_mod.verdicts, "ask_state", lambda _t: (states or []).pop(0))
    monkeypatch.setattr(handoff_mod.verdicts, "heard", lambda _t: None)  # the target's address: silent
    monkeypatch.setattr(handoff_mod.time, "sleep", lambda _s: None)
    events: list[str] = []
    monkeypatch.setattr(handoff_mod, "_emit", lambda ev, **_f: events.append(str(ev)))
    return src, events


def test_handoff_whose_agent_died_after_sent_never_thaws_while_the_target_runs_it(tmp_path, monkeypatch):
    """The reproduction: target committed, source agent SIGKILLed — the lease breaks (EOF).

    Before, the handoff read EOF as "abort" and thawed: the job ran on both nodes. Now it asks the
    target, which says the job runs there, and ends its copy.
    """
    src, events = _sent_source(
        tmp_path, monkeypatch, [""], [Verdict.UNKNOWN, Verdict.UNKNOWN, Verdict.RUNNING]
    )
    src._settle(handoff_mod._command())
    assert src.frozen.fate == ["end"] and events == ["committed", "done"]
    assert records.read(Path(src.spec.record), SourceRecord.from_json).state == SourceState.DONE


def test_handoff_thaws_after_sent_only_when_the_target_confirms(tmp_path, monkeypatch):
    src, events = _sent_source(tmp_path, monkeypatch, [""], [Verdict.UNKNOWN, Verdict.ABORTED])
    src._settle(handoff_mod._command())
    assert src.frozen.fate == ["thaw"] and events == ["thawed"]


def test_handoff_thaw_that_does_not_complete_is_said_and_retried_until_it_does(tmp_path, monkeypatch):
    """The network lock cannot be lifted at first: the tree runs (SIGCONT is thaw_tree's last word
    whatever failed), the record says THAW_INCOMPLETE with what is left — never THAWED — and the
    handoff tries again until the thaw completes."""
    src, events = _sent_source(tmp_path, monkeypatch, [""], [Verdict.ABORTED])
    left = Thaw(("CRIU's network lock still drops its TCP connections (cannot delete …)",))
    src.frozen = FakeFrozen([left, left, Thaw()])  # type: ignore[assignment]
    seen: list[str] = []
    write = handoff_mod.records.write
    monkeypatch.setattr(handoff_mod.records, "write", lambda p, d: (seen.append(d["state"]), write(p, d)))
    src._settle(handoff_mod._command())
    assert src.frozen.fate == ["thaw", "retry", "retry"]
    assert events == ["thaw-incomplete", "thawed"]  # said once, not once per try
    assert seen == ["thaw-incomplete", "thawed"]
    rec = records.read(Path(src.spec.record), SourceRecord.from_json)
    assert rec.state == SourceState.THAWED and rec.thaw_left is None


def test_source_machine_reports_an_incomplete_thaw_and_settles_when_the_handoff_completes_it(tmp_path):
    async def go():
        async def broken_send(_bdir, _counter):
            raise OSError("link cut")

        h = ScriptedHandoff(
            [
                ("until", FIRST, {**FROZEN, "bundle": str(tmp_path / "bundle")}),
                ("ask", Command.ABORT, {"event": "thaw-incomplete", "left": "lock (EPERM)"}),
                ("until", frozenset({Event.THAWED}), {"event": "thawed"}),
            ]
        )
        m = _source(tmp_path, h, send=broken_send)
        out = await m.run(_quiet_say)
        assert not out.ok and out.facts == {"thawed": "incomplete", "left": "lock (EPERM)"}
        assert m.state == SourceState.THAW_INCOMPLETE and not m.final  # never called success
        await m.finisher
        assert m.state == SourceState.THAWED
        h.done()

    asyncio.run(go())


def test_handoff_commit_is_refused_unless_the_target_runs_it(tmp_path, monkeypatch):
    src, events = _sent_source(
        tmp_path, monkeypatch, ["commit", "commit"], [], states=["restored", "running"]
    )
    src._settle(handoff_mod._command())
    assert src.frozen.fate == ["end"] and events == ["refused", "committed", "done"]


def test_handoff_abort_with_a_silent_target_stays_frozen_and_says_so(tmp_path, monkeypatch):
    src, events = _sent_source(tmp_path, monkeypatch, ["abort", ""], [Verdict.UNKNOWN, Verdict.ABORTED])
    src._settle(handoff_mod._command())
    assert events == ["in-doubt", "thawed"] and src.frozen.fate == ["thaw"]


def test_points_cost_nothing_unless_armed_and_pause_where_armed(tmp_path, monkeypatch):
    import threading

    from criuctl.agent import points
    from criuctl.agent.protocol import Point

    monkeypatch.delenv(PAUSE_AT, raising=False)
    monkeypatch.delenv(PAUSE_DIR, raising=False)
    points.reach(Point.CLIENT_SENT)  # not armed: returns at once
    monkeypatch.setenv(PAUSE_DIR, str(tmp_path))
    (tmp_path / points.ARMED).write_text("client.restored\n")
    points.reach(Point.CLIENT_SENT)  # another point is armed: returns at once
    t = threading.Thread(target=points.reach, args=(Point.CLIENT_RESTORED,), daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while not (tmp_path / "client.restored").exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert t.is_alive() and int((tmp_path / "client.restored").read_text()) == os.getpid()
    (tmp_path / "client.restored.go").touch()
    t.join(5)
    assert not t.is_alive()


def test_handoff_settle_order_thaws_only_when_the_target_stays_silent(tmp_path, monkeypatch):
    """A person declared the target down: the handoff asks it once more, and its answer wins."""
    from criuctl.agent.protocol import SettleOrder

    order = SettleOrder("--target-down by test", 1.0)
    # silent: thawed, the record says on whose word
    src, events = _sent_source(tmp_path, monkeypatch, ["settle"], [Verdict.UNKNOWN])
    records.order_settle(src.spec.record, order)
    src._settle(handoff_mod._command())
    assert src.frozen.fate == ["thaw"] and events == ["thawed"]
    rec = records.read(Path(src.spec.record), SourceRecord.from_json)
    assert rec.state == SourceState.THAWED and rec.settled == order.declared
    # the target answers that it runs the job: whatever was declared, the source ends its copy
    (tmp_path / "r").mkdir()
    src, events = _sent_source(tmp_path / "r", monkeypatch, ["settle"], [Verdict.RUNNING])
    records.order_settle(src.spec.record, order)
    src._settle(handoff_mod._command())
    assert src.frozen.fate == ["end"] and events == ["committed", "done"]


def test_handoff_whose_lease_broke_finds_a_settle_order_while_it_waits(tmp_path, monkeypatch):
    """Its agent died: nobody can tell it "settle", so it looks beside its record between asks."""
    from criuctl.agent.protocol import SettleOrder

    asked = []
    src, events = _sent_source(tmp_path, monkeypatch, [""], [])

    def silent(_ticket):
        asked.append(1)
        if len(asked) == 3:  # while it keeps asking, a person settles (through a restarted agent)
            records.order_settle(src.spec.record, SettleOrder("node b deleted", 2.0))
        return Verdict.UNKNOWN

    monkeypatch.setattr(handoff_mod.verdicts, "ask_abort", silent)
    src._settle(handoff_mod._command())
    # the order is read after each silence, and the address asked again (`heard`) before the thaw
    assert len(asked) == 3
    assert src.frozen.fate == ["thaw"] and events == ["thawed"]
    assert records.read(Path(src.spec.record), SourceRecord.from_json).settled == "node b deleted"


def test_a_settle_order_never_thaws_while_anything_answers_at_the_targets_address(tmp_path, monkeypatch):
    """Declared down, but its address answers (unsigned, or a refused connection: the node is up):
    frozen still, said as in doubt; once the address is silent, the order stands."""
    from criuctl.agent.protocol import SettleOrder

    src, events = _sent_source(
        tmp_path, monkeypatch, ["settle", "settle"], [Verdict.UNKNOWN, Verdict.UNKNOWN]
    )
    records.order_settle(src.spec.record, SettleOrder("--target-down", 1.0))
    said = iter(["its address refuses connections: the node is up, its agent is not", None])
    monkeypatch.setattr(handoff_mod.verdicts, "heard", lambda _t: next(said))
    src._settle(handoff_mod._command())
    assert events == ["in-doubt", "thawed"] and src.frozen.fate == ["thaw"]


def test_a_commit_is_never_turned_into_a_settle(tmp_path, monkeypatch):
    """An order on disk, then the client commits (the target answered it): the commit asks the
    target's state as ever; the order does not make it thaw."""
    from criuctl.agent.protocol import SettleOrder

    src, events = _sent_source(tmp_path, monkeypatch, ["commit"], [], states=["running"])
    records.order_settle(src.spec.record, SettleOrder("--target-down", 1.0))
    src._settle(handoff_mod._command())
    assert src.frozen.fate == ["end"] and events == ["committed", "done"]


def test_no_settle_order_no_thaw_whatever_the_agent_says(tmp_path, monkeypatch):
    """ "settle" without the order on disk (a bug, or a forged line) is an abort: silent target, frozen."""
    src, events = _sent_source(tmp_path, monkeypatch, ["settle", ""], [Verdict.UNKNOWN, Verdict.ABORTED])
    src._settle(handoff_mod._command())
    assert events == ["in-doubt", "thawed"] and src.frozen.fate == ["thaw"]
    assert records.read(Path(src.spec.record), SourceRecord.from_json).settled is None
