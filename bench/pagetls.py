"""Post-copy's pull over CRIU's TLS (HTTPS agents, the default since issue 42) against the same pull
in the clear (`--insecure` agents), paired in one run.

Two clusters of two nodes each (network namespaces on this host, as the tests make them): one whose
agents serve HTTPS, where the source's page server and the target's lazy-pages daemon speak CRIU's
TLS pinned to certificates made for the move (criuctl.agent.pagesession), and one `--insecure`,
where they speak plain TCP. Each round moves a fresh job holding `--gib` GiB of model + Adam state
(bench/big_state.py) a → b post-copy in each cluster, the order alternating, and measures raw TCP
between the plain cluster's nodes in the same round (the VM's network drifts). What is compared:
`pages_seconds` (freeze → the last page in on the target: the pull) and the downtime (freeze →
running on the target, which the TLS handshake could lengthen).

Run as root: `.venv/bin/python bench/pagetls.py [--gib 1] [--reps 3]`; raw results in
bench/results/pagetls.json, the table in docs/benchmarks.md.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tools"))  # tests.requirements reads the local cluster's layout

from bench.migrate import bench_criuctl, bench_tcp, machine, touch_memory  # noqa: E402 - one harness
from bench.rounds import arguments  # noqa: E402
from tests.cluster import Cluster  # noqa: E402 - the same nodes the tests use

console = Console(stderr=True)
CONTENDERS = {"tls": True, "plain": False}


def main() -> int:
    ap = arguments("pagetls", reps=3)
    ap.add_argument("--gib", type=float, default=1.0)
    a = ap.parse_args()
    work = Path(a.dir)
    shutil.rmtree(work, ignore_errors=True)
    runs = []
    with Cluster(work / "tls", tls=True) as tls, Cluster(work / "plain", tls=False) as plain:
        clusters = {"tls": tls, "plain": plain}
        touch_memory()
        for c in clusters.values():  # one untimed move each: imports, page cache, first handshakes
            bench_criuctl(c, min(a.gib, 0.25), "post-copy")
        for turn in range(a.reps):
            order = list(CONTENDERS) if turn % 2 == 0 else list(CONTENDERS)[::-1]
            run: dict = {"tcp": bench_tcp(plain)}
            for name in order:
                console.print(f"  round {turn + 1}: {a.gib} GiB post-copy, {name} …")
                run[name] = bench_criuctl(clusters[name], a.gib, "post-copy")
            runs.append(run)
    out = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "gib": a.gib, "runs": runs}
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    table = Table(title=f"post-copy of {a.gib} GiB, {a.reps} paired rounds: medians (min–max)")
    for col in ("", "pull (s)", "pull GB/s", "downtime (s)"):
        table.add_column(col)
    size = a.gib * (1 << 30)

    def spread(xs: list[float], f: str = "{:.2f}") -> str:
        return f"{f.format(statistics.median(xs))} ({f.format(min(xs))}–{f.format(max(xs))})"

    for name in CONTENDERS:
        pulls = [r[name]["pages_seconds"] for r in runs]
        downs = [r[name]["downtime_seconds"] for r in runs]
        table.add_row(name, spread(pulls), spread([size / p / 1e9 for p in pulls]), spread(downs))
    ratios = [r["tls"]["pages_seconds"] / r["plain"]["pages_seconds"] for r in runs]
    table.add_row("tls ÷ plain", spread(ratios), "", "")
    table.add_row("raw TCP GB/s", spread([r["tcp"] / 1e9 for r in runs]), "", "")
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
