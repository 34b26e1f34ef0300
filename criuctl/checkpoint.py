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

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
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


def dump(target: str, out: Path, leave_running: bool = False, progress: Progress = _quiet) -> DumpOutcome:
    """Checkpoint workload `target` (name or PID) into bundle directory `out`."""
    started = time.monotonic()
    criu.require_version()
    w = workloads.resolve(target)
    out = out.absolute()
    _check_out_dir(out)
    key = bundle.load_key(workloads.key_path())
    processes = procinfo.describe(w.root_pid)
    pids = [p.pid for p in processes]
    for pid, fd, what, fix in procinfo.unsupported_resources(pids)[:1]:
        name = next(p.name for p in processes if p.pid == pid)
        raise CriuctlError(
            f"PID {pid} ({name}) holds {what} (fd {fd}), which CRIU cannot checkpoint",
            f"{fix}; nothing was frozen, the workload keeps running",
        )
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    images = staging / bundle.IMAGES_DIR
    images.mkdir(mode=0o700)
    progress("freezing")
    try:
        result = criu.dump(
            criu.DumpOptions(
                pid=w.root_pid,
                images_dir=images,
                work_dir=staging,
                leave_stopped=True,
                log_file=bundle.DUMP_LOG,
                **_COMMON,
            )
        )
        progress("sealing")
        manifest = bundle.Manifest(
            workload=w.name,
            command=w.command,
            processes=processes,
            open_files=procinfo.open_files(pids),
            uses_gpu=procinfo.uses_gpu(pids),
            criu_version=".".join(map(str, criu.version())),
            stdio_pipes=w.stdio_pipes,
            freeze_seconds=result.seconds,
        )
        bundle.seal(staging, manifest, key)
        if out.exists():
            out.rmdir()
        os.rename(staging, out)
    except BaseException as exc:
        _thaw(w.root_pid)
        log = _keep_log(staging / bundle.DUMP_LOG, w.name)
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(exc, CriuctlError) and log:
            exc.hint += f" (CRIU log: {log})"
        if isinstance(exc, OSError) and exc.errno == 28:
            raise CriuctlError(
                f"disk full while writing {out}",
                "free space or pick another -o directory; the workload keeps running",
            ) from exc
        raise
    # Commit: the bundle is complete and signed.
    if leave_running:
        _thaw(w.root_pid)
    else:
        w.state, w.bundle = workloads.CHECKPOINTED, str(out)
        workloads.save(w)
        os.kill(w.root_pid, signal.SIGKILL)  # PID 1 of the namespace: takes the whole tree
    return DumpOutcome(out, manifest, result.seconds, time.monotonic() - started, bundle.size_bytes(out))


def restore(bundle_dir: Path, name: str | None = None, progress: Progress = _quiet) -> int:
    """Verify and restore a bundle, then supervise it in the foreground; returns its exit status."""
    bundle_dir = bundle_dir.absolute()
    manifest = bundle.verify(bundle_dir, bundle.load_key(workloads.key_path(), create=False))
    criu.require_version()
    name = workloads.unique_name(name or manifest.workload)
    stdio = supervisor.Stdio.create()
    inherit = {
        manifest.stdio_pipes[k]: fd
        for k, fd in (("stdout", stdio.out_w), ("stderr", stdio.err_w))
        if k in manifest.stdio_pipes
    }
    work = Path(tempfile.mkdtemp(prefix=f"restore-{name}-", dir=_logs_dir("restores")))
    progress("restoring")
    try:
        result = criu.restore(
            criu.RestoreOptions(
                images_dir=bundle_dir / bundle.IMAGES_DIR, work_dir=work, inherit_fds=inherit, **_COMMON
            )
        )
    except BaseException:
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
    workloads.save(w)
    stdio.close_write_ends()
    print(
        f"criuctl: restored {name!r} from {bundle_dir} in {result.seconds:.2f} s (PID {result.pid})",
        file=sys.stderr,
        flush=True,
    )
    return supervisor.supervise(w, stdio)


def _logs_dir(kind: str) -> Path:
    d = workloads.state_dir() / kind
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


def _keep_log(log: Path, name: str) -> Path | None:
    """Keep a failed dump's CRIU log (the staging directory is about to go)."""
    if not log.exists():
        return None
    kept = _logs_dir("logs") / f"dump-{name}-{time.strftime('%Y%m%dT%H%M%S')}.log"
    shutil.move(log, kept)
    return kept
