"""Containers, side by side in one run: what moving a container costs, and what checkpointing one costs.

Nodes are the tests' (network namespaces, a containerd 1.6 + criuctl agent each). For each state
size, a job holding N GiB of model + Adam state (bench/big_state.py) runs as a container under
criuctl's init, and is moved to a placeholder on the other node by

    container stop-and-copy     criuctl migrate ctr-… --mode stop-and-copy (dump, stream, restore
                                into the placeholder: mounts mapped, writable layer, cgroups)
    container post-copy         criuctl migrate ctr-… --mode post-copy
    process stop-and-copy       the same job under `criuctl run` (no container): what the
    process post-copy           container path adds
    app-level                   torch.save, then a new process: import torch, torch.load, one step

and the ceiling, raw TCP between the two nodes. Then the checkpoint alone (leave-running, local
disk), on one containerd 2.1.9 container (the runtime that implements it):

    CRI CheckpointContainer     the kubelet's checkpoint call (runc checkpoint → CRIU → archive tar)
    criuctl dump --leave-running   the same container through criuctl (CRIU via pycriu, signed bundle)

Contenders alternate within each repetition (these are VMs: the first touch of memory is slow),
and each number is the median of the repetitions. Run as root: `.venv/bin/python bench/containers.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import migrate as procbench  # noqa: E402 - the process-migration contenders, as bench/migrate.py runs them
from rounds import arguments  # noqa: E402

from criuctl.container import containers  # noqa: E402
from tests import test_cri_archive as cri2  # noqa: E402 - containerd 2.x started as its tests start it
from tests.cluster import PLAIN, Cluster  # noqa: E402
from tests.containerd import INIT, PY, Containerd  # noqa: E402
from tests.jobs import CRIUCTL  # noqa: E402

console = Console(stderr=True)
BIG = HERE / "big_state.py"


def _ready(log: Path, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while " F ready" not in (log.read_text(errors="replace") if log.exists() else ""):
        if time.monotonic() > deadline:
            raise SystemExit(f"the job never got ready: {log}")
        time.sleep(0.2)


def _pods(c: Cluster, rts: dict[str, Containerd], inject: Path, gib: float, tag: str):
    mounts = {p: p for p in ("/usr", "/lib", "/lib64", "/root/.pyenv", str(HERE.parent))}
    mounts["/.criuctl"] = str(inject)
    job = rts["a"].run_pod(tag, [*INIT, "--", PY, str(BIG), "--gib", str(gib)], mounts=mounts)
    holder = rts["b"].run_pod(tag, [*INIT, "--placeholder"], mounts=mounts)
    _ready(job.log)
    return job, holder


def bench_container(c: Cluster, rts: dict[str, Containerd], inject: Path, gib: float, mode: str, n: int):
    job, holder = _pods(c, rts, inject, gib, f"b{n}-{mode[:4]}")
    r = c.migrate(containers.name_of(job.container), "b", "--mode", mode)
    if r.returncode != 0:
        raise SystemExit(f"container migrate failed: {r.stderr[-2000:]}")
    rts["b"].stop_container(holder.container, grace=1)
    return json.loads(r.stdout.strip().splitlines()[-1])


def bench_checkpoint(gib: float, work: Path, reps: int) -> dict[str, list[float]]:
    """CRI CheckpointContainer vs criuctl dump --leave-running, alternated, on one containerd 2 container."""
    root = Path(tempfile.mkdtemp(prefix="c2-", dir=work))
    node = cri2._start(root)
    c2 = Containerd(root)  # the same CRI calls a kubelet makes, on containerd 2's socket
    c2.proc, c2.rt, c2.channel = node.proc, node.rt, node.channel
    out: dict[str, list[float]] = {"cri": [], "criuctl": []}
    try:
        inject = containers.write_inject_dir(root / "inject")
        mounts = {p: p for p in ("/usr", "/lib", "/lib64", "/root/.pyenv", str(HERE.parent))}
        mounts["/.criuctl"] = str(inject)
        pod = c2.run_pod("ckpt", [*INIT, "--", PY, str(BIG), "--gib", str(gib)], mounts=mounts)
        _ready(pod.log)
        from criuctl.container import runtime

        rt = runtime.connect(c2.endpoint)
        env = {**os.environ, "CRIUCTL_RUNTIME_ENDPOINT": c2.endpoint, "CRIUCTL_STATE_DIR": str(root / "st")}
        for i in range(reps + 1):  # the first round warms memory up and is dropped
            target = root / f"a{i}.tar"
            t0 = time.monotonic()
            rt.checkpoint(pod.container, str(target))
            cri = time.monotonic() - t0
            target.unlink()
            t0 = time.monotonic()
            argv = [*CRIUCTL, "dump", pod.container, "--bundle", str(root / f"b{i}"), "--leave-running"]
            subprocess.run(argv, env=env, check=True, capture_output=True)
            ours = time.monotonic() - t0
            shutil.rmtree(root / f"b{i}")
            if i:
                out["cri"].append(cri)
                out["criuctl"].append(ours)
    finally:
        c2.stop()
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> int:
    ap = arguments("containers", reps=2)
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.5, 2])
    a = ap.parse_args()
    work = Path(a.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    rows = []
    socks = {n: work / "cluster" / n / "containerd" / "containerd.sock" for n in ("a", "b")}
    args = {n: ["--runtime-endpoint", f"unix://{s}", "--inject-dir", str(work / n)] for n, s in socks.items()}
    with Cluster(work / "cluster", agent_args=args, tls=False) as c:  # as before TLS was the default
        rts = {n: Containerd(socks[n].parent, netns=c.nodes[n].ns).start() for n in ("a", "b")}
        try:
            inject = containers.write_inject_dir(work / "inject")
            tcp = procbench.bench_tcp(c)
            console.print(f"raw TCP a→b: {tcp / 1e9:.2f} GB/s")
            n = 0
            for gib in a.sizes:
                row: dict = {"gib": gib}
                for rep in range(a.reps):
                    for mode in ("stop-and-copy", "post-copy"):
                        n += 1
                        console.print(f"{gib} GiB, round {rep + 1}: container {mode} …")
                        row.setdefault(f"container {mode}", []).append(
                            bench_container(c, rts, inject, gib, mode, n)
                        )
                        console.print(f"{gib} GiB, round {rep + 1}: process {mode} …")
                        row.setdefault(f"process {mode}", []).append(procbench.bench_criuctl(c, gib, mode))
                    console.print(f"{gib} GiB, round {rep + 1}: app-level …")
                    row.setdefault("app", []).append(procbench.bench_app_level(gib, work))
                console.print(f"{gib} GiB: CRI CheckpointContainer vs criuctl dump --leave-running …")
                row["checkpoint"] = bench_checkpoint(gib, work, a.reps)
                rows.append(row)
        finally:
            for rt in rts.values():
                rt.stop()
    Path(a.json).parent.mkdir(exist_ok=True)
    doc = {
        "machine": procbench.machine(),
        "date": time.strftime("%Y-%m-%d"),
        "tcp_bytes_per_s": tcp,
        "transport": PLAIN,
        "rows": rows,
    }
    Path(a.json).write_text(json.dumps(doc, indent=2))
    report(rows, tcp)
    return 0


def _med(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def report(rows: list[dict], tcp: float) -> None:
    t = Table(title=f"containers, seconds (median) — {procbench.machine()}, {time.strftime('%Y-%m-%d')}")
    cols = [
        "state",
        "ctr stop&copy down",
        "proc stop&copy down",
        "ctr post-copy down",
        "proc post-copy down",
        "app-level down",
        "ctr ÷ proc (s&c)",
        "CRI Checkpoint",
        "criuctl dump",
        "TCP GB/s",
    ]
    for col in cols:
        t.add_column(col, justify="right")
    for r in rows:
        cs, ps = (
            _med(r["container stop-and-copy"], "downtime_seconds"),
            _med(r["process stop-and-copy"], "downtime_seconds"),
        )
        cp, pp = (
            _med(r["container post-copy"], "downtime_seconds"),
            _med(r["process post-copy"], "downtime_seconds"),
        )
        app = _med(r["app"], "downtime")
        ck = r["checkpoint"]
        cri, ours = statistics.median(ck["cri"]), statistics.median(ck["criuctl"])
        cells = [cs, ps, cp, pp, app, cs / ps, cri, ours, tcp / 1e9]
        t.add_row(f"{r['gib']} GiB", *(f"{x:.2f}" for x in cells))
    Console().print(t)


if __name__ == "__main__":
    sys.exit(main())
