"""The migrator protocol's signal file, shared by the job (`criuctl.migration`) and its preStop.

States, as pytorchjob-migration has them: init -> save (the preStop asks) -> resume (the job has
saved; the next run loads) -> init (loaded). The file sits beside the checkpoint on a volume that
outlives the pod. It is replaced whole (written to a temporary name, renamed), never written in
place, so a reader never sees half a word.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from criuctl.core import env
from criuctl_hook import durable

INIT, SAVE, RESUME = "init", "save", "resume"
SIGNALS = (INIT, SAVE, RESUME)


def default_path() -> Path:
    return env.MIGRATION_SIGNAL_PATH.get()


def write(path: Path, signal: str) -> None:
    if signal not in SIGNALS:
        raise ValueError(f"a migration signal is one of {', '.join(SIGNALS)}, not {signal!r}")
    durable.replace(path, signal.encode(), 0o644)


def read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[:64].strip()
    except FileNotFoundError:
        return INIT


def prestop(path: str | None, timeout: float) -> int:
    """`criuctl prestop`: write `save`, wait for `resume`; 0 once saved, 1 (one line) if not in time."""
    signal = Path(path) if path else default_path()
    if not signal.parent.is_dir():
        print(
            f"criuctl prestop: {signal.parent} does not exist: the job's checkpoint volume is not mounted "
            f"here (set {env.MIGRATION_SIGNAL_PATH} or --signal to the job's signal file)",
            file=sys.stderr,
        )
        return 1
    if signal.is_dir() or (signal.exists() and read(signal) not in SIGNALS):
        print(
            f"criuctl prestop: {signal} is not a migration signal file (one of {', '.join(SIGNALS)}); "
            "nothing was written: pass the job's signal file",
            file=sys.stderr,
        )
        return 2
    write(signal, SAVE)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M:%S')} criuctl prestop: asked the job to save ({signal})", flush=True
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if read(signal) == RESUME:
            print(f"{time.strftime('%Y-%m-%d %H:%M:%S')} criuctl prestop: saved", flush=True)
            return 0
        time.sleep(0.2)
    print(
        f"criuctl prestop: the job did not save within {timeout:.0f} s ({signal} still says "
        f"{read(signal)!r}); is it calling migrator.listening() and still training?",
        file=sys.stderr,
    )
    return 1
