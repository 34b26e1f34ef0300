"""The supervisor: starts a workload so that CRIU can checkpoint it, and stands by it until it ends.

    criuctl run (this process, outside the tree)
      └─ criuctl-init   PID 1 of a new PID namespace and session (criuctl.core.nsinit)
           └─ CMD       the user's job, with hooks/ on PYTHONPATH

The supervisor owns the pipes the workload writes its stdout/stderr to and copies them to its own;
a restore gives CRIU new pipes for the same pipe ids (`--inherit-fd`), so output keeps flowing.
It forwards SIGTERM/SIGINT/SIGHUP to the init, and exits with the workload's status; when the
workload was checkpointed and stopped, it says so on stderr and exits 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import select
import selectors
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from criuctl.core import procinfo, workloads
from criuctl.core.env import PID_NAMESPACE
from criuctl.core.errors import CriuctlError
from criuctl.core.nsinit import ENV_ALLOW_IO_URING, ENV_REPORT_FD, exit_code
from criuctl.local import stepboundary
from criuctl_hook.contract import ENV_CONTROL_DIR, ENV_HOOKS_DIR, ENV_RESUME_STATE, ENV_WORKLOAD, HOOKS_DIR

_CLONE_NEWPID = 0x20000000
_PR_SET_CHILD_SUBREAPER = 36


@dataclass
class Stdio:
    """Read ends the supervisor copies from, and the write ends handed to the workload (or CRIU)."""

    out_r: int
    out_w: int
    err_r: int
    err_w: int

    @classmethod
    def create(cls) -> Stdio:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        return cls(out_r, out_w, err_r, err_w)

    def keys(self) -> dict[str, str]:
        """CRIU's names for the pipes the workload writes to ('pipe:[inode]')."""
        return {
            "stdout": f"pipe:[{os.fstat(self.out_w).st_ino}]",
            "stderr": f"pipe:[{os.fstat(self.err_w).st_ino}]",
        }

    def close_write_ends(self) -> None:
        os.close(self.out_w)
        os.close(self.err_w)


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def workload_env(
    name: str, allow_io_uring: bool, control: Path | None = None, base: dict[str, str] | None = None
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env[ENV_WORKLOAD] = name
    if control is not None:
        env[ENV_CONTROL_DIR] = str(control)
    env[ENV_HOOKS_DIR] = str(HOOKS_DIR)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOKS_DIR), env.get("PYTHONPATH")]))
    if allow_io_uring:
        env[ENV_ALLOW_IO_URING] = "1"
    return env


_REPORT_FD = 3  # where the init finds the exec-report pipe (nsinit.ENV_REPORT_FD)
_EXEC_WAIT = 30.0  # seconds to learn whether the command started; a python start-up takes ~0.1


class CannotStart(CriuctlError):
    """The command could not be executed: nothing runs, nothing is registered.

    The exit status follows the shell's: 127 when the program is not found, 126 otherwise.
    """

    def __init__(self, command: list[str], err: int) -> None:
        program = command[0]
        if err == errno.E2BIG:
            strings = [*command, *(f"{k}={v}" for k, v in os.environ.items())]
            size = sum(len(os.fsencode(a)) + 1 for a in strings)
            longest = max(len(os.fsencode(a)) for a in strings)
            super().__init__(
                f"cannot start {program!r}: its arguments and environment are too long for the "
                f"kernel ({size} bytes, the longest string {longest}; the limits here are "
                f"{os.sysconf('SC_ARG_MAX')} in all and {_MAX_ARG_STRLEN} per string)",
                "pass long data in a file instead of on the command line",
            )
        elif err == errno.ENOENT:
            super().__init__(
                f"cannot start {program!r}: {os.strerror(err)}",
                "check the program's name and PATH: criuctl run [--name NAME] -- CMD [ARG...]",
            )
        else:
            super().__init__(
                f"cannot start {program!r}: {os.strerror(err)}",
                "make it an executable file (chmod +x, a #! line) or run it through its interpreter",
            )
        self.exit_code = 127 if err == errno.ENOENT else 126


def pid_namespace() -> bool:
    """Whether `run` gives the job its own PID namespace: yes, except on an NVIDIA GPU node.

    CUDA reads /proc/<its own PID>; without a mount namespace the job sees the node's /proc, where
    a namespace PID names another process, and CUDA's initialisation fails ("OS call failed", error
    304; seen on the H200 check host). There the job keeps the node's PIDs, which CRIU restores as
    they were: they must be free on the target (they are, once the source's tree is gone).
    CRIUCTL_PID_NAMESPACE=1 or 0 decides instead.
    """
    forced = PID_NAMESPACE.get()
    if forced is not None:
        return forced
    return not os.path.exists("/dev/nvidiactl")


_MAX_ARG_STRLEN = 32 * 4096  # linux/binfmts.h: the longest single argument or environment string


def _spawn_in_new_pidns(
    argv: list[str], env: dict[str, str], stdio: Stdio, cwd: str | None = None, new_pidns: bool = True
) -> tuple[int, int]:
    """Fork a child that is PID 1 of a new PID namespace; return its host PID and exec-report fd.

    unshare(CLONE_NEWPID) only affects the caller's *next* child, so an intermediate process does
    it, forks the init and exits; the init is reparented to us (we are a child subreaper). The
    report fd (read end) says whether both execs — the init's and the command's — worked:
    `_await_exec`.
    """
    _libc().prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    report_r, report_w = os.pipe()
    exec_r, exec_w = os.pipe()  # close-on-exec: EOF once the command runs
    middle = os.fork()
    if middle == 0:
        try:
            os.close(exec_r)
            if new_pidns and _libc().unshare(_CLONE_NEWPID) != 0:
                os.write(report_w, f"E{ctypes.get_errno()}".encode())
                os._exit(1)
            init = os.fork()
            if init == 0:
                try:
                    high = fcntl.fcntl(exec_w, fcntl.F_DUPFD_CLOEXEC, 100)  # clear of 0-3
                    devnull = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(devnull, 0)
                    os.dup2(stdio.out_w, 1)
                    os.dup2(stdio.err_w, 2)
                    os.dup2(high, _REPORT_FD)  # inheritable: nsinit makes it close-on-exec
                    os.closerange(_REPORT_FD + 1, 65536)
                    if cwd:
                        os.chdir(cwd)
                    os.execve(sys.executable, argv, {**env, ENV_REPORT_FD: str(_REPORT_FD)})
                except OSError as exc:  # the init itself cannot start (an argument list too long)
                    os.write(_REPORT_FD, str(exc.errno or 0).encode())
                finally:
                    os._exit(127)
            os.write(report_w, str(init).encode())
        finally:
            os._exit(0)
    os.close(report_w)
    os.close(exec_w)
    answer = os.read(report_r, 64).decode()
    os.close(report_r)
    os.waitpid(middle, 0)
    if not answer or answer.startswith("E"):
        os.close(exec_r)
        err = int(answer[1:] or 0)
        raise CriuctlError(
            f"cannot create a PID namespace: {os.strerror(err)}",
            "criuctl run needs root (CAP_SYS_ADMIN) on a kernel with PID namespaces",
        )
    return int(answer), exec_r


def _await_exec(init: int, exec_r: int, command: list[str]) -> None:
    """Return once the command runs; CannotStart (the init reaped) when it could not be executed."""
    try:
        ready, _, _ = select.select([exec_r], [], [], _EXEC_WAIT)
        answer = os.read(exec_r, 64) if ready else b""  # no answer in time: it is running, slowly
    finally:
        os.close(exec_r)
    if answer:
        os.waitpid(init, 0)  # it exits 127 at once; nothing is left of it
        raise CannotStart(command, int(answer) if answer.isdigit() else 0)


def start(
    command: list[str],
    name: str | None,
    allow_io_uring: bool = False,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    resume_state: Path | None = None,
) -> tuple[workloads.Workload, Stdio]:
    """Start `command` as a checkpointable workload and register it.

    `env` and `cwd` replace ours (a state bundle starts its job again as it first ran), and
    `resume_state` puts the hook in resume mode with that state directory.

    Everything that can be refused is refused before anything runs (the name, the state dir), and
    a command that cannot be executed is reported, not registered: a workload either runs
    supervised and recorded, or not at all.
    """
    if not command:
        raise CriuctlError("no command given", "usage: criuctl run [--name NAME] -- CMD [ARG...]")
    if name is None:
        name = workloads.unique_name(workloads.name_for(command[0]))
    elif (old := workloads.load(name)) is not None and old.state == workloads.RUNNING and old.alive():
        raise CriuctlError(
            f"a workload named {name!r} is already running (PID {old.root_pid})",
            "pick another --name, or stop it first",
        )
    workloads.log_path(name)  # the logs folder exists (or the state dir said why not) before the job
    stdio = Stdio.create()
    argv = [sys.executable, "-I", "-m", "criuctl.core.nsinit", "--", *command]
    control = stepboundary.control_dir(name)
    stepboundary.prepare(control)
    job_env = workload_env(name, allow_io_uring, control, env)
    if resume_state is not None:
        job_env[ENV_RESUME_STATE] = str(resume_state)
    root, exec_r = _spawn_in_new_pidns(argv, job_env, stdio, cwd, pid_namespace())
    try:
        _await_exec(root, exec_r, command)
        w = workloads.Workload.of_tree(
            root,
            name=name,
            command=command,
            supervisor_pid=os.getpid(),
            stdio_pipes=stdio.keys(),
            control=str(control),
        )
        workloads.save(w)
    except BaseException:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(root, signal.SIGKILL)  # never leave a job running that nobody supervises
            os.waitpid(root, 0)
        for fd in (stdio.out_r, stdio.out_w, stdio.err_r, stdio.err_w):
            os.close(fd)
        raise
    stdio.close_write_ends()
    return w, stdio


def forward_signals(root_pid: int) -> None:
    """From now on SIGTERM/SIGINT/SIGHUP to us go to the workload's init, which forwards them on."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda n, _f: procinfo.send_signal(root_pid, n))


def supervise(w: workloads.Workload, stdio: Stdio, echo: bool = True) -> int:
    """Copy the workload's output until it ends; return the exit status for this command.

    Output always goes to the node's log for the workload (`criuctl logs`); with `echo` also to our
    own stdout/stderr (a foreground `criuctl run`; an agent-started supervisor has no terminal).
    """
    forward_signals(w.root_pid)
    log = workloads.log_path(w.name).open("ab")
    sinks = {stdio.out_r: sys.stdout.buffer, stdio.err_r: sys.stderr.buffer}
    sel = selectors.DefaultSelector()
    for fd in sinks:
        sel.register(fd, selectors.EVENT_READ)
    status: int | None = None
    drain_until = 0.0
    while sinks:
        for key, _ in sel.select(timeout=0.2):
            data = os.read(key.fd, 1 << 16)
            if data:
                log.write(data)
                log.flush()
                if echo:
                    _write(sinks[key.fd], data)
            else:
                sel.unregister(key.fd)
                os.close(key.fd)
                del sinks[key.fd]
        if status is None:
            pid, st = os.waitpid(w.root_pid, os.WNOHANG)
            if pid:
                status, drain_until = st, time.monotonic() + 5.0
        elif time.monotonic() > drain_until:
            break  # a writer outside the namespace kept a pipe open; do not hang on it
    if status is None:
        _, status = os.waitpid(w.root_pid, 0)
    log.close()
    return _finish(w, status)


def _write(sink: BinaryIO, data: bytes) -> None:
    try:
        sink.write(data)
        sink.flush()
    except (BrokenPipeError, ValueError):
        pass  # whoever watched us went away; the log keeps everything


def _finish(w: workloads.Workload, status: int) -> int:
    now = workloads.load(w.name)
    if now is not None and now.root_pid == w.root_pid:
        if now.state == workloads.CHECKPOINTED:
            _say(
                f"criuctl: workload {w.name!r} was checkpointed to {now.bundle} and stopped; "
                f"resume it with: criuctl restore {now.bundle}"
            )
            return 0
        if now.state == workloads.MIGRATED:
            _say(
                f"criuctl: workload {w.name!r} moved to node {now.moved_to}; "
                f"follow it with: criuctl logs {w.name} --node {now.moved_to} -f"
            )
            return 0
    code = exit_code(status)
    w.state, w.exit_code = workloads.EXITED, code
    workloads.save(w)
    return code


def _say(line: str) -> None:
    with contextlib.suppress(BrokenPipeError, ValueError):
        print(line, file=sys.stderr, flush=True)
