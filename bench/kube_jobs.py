"""A worker of a multi-worker PyTorchJob on Kubernetes moved by criuctl, against the same job
restarted by its operator from a `torch.distributed.checkpoint`, side by side in one run.

On the local cluster (localcluster: API server, scheduler, controller-manager, two kubelet nodes,
criuctl's agents, webhook and controller from the built image, the PyTorchJob stand-in), for each
job (ranks 3 and 4: the master on node a, the workers on b; a small model, and one with ~130 MiB of
weights + Adam state per rank), alternating, repeated:

  criuctl    `criuctl migrate JOB-worker-0 a`: its preStop checkpoints it, the operator recreates
             it, criuctl restores it there with every connection re-pointed; the other ranks
             never stop
  restart    what a job without criuctl goes through when a node is drained and its elastic
             launcher restarts: every pod of the job deleted and recreated by its operator, a new
             rendezvous, all ranks resuming from the newest DCP checkpoint (written every 10
             steps to a folder both nodes see); no failure-detection delay is counted

Measured on rank 0's step timestamps (`--times`): the *job stall* (the longest gap between two
steps around the move, less the median step), the steps lost (done since the last checkpoint,
done again), and their sum in time (stall + the lost steps' time again). For criuctl, the moved
rank's own downtime (its pod's delete to it running again, the CLI's measure) and the steps of
the successor path (its Migrated Event: criuctl.kube.moves.STEPS). Run as root:
`.venv/bin/python bench/kube_jobs.py [--reps 2] [--ranks 3 4] [--sizes small 130MiB]`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tools"))

from localcluster import __main__ as lc  # noqa: E402
from localcluster.layout import Layout  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.multinode import COLUMNS, SIZES, fmt, job_stall  # noqa: E402 - the same jobs, measured alike
from tests.kube import Kubectl, LogFollower, ddp_job  # noqa: E402

CRIUCTL = str(HERE.parent / ".venv" / "bin" / "criuctl")
console = Console(stderr=True)
STEPS, AT, EVERY, STEP_TIME = 120, 40, 10, "0.05"
DCP = Path("/var/tmp/criuctl-bench-kube-jobs-dcp")
_TIME = re.compile(r"^time (\d+) (\S+)$", re.M)
_STEP_SECONDS = re.compile(r"(\w+) (\d+\.\d+) s")


def _job(name: str, world: int, size: str, dcp: str) -> dict:
    args = ("--steps", str(STEPS), "--step-time", STEP_TIME, "--times", *SIZES[size])
    if dcp:
        args += ("--dcp", dcp, "--save-every", str(EVERY))
    return ddp_job(name, workers=world - 1, args=args, migratable=not dcp, dcp=str(DCP) if dcp else "")


def _times(log: str) -> dict[int, float]:
    return {int(m[1]): float(m[2]) for m in _TIME.finditer(log)}


def _wait(k: Kubectl, pod: str, done: object, what: str, timeout: float = 600) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = k.logs(pod)
        if done(log):
            return log
        time.sleep(0.5)
    raise SystemExit(f"{pod}: {what} not within {timeout:.0f} s: {k.logs(pod)[-800:]}")


def _at(step: int):
    return lambda log: max(_times(log), default=-1) >= step


def _final(log: str) -> bool:
    return "\nfinal " in log or log.startswith("final ")


def _gone(k: Kubectl, job: str) -> None:
    k("delete", "pytorchjob", job, "--wait=false", check=False)
    deadline = time.monotonic() + 120
    while k.pods(selector=f"training.kubeflow.org/job-name={job}") and time.monotonic() < deadline:
        time.sleep(1)


def bench_criuctl(lay: Layout, k: Kubectl, job: str, world: int, size: str) -> dict:
    k.apply(_job(job, world, size, ""))
    master = f"{job}-master-0"
    _wait(k, master, _at(AT), f"step {AT}")
    env = {**os.environ, "KUBECONFIG": str(lay.kubeconfig)}
    r = subprocess.run(
        [CRIUCTL, "migrate", f"{job}-worker-0", "a", "-o", "json"], capture_output=True, text=True, env=env
    )
    if r.returncode != 0:
        raise SystemExit(f"criuctl migrate failed: {r.stderr[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    times = _times(_wait(k, master, _final, "the end"))
    events = k(
        "get",
        "events",
        "--field-selector",
        f"involvedObject.name={job}-worker-0,reason=Migrated",
        "-o",
        "json",
    )
    said = " ".join(e["message"] for e in json.loads(events.stdout)["items"])
    _gone(k, job)
    waited, step = job_stall(times)
    return dict(
        stall=waited,
        step=step,
        lost=0,
        downtime=out["downtime_seconds"],
        freeze=out["freeze_seconds"],
        bytes=out["bytes_moved"],
        steps={name: float(sec) for name, sec in _STEP_SECONDS.findall(said)},
    )


def bench_restart(k: Kubectl, job: str, world: int, size: str) -> dict:
    dcp = DCP / job
    shutil.rmtree(dcp, ignore_errors=True)
    dcp.mkdir(parents=True)
    k.apply(_job(job, world, size, str(dcp)))
    master = f"{job}-master-0"
    _wait(k, master, _at(AT), f"step {AT}")
    old = LogFollower(k, master)  # every step it makes until its pod goes
    old.start()
    time.sleep(1)
    k("delete", "pod", "-l", f"training.kubeflow.org/job-name={job}", "--grace-period=0", "--force")
    deleted = time.time()
    old.join(60)
    before = _times(old.text)
    # the recreated master (a new pod, the same name) says it resumed from the newest checkpoint
    _wait(k, master, lambda log: "resumed " in log, "the resume from the checkpoint", 300)
    after = _times(_wait(k, master, _final, "the end"))
    _gone(k, job)
    shutil.rmtree(dcp, ignore_errors=True)
    step = job_stall(before)[1]
    last, first = max(before), min(after)
    return dict(
        stall=after[first] - before[last] - step,
        step=step,
        lost=last + 1 - first,
        downtime=after[first] - deleted,
    )


def report(rows: list[dict]) -> None:
    t = Table(title="a worker of a running PyTorchJob moved, seconds (median [min–max])")
    for col in (*COLUMNS, "stall + redo", "its downtime"):
        t.add_column(col)
    for row in rows:
        runs = row["runs"]
        what = "criuctl migrate" if row["contender"] == "criuctl" else "restart from DCP"
        t.add_row(
            str(row["ranks"]),
            row["size"],
            what,
            fmt([r["stall"] for r in runs]),
            str(max(r["lost"] for r in runs)),
            fmt([r["stall"] + r["lost"] * r["step"] for r in runs]),
            fmt([r["downtime"] for r in runs]),
        )
    Console(width=170).print(t)
    steps = [(row, r["steps"]) for row in rows for r in row["runs"] if r.get("steps")]
    if steps:
        s = Table(title="criuctl's successor path, step by step (median seconds)")
        names = list(dict.fromkeys(n for _, st in steps for n in st))
        for col in ("ranks", "state / rank", *names):
            s.add_column(col)
        for row in rows:
            if row["contender"] == "criuctl":
                cells = [statistics.median(r["steps"].get(n, 0.0) for r in row["runs"]) for n in names]
                s.add_row(str(row["ranks"]), row["size"], *(f"{x:.2f}" for x in cells))
        Console(width=170).print(s)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ranks", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/criuctl-bench-kube-jobs"))
    ap.add_argument("--out", type=Path, default=HERE / "results" / "kube_jobs.json")
    a = ap.parse_args()
    lay = Layout(a.dir, prefix="kj", net="10.202.0")
    lc.up(lay)
    rows: list[dict] = []
    try:
        k = Kubectl(lay)
        for world, size in itertools.product(a.ranks, a.sizes):
            results: dict[str, list[dict]] = {"criuctl": [], "restart": []}
            for rep in range(a.reps):
                order = ["criuctl", "restart"] if rep % 2 == 0 else ["restart", "criuctl"]
                for contender in order:
                    job = f"j{world}{size[:2].lower()}{rep}{contender[0]}"
                    if contender == "criuctl":
                        res = bench_criuctl(lay, k, job, world, size)
                    else:
                        res = bench_restart(k, job, world, size)
                    console.print(f"{world} ranks, {size}, {contender}, round {rep + 1}: {res}")
                    results[contender].append(res)
            rows += [dict(ranks=world, size=size, contender=c, runs=runs) for c, runs in results.items()]
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps({"machine": platform.node(), "rows": rows}, indent=1))  # as it goes
    finally:
        lc.down(lay)
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
