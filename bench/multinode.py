"""One rank of a multi-node gloo DDP job moved to another node, against restarting the job from a
`torch.distributed.checkpoint`, side by side in one run.

For each job size (ranks 2 and 4; a small model and one with ~130 MiB of weights + Adam state per
rank), alternating, repeated:
  criuctl    `criuctl migrate --job JOB RANK1=SPARE` (stop-and-copy, or post-copy with --modes):
             rank 1 moves, every rank keeps its connections, nothing restarts
  restart    what torchrun elastic does when a node leaves: every rank is killed and started again
             (rank 1 on the spare node), a new rendezvous, and all resume from the newest DCP
             checkpoint (written every 10 steps) — without torchrun's own failure-detection delay

Measured on rank 0's step timestamps: the *stall* (the longest gap between two steps around the
move, less the median step) and, for the restart, the steps lost (done since the last checkpoint,
done again). criuctl's own downtime (rank 1 frozen → running on its new node) is shown beside it.
Nodes are network namespaces on this host (tests.cluster). Run as root:
`.venv/bin/python bench/multinode.py [--reps 3]`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from tests.cluster import PLAIN, Cluster  # noqa: E402 - the same nodes the tests use

console = Console(stderr=True)
SCRIPT = "train_ddp_nodes.py"
SIZES = {"small": ("--width", "64"), "130MiB": ("--width", "2048", "--depth", "2")}
STEPS, AT, EVERY = 80, 25, 10  # steps of the job, the step to move at, DCP interval
COLUMNS = ("ranks", "state / rank", "contender", "job stall", "steps lost")  # bench/kube_jobs.py's too


def _log_times(c: Cluster, name: str) -> dict[int, float]:
    out = {}
    for node in c.nodes.values():
        for line in node.log(name).splitlines():
            if line.startswith("time "):
                _, i, t = line.split()
                out[int(i)] = float(t)
    return out


def _start(c: Cluster, prefix: str, placement: list[str], size: str, dcp: Path | None) -> None:
    master = f"{c.nodes[placement[0]].addr}:{random.randint(20000, 29000)}"
    extra = ("--dcp", str(dcp), "--save-every", str(EVERY)) if dcp else ()
    for rank, node in enumerate(placement):
        c.run(
            node,
            f"{prefix}-{rank}",
            SCRIPT,
            "--rank",
            str(rank),
            "--world",
            str(len(placement)),
            "--master",
            master,
            "--steps",
            str(STEPS),
            "--step-time",
            "0.05",
            "--times",
            *SIZES[size],
            *extra,
        )


def job_stall(times: dict[int, float]) -> tuple[float, float]:
    """(longest gap between consecutive steps less the median gap, the median gap)."""
    steps = sorted(times)
    gaps = [times[b] - times[a] for a, b in itertools.pairwise(steps) if b == a + 1]
    med = statistics.median(gaps)
    return max(gaps) - med, med


def _kill(c: Cluster, prefix: str) -> None:
    for node in c.nodes.values():
        for rec in node.records():
            if rec["name"].startswith(prefix + "-"):
                for pid in (rec["root_pid"], rec["supervisor_pid"]):
                    subprocess.run(["kill", "-9", str(pid)], capture_output=True)


def _wait_done(c: Cluster, name: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not c.final(name):
        if time.monotonic() > deadline:
            raise SystemExit(f"{name} did not finish")
        time.sleep(0.3)


def bench_criuctl(c: Cluster, prefix: str, world: int, size: str, mode: str) -> dict:
    nodes = list(c.nodes)
    _start(c, prefix, nodes[:world], size, None)
    c.wait_step(f"{prefix}-0", AT, timeout=300)
    r = c.client("migrate", "--job", prefix, f"{prefix}-1={nodes[world]}", "--mode", mode, "--json")
    if r.returncode != 0:
        raise SystemExit(f"criuctl migrate failed: {r.stderr[-2000:]}")
    res = json.loads(r.stdout)
    _wait_done(c, f"{prefix}-0")
    stall, step = job_stall(_log_times(c, f"{prefix}-0"))
    time.sleep(1)
    _kill(c, prefix)
    rank = res["ranks"][0]
    return dict(
        stall=stall,
        step=step,
        downtime=res["downtime_seconds"],
        lost=0,
        bytes=rank["bytes_moved"],
        freeze=rank["freeze_seconds"],
        transfer=rank["transfer_seconds"],
        restore=rank["restore_seconds"],
        total=res["total_seconds"],
    )


def bench_restart(c: Cluster, prefix: str, world: int, size: str, work: Path) -> dict:
    nodes = list(c.nodes)
    dcp = work / prefix
    shutil.rmtree(dcp, ignore_errors=True)
    dcp.mkdir(parents=True)
    _start(c, prefix, nodes[:world], size, dcp)
    c.wait_step(f"{prefix}-0", AT, timeout=300)
    before = _log_times(c, f"{prefix}-0")
    _kill(c, prefix)
    killed = time.time()
    last = max(before)
    placement = [nodes[world] if r == 1 else nodes[r] for r in range(world)]
    _start(c, prefix + "r", placement, size, dcp)
    _wait_done(c, f"{prefix}r-0")
    after = _log_times(c, f"{prefix}r-0")
    first = min(after)
    _, step = job_stall(before)
    time.sleep(1)
    _kill(c, prefix + "r")
    shutil.rmtree(dcp, ignore_errors=True)
    return dict(
        stall=after[first] - before[last] - step,
        step=step,
        downtime=after[first] - killed,
        lost=last + 1 - first,
    )


def fmt(vals: list[float], unit: str = "s") -> str:
    med = statistics.median(vals)
    return f"{med:.2f} {unit} [{min(vals):.2f}–{max(vals):.2f}]" if len(vals) > 1 else f"{med:.2f} {unit}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--modes", nargs="+", default=["stop-and-copy"], choices=["stop-and-copy", "post-copy"])
    ap.add_argument("--work", type=Path, default=Path("/tmp/criuctl-bench-multinode"))
    ap.add_argument("--out", type=Path, default=HERE / "results" / "multinode.json")
    a = ap.parse_args()
    shutil.rmtree(a.work, ignore_errors=True)
    rows: list[dict] = []
    for world in a.ranks:
        names = tuple("abcdefgh"[: world + 1])
        with Cluster(a.work / f"c{world}", names=names, tls=False) as c:  # as before TLS was the default
            for size in a.sizes:
                results: dict[str, list[dict]] = {m: [] for m in [*a.modes, "restart"]}
                for rep in range(a.reps + 1):  # the first round warms up (page cache, VM memory)
                    order = [*a.modes, "restart"]
                    if rep % 2:
                        order.reverse()
                    for contender in order:
                        prefix = f"j{world}{size[:2]}{rep}{contender[:2]}"
                        if contender == "restart":
                            res = bench_restart(c, prefix, world, size, a.work / "dcp")
                        else:
                            res = bench_criuctl(c, prefix, world, size, contender)
                        console.print(f"{world} ranks, {size}, {contender}, round {rep}: {res}")
                        if rep:
                            results[contender].append(res)
                for contender, runs in results.items():
                    rows.append(dict(ranks=world, size=size, contender=contender, runs=runs))
    table = Table(
        title=f"moving rank 1 of a running multi-node gloo DDP job over {PLAIN} (median \\[min–max])"
    )
    for col in (*COLUMNS, "its downtime", "bytes moved"):
        table.add_column(col)
    for row in rows:
        runs = row["runs"]
        what = "criuctl " + row["contender"] if row["contender"] != "restart" else "restart from DCP"
        nbytes = [r["bytes"] for r in runs if "bytes" in r]
        table.add_row(
            str(row["ranks"]),
            row["size"],
            what,
            fmt([r["stall"] for r in runs]),
            str(max(r["lost"] for r in runs)),
            fmt([r["downtime"] for r in runs]),
            f"{statistics.median(nbytes) / (1 << 20):.0f} MiB" if nbytes else "-",
        )
    Console(width=170).print(table)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"machine": platform.node(), "transport": PLAIN, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
