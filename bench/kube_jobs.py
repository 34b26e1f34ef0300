"""A worker of a multi-worker PyTorchJob on Kubernetes moved by criuctl, against the same job
restarted by its operator from a `torch.distributed.checkpoint`, side by side in one run.

The moved worker (rank 1) holds live state besides the model (`--state-mb`: a sharded optimizer's
state, a replay buffer) in the "0.5GiB", "2GiB" and "8GiB" sizes; the other ranks only the model.
criuctl moves it by post-copy (the default) and, where asked (`--contenders ... stop-and-copy`), by
stop-and-copy; each round also measures the raw TCP rate between the two nodes, so that the pull's
time can be set against the link's time for the same bytes.

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
# the moved rank's live state (MiB); a job holding GiBs checkpoints less often (every 40 steps)
STATE = {"0.5GiB": 512, "2GiB": 2048, "8GiB": 8192}
CONTENDERS = ("criuctl", "stop-and-copy", "restart")
DCP = Path("/var/tmp/criuctl-bench-kube-jobs-dcp")
_TIME = re.compile(r"^time (\d+) (\S+)$", re.M)
_STEP_SECONDS = re.compile(r"(\w+) (\d+\.\d+) s")


def _every(size: str) -> int:
    return 40 if STATE.get(size, 0) >= 2048 else EVERY


def _at(size: str) -> int:
    return AT + 10 if _every(size) > EVERY else AT  # 10 steps past the last checkpoint, as the small


def _job(name: str, world: int, size: str, dcp: str) -> dict:
    shape = SIZES.get(size) or ("--width", "64", "--state-mb", str(STATE[size]), "--state-ranks", "1")
    # a moved rank's job runs on past its pull (~0.25 GB/s: docs/benchmarks.md): one that ended
    # sooner would time its end, not the pull, and its stall would miss the faults of a whole pull.
    # The restart's job stays short: its checkpoint of the state every 40 steps would dominate it
    steps = STEPS if dcp else STEPS + STATE.get(size, 0) // 16
    args = ("--steps", str(steps), "--step-time", STEP_TIME, "--times", *shape)
    if dcp:
        args += ("--dcp", dcp, "--save-every", str(_every(size)))
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


def _past(step: int):
    return lambda log: max(_times(log), default=-1) >= step


def link_rate(lay: Layout, nbytes: int = 1 << 30) -> float:
    """Raw TCP between the two nodes (their network namespaces), bytes a second: Python sockets,
    1 MiB sends, as bench/migrate.py measures its ceiling."""
    a, b = lay.node("a"), lay.node("b")
    recv = (
        "import socket,time;s=socket.create_server(('0.0.0.0',47777));c,_=s.accept();n=0;"
        "b=bytearray(1<<20);t=time.monotonic()\nwhile (k:=c.recv_into(b)):n+=k\n"
        "print(n/(time.monotonic()-t))"
    )
    send = (
        f"import socket;s=socket.create_connection(('{a.ip}',47777));b=bytes(1<<20)\n"
        f"for _ in range({nbytes >> 20}):s.sendall(b)\ns.close()"
    )
    inside = ["nsenter", "--net=/run/netns/{}"]
    rx = subprocess.Popen(
        [inside[0], inside[1].format(a.ns), sys.executable, "-c", recv], stdout=subprocess.PIPE, text=True
    )
    time.sleep(0.5)
    subprocess.run([inside[0], inside[1].format(b.ns), sys.executable, "-c", send], check=True)
    return float(rx.communicate(timeout=120)[0])


def _final(log: str) -> bool:
    return "\nfinal " in log or log.startswith("final ")


def _gone(k: Kubectl, job: str) -> None:
    k("delete", "pytorchjob", job, "--wait=false", check=False)
    deadline = time.monotonic() + 120
    while k.pods(selector=f"training.kubeflow.org/job-name={job}") and time.monotonic() < deadline:
        time.sleep(1)


def bench_criuctl(lay: Layout, k: Kubectl, job: str, world: int, size: str, mode: str = "post-copy") -> dict:
    k.apply(_job(job, world, size, ""))
    master = f"{job}-master-0"
    _wait(k, master, _past(_at(size)), f"step {_at(size)}")
    env = {**os.environ, "KUBECONFIG": str(lay.kubeconfig)}
    r = subprocess.run(
        [CRIUCTL, "migrate", f"{job}-worker-0", "a", "--mode", mode, "-o", "json"],
        capture_output=True,
        text=True,
        env=env,
    )
    if r.returncode != 0:  # a result too: said in the tables, the run goes on
        _gone(k, job)
        (line,) = r.stderr.strip().splitlines()[-1:] or ["(nothing said)"]
        return dict(failed=line)
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
        mode=out["mode"],
        pages=out.get("pages_seconds"),
        steps={name: float(sec) for name, sec in _STEP_SECONDS.findall(said)},
    )


def bench_restart(k: Kubectl, job: str, world: int, size: str) -> dict:
    dcp = DCP / job
    shutil.rmtree(dcp, ignore_errors=True)
    dcp.mkdir(parents=True)
    k.apply(_job(job, world, size, str(dcp)))
    master = f"{job}-master-0"
    _wait(k, master, _past(_at(size)), f"step {_at(size)}")
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


def _ok(runs: list[dict]) -> list[dict]:
    """The rounds whose move went through (a failed one says only its line)."""
    return [r for r in runs if "failed" not in r]


def report(rows: list[dict]) -> None:
    t = Table(title="a worker of a running PyTorchJob moved, seconds (median [min–max])")
    for col in (*COLUMNS, "stall + redo", "its downtime"):
        t.add_column(col)
    for row in rows:
        runs = _ok(row["runs"])
        failed = len(row["runs"]) - len(runs)
        if not runs:
            t.add_row(str(row["ranks"]), row["size"], row["contender"], f"all {failed} failed", "", "", "")
            continue
        what = {"criuctl": "criuctl (post-copy)", "stop-and-copy": "criuctl (stop-and-copy)"}.get(
            row["contender"], "restart from DCP"
        )
        t.add_row(
            str(row["ranks"]),
            row["size"],
            what + (f" ({failed} of {len(row['runs'])} failed)" if failed else ""),
            fmt([r["stall"] for r in runs]),
            str(max(r["lost"] for r in runs)),
            fmt([r["stall"] + r["lost"] * r["step"] for r in runs]),
            fmt([r["downtime"] for r in runs]),
        )
    Console(width=170).print(t)
    pulls = [
        row for row in rows if row["contender"] == "criuctl" and any(r.get("pages") for r in _ok(row["runs"]))
    ]
    if pulls:
        p = Table(title="post-copy's pull: every page on the target, against the link's time for its bytes")
        for col in ("ranks", "state / rank", "moved", "all pages in", "link time", "÷ link"):
            p.add_column(col)
        for row in pulls:
            runs = [r for r in _ok(row["runs"]) if r.get("pages")]
            link = [r["bytes"] / r["tcp"] for r in runs if r.get("tcp")]
            p.add_row(
                str(row["ranks"]),
                row["size"],
                f"{statistics.median(r['bytes'] for r in runs) / 2**30:.2f} GiB",
                fmt([r["pages"] for r in runs]),
                fmt(link) if link else "-",
                f"{statistics.median(r['pages'] / lt for r, lt in zip(runs, link, strict=False)):.2f}"
                if link
                else "-",
            )
        Console(width=170).print(p)
    steps = [(row, r["steps"]) for row in rows for r in row["runs"] if r.get("steps")]  # none if failed
    if steps:
        s = Table(title="criuctl's successor path, step by step (median seconds)")
        names = list(dict.fromkeys(n for _, st in steps for n in st))
        for col in ("ranks", "state / rank", *names):
            s.add_column(col)
        for row in rows:
            if row["contender"] != "restart":
                ok = _ok(row["runs"]) or [{"steps": {}}]
                cells = [statistics.median(r["steps"].get(n, 0.0) for r in ok) for n in names]
                s.add_row(str(row["ranks"]), row["size"], *(f"{x:.2f}" for x in cells))
        Console(width=170).print(s)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--ranks", type=int, nargs="+", default=[3, 4])
    ap.add_argument("--sizes", nargs="+", default=list(STATE), choices=[*SIZES, *STATE])
    ap.add_argument("--contenders", nargs="+", default=["criuctl", "restart"], choices=CONTENDERS)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/criuctl-bench-kube-jobs"))
    ap.add_argument("--out", type=Path, default=HERE / "results" / "kube_jobs.json")
    a = ap.parse_args()
    lay = Layout(a.dir, prefix="kj", net="10.202.0")
    lc.up(lay)
    rows: list[dict] = []
    try:
        k = Kubectl(lay)
        for world, size in itertools.product(a.ranks, a.sizes):
            results: dict[str, list[dict]] = {c: [] for c in a.contenders}
            for rep in range(a.reps):
                order = a.contenders[rep % len(a.contenders) :] + a.contenders[: rep % len(a.contenders)]
                tcp = link_rate(lay)
                for contender in order:
                    job = f"j{world}{size[:2].lower().replace('.', '')}{rep}{contender[0]}"
                    if contender == "restart":
                        res = bench_restart(k, job, world, size)
                    else:
                        mode = "post-copy" if contender == "criuctl" else "stop-and-copy"
                        res = bench_criuctl(lay, k, job, world, size, mode)
                    res["tcp"] = tcp
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
