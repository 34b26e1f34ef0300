"""Benchmark: checkpoint and restore of jobs holding 0.5, 2 and 4 GiB of model + Adam state.

Measured side by side in one run, on the same disk:
  criuctl dump / restore    (CRIU + BLAKE3 of every file + signature + fsync; verification)
  plain `criu dump` / `criu restore` of the same kind of job
  torch.save / torch.load   of the same state (the app-level way)
  dd                        writing as many bytes (page cache, and with fdatasync: the disk)

Steady state, as far as a VM allows: guest memory is touched once before anything is timed (for a
VM that keeps what it backed), one untimed round warms every contender, then each size is measured
`--reps` times or more (until the median of criuctl's per-round ratio to plain CRIU settles:
bench/rounds.py) with the contenders' order alternating (criuctl and plain CRIU back to back),
everything a contender left (bundle, restored job) removed before the next one. Medians, with
min–max. On the development VM freed memory goes straight back to the host (free page reporting,
`min_free_ms=0`), so every GiB any contender allocates is a first touch (~0.6 s/GiB there):
docs/benchmarks.md says what that means.
Usage: python bench/dump_restore.py [--sizes 0.5 2 4] [--reps 3] [--most 8] [--dir /var/tmp/criuctl-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from bench.rounds import paired, settle  # noqa: E402 - paired rounds until the spread is known

CRIUCTL = [sys.executable, "-m", "criuctl.cli.main"]
JOB = [sys.executable, str(HERE / "big_state.py")]
console = Console(highlight=False, width=200)


def wait_line(proc: subprocess.Popen, pattern: str, stream: str = "stdout", timeout: float = 600) -> str:
    rx, deadline = re.compile(pattern), time.monotonic() + timeout
    src = proc.stdout if stream == "stdout" else proc.stderr
    while time.monotonic() < deadline:
        line = src.readline()
        if not line:
            raise RuntimeError(f"process ended before {pattern!r}: {proc.stderr.read()[-800:]}")
        if rx.search(line):
            return line
    raise TimeoutError(pattern)


def start_job(name: str, gib: float) -> subprocess.Popen:
    p = subprocess.Popen(
        [*CRIUCTL, "run", "--name", name, "--", *JOB, "--gib", str(gib)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_line(p, r"^ready")
    return p


def root_pid(name: str) -> int:
    from criuctl.core import workloads

    return workloads.load(name).root_pid


def timed(cmd: list[str], **kw) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed: {r.stderr[-800:]}")
    return dt, r


def drop(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def bench_criuctl(gib: float, work: Path) -> dict:
    job = start_job("bench-criuctl", gib)
    out = work / "criuctl-bundle"
    t_dump, r = timed([*CRIUCTL, "dump", "bench-criuctl", "--bundle", str(out)])
    job.wait(60)
    said = re.search(r"frozen [0-9.]+ s \((.*?)\)", r.stderr)  # a criuctl before 2026-12 says no phases
    phases = {k: float(v) for k, v in re.findall(r"(\w+) ([0-9.]+) s", said[1] if said else "")}
    size = bundle_bytes(out)
    t0 = time.perf_counter()
    rest = subprocess.Popen(
        [*CRIUCTL, "restore", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = wait_line(rest, r"restored .* in ([0-9.]+) s", stream="stderr")
    t_restore = time.perf_counter() - t0
    criu_restore = float(re.search(r" in ([0-9.]+) s", line)[1])
    verified = re.search(r"verified in ([0-9.]+) s", line)
    verify = float(verified[1]) if verified else 0.0
    rest.send_signal(signal.SIGTERM)
    rest.wait(60)
    drop(out)
    return dict(
        dump=t_dump,
        criu_dump=phases.get("criu_dump", 0.0),
        seal=phases.get("seal", 0.0),
        restore=t_restore,
        restore_criu=criu_restore,
        verify=verify,
        bytes=size,
    )


def bundle_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def bench_plain_criu(gib: float, work: Path) -> dict:
    """The same job, checkpointed with the criu CLI and nothing else (no manifest, no checksums)."""
    job = start_job("bench-plain", gib)
    pid = root_pid("bench-plain")
    d = work / "plain"
    d.mkdir()
    base = ["criu", "-D", str(d), "--tcp-established", "--ext-unix-sk", "--network-lock", "nftables"]
    t_dump, _ = timed([*base[:3], "dump", *base[3:], "-t", str(pid)])
    job.wait(60)
    t0 = time.perf_counter()  # what criuctl does before it kills a tree: the images on disk
    for f in [*d.iterdir(), d]:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    t_sync = time.perf_counter() - t0
    pidfile = work / "plain.pid"
    t_restore, _ = timed([*base[:3], "restore", *base[3:], "-d", "--pidfile", str(pidfile)])
    os.kill(int(pidfile.read_text()), signal.SIGKILL)
    drop(d)
    drop(pidfile)
    return dict(dump=t_dump, dump_sync=t_dump + t_sync, restore=t_restore)


def bench_torch(gib: float, work: Path) -> dict:
    f = work / "state.pt"
    _, r = timed([*JOB, "--gib", str(gib), "--save", str(f)])
    m = re.search(r"save ([0-9.]+) load ([0-9.]+) bytes (\d+)", r.stdout)
    drop(f)
    return dict(save=float(m[1]), load=float(m[2]), bytes=int(m[3]))


def bench_dd(nbytes: int, work: Path) -> dict:
    f = work / "dd.bin"
    count = max(1, nbytes >> 20)
    t_cache, _ = timed(["dd", "if=/dev/zero", f"of={f}", "bs=1M", f"count={count}"])
    drop(f)
    t_sync, _ = timed(["dd", "if=/dev/zero", f"of={f}", "bs=1M", f"count={count}", "conv=fdatasync"])
    drop(f)
    return dict(cache=t_cache, sync=t_sync)


def touch_memory(gib: float) -> None:
    """Write `gib` GiB once, so that the VM has backed guest memory before anything is timed."""
    subprocess.run(
        [sys.executable, "-c", f"b = bytearray({int(gib * (1 << 30))}); b[::4096] = b'x' * len(b[::4096])"],
        check=True,
    )


def free_gib() -> float:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable"))
    return int(line.split()[1]) / (1 << 20)


CONTENDERS = {
    "criuctl": bench_criuctl,
    "criu": bench_plain_criu,
    "torch": bench_torch,
}


def one_round(gib: float, work: Path, flip: bool) -> dict:
    names = list(CONTENDERS)[::-1] if flip else list(CONTENDERS)
    out = {name: CONTENDERS[name](gib, work) for name in names}
    out["dd"] = bench_dd(out["criuctl"]["bytes"], work)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.5, 2, 4])
    ap.add_argument("--reps", type=int, default=3, help="rounds at least (bench/rounds.py)")
    ap.add_argument("--most", type=int, default=8, help="rounds at most, while the median ratio moves")
    ap.add_argument("--dir", default="/var/tmp/criuctl-bench")
    ap.add_argument("--json", default=str(HERE / "results" / "dump_restore.json"))
    a = ap.parse_args()
    work = Path(a.dir)
    drop(work)
    work.mkdir(parents=True)
    os.environ["CRIUCTL_STATE_DIR"] = str(work / "state")
    console.print(f"touching {free_gib() - 2:.0f} GiB of guest memory, then one untimed round …")
    touch_memory(free_gib() - 2)
    one_round(min(a.sizes), work, False)
    rows = []
    for gib in a.sizes:

        def one(turn: int, gib: float = gib) -> dict:
            console.print(f"[bold]{gib} GiB[/] round {turn + 1}")
            return one_round(gib, work, turn % 2 == 1)  # criuctl and plain CRIU back to back

        runs = settle(one, SETTLE, a.reps, max(a.reps, a.most), say=console.print)
        rows.append(dict(gib=gib, runs=runs))
    drop(work)
    report(rows)
    Path(a.json).parent.mkdir(exist_ok=True)
    Path(a.json).write_text(
        json.dumps(dict(machine=machine(), date=time.strftime("%Y-%m-%d"), rows=rows), indent=2)
    )
    return 0


def machine() -> str:
    cpus = os.cpu_count()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return f"{platform.node()}: {cpus} cores, {mem:.0f} GiB, kernel {platform.release()}"


def med(runs: list[dict], who: str, what: str) -> float:
    return statistics.median(r[who][what] for r in runs)


def spread(runs: list[dict], who: str, what: str) -> str:
    vals = [r[who][what] for r in runs]
    return f"{statistics.median(vals):.2f} ({min(vals):.2f}–{max(vals):.2f})"


def ratio(runs: list[dict], a: tuple[str, str], b: tuple[str, str]) -> str:
    """Median of the per-round ratios (each round's contenders ran back to back), min–max, rounds."""
    return paired(runs, lambda r: r[a[0]][a[1]] / r[b[0]][b[1]])


# a size's rounds go on while one of these still moves (criuctl against plain CRIU, per round)
SETTLE = [
    lambda r: r["criuctl"]["dump"] / r["criu"]["dump"],
    lambda r: r["criuctl"]["restore"] / r["criu"]["restore"],
]


def report(rows: list[dict]) -> None:
    t = Table(title=f"seconds, median (min–max) — {machine()}, {time.strftime('%Y-%m-%d')}")
    cols = [
        "state",
        "bundle",
        "criuctl dump",
        "plain criu dump",
        "… + fsync",
        "torch.save",
        "dd",
        "dd+fdatasync",
        "criuctl restore",
        "plain criu restore",
        "torch.load",
    ]
    for col in cols:
        t.add_column(col, justify="right")
    for r in rows:
        runs = r["runs"]
        t.add_row(
            f"{r['gib']} GiB",
            f"{med(runs, 'criuctl', 'bytes') / 2**30:.2f} GiB",
            *(
                spread(runs, who, what)
                for who, what in (
                    ("criuctl", "dump"),
                    ("criu", "dump"),
                    ("criu", "dump_sync"),
                    ("torch", "save"),
                    ("dd", "cache"),
                    ("dd", "sync"),
                    ("criuctl", "restore"),
                    ("criu", "restore"),
                    ("torch", "load"),
                )
            ),
        )
    console.print(t)
    t = Table(title="ratios: median of each round's ratio (min–max; rounds: until the median settles)")
    for col in (
        "state",
        "criuctl ÷ criu dump",
        "… ÷ criu dump + fsync",
        "criuctl ÷ criu restore",
        "… its CRIU part ÷ criu restore",
        "criuctl dump ÷ torch.save",
        "criuctl restore ÷ torch.load",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        runs = r["runs"]
        t.add_row(
            f"{r['gib']} GiB",
            ratio(runs, ("criuctl", "dump"), ("criu", "dump")),
            ratio(runs, ("criuctl", "dump"), ("criu", "dump_sync")),
            ratio(runs, ("criuctl", "restore"), ("criu", "restore")),
            ratio(runs, ("criuctl", "restore_criu"), ("criu", "restore")),
            ratio(runs, ("criuctl", "dump"), ("torch", "save")),
            ratio(runs, ("criuctl", "restore"), ("torch", "load")),
        )
    console.print(t)
    t = Table(title="where criuctl's time goes, median seconds")
    for col in (
        "state",
        "dump: CRIU",
        "seal (BLAKE3 rest + fsync)",
        "dump: the rest",
        "restore: verify",
        "restore: CRIU",
        "restore: the rest",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        runs = r["runs"]
        c = {k: med(runs, "criuctl", k) for k in runs[0]["criuctl"]}
        t.add_row(
            f"{r['gib']} GiB",
            f"{c['criu_dump']:.2f}",
            f"{c['seal']:.2f}",
            f"{c['dump'] - c['criu_dump'] - c['seal']:.2f}",
            f"{c['verify']:.2f}",
            f"{c['restore_criu']:.2f}",
            f"{c['restore'] - c['restore_criu'] - c['verify']:.2f}",
        )
    console.print(t)


if __name__ == "__main__":
    sys.exit(main())
