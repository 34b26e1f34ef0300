"""The processes that hold a workload across a migration, so that no crash loses or doubles it.

An agent never freezes or restores a workload in its own process. It starts one of these with a
spec file (`protocol.SourceSpec` / `TargetSpec`), talks to it over two pipes — commands on its
stdin, one JSON event per line on its stdout — and the stdin pipe is a lease: when the agent dies,
the pipe closes. What a handoff does then depends on how far it got, and is written down first:

    source  hold record FREEZING (before CRIU touches the tree), freeze, seal → FROZEN
            "sent" → SENT recorded; from here on only the target's verdict settles it:
                "commit": ask the target; running → end the tree (COMMITTED, DONE)
                "abort" or the lease breaks: ask the target to abort; aborted → thaw (THAWED),
                    running → end the tree; no answer → stay frozen and ask again
                "settle" (or the order found while the lease is broken): ask once more as for
                    "abort"; no answer → thaw on the person's word that the target is down
            before "sent": "abort" or the lease breaks → thaw (THAWED)
    target  restore the tree *stopped* → RESTORED
            "commit": RUNNING recorded, then the tree runs; this process stays as its supervisor
            "abort" or the lease breaks: kill the tree (it never ran) → ABORTED
    dump    `criuctl dump` on the agent's behalf (POST /v1/workloads/NAME/checkpoint)

A source that dies *after* committing a post-copy migration, before the last page is pulled,
takes the job with it: that window lasts as long as the page transfer (docs/architecture.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

from criuctl.agent import pageserving, points, records, tickets, verdicts, warmstart
from criuctl.agent.protocol import (
    BadTransition,
    Command,
    Event,
    Point,
    SourceRecord,
    SourceSpec,
    SourceState,
    TargetRecord,
    TargetSpec,
    TargetState,
    Ticket,
    Verdict,
    check_transition,
    timeouts,
)
from criuctl.container import cgroups, placeholder, runtime
from criuctl.core import procinfo, workloads
from criuctl.core.errors import CriuctlError, WorkloadEnded
from criuctl.core.retry import Backoff
from criuctl.engine import criu
from criuctl.format import bundle
from criuctl.gpu import gpus
from criuctl.local import checkpoint, exitwrites, restoring
from criuctl.net import readdress
from criuctl_hook import durable


class _Events:
    """The pipe this process's events go to (`--events-fd`, opened by the agent). Not stdout: any
    library here may print there (it goes to the handoff's log)."""

    out: IO[str] | None = None


def _emit(event: Event, **fields: object) -> None:
    if _Events.out is None:
        return
    with contextlib.suppress(BrokenPipeError, ValueError, OSError):  # the agent is gone: the lease decides
        print(json.dumps({"event": str(event), **fields}), file=_Events.out, flush=True)


def _error(exc: CriuctlError) -> None:
    _emit(Event.ERROR, what=exc.what, hint=exc.hint, detail=exc.detail, ended=isinstance(exc, WorkloadEnded))


def _command() -> str:
    """The agent's next command; '' when the lease broke (the agent died or closed it)."""
    try:
        return sys.stdin.readline().strip()
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------ source


def _held_point(phase: str) -> None:
    """`freeze` says "freezing" once the trainers stopped at their step boundary, before CRIU."""
    if phase == "freezing":
        points.reach(Point.SOURCE_HELD)


class _Source:
    """One source handoff: the tree, its record, and the only code that thaws or ends it."""

    def __init__(self, spec: SourceSpec) -> None:
        self.spec = spec
        self.path = Path(spec.record)
        self.frozen: checkpoint.Frozen | None = None
        self.rec: SourceRecord | None = None

    def _advance(self, state: SourceState, **fields: object) -> None:
        assert self.rec is not None
        self.rec.state = check_transition(self.rec.state, state)
        for k, v in fields.items():
            setattr(self.rec, k, v)
        self.rec.updated = time.time()
        records.write(self.path, self.rec.to_json())

    def run(self) -> int:
        spec = self.spec
        started = time.monotonic()
        try:
            w = workloads.resolve(spec.workload)
        except CriuctlError as exc:
            _error(exc)
            return 1
        me = procinfo.Identity.of(os.getpid())
        self.rec = SourceRecord(
            spec.migration,
            w.name,
            spec.mode,
            SourceState.FREEZING,
            spec.ticket,
            me.pid,
            me.boot,
            root_pid=w.root_pid,
            root_start=w.root_start,
            hold_start=me.start,
            updated=time.time(),
        )
        records.write(self.path, self.rec.to_json())  # before CRIU freezes anything
        try:
            endpoints = readdress.EndpointMap.from_json(spec.readdress) if spec.readdress else None
            pages_to = criu.PagesTo.from_json(spec.pages_to) if spec.pages_to else None
            self.frozen = checkpoint.freeze(
                w.name,
                Path(spec.parent),
                lazy_port=spec.lazy_port,
                progress=_held_point,
                endpoints=endpoints,
                boundary=spec.boundary,
                durable=False,
                on_dumping=lambda folder: _emit(Event.DUMPING, bundle=str(folder)),
                pages_to=pages_to,
                lazy_tls=criu.PageTls(**{k: Path(v) for k, v in spec.lazy_tls.items()})
                if spec.lazy_tls
                else None,
                target_gpus=None
                if spec.target_gpus is None
                else [gpus.GpuInfo.from_dict(g) for g in spec.target_gpus],
                key=tickets.seal_key(spec.ticket.secret),
            )
        except CriuctlError as exc:
            self._advance(SourceState.FAILED)
            _error(exc)
            return 1
        self._advance(
            SourceState.FROZEN, bundle=str(self.frozen.bundle_dir), netlock_table=self.frozen.netlock_table
        )
        _emit(
            Event.FROZEN,
            bundle=str(self.frozen.bundle_dir),
            freeze_seconds=self.frozen.freeze_seconds,
            started_ago=time.monotonic() - started,
            rss_bytes=self.frozen.manifest.rss_bytes,
            phases=self.frozen.phases,
        )
        if _command() != Command.SENT:
            self._thaw()
            return 0
        self._advance(SourceState.SENT)
        _emit(Event.SENT)
        self._settle(_command())
        return 0

    def _settle(self, cmd: str) -> None:
        """SENT: whatever we are told, the target's answer decides — or, once it stays silent, a
        person's settle order (`SettleOrder`: the agent says "settle", or a handoff whose agent died
        finds the order beside its record while it waits). Returns once settled."""
        backoff = Backoff(timeouts().ask_backoff_max)
        while True:
            if cmd == Command.COMMIT:  # (never a settle: the target answered the client)
                state = verdicts.ask_state(self.spec.ticket)
                if state == TargetState.RUNNING:
                    return self._commit()
                _emit(Event.REFUSED, target_state=state)
                cmd = _command()
                continue
            verdict = verdicts.ask_abort(self.spec.ticket)  # "abort", "settle", or the lease broke
            if verdict == Verdict.RUNNING:
                return self._commit()
            if verdict == Verdict.ABORTED:
                return self._thaw()
            order = records.settle_order(self.path)  # whatever the command: its agent may be dead
            if order is not None and verdicts.heard(self.spec.ticket) is None:
                return self._thaw(settled=order.declared)  # silent, declared down: thawed without a verdict
            if cmd in (Command.ABORT, Command.SETTLE):  # the agent asked and is still there: tell it
                _emit(Event.IN_DOUBT)
                cmd = _command()
                continue
            # the lease broke and the target is silent: frozen, not lost; a new order ends the wait
            backoff.sleep(until=None if order is not None else self._ordered)

    def _ordered(self) -> bool:
        return records.settle_order(self.path) is not None

    def _thaw(self, settled: str | None = None) -> None:
        """The tree runs here again. A thaw that did not complete (its lock could not be lifted, say)
        is said at once (THAW_INCOMPLETE, with what is left) and retried here until it completes;
        only then THAWED. The tree runs meanwhile: it got its SIGCONT whatever failed. `settled`:
        the declaration it thaws on (written into the record with the first step)."""
        assert self.frozen is not None
        if settled is not None and self.rec is not None:
            self.rec.settled = settled
        thaw, backoff = self.frozen.thaw(), Backoff(timeouts().thaw_retry_max)
        while not thaw.complete:
            if self.rec is not None and self.rec.thaw_left != thaw.line():
                self._advance(SourceState.THAW_INCOMPLETE, thaw_left=thaw.line())
                _emit(Event.THAW_INCOMPLETE, left=thaw.line())
            backoff.sleep()
            thaw = self.frozen.retry_thaw()
        self._advance(SourceState.THAWED, thaw_left=None)
        _emit(Event.THAWED, settled=settled)

    def _commit(self) -> None:
        assert self.frozen is not None
        self._advance(SourceState.COMMITTED)
        _emit(Event.COMMITTED)
        waited = time.monotonic()
        self.frozen.commit(workloads.MIGRATED, moved_to=self.spec.to_node)  # post-copy: last page pulled
        self._advance(SourceState.DONE)
        _emit(Event.DONE, pages_seconds=time.monotonic() - waited)


def source(spec_file: Path) -> int:
    return _Source(SourceSpec.from_json(spec_file.read_text())).run()


# ------------------------------------------------------------------------------------------ target


def _advance_target(spec: TargetSpec, state: TargetState, **fields: object) -> None:
    if spec.record is None:  # a plain bundle restore has no migration record
        return
    path = Path(spec.record)
    rec = TargetRecord.from_json(json.loads(path.read_text()))
    rec.state = check_transition(rec.state, state)
    for k, v in fields.items():
        setattr(rec, k, v)
    rec.updated = time.time()
    rec.history.append(f"{state}@{rec.updated:.3f}")
    records.write(path, rec.to_json())


def target(spec_file: Path) -> int:
    spec = TargetSpec.from_json(spec_file.read_text())
    page_server = None
    if spec.page_server:
        host, port = spec.page_server.rsplit(":", 1)
        page_server = (host, int(port))
    try:
        into = _placeholder(spec)
        endpoints = readdress.EndpointMap.from_json(spec.readdress) if spec.readdress else None
        vouched = bundle.Vouched(**spec.vouched) if spec.vouched else None
        page_tls = criu.PageTls(**{k: Path(v) for k, v in spec.page_tls.items()}) if spec.page_tls else None
        restored = restoring.restore_stopped(
            Path(spec.bundle),
            spec.name,
            page_server,
            spec.digests,
            into=into,
            endpoints=endpoints,
            vouched=vouched,
            page_tls=page_tls,
        )
    except CriuctlError as exc:
        _error(exc)
        return 1
    try:
        into = restored.into
        ph, me = procinfo.Identity.of(into.pid) if into else None, procinfo.Identity.of(os.getpid())
        _advance_target(
            spec,
            TargetState.RESTORED,
            handoff_pid=me.pid,
            handoff_start=me.start,
            root_pid=restored.workload.root_pid,
            root_start=restored.workload.root_start,
            placeholder=into.container.id if into else None,
            placeholder_pid=ph and ph.pid,
            placeholder_start=ph and ph.start,
        )
    except BadTransition:  # a restarted agent settled the record as ABORTED while CRIU restored
        restored.abort()
        _emit(Event.ABORTED)
        return 0
    _emit(
        Event.RESTORED,
        pid=restored.workload.root_pid,
        criu_seconds=restored.criu_seconds,
        phases=restored.phases,
    )
    cmd = _command()
    if not cmd and spec.follow:  # the lease broke: a job's rank does what the first moved rank did
        cmd = _follow(Ticket.from_json(spec.follow))
    if cmd != Command.COMMIT:
        restored.abort()  # it never ran: the source cannot have been told to end
        _advance_target(spec, TargetState.ABORTED)
        _emit(Event.ABORTED)
        return 0
    if restored.into is not None and not restored.into.alive():
        # its container was stopped after the restore: running the job now would run it to its
        # death; it never ran, so the source thaws and keeps it
        restored.abort("the placeholder stopped before the commit")
        _advance_target(spec, TargetState.ABORTED)
        _emit(Event.ERROR, what="the placeholder container stopped before the commit", hint="", detail="")
        return 1
    try:
        _advance_target(spec, TargetState.RUNNING)  # written before the tree runs
    except BadTransition:  # settled as ABORTED meanwhile: the source was told to thaw, never run this
        restored.abort()
        _emit(Event.ERROR, what="the migration was aborted before the commit arrived", hint="", detail="")
        return 1
    lazy = restored.lazy_daemon is not None
    restored.start(supervisor_pid=os.getpid(), node=spec.node, pages=workloads.PULLING if lazy else None)
    # the driver's restore ran inside start(): part of the downtime (post-copy: it pulls the
    # device memory's host copy), said apart so that a GPU job's stall shows where it went
    gpu = {"gpu_restore": restored.gpu_seconds} if restored.manifest and restored.manifest.gpu else {}
    _emit(Event.RUNNING, pid=restored.workload.root_pid, phases=gpu)
    _detach()
    if lazy:  # the images are read until the last page is in
        threading.Thread(target=_collect, args=(restored, Path(spec.bundle)), daemon=True).start()
    return restored.supervise(echo=False, keeper=True)


def _follow(leader: Ticket) -> str:
    """COMMIT once the job's first moved rank runs on its target, ABORT once it never will."""
    backoff = Backoff(timeouts().ask_backoff_max)
    while True:
        state = verdicts.ask_state(leader)
        if state == TargetState.RUNNING:
            return Command.COMMIT
        if state in (TargetState.ABORTED, TargetState.FAILED):
            return Command.ABORT
        backoff.sleep()  # stopped, never ran: it waits for the word, as a frozen source does


def _placeholder(spec: TargetSpec) -> placeholder.Placeholder | None:
    """Where a container's bundle goes: the placeholder the client named, or the one for its pod."""
    facts = bundle.read_manifest(Path(spec.bundle)).container
    if facts is None and spec.placeholder is None:
        return None
    rt = runtime.connect(spec.runtime)
    if spec.placeholder:
        return placeholder.find(rt, spec.placeholder)
    assert facts is not None
    return placeholder.match(rt, facts)


def _collect(restored: restoring.Restored, bundle_dir: Path) -> None:
    """Post-copy: once the last page is here (or the pull failed, and the job with it), the
    bundle's images are no longer read."""
    said = restored.watch_pages()
    if said not in (workloads.PULLED, workloads.ENDED):
        print(f"criuctl: {restored.workload.name}: {said}", file=sys.stderr, flush=True)
    shutil.rmtree(bundle_dir, ignore_errors=True)
    pageserving.forget(bundle_dir.name)


def _detach() -> None:
    """From here on this process is the workload's supervisor: it must outlive the agent."""
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):
        os.dup2(devnull, fd)
    os.close(devnull)
    if _Events.out is not None:  # nothing more to say: the agent sees the pipe end
        with contextlib.suppress(OSError):
            _Events.out.close()
        _Events.out = None


# ------------------------------------------------------------------------------------------ dump


def dump(spec_file: Path) -> int:
    """A checkpoint the agent asked for: the same exactly-once dump as `criuctl dump`.

    In a pod (the DaemonSet), it first leaves the agent's container: it must run to its end
    whatever becomes of the agent (criuctl.container.cgroups); a restarted agent finds the bundle
    it sealed, or the job running on where the dump failed (criuctl.kube.successors)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST") and not cgroups.leave_container():
        print("the dump stays in the agent's cgroups: it ends if the agent's pod does", file=sys.stderr)
    spec = json.loads(spec_file.read_text())
    if spec.get("lazy"):
        return _serve(spec)
    try:
        out = checkpoint.dump(
            spec["workload"],
            Path(spec["out"]),
            bool(spec.get("leave_running")),
            connections=bool(spec.get("connections")),
        )
    except CriuctlError as exc:
        _error(exc)
        return 1
    except OSError as exc:
        _emit(Event.ERROR, what=f"checkpoint failed: {exc}", hint="see the agent log", detail="")
        return 1
    left = out.thaw.line() if out.thaw is not None and not out.thaw.complete else None
    _emit(Event.DONE, bytes=out.size_bytes, freeze_seconds=out.freeze_seconds, thaw_left=left)
    return 0


def _serve(spec: dict[str, Any]) -> int:
    """Post-copy for a pod's successor (criuctl.agent.pageserving): freeze with the memory pages
    kept back, keep the bundle (everything else), end the tree, say SERVING (the port, the page
    server's certificate), then serve the pages until a restore has pulled them all, the agent
    stops it (SIGTERM), or `lazy.seconds` pass. The pages go when it ends, and the bundle here
    with them: without its pages it restores nowhere."""
    out, lazy = Path(spec["out"]), spec["lazy"]
    bid = out.name
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        page_tls, cert = pageserving.serve_tls(bid, lazy.get("clients") or [])
        frozen = checkpoint.freeze(
            spec["workload"],
            out.parent,
            lazy_port=int(lazy["port"]),
            durable=False,  # the pages live in this process: a power loss takes them either way
            connections=bool(spec.get("connections")),
            lazy_tls=page_tls,
        )
    except CriuctlError as exc:
        pageserving.forget(bid)
        _error(exc)
        return 1
    try:
        durable.move(frozen.bundle_dir, out)
    except OSError as exc:
        frozen.thaw()
        pageserving.forget(bid)
        _emit(Event.ERROR, what=f"checkpoint failed: {exc}", hint="the job runs on", detail="")
        return 1
    frozen.bundle_dir = out
    try:
        left = frozen.end_serving(workloads.CHECKPOINTED, bundle=str(out))  # the job: this bundle, its pages
    except exitwrites.DisarmFailed as exc:  # the tree is whole: it runs on, and may move another way
        frozen.thaw()
        pageserving.forget(bid)
        exc.hint = "the job runs on; move it by stop-and-copy"
        _error(exc)
        return 1
    until = time.monotonic() + float(lazy["seconds"])
    pageserving.note_serving(bid, int(lazy["port"]), frozen.criu_pid, time.time() + float(lazy["seconds"]))
    _emit(
        Event.SERVING,
        bytes=bundle.size_bytes(out),
        freeze_seconds=frozen.freeze_seconds,
        port=int(lazy["port"]),
        cert=cert,
        thaw_left=left,
    )
    _detach()
    started = time.monotonic()
    served = frozen.serve(until, stop=stop)
    print(
        f"criuctl: bundle {bid}'s pages: {served} after {time.monotonic() - started:.1f} s",
        file=sys.stderr,
        flush=True,
    )
    shutil.rmtree(out, ignore_errors=True)
    pageserving.forget(bid)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m criuctl.agent.handoff")
    p.add_argument("role", choices=["source", "target", "dump", warmstart.WARM])
    p.add_argument("spec", type=Path, help="JSON spec written by the agent (warm: a blank)")
    p.add_argument("--events-fd", type=int, help="the pipe the agent reads this process's events from")
    a = p.parse_args(argv)
    role, spec = a.role, a.spec
    # before any thread: the paths it reads, the roots it gives CRIU and the moves it makes are then
    # the node's, not those of the agent's cgroup namespace (cgroup v2: criuctl.container.cgroups)
    if not cgroups.enter_node_namespace():
        print("the handoff stays in the agent's cgroup namespace: it cannot leave it", file=sys.stderr)
    if a.events_fd is not None:
        _Events.out = os.fdopen(a.events_fd, "w")
    if role == warmstart.WARM:  # started ahead: the agent names the job on stdin when it has one
        criu.preload()  # what the roles would import on first use (pycriu: 40 ms of a downtime)
        job = warmstart.take_job()
        if job is None:
            return 0
        role, spec, _log = job
    try:
        return {"source": source, "target": target, "dump": dump}[role](spec)
    except Exception as exc:  # a bug: said on the events pipe too, not only in the log
        traceback.print_exc()  # to the handoff's log
        _emit(
            Event.ERROR,
            what=f"the {role} handoff failed: {type(exc).__name__}: {exc}",
            hint="a criuctl bug: please report it with the handoff's log",
            detail="".join(traceback.format_exception_only(exc)).strip(),
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
