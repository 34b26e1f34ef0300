"""The one error type every criuctl layer raises at a user-facing boundary.

Each error carries what went wrong and what to do, in words for the user; the CLI prints it as one
line and exits non-zero. Lower layers chain the cause (`raise ... from exc`) and never print.
"""

from __future__ import annotations


class CriuctlError(Exception):
    """A failure the user can act on: `what` happened, `hint` says what to do."""

    exit_code = 1

    def __init__(self, what: str, hint: str = "", detail: str = "") -> None:
        super().__init__(what)
        self.what = what
        self.hint = hint
        self.detail = detail  # long context (a CRIU log tail) for verbose output, never the one line

    def line(self) -> str:
        return f"{self.what}: {self.hint}" if self.hint else self.what


class WorkloadEnded(CriuctlError):
    """The workload ended on its own while criuctl was freezing it: nothing was checkpointed, and
    nothing runs any more, so no caller may say that it "keeps running"."""


class NotRoot(CriuctlError):
    exit_code = 77

    def __init__(self, verb: str) -> None:
        super().__init__(
            f"criuctl {verb} needs root",
            "CRIU freezes processes with ptrace and reads every memory page; run it with sudo",
        )


def require_root(verb: str) -> None:
    import os

    if os.geteuid() != 0:
        raise NotRoot(verb)
