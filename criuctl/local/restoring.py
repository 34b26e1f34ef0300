"""The local restore workflow: verify a bundle, recreate its tree as our child, then let it run.


Interrupt-safe: from the moment CRIU starts until the restored tree is supervised (or killed),
SIGINT, SIGTERM and SIGHUP are deferred (`interrupts`). One that arrived while CRIU restored kills
what CRIU restored, and the command exits with one line and 128 + the signal's number; one that
arrives after the tree runs is forwarded to it, as `criuctl run` does. Never a stopped copy of the
job left behind, reparented to PID 1.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from criuctl.container import containers, placeholder
from criuctl.core import faults, procinfo, statedir, workloads
from criuctl.core.errors import CriuctlError
from criuctl.engine import criu
from criuctl.format import bundle
from criuctl.gpu import gpustate
from criuctl.local import interrupts, stepboundary, supervisor
from criuctl.net import readdress


def _quiet(_msg: str) -> None:
    pass


@dataclass
class Restored:
    """A tree CRIU recreated, still stopped: `start` lets it run (and registers it), `abort` kills it."""

    workload: workloads.Workload
    stdio: supervisor.Stdio | None  # None in a placeholder: the tree writes to the container's pipes
    criu_seconds: float
    lazy_daemon: subprocess.Popen | None = None
    into: placeholder.Placeholder | None = None
    manifest: bundle.Manifest | None = None
    gpu_map: dict[str, str] = field(default_factory=dict)  # old -> new GPU UUIDs (gpustate.plan)
    gpu_seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # seconds per step, for benchmarks
    work: Path | None = None  # CRIU's folder of this restore (its logs, the lazy-pages daemon's)
    _pages_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _tree_ended: bool = False  # post-copy: the job ended before its pull did

    def start(self, **record: object) -> None:
        w = self.workload
        for k, v in record.items():
            setattr(w, k, v)
        workloads.save(w)
        if self.stdio is not None:
            self.stdio.close_write_ends()
        if self.into is not None:
            self.into.close_fds()
            self.into.tell(f"running {w.name} (host PID {w.root_pid})")
        m = self.manifest
        if m is not None and m.boundary is not None:  # a trainer held at its step boundary goes on
            stepboundary.let_go_on_target(w.control or "", m.boundary.request_id)
        for pid in procinfo.tree_pids(w.root_pid):  # CRIU's restore lifted its lock and repair mode
            procinfo.send_signal(pid, signal.SIGCONT)
        if m is not None and m.gpu is not None:  # running: the driver's restore thread can work
            self.gpu_seconds = gpustate.resume_until_done(m.gpu, w.root_pid, self.gpu_map, _gpu_not_back)

    def watch_pages(self) -> str:
        """Post-copy, once the job runs: wait until the lazy-pages daemon ends, and record how
        (`Workload.pages`). A daemon that failed (the source went away, its link broke for good)
        left the job's memory incomplete, and the kernel maps zeros where a page never came: the
        job is killed at once, before it computes on them for long. Returns what was recorded."""
        assert self.lazy_daemon is not None
        return self._pages_end(self.lazy_daemon.wait())

    def _pages_end(self, rc: int, save: bool = True) -> str:
        """Record once how the pull ended (`watch_pages`'s thread and `_pull_after_exit` may both
        get here): the first word stands. Saved, unless the caller saves the record itself."""
        with self._pages_lock:
            w = self.workload
            if w.pages != workloads.PULLING:
                return w.pages or ""
            w.pages_done = time.time()
            if rc == 0:
                w.pages = workloads.PULLED
            elif self._tree_ended:  # the job's end came first: whatever its daemon did after, moot
                w.pages = workloads.ENDED
            else:
                procinfo.kill_tree(w.root_pid)
                why = criu.log_tail(self.work / "lazy-pages.log", 1) if self.work else ""
                w.pages = f"lost: CRIU's lazy-pages daemon failed (exit {rc}) before every page was here"
                w.pages += f": {why.strip()[-300:]}" if why.strip() else ""
            if save:
                with contextlib.suppress(OSError, CriuctlError):
                    workloads.save(w)
            return w.pages

    def _pull_after_exit(self) -> None:
        """The job ended while its pages were pulled (a job that finishes sooner than its pull):
        nothing is left to pull. Its daemon, which saw every process go, ends by itself; one that
        does not within `PULL_AFTER_EXIT` is killed. Recorded before the workload's exit, and
        before the placeholder ends (its cgroups, where the daemon is, go with it): a keeper that
        exited first left the record `pulling` for ever, and its move waiting on it."""
        if self.lazy_daemon is None:
            return
        if self.lazy_daemon.poll() is None:  # it pulled on when the job ended: whatever it does now is moot
            self._tree_ended = True
            try:
                self.lazy_daemon.wait(timeout=PULL_AFTER_EXIT)
            except subprocess.TimeoutExpired:
                _drop_lazy(self.lazy_daemon)
        # a daemon that had ended before the job did says how the pull went (a failed one: lost)
        self._pages_end(self.lazy_daemon.wait(), save=False)
        with self._pages_lock, contextlib.suppress(OSError, CriuctlError):
            # the last word on disk: the exit's own save (`supervisor`) may have landed after the
            # watcher's, with the pull as it was before the watcher's word
            workloads.save(self.workload)

    def abort(self, why: str = "the migration did not commit") -> None:
        _drop_lazy(self.lazy_daemon)  # first: see `_drop_lazy`
        _kill_and_reap(self.workload.root_pid)
        _close(self.stdio, self.into, why)

    def supervise(self, echo: bool = True, keeper: bool = False) -> int:
        """Stand by the running tree until it ends; the exit status for this command. A `keeper`
        (the agent's target handoff) joins the placeholder's cgroups (`placeholder.keep`)."""
        if self.into is None:
            assert self.stdio is not None
            code = supervisor.supervise(self.workload, self.stdio, echo=echo)
            self._pull_after_exit()
            return code
        lazy = (self.lazy_daemon.pid,) if self.lazy_daemon is not None else ()  # gone: the kernel says no
        code = placeholder.keep(self.into, self.workload.root_pid, join_cgroups=keeper, helpers=lazy)
        self._pull_after_exit()
        w = self.workload
        now = workloads.load(w.name)
        if now is None or now.state == workloads.RUNNING:
            w.state, w.exit_code = workloads.EXITED, code
            workloads.save(w)
        self.into.tell(f"exit {code}")  # last: the placeholder then ends, and its cgroups with it
        return code


def _gpu_not_back(exc: CriuctlError) -> None:
    """The job runs and its CUDA calls wait: said on stderr (the handoff's log, or the user's terminal)."""
    print(
        f"criuctl: warning: the GPU state is not back yet, trying again: {exc.line()}",
        file=sys.stderr,
        flush=True,
    )


def _close(stdio: supervisor.Stdio | None, into: placeholder.Placeholder | None, why: str) -> None:
    if stdio is not None:
        for fd in (stdio.out_r, stdio.out_w, stdio.err_r, stdio.err_w):
            with contextlib.suppress(OSError):
                os.close(fd)
    if into is not None:
        into.close_fds()
        into.tell(f"aborted {why}")


def _kill_and_reap(pid: int) -> None:
    """SIGKILL a restored namespace init (the namespace goes with it) and reap it (it is our child)."""
    procinfo.kill_tree(pid)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children()}


def restore_stopped(
    bundle_dir: Path,
    name: str | None = None,
    page_server: tuple[str, int] | None = None,
    digests: dict[str, str] | None = None,
    progress=_quiet,
    into: placeholder.Placeholder | None = None,
    endpoints: readdress.EndpointMap | None = None,
    vouched: bundle.Vouched | None = None,
    page_tls: criu.PageTls | None = None,
) -> Restored:
    """Verify a bundle and recreate its tree, stopped, as our child (see `Restored`).

    A post-copy bundle needs `page_server` (the source's address and port): a `criu lazy-pages`
    daemon pulls the missing pages from it, on demand and in the background (over TLS with
    `page_tls`, pinned to the page server's certificate). Raises
    `interrupts.Interrupted` if SIGINT/SIGTERM/SIGHUP came while CRIU restored: by then what CRIU
    restored is dead and reaped. A container's bundle is restored only `into` a placeholder
    container (`criuctl.container.placeholder`), which then holds the tree's files, namespaces and cgroups.
    `endpoints` gives its TCP sockets new addresses (a job's rank in a pod, whose successor has another
    address than the pod it was dumped in): applied to a copy of the socket image, after the bundle
    was verified, so the bundle itself stays as signed and can be restored again elsewhere.
    `vouched`: the memory pages this node's page server received straight from the source's dump
    (`criuctl.net.directpages`); a bundle whose pages came that way restores only with it.
    """
    bundle_dir = bundle_dir.absolute()
    t0 = time.monotonic()
    manifest = bundle.verify(bundle_dir, bundle.load_key(statedir.key_path(), create=False), digests, vouched)
    verified = time.monotonic() - t0
    criu.require_version()
    if manifest.lazy_pages and page_server is None:
        raise CriuctlError(
            f"{bundle_dir} is a post-copy bundle: its memory is still on the source node",
            "it can only be restored by `criuctl migrate --mode post-copy`",
        )
    name = workloads.unique_name(name or manifest.workload)
    # a node (or a placeholder pod) without the GPUs is refused before CRIU runs
    gpu_map = gpustate.plan(manifest.gpu, within=into.pid if into is not None else None)
    images = bundle_dir / bundle.IMAGES_DIR
    work = Path(tempfile.mkdtemp(prefix=f"restore-{name}-", dir=statedir.RESTORES.ensure()))
    if endpoints is not None:
        images = _readdressed(images, work, endpoints)
    stdio, inherit, into_options = _destination(bundle_dir, manifest, into)
    lazy = None
    result: criu.RestoreResult | None = None
    before = _children()
    progress("restoring")
    with interrupts.deferred() as caught:
        try:
            if faults.injected(faults.Fault.RESTORE):
                raise criu.CriuError(
                    "CRIU restore failed: injected fault", "a test's fault (criuctl.core.faults)"
                )
            session = criu.Session()
            if page_server is not None:
                lazy = criu.lazy_pages_daemon(images, work, *page_server, tls=page_tls)
                _end_with(lazy, session)
            result = criu.restore(
                criu.RestoreOptions(
                    images_dir=images,
                    work_dir=work,
                    inherit_fds=inherit,
                    leave_stopped=True,
                    lazy_pages=lazy is not None,
                    **into_options,
                    **criu.tree_options(),
                ),
                session,
            )
            session.swrk_pid = None  # done: nothing for the watch to kill
        except BaseException as exc:
            _undo(None, lazy, stdio, before, into, f"CRIU could not restore: {exc}")
            raise
    if caught.first is not None:
        _undo(result, lazy, stdio, before, into, f"interrupted by {caught.first.name}")
        raise interrupts.Interrupted(
            caught.first,
            f"restore of {bundle_dir} interrupted by {caught.first.name}: what CRIU had restored was killed",
            f"the bundle is untouched; restore it again with: criuctl restore {bundle_dir}",
        )
    w = workloads.Workload.of_tree(
        result.pid,
        name=name,
        command=manifest.command,
        supervisor_pid=os.getpid(),
        # into a placeholder, the job now writes to the placeholder's pipes: those are what a next
        # dump must name (the bundle's were the first container's, gone with it)
        stdio_pipes=stdio.keys() if stdio else _placeholder_pipes(into, manifest),
        restored_from=str(bundle_dir),
        container=into.container.id if into else None,
        pod_uid=(into.container.pod_uid or None) if into else None,
        pod=_pod_of(into),
        runtime=into.container.runtime if into else None,
        # a container's control directory is reached through its init's /proc/PID/root: the new one's
        control=containers.control_dir(result.pid) if into else (manifest.control_dir or None),
    )
    phases = {"verify": verified, "criu_restore": result.seconds}
    return Restored(w, stdio, result.seconds, lazy, into, manifest, gpu_map, phases=phases, work=work)


def _pod_of(into: placeholder.Placeholder | None) -> str | None:
    """NAMESPACE/POD/CONTAINER of the placeholder the job now runs in (what `ps --jobs` shows)."""
    c = into.container if into else None
    return f"{c.pod_namespace}/{c.pod_name}/{c.name}" if c is not None and c.pod_name else None


def _readdressed(images: Path, work: Path, endpoints: readdress.EndpointMap) -> Path:
    """An images folder of hard links to the verified images but a rewritten copy of `files.img`,
    the one image that holds socket addresses (the pages are never copied). Not symbolic links:
    CRIU opens some images after it entered the restored mount namespace, where a path of ours
    means nothing."""
    out = work / "images"
    out.mkdir(mode=0o700)
    for f in images.iterdir():
        if f.name == "files.img":
            (out / f.name).write_bytes(f.read_bytes())
            continue
        try:
            os.link(f, out / f.name)
        except OSError:  # another file system: a copy
            shutil.copy2(f, out / f.name)
    readdress.apply(out, endpoints)
    return out


def _placeholder_pipes(into: placeholder.Placeholder | None, manifest: bundle.Manifest) -> dict[str, str]:
    from criuctl.container import containers

    return containers.stdio_pipes(into.pid) if into is not None else manifest.stdio_pipes


def _destination(
    bundle_dir: Path, manifest: bundle.Manifest, into: placeholder.Placeholder | None
) -> tuple[supervisor.Stdio | None, dict[str, int], dict]:
    """Where the tree goes: our own pipes (a process tree), or into a placeholder (a container's)."""
    if manifest.container is None:
        if into is not None:
            raise CriuctlError(
                f"{bundle_dir} holds a process tree, not a container: it restores without a placeholder",
                "restore it with `criuctl restore BUNDLE` (no --into)",
            )
        stdio = supervisor.Stdio.create()
        inherit = {
            manifest.stdio_pipes[k]: fd
            for k, fd in (("stdout", stdio.out_w), ("stderr", stdio.err_w))
            if k in manifest.stdio_pipes
        }
        return stdio, inherit, {}
    if into is None:
        raise CriuctlError(
            f"{bundle_dir} holds container {manifest.container.id[:12]}: it restores only into a "
            "placeholder container",
            "start a placeholder (docs/containers.md) and restore with --into CONTAINER, or use migrate",
        )
    into.tell(f"restoring {manifest.workload} from node {manifest.host}")
    try:
        placeholder.prepare(into, bundle_dir, manifest.container)
        options = placeholder.restore_options(into, manifest.container, manifest.stdio_pipes)
    except BaseException as exc:
        _close(None, into, f"cannot prepare the placeholder: {exc}")
        raise
    return None, options.pop("inherit_fds"), options


def _undo(
    result: criu.RestoreResult | None,
    lazy: subprocess.Popen | None,
    stdio: supervisor.Stdio | None,
    before: set[int],
    into: placeholder.Placeholder | None = None,
    why: str = "",
) -> None:
    """Kill and reap whatever this restore created: the restored init, any other new child, the daemon."""
    _drop_lazy(lazy)
    if result is not None:
        _kill_and_reap(result.pid)
    for pid in _children() - before - {lazy.pid if lazy else -1}:
        _kill_and_reap(pid)  # CRIU failed half-way: a restored init it did not name
    _close(stdio, into, why)


def _end_with(lazy: subprocess.Popen, session: criu.Session) -> None:
    """A lazy-pages daemon that ends while CRIU still restores fails that restore at its end,
    where CRIU's undo waits for ever on the processes it traces (their namespace's init waits for
    them to be reaped, and CRIU waits for the init): CRIU is killed then, which lets them go, and
    the restore fails at once (`_undo` kills what it made)."""

    def watch() -> None:
        lazy.wait()
        session.kill()

    threading.Thread(target=watch, name="lazy-daemon-watch", daemon=True).start()


PULL_AFTER_EXIT = 10.0  # seconds a lazy-pages daemon is given to end once its job has ended


def _drop_lazy(lazy: subprocess.Popen | None) -> None:
    """Kill a copy's lazy-pages daemon *before* the copy: a daemon that saw its processes exit
    would tell the source's page server it is done, and the pages would go with it; killed, it
    leaves them served for another restore (the source's fallback, when its tree is gone)."""
    if lazy is not None:
        lazy.kill()
        lazy.wait()


def restore(
    bundle_dir: Path,
    name: str | None = None,
    progress=_quiet,
    into: placeholder.Placeholder | None = None,
    vouched: bundle.Vouched | None = None,
) -> int:
    """Verify and restore a bundle, then supervise it in the foreground; returns its exit status."""
    with interrupts.deferred() as caught:
        r = restore_stopped(bundle_dir, name, progress=progress, into=into, vouched=vouched)
        r.start()
        supervisor.forward_signals(r.workload.root_pid)  # before the signals are let through
    for sig in caught.signals:  # came after CRIU was done: the running job gets it, as under `run`
        procinfo.send_signal(r.workload.root_pid, sig)
    print(
        f"criuctl: restored {r.workload.name!r} from {r.workload.restored_from} in {r.criu_seconds:.2f} s "
        f"(PID {r.workload.root_pid}; verified in {r.phases.get('verify', 0.0):.2f} s)",
        file=sys.stderr,
        flush=True,
    )
    return r.supervise()
