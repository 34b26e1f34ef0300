"""What the exactly-once protocol costs: the same migration under two versions of criuctl, alternated.

The hardened protocol adds, on the migration's path: the hold record written (fsync) before the
freeze, the bundle fsynced before the source dies, the target's record written at every step, and
the source asking the target before it ends its tree. This runs one migration at a time, for each
mode and size, alternating between an older checkout (`--old`, e.g. a `git worktree` of the commit
before the change) and this one, a few times each after a warm-up, on the same pair of nodes, and
prints median downtime and total time side by side.

    .venv/bin/python bench/protocol_cost.py --old /work/baseline [--sizes 0.5] [--repeat 3]

Each measurement is a fresh `python` in that checkout (PYTHONPATH), so agents, handoffs and the
client all run that version's code; both use the same CRIU and the same job (bench/big_state.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
NEW = HERE.parent

ONE = """
import json, sys
from pathlib import Path
sys.path.insert(0, {tree!r})
import bench.migrate as m
from tests.cluster import Cluster
with Cluster(Path({work!r}), tls=False) as c:  # plain TCP in both trees (an older one has no TLS default)
    print(json.dumps(m.bench_criuctl(c, {gib}, {mode!r})))
"""


def one(tree: Path, work: Path, gib: float, mode: str) -> dict:
    subprocess.run(["rm", "-rf", str(work)], check=True)
    code = ONE.format(tree=str(tree), work=str(work), gib=gib, mode=mode)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    r = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{tree}: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", type=Path, required=True, help="a checkout of the version to compare with")
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.5])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/criuctl-bench-protocol"))
    ap.add_argument("--json", type=Path, default=HERE / "results" / "protocol_cost.json")
    a = ap.parse_args()
    trees = {"before": a.old.resolve(), "hardened": NEW}
    rows = []
    for gib in a.sizes:
        for mode in ("stop-and-copy", "post-copy"):
            for name, tree in trees.items():  # warm-up: first touch of guest memory, page cache
                one(tree, a.dir, gib, mode)
                print(f"warm-up {gib} GiB {mode} {name}", file=sys.stderr, flush=True)
            got: dict[str, list[dict]] = {n: [] for n in trees}
            for i in range(a.repeat):
                order = list(trees.items()) if i % 2 == 0 else list(reversed(trees.items()))
                for name, tree in order:
                    got[name].append(one(tree, a.dir, gib, mode))
            row = {"gib": gib, "mode": mode}
            for name, runs in got.items():
                row[name] = {
                    "downtime": statistics.median(r["downtime_seconds"] for r in runs),
                    "total": statistics.median(r["total_seconds"] for r in runs),
                    "runs": [(r["downtime_seconds"], r["total_seconds"]) for r in runs],
                }
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    a.json.parent.mkdir(exist_ok=True)
    a.json.write_text(json.dumps({"repeat": a.repeat, "rows": rows}, indent=2))
    print("| state | mode | downtime before | downtime hardened | ratio | total before | total hardened |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        b, h = r["before"], r["hardened"]
        print(
            f"| {r['gib']} GiB | {r['mode']} | {b['downtime']:.2f} s | {h['downtime']:.2f} s | "
            f"{h['downtime'] / b['downtime']:.2f} | {b['total']:.2f} s | {h['total']:.2f} s |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
