"""Hold off Ctrl-C, SIGTERM and SIGHUP while CRIU restores, then deal with them in one place.

Why: a restore is the one moment when a signal can split a job. CRIU creates the tree as our
child (rst_sibling); a KeyboardInterrupt in the middle of the RPC would end this process and leave
that tree — stopped, reparented to PID 1, invisible to `criuctl ps`. And a terminal's Ctrl-C goes
to the whole foreground process group, `criu swrk` included, which would die mid-restore.

So the signals are *blocked* (not handled) in this thread for the duration: `criu swrk`, forked
and exec'ed inside that window, inherits the blocked mask (CRIU's main process never unblocks
them), and the signals wait as pending. On leaving, they are taken off the pending set and
reported, so the caller can kill what CRIU restored and exit with the signal's status.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field

from criuctl.core.errors import CriuctlError

DEFERRED = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})


@dataclass
class Deferred:
    """The signals that arrived while deferred, in order (each once)."""

    signals: list[signal.Signals] = field(default_factory=list)

    @property
    def first(self) -> signal.Signals | None:
        return self.signals[0] if self.signals else None


@contextlib.contextmanager
def deferred() -> Iterator[Deferred]:
    """Block SIGINT/SIGTERM/SIGHUP in this thread; on exit collect the ones that arrived.

    Nests: an inner block leaves them blocked for the outer one. The caller decides what a
    collected signal means; it is never re-raised.
    """
    got = Deferred()
    old = signal.pthread_sigmask(signal.SIG_BLOCK, DEFERRED)
    try:
        yield got
    finally:
        while (info := signal.sigtimedwait(DEFERRED, 0)) is not None:
            sig = signal.Signals(info.si_signo)
            if sig not in got.signals:
                got.signals.append(sig)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


class Interrupted(CriuctlError):
    """A signal stopped the command; it exits as a process killed by that signal would (128 + n)."""

    def __init__(self, sig: signal.Signals, what: str, hint: str) -> None:
        super().__init__(what, hint)
        self.signal = sig
        self.exit_code = 128 + int(sig)
