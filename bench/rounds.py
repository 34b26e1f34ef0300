"""Paired rounds until the spread is known: the one rule every contender-against-baseline
benchmark here follows.

A plain-CRIU baseline on these VMs moved from 3.1 s to 8.4 s between two runs on the same
machine; a ratio against such a number decides nothing. So each round runs criuctl and its
baseline back to back (the pair), the ratio is taken per round, and a size gets more rounds
while its median ratio still moves: at least `least`, then one more as long as adding the last
round moved the median by more than `tolerance` (relative), at most `most`. The tables show the
median of the per-round ratios, their min–max, and how many rounds it took.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

Round = dict
Ratio = Callable[[Round], float]


def settle(
    one: Callable[[int], Round],
    ratios: list[Ratio],
    least: int,
    most: int,
    tolerance: float = 0.05,
    say: Callable[[str], None] = print,
) -> list[Round]:
    """Rounds `one(turn)` until every ratio in `ratios` settles (see the module's docstring)."""
    runs: list[Round] = []
    while len(runs) < max(least, 1):
        runs.append(one(len(runs)))
    while len(runs) < most:
        moved = [_moved(runs, r) for r in ratios]
        if max(moved) <= tolerance:
            break
        say(f"  the median ratio moved {max(moved):.0%} with round {len(runs)}: one more")
        runs.append(one(len(runs)))
    return runs


def _moved(runs: list[Round], ratio: Ratio) -> float:
    if len(runs) < 2:
        return float("inf")
    now, before = statistics.median(map(ratio, runs)), statistics.median(map(ratio, runs[:-1]))
    return abs(now - before) / before if before else float("inf")


def paired(runs: list[Round], ratio: Ratio) -> str:
    """Median of the per-round ratios, (min–max), and the rounds: `1.23 (1.10–1.40; 5 rounds)`."""
    vals = [ratio(r) for r in runs]
    return f"{statistics.median(vals):.2f} ({min(vals):.2f}–{max(vals):.2f}; {len(vals)} rounds)"


def arguments(name: str, reps: int) -> argparse.ArgumentParser:
    """The options every benchmark here takes: rounds at least, its work folder, its raw results
    (bench/results/NAME.json); a script adds its own sizes."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=reps, help="rounds at least")
    ap.add_argument("--dir", default=f"/var/tmp/criuctl-bench-{name}")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / f"{name}.json"))
    return ap
