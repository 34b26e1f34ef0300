"""Local checkpoint and restore workflows: wire the engine, the bundle and the supervisor together.

Exactly once, nothing lost. A dump leaves the tree *frozen* (CRIU's leave-stopped), seals the
bundle in a staging directory and renames it into place; only then is the workload killed (or, with
--leave-running, thawed). Any failure before that point thaws the tree and removes the staging
directory, so the job is still running exactly once.

    phase        on failure
    ---------    --------------------------------------------------------------
    resolve      nothing touched
    lock         another dump holds the workload: refused at once, nothing touched
    freeze+dump  CRIU thaws the tree itself; we SIGCONT anything left stopped
    seal         tree thawed (`thaw_tree`), staging removed
    commit       bundle in place and on disk: kill the tree (or `thaw_tree` with
                 --leave-running); either way CRIU's network lock table goes

A successful CRIU dump leaves its nftables lock table and the tree's TCP sockets in repair mode
(see `netlock`, `tcprepair`): every thaw of a dumped tree goes through `thaw_tree`, which undoes
both before the tree runs, so its connections keep working.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

import psutil

from criuctl.container import containers, rootfsdiff
from criuctl.core import procinfo, statedir, workloads
from criuctl.core.errors import CriuctlError, WorkloadEnded
from criuctl.engine import criu
from criuctl.format import bundle, criuimages, imagetail
from criuctl.gpu import gpus, gpustate, nccl
from criuctl.local import exitwrites, locks, stepboundary
from criuctl.net import netlock, pagetls, peers, readdress, tcprepair
from criuctl_hook import durable

Progress = Callable[[str], None]


def _quiet(_msg: str) -> None:
    pass


@dataclass(frozen=True)
class DumpOutcome:
    bundle: Path
    manifest: bundle.Manifest
    freeze_seconds: float  # CRIU dump, the tree frozen throughout
    total_seconds: float
    size_bytes: int
    phases: dict[str, float] = field(default_factory=dict)  # criu_dump, seal (hash + fsync)
    thaw: Thaw | None = None  # --leave-running: how the thaw went (incomplete: what is left)


def _check_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CriuctlError(f"{out} already exists and is not empty", "pass a new directory to --bundle")
    if not out.parent.is_dir():
        raise CriuctlError(f"{out.parent} does not exist", "create the parent directory first")


@dataclass(frozen=True)
class Thaw:
    """What a thaw did. The tree always got its SIGCONT: it runs. `left` names each step that failed
    — CRIU's network lock still dropping its connections, sockets still in repair mode, CUDA state
    the driver still holds — and is never called success: the caller records it, reports it, and
    retries (`thaw_tree` again: every step is idempotent) until nothing is left."""

    left: tuple[str, ...] = ()

    @property
    def complete(self) -> bool:
        return not self.left

    def line(self) -> str:
        return "; ".join(self.left)


def thaw_tree(
    root_pid: int, images_dir: Path | None = None, table: str | None = None, workload: str | None = None
) -> Thaw:
    """Let a frozen (dumped or not) tree run on where it is: the one thaw every path uses.

    Before any process runs: CRIU's network lock for this tree is lifted (the table named in
    `images_dir`'s inventory when given, and any lock table holding one of the tree's TCP
    connections) and its TCP sockets are taken out of repair mode; then every process gets
    SIGCONT. `table` (`Frozen.netlock_table`, kept in a record) names the table when the images
    are gone. With neither, a tree with no TCP connection may leave an (empty, harmless) table
    behind. Idempotent; acts in the caller's network namespace (a workload shares the host's).
    Last, processes whose CUDA state the driver holds (a dump that got that far) get it back.

    Each step is best effort and the SIGCONT comes whatever failed before it: a tree left stopped
    because its lock could not be lifted would be a job lost while every record says it runs. What
    failed is in the returned `Thaw`, and in `workload`'s record (`ps` shows it) until a later
    thaw completes.
    """
    pids = procinfo.tree_pids(root_pid)
    left: list[str] = []
    try:
        _step(
            left,
            "CRIU's network lock still drops its TCP connections",
            lambda: lift_network_lock(pids, images_dir, table),
        )
        reuse = tcprepair.reuseaddr_from_images(images_dir) if images_dir else None
        _step(left, "its TCP sockets are still in repair mode", lambda: tcprepair.leave_repair(pids, reuse))
    finally:
        for pid in pids:
            with contextlib.suppress(OSError):
                procinfo.send_signal(pid, signal.SIGCONT)
    # running again: GPU state the driver holds goes back (GPU nodes)
    _step(left, "the GPU driver still holds its CUDA state", lambda: gpustate.give_back_tree(pids))
    thaw = Thaw(tuple(left))
    if workload is not None:
        _record_thaw(workload, root_pid, thaw)
    return thaw


def _step(left: list[str], what: str, step: Callable[[], object]) -> None:
    try:
        step()
    except Exception as exc:  # best effort: the tree must still get its SIGCONT; this is reported
        why = exc.line() if isinstance(exc, CriuctlError) else f"{type(exc).__name__}: {exc}"
        left.append(f"{what} ({why})")


def _record_thaw(name: str, root_pid: int, thaw: Thaw) -> None:
    """Keep an incomplete thaw in the workload's record (what `ps` shows), or clear it once done."""
    with contextlib.suppress(CriuctlError, OSError, ValueError, TypeError):
        w = workloads.load(name)
        now = None if thaw.complete else thaw.line()
        if w is not None and w.root_pid == root_pid and w.thaw_incomplete != now:
            w.thaw_incomplete = now
            workloads.save(w)


def lift_network_lock(pids: list[int], images_dir: Path | None = None, table: str | None = None) -> list[str]:
    """Delete `table`, the lock table of the dump in `images_dir`, and those holding `pids`' connections."""
    found = [table] if table else []
    if images_dir is not None and (t := netlock.table_for_images(images_dir)):
        found.append(t)
    found += netlock.tables_holding({(*s.local, *s.remote) for s in peers.sockets(pids) if s.remote[1]})
    return [t for t in dict.fromkeys(found) if netlock.lift(t)]


@dataclass
class Frozen:
    """A workload whose tree is stopped and whose sealed bundle is in `bundle_dir`: not yet committed.

    Exactly one of `commit` (the tree dies, the bundle is the job now) or `thaw` (the tree runs on,
    the bundle goes) must follow. In post-copy (`lazy`) CRIU is still running, serving the pages
    that are not in the bundle; it ends when the last page has been pulled.
    """

    workload: workloads.Workload
    bundle_dir: Path
    manifest: bundle.Manifest
    freeze_seconds: float  # freeze start to bundle sealed
    lazy: bool = False
    lock: locks.WorkloadLock | None = None  # held from before the freeze until commit or thaw ends
    criu_dir: Path | None = None  # post-copy: CRIU's folder (its log) while it serves, beside the bundle
    netlock_table: str | None = None  # CRIU's lock table for this dump, once CRIU has dumped
    boundary: stepboundary.Reached | None = None  # the trainers held at a step boundary
    gpu: bundle.GpuFacts | None = None  # CUDA state the driver moved to host memory
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step of the freeze, for benchmarks
    _criu: threading.Thread | None = None
    _session: criu.Session | None = None
    _error: list[BaseException] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return procinfo.tree_pids(self.workload.root_pid)

    @property
    def images_dir(self) -> Path:
        return self.bundle_dir / bundle.IMAGES_DIR

    def thaw(self, remove_bundle: bool = True) -> Thaw:
        """Let the tree run on where it was, connections working; remove the bundle (unless told not to).

        An incomplete thaw (`Thaw.left`) still lets the tree run; `netlock_table` keeps the name of
        its lock for the retries, the images being gone."""
        try:
            if self._criu is not None:
                # post-copy: CRIU still holds the tree (ptrace) to serve its pages, and its death
                # lets every process run at once — with its TCP sockets still in repair mode
                # (a read fails with EPERM, and the job dies). A SIGSTOP queued first makes them
                # stop instead, until thaw_tree has released the sockets and sends SIGCONT.
                for pid in self.pids:
                    with contextlib.suppress(OSError):
                        procinfo.send_signal(pid, signal.SIGSTOP)
                self.stop_serving()
            self.netlock_table = self.netlock_table or netlock.table_for_images(self.images_dir)
            thaw = thaw_tree(self.workload.root_pid, self.images_dir, self.netlock_table, self.workload.name)
            stepboundary.let_go(self.workload, self.boundary)
            if remove_bundle:
                shutil.rmtree(self.bundle_dir, ignore_errors=True)
            return thaw
        finally:
            self.unlock()

    def retry_thaw(self) -> Thaw:
        """Once more, what an incomplete `thaw` left undone (the tree already runs)."""
        return thaw_tree(self.workload.root_pid, None, self.netlock_table, self.workload.name)

    def unlock(self) -> None:
        """Let another dump of this workload start. Commit and thaw do it; call it only if neither runs."""
        if self.lock is not None:
            self.lock.release()

    def commit(self, state: str = workloads.CHECKPOINTED, **record: str) -> None:
        """The job now lives in the bundle (or on the node that restored it): end the tree.

        In post-copy, first queue a SIGSTOP to every process: should CRIU fail while serving
        pages, it lets the tree go, and the tree must not run on beside its copy. Then wait for
        the last page to be pulled before killing: the target's daemon is connected by then (it
        connected before its restore), and one gone for `COMMIT_IDLE` seconds is not coming back.
        """
        w = self.workload
        for k, v in record.items():
            setattr(w, k, v)
        tree = w.identity
        try:
            if self._criu is not None:
                for pid in self.pids:
                    procinfo.send_signal(pid, signal.SIGSTOP)
                self.serve(until=math.inf, idle=COMMIT_IDLE)
            left = end_frozen(tree, w, state, self.netlock_table, self.boundary)
        finally:
            self.unlock()
        if left:
            raise CriuctlError(left, "it blocks only the ended tree's connections; remove the table it names")

    def end_serving(self, state: str = workloads.MIGRATED, **record: str) -> str | None:
        """Post-copy through a successor (a pod being deleted): end the tree now, while CRIU goes on
        serving its pages. They are in CRIU's page pipes, which hold the pages themselves (vmsplice),
        not the tree's mappings: they outlive the tree. But they are the tree's own pages, which a
        dying thread writes into: its threads are disarmed first (`exitwrites`). The job then lives
        in the bundle and in those pipes, until a lazy-pages daemon has pulled every page (`serve`).
        Returns what could not be done (as `end_frozen`). `exitwrites.DisarmFailed`: nothing was
        ended, and the tree may be thawed."""
        assert self._criu is not None, "end_serving is for a post-copy dump whose CRIU serves"
        exitwrites.disarm(self.pids, self.images_dir)
        w = self.workload
        for k, v in record.items():
            setattr(w, k, v)
        try:
            return end_frozen(w.identity, w, state, self.netlock_table, self.boundary)
        finally:
            self.unlock()

    @property
    def criu_pid(self) -> int | None:
        """The CRIU process serving the pages (post-copy), while it does."""
        return self._session.swrk_pid if self._session is not None and self._criu is not None else None

    def client_connected(self) -> bool:
        """Whether a lazy-pages daemon is connected to CRIU's page server now."""
        pid = self.criu_pid
        if not pid:
            return False
        with contextlib.suppress(OSError, psutil.Error):
            return any(s.established and s.remote[1] for s in peers.sockets([pid]))
        return False

    def serve(self, until: float, idle: float | None = None, stop: threading.Event | None = None) -> Served:
        """Wait while CRIU serves the pages, until a daemon has pulled them all (CRIU ends by
        itself), `stop` is set, `until` (time.monotonic()) passes, or no daemon has been connected
        for `idle` seconds; CRIU is killed in the last three cases (its pages go with it). A
        daemon that went away before it had every page leaves them to the next one (CRIU's patch,
        scripts/criu-patches/lazy-pages-serve-until-pulled.patch)."""
        assert self._criu is not None and self._session is not None
        quiet_since = time.monotonic()
        while self._criu.is_alive():
            now = time.monotonic()
            if self.client_connected():
                quiet_since = now
            ended: Served | None = None
            if stop is not None and stop.is_set():
                ended = Served.STOPPED
            elif now >= until:
                ended = Served.DEADLINE
            elif idle is not None and now - quiet_since >= idle:
                ended = Served.IDLE
            if ended is not None:
                self._session.kill()
                self._criu.join()
                outcome = ended
                break
            self._criu.join(SERVE_POLL)
        else:
            outcome = Served.FAILED if self._error else Served.PULLED
        self._criu = None
        if self.criu_dir is not None:
            failed = outcome not in (Served.PULLED, Served.STOPPED)
            _keep_log(self.criu_dir / bundle.DUMP_LOG, f"{self.workload.name}-pages", failed)
            shutil.rmtree(self.criu_dir, ignore_errors=True)
        return outcome

    def stop_serving(self) -> None:
        """Kill the CRIU that serves the pages, now (its pages go with it)."""
        stop = threading.Event()
        stop.set()
        self.serve(until=math.inf, stop=stop)


SERVE_POLL = 1.0  # seconds between looks at a serving CRIU
COMMIT_IDLE = 30.0  # a migration's target daemon gone this long after the commit: its pull failed


class Served(StrEnum):
    """How a post-copy dump's page server ended (`Frozen.serve`)."""

    PULLED = "pulled"  # a lazy-pages daemon had every page
    FAILED = "failed"  # CRIU ended with an error
    STOPPED = "stopped"  # whoever served asked it to stop
    DEADLINE = "deadline"  # nobody had pulled every page in time
    IDLE = "idle"  # no daemon connected for too long


def end_frozen(
    tree: procinfo.Identity,
    w: workloads.Workload | None,
    state: str,
    netlock_table: str | None,
    boundary: stepboundary.Reached | None = None,
) -> str | None:
    """The job lives elsewhere now (or in a bundle): the one way a frozen tree ends, whoever ends it
    (the handoff that froze it, or an agent recovering its record after the handoff died).

    Records `state` (if `w` is still the very tree), marks its pod's job as moved (a restarted
    container must not run it again), kills the tree (waiting for its PIDs to be free when it shares
    a PID namespace), lifts CRIU's network lock and lets go of the step-boundary request: both would
    only outlive it. Returns what could not be done (the lock left), None when all was done.
    """
    if w is not None and w.root_pid == tree.pid:
        w.state = state
        workloads.save(w)
        if state in (workloads.MIGRATED, workloads.CHECKPOINTED):
            where = w.moved_to if state == workloads.MIGRATED else None
            containers.mark_moved(w, where or "another node")
    if tree.alive():
        own_ns = True  # PID 1 of its namespace (unless on a GPU node, `supervisor.pid_namespace`)
        with contextlib.suppress(OSError):
            own_ns = procinfo.ns_pid(tree.pid) == 1
        procinfo.kill_tree(tree.pid, wait=0.0 if own_ns else 5.0)  # PIDs kept: free them first
    if w is not None:
        stepboundary.let_go(w, boundary)
    if netlock_table:
        try:
            netlock.lift(netlock_table)
        except CriuctlError as exc:  # it blocks connections of a tree that is gone: said, not fatal
            return f"the network lock of the ended tree was left: {exc.line()}"
    return None


def freeze(
    target: str,
    parent: Path,
    lazy_port: int | None = None,
    progress: Progress = _quiet,
    endpoints: readdress.EndpointMap | None = None,
    boundary: bool = True,
    durable: bool = True,
    on_dumping: Callable[[Path], None] | None = None,
    connections: bool = False,
    pages_to: criu.PagesTo | None = None,
    target_gpus: list[gpus.GpuInfo] | None = None,
    lazy_tls: criu.PageTls | None = None,
    key: bytes | None = None,
) -> Frozen:
    """Freeze workload `target` (name or PID) and seal its bundle in a new directory under `parent`.

    With `lazy_port` (post-copy) memory pages stay out of the bundle: CRIU serves them on that port
    once the bundle is sealed (over TLS to the pinned clients of `lazy_tls`, if given); its log
    then goes beside the bundle (`Frozen.criu_dir`), which it keeps writing while it serves, and
    the bundle holds its log as it was at the seal. `endpoints` gives the images' TCP sockets new
    addresses before the seal (a rank of a multi-node job that moves). Without `boundary` the
    trainers are frozen where they are (ranks of one job frozen together would each wait at a
    boundary for the others). On
    any failure the tree is thawed and nothing is left behind. `durable=False` skips the fsyncs of
    the seal: a migration's source keeps its tree frozen in memory until the target decides, so its
    bundle is only the stream's buffer and a power loss takes the tree with it either way.
    `on_dumping(folder)` is called as CRIU starts writing the bundle there (a migration streams it).
    `connections`: a container's TCP connections to other hosts are dumped, not refused (a job's
    rank whose restore re-addresses them, criuctl.kube.jobmoves). `pages_to`: memory pages go to
    the target's page server, never to this disk; the manifest signs how many went, and over which
    TLS session (`criuctl.net.directpages`). `target_gpus`: the GPUs of the node a GPU job moves to;
    one that cannot take the job is refused before anything is held or frozen. `key`: what the
    bundle is signed with (a move's own key, `tickets.seal_key`: the target checks it by that,
    never by a key of this node's); this node's key by default.
    """
    started = time.monotonic()
    criu.require_version()
    w = workloads.resolve(target)
    key = key or bundle.load_key(statedir.key_path())
    lock = locks.lock_workload(w.name, _purpose())
    try:
        return _freeze_locked(
            w,
            key,
            lock,
            parent,
            lazy_port,
            progress,
            started,
            endpoints,
            boundary,
            durable,
            on_dumping,
            connections,
            pages_to,
            target_gpus,
            lazy_tls,
        )
    except BaseException:
        lock.release()
        raise


def _purpose() -> str:
    """What this process is, for the message another dump of the same workload gets."""
    with contextlib.suppress(psutil.Error):
        argv = psutil.Process().cmdline()
        if "criuctl.agent.handoff" in argv:
            return "a migration's handoff"
        if "dump" in argv:
            return "criuctl " + " ".join(argv[argv.index("dump") :])
    return "criuctl"


def _freeze_locked(
    w: workloads.Workload,
    key: bytes,
    lock: locks.WorkloadLock,
    parent: Path,
    lazy_port: int | None,
    progress: Progress,
    started: float,
    endpoints: readdress.EndpointMap | None = None,
    boundary: bool = True,
    durable: bool = True,
    on_dumping: Callable[[Path], None] | None = None,
    connections: bool = False,
    pages_to: criu.PagesTo | None = None,
    target_gpus: list[gpus.GpuInfo] | None = None,
    lazy_tls: criu.PageTls | None = None,
) -> Frozen:
    now = workloads.load(w.name)
    if now is None or now.root_pid != w.root_pid or now.state != workloads.RUNNING or not w.alive():
        raise workloads.UnknownWorkload(  # a dump that held the lock before us committed it
            f"workload {w.name!r} is no longer running here",
            "see `criuctl ps --all`; nothing was frozen",
        )
    processes = procinfo.describe(w.root_pid)
    pids = [p.pid for p in processes]
    for pid, fd, what, fix in procinfo.unsupported_resources(pids)[:1]:
        name = next(p.name for p in processes if p.pid == pid)
        raise CriuctlError(
            f"PID {pid} ({name}) holds {what} (fd {fd}), which CRIU cannot checkpoint",
            f"{fix}; nothing was frozen, the workload keeps running",
        )
    plan = containers.plan(w, pids, connections) if w.container else None  # refusals come before the freeze
    if target_gpus is not None:
        gpustate.check_target(pids, target_gpus)
    staging = Path(tempfile.mkdtemp(prefix=f".{w.name}.partial-", dir=parent))
    images = staging / bundle.IMAGES_DIR
    images.mkdir(mode=0o700)
    lazy = lazy_port is not None
    criu_dir = Path(tempfile.mkdtemp(prefix=f".{w.name}.criu-", dir=parent)) if lazy else staging
    options = criu.DumpOptions(
        pid=w.root_pid,
        images_dir=images,
        work_dir=criu_dir,
        leave_stopped=True,
        log_file=bundle.DUMP_LOG,
        lazy_pages=lazy,
        page_server_port=lazy_port or 0,
        lazy_tls=lazy_tls,
        pages_to=pages_to,
        external=plan.external if plan else [],
        **criu.tree_options(),
    )
    frozen = Frozen(w, staging, None, 0.0, lazy=lazy, lock=lock, criu_dir=criu_dir if lazy else None)  # type: ignore[arg-type]
    try:
        if w.control and boundary:
            progress("step boundary")
            t0 = time.monotonic()
            frozen.boundary = stepboundary.reach(w)
            frozen.phases["boundary"] = time.monotonic() - t0
            if refused := nccl.refusal(frozen.boundary.reports):
                raise refused  # before the driver's lock: the thaw below lets the trainers go on
            started = time.monotonic()  # the job ran on while it finished its step: not frozen time
        progress("freezing")
        frozen.gpu = gpustate.suspend(pids, stepboundary.timeout())
        if frozen.gpu is not None:  # device memory is host memory now, which CRIU writes: count it
            processes = procinfo.describe(w.root_pid)
        with locks.host_dump_slot():
            t0 = time.monotonic()
            frozen.phases["prepare"] = t0 - started  # facts, GPU, the dump slot (not the boundary)
            tail = None if frozen.lazy or pages_to else imagetail.Tail(images).start()
            if on_dumping is not None:
                on_dumping(staging)
            try:
                _run_dump(frozen, options)
            finally:
                known = tail.finish() if tail is not None else {}
            frozen.phases["criu_dump"] = time.monotonic() - t0
        if frozen.criu_dir is not None:  # the log as it is now: CRIU goes on writing its own
            shutil.copyfile(frozen.criu_dir / bundle.DUMP_LOG, staging / bundle.DUMP_LOG)
        t0 = time.monotonic()
        frozen.netlock_table = netlock.table_for_images(images)
        if endpoints is not None:
            readdress.apply(images, endpoints)  # before the seal: the digests cover the new addresses
        progress("sealing")
        if plan is not None:
            _carry_files(staging, plan)
        manifest = bundle.Manifest(
            workload=w.name,
            command=w.command,
            processes=processes,
            open_files=procinfo.open_files(pids),
            uses_gpu=frozen.gpu is not None or procinfo.uses_gpu(pids),
            criu_version=".".join(map(str, criu.version())),
            stdio_pipes=w.stdio_pipes,
            lazy_pages=frozen.lazy,
            container=plan.facts if plan else None,
            control_dir=w.control or "",
            boundary=frozen.boundary.facts() if frozen.boundary else None,
            gpu=frozen.gpu,
            direct_pages=_direct_pages(staging, pages_to),
        )
        manifest.freeze_seconds = time.monotonic() - started
        frozen.manifest = bundle.seal(staging, manifest, key, durable, known)
        frozen.freeze_seconds = manifest.freeze_seconds
        frozen.phases["seal"] = time.monotonic() - t0
    except BaseException as exc:
        log = _keep_log(criu_dir / bundle.DUMP_LOG, w.name)
        thawed = frozen.thaw()  # lifts the network lock CRIU left, if it got that far; releases the lock
        if isinstance(exc, CriuctlError) and not thawed.complete:
            exc.hint += f"; it runs again, but its thaw did not complete: {thawed.line()}"
        if isinstance(exc, criu.CriuError) and not w.alive():
            raise WorkloadEnded(
                f"workload {w.name!r} ended while it was being frozen",
                f"nothing was checkpointed; see `criuctl logs {w.name}` for how it ended",
            ) from exc
        if isinstance(exc, CriuctlError) and log:
            exc.hint += f" (CRIU log: {log})"
        if isinstance(exc, OSError) and exc.errno == 28:
            raise CriuctlError(
                f"disk full while writing {parent}",
                "free space or write the bundle elsewhere; the workload keeps running",
            ) from exc
        raise
    return frozen


def _direct_pages(staging: Path, pages_to: criu.PagesTo | None) -> bundle.DirectPages | None:
    """What the manifest signs of pages sent straight to the target: CRIU's count, and the session."""
    if pages_to is None:
        return None
    return bundle.DirectPages(
        pages=criuimages.pages_written(staging, staging / bundle.IMAGES_DIR),
        source_cert=pagetls.fingerprint(pages_to.tls.cert.read_text()),
        target_cert=pagetls.fingerprint(pages_to.tls.peer_cert.read_text()),
    )


def _carry_files(staging: Path, plan: containers.DumpPlan) -> None:
    """A container's files the images do not hold, taken while the tree is frozen (sizes match)."""
    if plan.upperdir:
        plan.facts.rootfs_diff = ROOTFS_DIFF
        plan.facts.deleted = rootfsdiff.write(Path(plan.upperdir), staging / ROOTFS_DIFF)
    plan.carry_volumes(staging, VOLUMES_DIR)


ROOTFS_DIFF = "rootfs-diff.tar"
VOLUMES_DIR = "volumes"


def _run_dump(frozen: Frozen, options: criu.DumpOptions) -> None:
    """Run CRIU; in post-copy, in a thread, returning once the images are written and pages served."""
    if not frozen.lazy:
        criu.dump(options)
        return
    ready = threading.Event()

    def on_notify(name: str) -> bool:
        if name == "status-ready":
            ready.set()
        return True

    def serve() -> None:
        try:
            criu.dump(options, on_notify, frozen._session)
        except BaseException as exc:  # reported to whoever waits
            frozen._error.append(exc)
        finally:
            ready.set()

    frozen._session = criu.Session()
    frozen._criu = threading.Thread(target=serve, name="criu-lazy-dump", daemon=True)
    frozen._criu.start()
    ready.wait()
    if frozen._error:
        frozen._criu.join()
        frozen._criu = None
        raise frozen._error[0]


def dump(
    target: str,
    out: Path,
    leave_running: bool = False,
    progress: Progress = _quiet,
    freezer: Callable[..., Frozen] | None = None,
    connections: bool = False,
) -> DumpOutcome:
    """Checkpoint workload `target` (name or PID) into bundle directory `out` (`freezer`: how;
    CRIU by default, `statesnapshot.freeze_state` for the training-state snapshot)."""
    started = time.monotonic()
    out = out.absolute()
    _check_out_dir(out)
    if freezer is None:  # a snapshot leaves the tree running: its bundle needs no fsync to be safe
        frozen = freeze(
            target, out.parent, progress=progress, durable=not leave_running, connections=connections
        )
    else:
        frozen = freezer(target, out.parent, progress=progress)
    try:
        if out.exists():
            out.rmdir()
        durable.move(frozen.bundle_dir, out)  # the rename itself on disk before the tree dies
    except OSError as exc:
        thawed = frozen.thaw()
        raise CriuctlError(
            f"cannot move the bundle into {out}: {exc.strerror}",
            "nothing was checkpointed, the workload keeps running"
            + ("" if thawed.complete else f" (its thaw did not complete: {thawed.line()})")
            + "; pass a new, empty -o directory",
        ) from exc
    except BaseException:
        frozen.thaw()
        raise
    frozen.bundle_dir = out
    # Commit: the bundle is complete, signed and on disk.
    thaw = None
    if leave_running:
        thaw = frozen.thaw(remove_bundle=False)
    else:
        frozen.commit(bundle=str(out))
    size = bundle.size_bytes(out)
    took = time.monotonic() - started
    return DumpOutcome(out, frozen.manifest, frozen.freeze_seconds, took, size, frozen.phases, thaw)


def _keep_log(log: Path, name: str, keep: bool = True) -> Path | None:
    """Keep a failed dump's CRIU log (the staging directory is about to go)."""
    if not keep or not log.exists():
        return None
    kept = statedir.LOGS.ensure() / f"dump-{name}-{time.strftime('%Y%m%dT%H%M%S')}.log"
    shutil.move(log, kept)
    return kept
