"""`criuctl demo`: train under criuctl, freeze mid-training, restore, and prove nothing changed.

Runs the same job twice: once uninterrupted, once frozen at a step and restored from the bundle.
Every loss after the freeze and the final weights must be bit-identical. Uses the real verbs
(`criuctl run`, `dump`, `restore`) as a user would, and draws both loss curves.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from criuctl.cli import render
from criuctl.core.errors import CriuctlError
from criuctl.local import checkpoint

CRIUCTL = [sys.executable, "-m", "criuctl.cli.main"]
# Run as a script, never imported: torch loads in the training job only, not in criuctl.
TRAIN_DEMO = Path(__file__).with_name("examples") / "train_demo.py"
# What the demo needs beyond criuctl's own dependencies: the `demo` extra (pyproject.toml).
EXTRA = ("torch", "matplotlib")
_STEP = re.compile(r"^step (\d+) loss (\S+)$")
_FINAL = re.compile(r"^final (\w+)$")
_RESTORED = re.compile(r" in ([0-9.]+) s ")


class Run:
    """A criuctl process whose stdout is read line by line: steps, final digest."""

    def __init__(self, argv: list[str]) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.steps: dict[int, float] = {}
        self.final: str | None = None

    def read_until(self, stop: Callable[[int], bool], on_step: Callable[[int], None]) -> None:
        for line in self.proc.stdout:
            if m := _STEP.match(line.strip()):
                i = int(m[1])
                self.steps[i] = float.fromhex(m[2])
                on_step(i)
                if stop(i):
                    return
            elif m := _FINAL.match(line.strip()):
                self.final = m[1]

    def finish(self, on_step: Callable[[int], None]) -> tuple[int, str]:
        self.read_until(lambda _i: False, on_step)
        return self.proc.wait(), self.proc.stderr.read()


def check_installed() -> None:
    """criuctl itself never needs torch or matplotlib, so an install may lack them: say so in one line."""
    missing = [m for m in EXTRA if importlib.util.find_spec(m) is None]
    if missing:
        raise CriuctlError(
            f"criuctl demo trains a PyTorch model and draws its losses, and this Python lacks "
            f"{' and '.join(missing)}",
            "pip install 'criuctl[demo]'",
        )


def main(out: Path, steps: int = 80, freeze_at: int = 30) -> int:
    out = out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    bundle_dir = out / "bundle"
    shutil.rmtree(bundle_dir, ignore_errors=True)
    job = [sys.executable, str(TRAIN_DEMO), "--steps", str(steps)]
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description:<34}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=render.err) as bar:
        ref_task = bar.add_task("uninterrupted run", total=steps, info="")
        ref = Run([*CRIUCTL, "run", "--name", "demo-reference", "--", *job])
        rc, err = ref.finish(lambda i: bar.update(ref_task, completed=i + 1, info=f"step {i}"))
        if rc != 0:
            render.err.print(f"[red]the reference run failed ({rc}):[/] {err[-500:]}")
            return 1

        run_task = bar.add_task("run under criuctl until the freeze", total=freeze_at + 1, info="")
        run = Run([*CRIUCTL, "run", "--name", "demo", "--", *job])
        run.read_until(
            lambda i: i >= freeze_at, lambda i: bar.update(run_task, completed=i + 1, info=f"step {i}")
        )

        freeze_task = bar.add_task("freeze + checkpoint (CRIU dump)", total=1, info="")
        dumped = checkpoint.dump("demo", bundle_dir)
        bar.update(
            freeze_task,
            completed=1,
            info=f"{dumped.freeze_seconds:.2f} s, {render.human_bytes(dumped.size_bytes)}",
        )
        run.finish(lambda i: None)  # lines already in the pipe at the freeze
        frozen_after = max(run.steps)

        restore_task = bar.add_task("restore and train on", total=steps - frozen_after - 1, info="")
        t0 = time.monotonic()
        resumed = Run([*CRIUCTL, "restore", str(bundle_dir)])
        first_step: list[float] = []

        def on_restored_step(i: int) -> None:
            first_step.append(first_step[0] if first_step else time.monotonic() - t0)
            bar.update(restore_task, completed=i - frozen_after, info=f"step {i}")

        rc, err = resumed.finish(on_restored_step)
        if rc != 0:
            render.err.print(f"[red]the restored run failed ({rc}):[/] {err[-500:]}")
            return 1
    m = _RESTORED.search(err)
    restore_seconds = float(m[1]) if m else float("nan")
    combined = {**run.steps, **resumed.steps}
    identical = combined == ref.steps and resumed.final == ref.final
    plot = _plot(out / "criuctl-demo.png", ref.steps, run.steps, resumed.steps, frozen_after)
    _summary(
        dumped,
        restore_seconds,
        first_step[0] if first_step else float("nan"),
        ref,
        resumed,
        frozen_after,
        identical,
        plot,
    )
    return 0 if identical else 1


def _summary(dumped, restore_s, first_step_s, ref, resumed, frozen_after, identical, plot) -> None:
    t = Table(title="criuctl demo", show_header=False, box=None)
    t.add_row("frozen after step", str(frozen_after))
    t.add_row("freeze (CRIU dump, job stopped)", f"{dumped.freeze_seconds:.2f} s")
    t.add_row("bundle", f"{render.human_bytes(dumped.size_bytes)} at {dumped.bundle}")
    t.add_row("restore (CRIU)", f"{restore_s:.2f} s")
    t.add_row("restore to first new step", f"{first_step_s:.2f} s")
    same = sum(1 for i, v in resumed.steps.items() if ref.steps.get(i) == v)
    t.add_row(
        "losses after the freeze", f"{same}/{len(resumed.steps)} bit-identical to the uninterrupted run"
    )
    t.add_row("final weights", "identical" if resumed.final == ref.final else "DIFFERENT")
    t.add_row("plot", str(plot))
    render.out.print(t)
    render.out.print(
        "[green]OK: the restored job continued exactly where it stopped.[/]"
        if identical
        else "[red]MISMATCH: the restored job diverged from the uninterrupted run.[/]"
    )


def _plot(
    path: Path,
    ref: dict,
    before: dict,
    after: dict,
    frozen_after: int,
    labels: tuple[str, str, str] = (
        "under criuctl, before freeze",
        "restored from the bundle",
        "freeze → CRIU dump → restore",
    ),
    title: str = "Loss curves: identical after a freeze and restore",
) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    xs = sorted(ref)
    ax.plot(xs, [ref[i] for i in xs], color="tab:blue", lw=2.5, alpha=0.5, label="uninterrupted run")
    xb = sorted(before)
    ax.plot(xb, [before[i] for i in xb], "o", ms=3, color="tab:green", label=labels[0])
    xa = sorted(after)
    ax.plot(xa, [after[i] for i in xa], "x", ms=4, color="tab:red", label=labels[1])
    ax.axvline(frozen_after + 0.5, color="black", ls="--", lw=1)
    ax.annotate(
        labels[2],
        (frozen_after + 0.5, ax.get_ylim()[1]),
        ha="left",
        va="top",
        fontsize=9,
        xytext=(4, -4),
        textcoords="offset points",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(title)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
