"""Local checkpoint and restore workflows: wire the engine, the bundle and the supervisor together.

Exactly once, nothing lost. A dump leaves the tree *frozen* (CRIU's leave-stopped), seals the
bundle in a staging directory and renames it into place; only then is the workload killed (or, with
--leave-running, thawed). Any failure before that point thaws the tree and removes the staging
directory, so the job is still running exactly once.

    phase        on failure
    ---------    --------------------------------------------------------------
    resolve      nothing touched
    freeze+dump  CRIU thaws the tree itself; we SIGCONT anything left stopped
    seal         tree thawed, staging removed
    commit       bundle in place: kill the tree (or thaw it with --leave-running)
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from criuctl import bundle, criu, procinfo, supervisor, workloads
from criuctl.errors import CriuctlError

# The options both sides agree on: a training tree holds TCP (DDP), unix sockets and file locks.
_COMMON = dict(tcp_established=True, ext_unix_sk=True, file_locks=True, network_lock="nftables")

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


def _check_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CriuctlError(f"{out} already exists and is not empty", "pass a new directory to -o")
    if not out.parent.is_dir():
        raise CriuctlError(f"{out.parent} does not exist", "create the parent directory first")


def _thaw(root_pid: int) -> None:
    for pid in procinfo.tree_pids(root_pid):
        procinfo.send_signal(pid, signal.SIGCONT)


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
    _criu: threading.Thread | None = None
    _session: criu.Session | None = None
    _error: list[BaseException] = field(default_factory=list)

    @property
    def pids(self) -> list[int]:
        return procinfo.tree_pids(self.workload.root_pid)

    def thaw(self) -> None:
        """Let the tree run on where it was; remove the bundle."""
        if self._criu is not None:
            self._session.kill()  # stop serving pages; CRIU's death releases the tree
            self._criu.join()
        _thaw(self.workload.root_pid)
        shutil.rmtree(self.bundle_dir, ignore_errors=True)

    def commit(self, state: str = workloads.CHECKPOINTED, **record: str) -> None:
        """The job now lives in the bundle (or on the node that restored it): end the tree.

        In post-copy, first queue a SIGSTOP to every process: should CRIU fail while serving
        pages, it lets the tree go, and the tree must not run on beside its copy. Then wait for
        the last page to be pulled before killing.
        """
        w = self.workload
        w.state = state
        for k, v in record.items():
            setattr(w, k, v)
        workloads.save(w)
        if self._criu is not None:
            for pid in self.pids:
                procinfo.send_signal(pid, signal.SIGSTOP)
            self._criu.join()
        os.kill(w.root_pid, signal.SIGKILL)  # PID 1 of the namespace: takes the whole tree


def freeze(target: str, parent: Path, lazy_port: int | None = None, progress: Progress = _quiet) -> Frozen:
    """Freeze workload `target` (name or PID) and seal its bundle in a new directory under `parent`.

    With `lazy_port` (post-copy) memory pages stay out of the bundle: CRIU serves them on that port
    once the bundle is sealed. On any failure the tree is thawed and nothing is left behind.
    """
    started = time.monotonic()
    criu.require_version()
    w = workloads.resolve(target)
    key = bundle.load_key(workloads.key_path())
    processes = procinfo.describe(w.root_pid)
    pids = [p.pid for p in processes]
    for pid, fd, what, fix in procinfo.unsupported_resources(pids)[:1]:
        name = next(p.name for p in processes if p.pid == pid)
        raise CriuctlError(
            f"PID {pid} ({name}) holds {what} (fd {fd}), which CRIU cannot checkpoint",
            f"{fix}; nothing was frozen, the workload keeps running",
        )
    staging = Path(tempfile.mkdtemp(prefix=f".{w.name}.partial-", dir=parent))
    images = staging / bundle.IMAGES_DIR
    images.mkdir(mode=0o700)
    options = criu.DumpOptions(
        pid=w.root_pid,
        images_dir=images,
        work_dir=staging,
        leave_stopped=True,
        log_file=bundle.DUMP_LOG,
        lazy_pages=lazy_port is not None,
        page_server_port=lazy_port or 0,
        **_COMMON,
    )
    frozen = Frozen(w, staging, None, 0.0, lazy=lazy_port is not None)  # type: ignore[arg-type]
    progress("freezing")
    try:
        with _one_dump_at_a_time():
            _run_dump(frozen, options)
        progress("sealing")
        manifest = bundle.Manifest(
            workload=w.name,
            command=w.command,
            processes=processes,
            open_files=procinfo.open_files(pids),
            uses_gpu=procinfo.uses_gpu(pids),
            criu_version=".".join(map(str, criu.version())),
            stdio_pipes=w.stdio_pipes,
            lazy_pages=frozen.lazy,
        )
        manifest.freeze_seconds = time.monotonic() - started
        frozen.manifest = bundle.seal(staging, manifest, key)
        frozen.freeze_seconds = manifest.freeze_seconds
    except BaseException as exc:
        log = _keep_log(staging / bundle.DUMP_LOG, w.name)
        frozen.thaw()
        if isinstance(exc, criu.CriuError) and not w.alive():
            raise CriuctlError(
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


FREEZE_LOCK = Path("/run/criuctl-dump.lock")


@contextlib.contextmanager
def _one_dump_at_a_time() -> Iterator[None]:
    """Serialise CRIU dumps on this host.

    For a task in its own PID namespace, CRIU's parasite mounts a /proc at `proc.crtools` in the
    task's *working directory*; two dumps of jobs started from one folder at once collide there
    (`Can't create a directory (-17)`), and one fails. Freezing is the short part of a migration;
    transfers and restores still run side by side.
    """
    fd = os.open(FREEZE_LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


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


def dump(target: str, out: Path, leave_running: bool = False, progress: Progress = _quiet) -> DumpOutcome:
    """Checkpoint workload `target` (name or PID) into bundle directory `out`."""
    started = time.monotonic()
    out = out.absolute()
    _check_out_dir(out)
    frozen = freeze(target, out.parent, progress=progress)
    try:
        if out.exists():
            out.rmdir()
        os.rename(frozen.bundle_dir, out)
    except BaseException:
        frozen.thaw()
        raise
    frozen.bundle_dir = out
    # Commit: the bundle is complete and signed.
    if leave_running:
        _thaw(frozen.workload.root_pid)
    else:
        frozen.commit(bundle=str(out))
    size = bundle.size_bytes(out)
    return DumpOutcome(out, frozen.manifest, frozen.freeze_seconds, time.monotonic() - started, size)


@dataclass
class Restored:
    """A tree CRIU recreated, still stopped: `start` lets it run (and registers it), `abort` kills it."""

    workload: workloads.Workload
    stdio: supervisor.Stdio
    criu_seconds: float
    lazy_daemon: subprocess.Popen | None = None

    def start(self, **record: object) -> None:
        w = self.workload
        for k, v in record.items():
            setattr(w, k, v)
        workloads.save(w)
        self.stdio.close_write_ends()
        _thaw(w.root_pid)

    def abort(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.workload.root_pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.workload.root_pid, 0)
        if self.lazy_daemon is not None:
            self.lazy_daemon.kill()
            self.lazy_daemon.wait()
        for fd in (self.stdio.out_r, self.stdio.out_w, self.stdio.err_r, self.stdio.err_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def restore_stopped(
    bundle_dir: Path,
    name: str | None = None,
    page_server: tuple[str, int] | None = None,
    digests: dict[str, str] | None = None,
    progress: Progress = _quiet,
) -> Restored:
    """Verify a bundle and recreate its tree, stopped, as our child (see `Restored`).

    A post-copy bundle needs `page_server` (the source's address and port): a `criu lazy-pages`
    daemon pulls the missing pages from it, on demand and in the background.
    """
    bundle_dir = bundle_dir.absolute()
    manifest = bundle.verify(bundle_dir, bundle.load_key(workloads.key_path(), create=False), digests)
    criu.require_version()
    if manifest.lazy_pages and page_server is None:
        raise CriuctlError(
            f"{bundle_dir} is a post-copy bundle: its memory is still on the source node",
            "it can only be restored by `criuctl migrate --mode post-copy`",
        )
    name = workloads.unique_name(name or manifest.workload)
    images = bundle_dir / bundle.IMAGES_DIR
    work = Path(tempfile.mkdtemp(prefix=f"restore-{name}-", dir=workloads.logs_dir("restores")))
    stdio = supervisor.Stdio.create()
    inherit = {
        manifest.stdio_pipes[k]: fd
        for k, fd in (("stdout", stdio.out_w), ("stderr", stdio.err_w))
        if k in manifest.stdio_pipes
    }
    lazy = None
    progress("restoring")
    try:
        if page_server is not None:
            lazy = criu.lazy_pages_daemon(images, work, *page_server)
        result = criu.restore(
            criu.RestoreOptions(
                images_dir=images,
                work_dir=work,
                inherit_fds=inherit,
                leave_stopped=True,
                lazy_pages=lazy is not None,
                **_COMMON,
            )
        )
    except BaseException:
        if lazy is not None:
            lazy.kill()
            lazy.wait()
        for fd in (stdio.out_r, stdio.out_w, stdio.err_r, stdio.err_w):
            os.close(fd)
        raise
    w = workloads.Workload(
        name=name,
        command=manifest.command,
        root_pid=result.pid,
        supervisor_pid=os.getpid(),
        stdio_pipes=stdio.keys(),
        restored_from=str(bundle_dir),
    )
    return Restored(w, stdio, result.seconds, lazy)


def restore(bundle_dir: Path, name: str | None = None, progress: Progress = _quiet) -> int:
    """Verify and restore a bundle, then supervise it in the foreground; returns its exit status."""
    r = restore_stopped(bundle_dir, name, progress=progress)
    r.start()
    print(
        f"criuctl: restored {r.workload.name!r} from {r.workload.restored_from} in {r.criu_seconds:.2f} s "
        f"(PID {r.workload.root_pid})",
        file=sys.stderr,
        flush=True,
    )
    return supervisor.supervise(r.workload, r.stdio)


def _keep_log(log: Path, name: str) -> Path | None:
    """Keep a failed dump's CRIU log (the staging directory is about to go)."""
    if not log.exists():
        return None
    kept = workloads.logs_dir("logs") / f"dump-{name}-{time.strftime('%Y%m%dT%H%M%S')}.log"
    shutil.move(log, kept)
    return kept
