"""PID 1 of a workload's PID namespace: start the command, forward signals, reap, pass on its status.

Why a separate init: CRIU dumps a PID namespace only from its PID 1, and a namespace init ignores
every signal it has no handler for, so a trainer running as PID 1 would ignore the preStop SIGTERM.
This init is part of the dumped tree, so it stays tiny: standard library only (it is exec'd with
`python -I -m criuctl.core.nsinit`, never with the workload's PYTHONPATH).

It also keeps io_uring out of the workload with a seccomp filter (io_uring_setup fails with ENOSYS):
CRIU cannot dump an io_uring, and torch's gloo opens one when it can, falling back to epoll.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import signal
import struct
import sys

FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGWINCH,
)
ENV_ALLOW_IO_URING = "CRIUCTL_ALLOW_IO_URING"
# The fd of a pipe on which the supervisor learns whether the command could be executed: it reads
# EOF when exec succeeded (the fd is close-on-exec) and an errno when it did not. Without it a
# command that cannot start would look like a workload that started and exited.
ENV_REPORT_FD = "CRIUCTL_INIT_REPORT_FD"
# The pod's UID (the webhook sets it from the downward API). When the node's agent has marked that
# pod's job as moved (MOVED_DIR/UID beside this file, written before the frozen job ended), this
# container is one the kubelet restarted after the job left: starting the command again would run
# the job a second time, from its first step, beside its moved copy. It waits instead.
ENV_POD_UID = "CRIUCTL_POD_UID"
# criuctl_hook.contract.ENV_HOOKS_DIR: this file runs alone in a container, where it cannot import
# the hook's contract, so the name is written here too (tests/test_env.py checks the two agree).
ENV_HOOKS_DIR = "CRIUCTL_HOOKS_DIR"
# criuctl_hook.contract.ENV_CONTROL_DIR, and where a container's trainers keep their control
# directory: in the container's own /run, which the node's criuctl reaches through /proc/PID/root
# (criuctl.local.stepboundary.container_control). A placeholder's init keeps its FIFOs beside it.
ENV_CONTROL_DIR = "CRIUCTL_CONTROL_DIR"
ENV_WORKLOAD = "CRIUCTL_WORKLOAD"  # the hook acts only where it is set: the container's host name
BOUNDARY_DIR = "/run/criuctl/boundary"
MOVED_DIR = "moved"
# In a placeholder container: where the init listens for the restorer ("ctl") and writes the
# signals it gets ("signals"). The restorer reaches them through /proc/PID/root
# (criuctl.container.placeholder).
CONTROL_DIR = "/run/criuctl"
PLACEHOLDER = "--placeholder"
# A container gets this file and the hook from the node's inject dir, mounted read-only here, and
# runs `python3 -I INJECT_MOUNT/INJECT_NAME -- CMD` (the webhook rewrites its command so).
INJECT_MOUNT = "/.criuctl"
INJECT_NAME = "nsinit.py"

# seccomp/BPF constants (linux/seccomp.h, linux/filter.h, linux/audit.h)
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_ENOSYS = 38
_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_NR_IO_URING_SETUP = 425  # same number on every architecture (generic syscall table)


def block_io_uring() -> bool:
    """Install the filter for this process and all its descendants; False where unsupported."""
    arch = _ARCH.get(platform.machine())
    if arch is None:
        return False
    prog = [
        (_LD_W_ABS, 0, 0, 4),  # A = seccomp_data.arch
        (_JEQ_K, 0, 3, arch),  # other arch (x32/compat): allow
        (_LD_W_ABS, 0, 0, 0),  # A = seccomp_data.nr
        (_JEQ_K, 0, 1, _NR_IO_URING_SETUP),
        (_RET_K, 0, 0, _RET_ERRNO | _ENOSYS),
        (_RET_K, 0, 0, _RET_ALLOW),
    ]
    raw = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    buf = ctypes.create_string_buffer(raw, len(raw))
    fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(buf))
    fbuf = ctypes.create_string_buffer(fprog, len(fprog))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    return bool(libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fbuf), 0, 0) == 0)


def exit_code(status: int) -> int:
    """A wait status as a shell would report it: the exit code, or 128 + the signal."""
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _report_fd() -> int | None:
    """The supervisor's exec-report pipe, close-on-exec here; None when run by hand."""
    raw = os.environ.pop(ENV_REPORT_FD, "")  # the command must not inherit it
    if not raw.isdigit():
        return None
    fd = int(raw)
    try:
        os.set_inheritable(fd, False)
    except OSError:
        return None
    return fd


def _say(line: str) -> None:
    """A line in the container's log (what `kubectl logs` shows)."""
    with contextlib.suppress(OSError):
        sys.stderr.write(f"criuctl: {line}\n")
        sys.stderr.flush()


def placeholder(control: str = CONTROL_DIR) -> int:
    """Wait, as a container's PID 1, for criuctl to restore a job into this container.

    The job's tree is not our child (it has a PID namespace of its own): its restorer tells us
    how it goes on `ctl`, one line at a time, and we exit with the job's status. Signals we get
    go to the restorer on `signals`; with nobody there (no job yet) they end the placeholder.
    """
    os.makedirs(control, mode=0o700, exist_ok=True)
    for name in ("ctl", "signals"):
        path = os.path.join(control, name)
        if not os.path.exists(path):
            os.mkfifo(path, 0o600)
    ctl = os.open(os.path.join(control, "ctl"), os.O_RDWR)  # read-write: no EOF between writers
    state = {"job": False}

    def forward(n: int, _frame: object) -> None:
        try:
            fd = os.open(os.path.join(control, "signals"), os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            fd = -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.write(fd, f"{n}\n".encode())
            os.close(fd)
        if fd < 0 or not state["job"]:
            _say(f"placeholder stopped by signal {n} before a job was restored into it")
            os._exit(128 + n)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    _say("placeholder ready; waiting for a job to be restored here")
    pending = b""
    while True:
        chunk = os.read(ctl, 4096)
        pending += chunk
        while b"\n" in pending:
            raw, pending = pending.split(b"\n", 1)
            line = raw.decode(errors="replace").strip()
            word, _, rest = line.partition(" ")
            word = word.rstrip(":")
            if word == "restoring":
                _say(f"restoring a job here{': ' + rest if rest else ''}")
            elif word == "running":
                state["job"] = True
                _say(f"the job was restored here and runs{': ' + rest if rest else ''}")
            elif word == "aborted":
                state["job"] = False
                _say(f"the restore was aborted ({rest or 'no reason given'}); this placeholder is empty")
            elif word == "exit" and rest.strip().isdigit():
                return int(rest)


def _hooks_env() -> None:
    """Put the hook shipped beside this file on PYTHONPATH (a container gets both in one volume), and
    give it its control directory in the container's /run: the step boundary works in a pod too."""
    here = os.path.dirname(os.path.abspath(__file__))
    hooks = os.path.join(here, "hooks")
    if os.path.isdir(os.path.join(hooks, "criuctl_hook")) and ENV_HOOKS_DIR not in os.environ:
        os.environ[ENV_HOOKS_DIR] = hooks
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [hooks, os.environ.get("PYTHONPATH")]))
        os.environ.setdefault(ENV_CONTROL_DIR, BOUNDARY_DIR)
        os.environ.setdefault(ENV_WORKLOAD, os.uname().nodename or "container")


def moved_to() -> str | None:
    """The node this pod's job moved to, if the agent marked it (see ENV_POD_UID)."""
    uid = os.environ.get(ENV_POD_UID, "")
    if not uid or "/" in uid or uid.startswith("."):
        return None
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), MOVED_DIR, uid)) as f:
            return f.read().strip() or "another node"
    except OSError:
        return None


def stay_moved(node: str) -> int:
    """The job runs on `node` now: wait, doing nothing, until the container is stopped."""
    for sig in FORWARDED:  # first: a stop that comes as soon as it is said ends it cleanly
        signal.signal(sig, lambda n, _f: os._exit(0))
    _say(f"this pod's job moved to node {node} (criuctl migrate); it is not started here again")
    while True:
        signal.pause()


def main(argv: list[str]) -> int:
    if argv and argv[0] == PLACEHOLDER:
        return placeholder()
    if (node := moved_to()) is not None:
        return stay_moved(node)
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        print("criuctl-init: no command", file=sys.stderr)
        return 2
    report = _report_fd()
    if os.getsid(0) != os.getpid():
        os.setsid()  # the session must start inside the tree, or CRIU cannot dump it
    _hooks_env()
    if os.environ.get(ENV_ALLOW_IO_URING) != "1" and not block_io_uring():
        print("criuctl-init: warning: could not block io_uring; CRIU may fail to dump", file=sys.stderr)
    child = os.fork()
    if child == 0:
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            if report is not None:
                os.write(report, str(exc.errno or 0).encode())  # the supervisor says it, in one line
            else:
                print(f"criuctl: cannot start {argv[0]!r}: {exc.strerror}", file=sys.stderr)
        os._exit(127)
    if report is not None:
        os.close(report)  # nothing of the supervisor's stays in the dumped tree
    for sig in FORWARDED:
        signal.signal(sig, lambda n, _f: os.kill(child, n))
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 0
        if pid == child:
            # Leaving kills whatever the trainer left behind: nothing outlives its workload.
            return exit_code(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
