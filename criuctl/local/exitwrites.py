"""What the kernel writes into a killed thread's memory, disarmed before a served tree is killed.

Why: post-copy through a successor (criuctl.agent.pageserving) kills the dumped tree while CRIU
still serves its memory pages from its page pipes, and those pipes hold the tree's own pages
(vmsplice), not copies. A thread that exits writes into its process's memory: the kernel zeroes
its `clear_child_tid` word (glibc's `struct pthread` tid, in the thread's stack) and marks the
robust mutexes it holds owner-died. Served after that, the restored job's threads read tid 0, and
the job crashed in libc when it joined them (seen: SIGSEGV at the job's end, every time). So
before the kill, each thread is made to call `set_tid_address(NULL)` and `set_robust_list(NULL)`,
through ptrace, as a debugger calls a function; it then exits writing nothing. The restore is
untouched: CRIU's images hold both values, dumped before, and it sets them in the restored threads.

A tree whose disarming fails part-way is armed again, from those images, before it may be thawed:
its threads must wake their joiners when they end.

x86-64 only (the registers and the system call instruction are the architecture's); elsewhere
`supported()` is False and the successor path moves by stop-and-copy.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
from collections.abc import Callable
from pathlib import Path

from criuctl.core import procinfo
from criuctl.core.errors import CriuctlError
from criuctl.format import criuimages

_PTRACE_GETREGS, _PTRACE_SETREGS, _PTRACE_SINGLESTEP, _PTRACE_DETACH = 12, 13, 9, 17
_PTRACE_SEIZE, _PTRACE_INTERRUPT = 0x4206, 0x4207
_NR_SET_TID_ADDRESS, _NR_SET_ROBUST_LIST = 218, 273  # x86-64
_ROBUST_LIST_HEAD = 24  # sizeof(struct robust_list_head): the only length the kernel takes
_WALL = 0x40000000
_SYSCALL = b"\x0f\x05"
_NO_SYSCALL = 2**64 - 1  # orig_rax -1: nothing for the kernel to restart
_STEPS = 4


class _Regs(ctypes.Structure):
    """struct user_regs_struct (x86-64)."""

    _fields_ = [
        (name, ctypes.c_ulonglong)
        for name in [
            "r15",
            "r14",
            "r13",
            "r12",
            "rbp",
            "rbx",
            "r11",
            "r10",
            "r9",
            "r8",
            "rax",
            "rcx",
            "rdx",
            "rsi",
            "rdi",
            "orig_rax",
            "rip",
            "cs",
            "eflags",
            "rsp",
            "ss",
            "fs_base",
            "gs_base",
            "ds",
            "es",
            "fs",
            "gs",
        ]
    ]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.ptrace.restype = ctypes.c_long
_libc.ptrace.argtypes = (ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p)


class DisarmFailed(CriuctlError):
    """A thread of the tree could not be disarmed: the tree must not be killed while it is served."""


def supported() -> bool:
    return platform.machine() == "x86_64"


def _ptrace(request: int, tid: int, addr: int = 0, data: object = None) -> int:
    got = int(_libc.ptrace(request, tid, addr, data))
    if got == -1:
        err = ctypes.get_errno()
        raise OSError(err, f"ptrace({request}) on thread {tid}: {os.strerror(err)}")
    return got


def _stopped(tid: int) -> None:
    _, status = os.waitpid(tid, _WALL)
    if not os.WIFSTOPPED(status):
        raise OSError(f"thread {tid} ended while it was being disarmed")


def _syscall_ip(pid: int) -> int:
    """The address of a system call instruction in `pid`'s vDSO (every x86-64 process has one)."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if line.endswith("[vdso]"):
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            with open(f"/proc/{pid}/mem", "rb") as mem:
                mem.seek(start)
                at = mem.read(end - start).find(_SYSCALL)
            if at >= 0:
                return start + at
    raise DisarmFailed(f"process {pid} has no vDSO with a system call instruction")


def _call(tid: int, base: _Regs, ip: int, nr: int, *args: int) -> int:
    """Have stopped thread `tid` make system call `nr` with `args`; its result (negative: -errno)."""
    r = _Regs.from_buffer_copy(base)
    r.rip, r.rax, r.orig_rax = ip, nr, _NO_SYSCALL
    for name, value in zip(("rdi", "rsi", "rdx"), args, strict=False):
        setattr(r, name, value)
    _ptrace(_PTRACE_SETREGS, tid, 0, ctypes.byref(r))
    out = _Regs()
    # A thread stopped inside a system call of its own first finishes that call's exit when it is
    # resumed, and the single step reports there, before any instruction of ours ran: step again
    # until the system call instruction is behind it.
    for _ in range(_STEPS):
        _ptrace(_PTRACE_SINGLESTEP, tid)
        _stopped(tid)
        _ptrace(_PTRACE_GETREGS, tid, 0, ctypes.byref(out))
        if out.rip == ip + len(_SYSCALL):
            return ctypes.c_longlong(out.rax).value
    raise OSError(f"thread {tid} did not make system call {nr} in {_STEPS} steps")


def _threads(pids: list[int]) -> list[tuple[int, int]]:
    out = []
    for pid in pids:
        with contextlib.suppress(OSError):
            out += [(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task")]
    return out


def _each(threads: list[int], pid_of: dict[int, int], act: Callable[[int, _Regs, int], None]) -> None:
    """Seize each thread (stopped, not traced), run `act(tid, regs, syscall address)` in it, put its
    registers back and let it go (it stays stopped)."""
    seized: list[int] = []
    ips: dict[int, int] = {}
    try:
        for tid in threads:
            _ptrace(_PTRACE_SEIZE, tid)
            seized.append(tid)
            _ptrace(_PTRACE_INTERRUPT, tid)
            _stopped(tid)
            base = _Regs()
            _ptrace(_PTRACE_GETREGS, tid, 0, ctypes.byref(base))
            pid = pid_of[tid]
            ip = ips[pid] if pid in ips else ips.setdefault(pid, _syscall_ip(pid))
            try:
                act(tid, base, ip)
            finally:
                _ptrace(_PTRACE_SETREGS, tid, 0, ctypes.byref(base))
    except OSError as exc:
        raise DisarmFailed(f"a thread of the tree could not be disarmed: {exc}") from exc
    finally:
        for tid in seized:
            with contextlib.suppress(OSError):
                _ptrace(_PTRACE_DETACH, tid)


def _checked(tid: int, what: str, got: int) -> None:
    if got < 0:
        raise OSError(-got, f"{what} in thread {tid}: {os.strerror(-got)}")


def disarm(pids: list[int], images_dir: Path) -> int:
    """Make every thread of the stopped processes `pids` forget its clear_child_tid and robust list,
    so that its death writes nothing into its memory; how many threads. DisarmFailed when one could
    not be: the threads done so far are first armed again from the dump's images (`images_dir`),
    so that the tree may be thawed."""
    threads = _threads(pids)
    pid_of = dict((tid, pid) for pid, tid in threads)
    done: list[int] = []

    def act(tid: int, base: _Regs, ip: int) -> None:
        _checked(tid, "set_tid_address", _call(tid, base, ip, _NR_SET_TID_ADDRESS, 0))
        done.append(tid)
        _checked(tid, "set_robust_list", _call(tid, base, ip, _NR_SET_ROBUST_LIST, 0, _ROBUST_LIST_HEAD))

    try:
        _each([tid for _, tid in threads], pid_of, act)
    except DisarmFailed:
        with contextlib.suppress(DisarmFailed, CriuctlError):
            _rearm(done, pid_of, criuimages.thread_exit_words(images_dir))
        raise
    return len(done)


def _rearm(tids: list[int], pid_of: dict[int, int], words: dict[int, criuimages.ExitWords]) -> None:
    """Give threads `tids` back the clear_child_tid and robust list the dump's images hold (keyed
    by the thread's ID in its PID namespace)."""
    by_tid = {tid: w for tid in tids if (w := words.get(procinfo.ns_pid(tid))) is not None}

    def act(tid: int, base: _Regs, ip: int) -> None:
        w = by_tid[tid]
        _checked(tid, "set_tid_address", _call(tid, base, ip, _NR_SET_TID_ADDRESS, w.clear_tid))
        size = w.robust_len or _ROBUST_LIST_HEAD
        _checked(tid, "set_robust_list", _call(tid, base, ip, _NR_SET_ROBUST_LIST, w.robust_head, size))

    _each(list(by_tid), pid_of, act)
