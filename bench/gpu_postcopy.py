"""A GPU job moved by post-copy and by stop-and-copy, against the stand-in driver: what post-copy
takes out of a GPU job's downtime, and what it cannot (issue 39, item 5; docs/gpu.md).

The job (tests/workloads/train_mlp.py) holds a stand-in CUDA context (tests/workloads/_standin_cuda.py)
with D MiB of "device memory"; the node agents load the stand-in libcuda and NVML
(tests/standin_gpu.py), as the GPU tests do. Its checkpoint fills the device memory's host copy in
the job's own memory, as the real driver's does, and its restore reads every byte of it back and
fails if one is missing, as the real driver's host → device copy would. So post-copy's pages of the
device memory must all be pulled inside the driver's restore, before the job's CUDA calls go on.

For each D, the two modes alternate in paired rounds between two agents (tests/cluster.py, TLS as
users run it). Reported per round: the downtime (the source's measure, frozen → running), the
`prepare` phase within it (the driver's lock and checkpoint, device → host), the driver's
restore (`gpu_restore`, the commit's phase), the bytes streamed before the restore, and
post-copy's every page on the target. The stand-in copies at memcpy speed, which says
nothing of a real device's 20–50 GB/s: what this measures is where the pull of the device memory
lands (inside the downtime), not how long a real driver takes. Run as root:
`.venv/bin/python bench/gpu_postcopy.py [--mib 256 1024 4096] [--reps 3]`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tools"))  # tests.requirements reads the local cluster's layout

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.migrate import _kill_everywhere, machine  # noqa: E402
from tests.cluster import Cluster  # noqa: E402
from tests.standin_gpu import H200, Gpu, StandinGpus, compile_standins  # noqa: E402

console = Console(stderr=True)
MODES = ("post-copy", "stop-and-copy")
GPU_A = Gpu(H200, "GPU-aaaaaaaa-1111-2222-3333-00000000000a")
GPU_B = Gpu(H200, "GPU-bbbbbbbb-1111-2222-3333-00000000000b")
JOB = ("train_mlp.py", "--steps", "100000", "--step-time", "0.05")


def one_move(c: Cluster, gpus: StandinGpus, mib: int, mode: str, name: str) -> dict:
    c.run("a", name, *JOB, env=gpus.job_env(GPU_A, mib))
    c.wait_step(name, 5, timeout=300)
    r = c.migrate(name, "b", "--mode", mode)
    try:
        if r.returncode != 0:
            raise SystemExit(f"criuctl migrate ({mode}, {mib} MiB) failed: {r.stderr[-2000:]}")
        res = json.loads(r.stdout)
        step = max(c.steps(name), default=-1)
        c.wait_step(name, step + 3, timeout=120)  # its CUDA calls went on, on b
        return res
    finally:
        _kill_everywhere(c, name)


def _med(runs: list[dict], fn) -> str:
    vals = [fn(r) for r in runs]
    return f"{statistics.median(vals):.2f} [{min(vals):.2f}–{max(vals):.2f}]"


def report(rows: list[dict]) -> None:
    t = Table(title="a GPU job (stand-in driver) moved between two agents: medians [min–max] of the rounds")
    for col in (
        "device memory",
        "mode",
        "downtime s",
        "of it: prepare s (the driver's checkpoint)",
        "of it: driver's restore s",
        "streamed before the restore GiB",
        "every page on b s",
    ):
        t.add_column(col)
    for row in rows:
        for mode in MODES:
            runs = [r[mode] for r in row["runs"]]
            t.add_row(
                f"{row['mib']} MiB",
                mode,
                _med(runs, lambda x: x["downtime_seconds"]),
                _med(runs, lambda x: x.get("phases", {}).get("prepare", 0.0)),
                _med(runs, lambda x: x.get("phases", {}).get("gpu_restore", 0.0)),
                _med(runs, lambda x: x["bytes_moved"] / (1 << 30)),
                _med(runs, lambda x: x["downtime_seconds"] + (x.get("pages_seconds") or 0.0)),
            )
    Console(width=170).print(t)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, nargs="+", default=[256, 1024, 4096], help="device memory sizes")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp/criuctl-bench-gpu-postcopy"))
    ap.add_argument("--json", type=Path, default=HERE / "results" / "gpu_postcopy.json")
    a = ap.parse_args()
    shutil.rmtree(a.dir, ignore_errors=True)
    a.dir.mkdir(parents=True)
    gpus = StandinGpus(compile_standins(a.dir), a.dir / "gpus")
    env = {"a": gpus.node_env(GPU_A), "b": gpus.node_env(GPU_B)}
    rows: list[dict] = []
    with Cluster(a.dir / "cluster", agent_env=env) as c:
        one_move(c, gpus, min(a.mib), "post-copy", "warm")  # untimed: the first touch of the VM's memory
        for mib in a.mib:
            runs = []
            for rep in range(a.reps):
                order = MODES if rep % 2 == 0 else MODES[::-1]
                run = {m: one_move(c, gpus, mib, m, f"g{mib}{m[:4]}{rep}") for m in order}
                console.print(
                    f"{mib} MiB, round {rep + 1}: "
                    + ", ".join(f"{m} down {run[m]['downtime_seconds']:.2f} s" for m in MODES)
                )
                runs.append(run)
            rows.append({"mib": mib, "runs": runs})
            doc = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "job": JOB, "rows": rows}
            a.json.write_text(json.dumps(doc, indent=1))  # as it goes
    report(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
