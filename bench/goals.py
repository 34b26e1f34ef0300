"""Issue 25's goals table, from the raw results of one run of bench/migrate.py and bench/dump_restore.py.

The table in docs/benchmarks.md is this script's output: every number comes from the two JSON files
(per-round ratios, each round's criuctl and plain CRIU back to back: bench/rounds.py), so anyone can
trace it to the run that made it.

    python bench/migrate.py --sizes 0.5 2 4 --post-copy-only 8 --json bench/results/goals-migrate.json
    python bench/dump_restore.py --sizes 0.5 2 4 --json bench/results/goals-dump_restore.json
    python bench/goals.py [--migrate FILE] [--dump-restore FILE]     # prints the Markdown table
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bench.migrate import _down, _pages_done, _ratio, _stream_rate  # noqa: E402 - one home per ratio
from bench.rounds import Round  # noqa: E402


@dataclass(frozen=True)
class Goal:
    what: str
    source: str  # "migrate" or "dump_restore": which run's rows it reads
    needs: tuple[str, ...]  # the contenders a round must hold
    value: Callable[[Round], float]
    limit: float
    at_most: bool = True  # the value must be <= limit (else >=)
    sizes: tuple[float, ...] | None = None  # only these sizes (None: every size the run measured)


GOALS = [
    Goal(
        "stop-and-copy downtime ÷ plain CRIU page-server migration",
        "migrate",
        ("stop-and-copy", "plain"),
        _ratio("stop-and-copy", "plain"),
        1.1,
    ),
    Goal(
        "… the same with pages straight into the target (`CRIUCTL_STREAM=direct`)",
        "migrate",
        ("direct", "plain"),
        _ratio("direct", "plain"),
        1.1,
    ),
    Goal(
        "criuctl's stream (sealed bundle) ÷ raw TCP",
        "migrate",
        ("sealed", "tcp"),
        lambda r: _stream_rate(r) / r["tcp"],
        0.8,
        at_most=False,
    ),
    Goal(
        "`criuctl restore` ÷ plain `criu restore`",
        "dump_restore",
        ("criuctl", "criu"),
        lambda r: r["criuctl"]["restore"] / r["criu"]["restore"],
        1.1,
    ),
    Goal(
        "post-copy: every page on b ÷ plain CRIU's whole migration",
        "migrate",
        ("post-copy", "plain"),
        _ratio("post-copy", "plain"),
        0.7,
    ),
    Goal(
        "post-copy downtime, seconds",
        "migrate",
        ("post-copy",),
        lambda r: _down(r, "post-copy"),
        0.5,
        sizes=(8,),
    ),
    Goal("post-copy: every page on b, seconds (for the reader)", "migrate", ("post-copy",), _pages_done, 0.0),
]


def cell(goal: Goal, runs: list[Round]) -> tuple[str, bool | None]:
    """The median (min–max; rounds) of the goal's value over a size's rounds, and whether it is met."""
    vals = [goal.value(r) for r in runs]
    med = statistics.median(vals)
    text = f"{med:.2f} ({min(vals):.2f}–{max(vals):.2f}; {len(vals)})" if len(vals) > 1 else f"{med:.2f} (1)"
    if not goal.limit:
        return text, None
    return text, med <= goal.limit if goal.at_most else med >= goal.limit


def table(results: dict[str, dict]) -> str:
    sizes = sorted({row["gib"] for doc in results.values() for row in doc["rows"]})
    head = "| goal | " + " | ".join(f"{s:g} GiB" for s in sizes) + " | target |"
    lines = [head, "|---|" + "---|" * len(sizes) + "---|"]
    for goal in GOALS:
        by_size = {row["gib"]: row["runs"] for row in results[goal.source]["rows"]}
        cells = []
        for s in sizes:
            runs = [r for r in by_size.get(s, []) if all(k in r for k in goal.needs)]
            if not runs or (goal.sizes and s not in goal.sizes):
                cells.append("–")
                continue
            text, met = cell(goal, runs)
            cells.append(text + {True: " ✓", False: " ✗", None: ""}[met])
        target = f"{'≤' if goal.at_most else '≥'} {goal.limit:g}" if goal.limit else ""
        lines.append(f"| {goal.what} | " + " | ".join(cells) + f" | {target} |")
    runs = "; ".join(f"{k}: {doc['machine']}, {doc['date']}" for k, doc in results.items())
    lines.append("")
    lines.append(f"Median of the per-round values (min–max; rounds). Runs: {runs}.")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--migrate", default=str(HERE / "results" / "goals-migrate.json"))
    ap.add_argument("--dump-restore", default=str(HERE / "results" / "goals-dump_restore.json"))
    a = ap.parse_args()
    results = {}
    for name, path in (("migrate", a.migrate), ("dump_restore", a.dump_restore)):
        try:
            results[name] = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            print(f"goals: cannot read {path} ({exc}); run the benches first (--help)", file=sys.stderr)
            return 2
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
