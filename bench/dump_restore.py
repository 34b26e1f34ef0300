"""Benchmark: checkpoint and restore of jobs holding 0.5, 2 and 4 GiB of model + Adam state.

Measured side by side in one run, on the same disk:
  criuctl dump / restore    (CRIU + manifest with sha256 of every file + signature + verification)
  plain `criu dump` / `criu restore` of the same kind of job
  torch.save / torch.load   of the same state (the app-level way)
  dd                        writing as many bytes (page cache, and with fdatasync: the disk)
Times are wall clock; files are written without fsync, as CRIU and torch.save do.
Usage: python bench/dump_restore.py [--sizes 0.5 2 4] [--dir /var/tmp/criuctl-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
CRIUCTL = [sys.executable, "-m", "criuctl.cli"]
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
    from criuctl import workloads

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
    from criuctl import bundle

    job = start_job("bench-criuctl", gib)
    out = work / "criuctl-bundle"
    t_dump, r = timed([*CRIUCTL, "dump", "bench-criuctl", "-o", str(out)])
    job.wait(60)
    freeze = float(re.search(r"frozen ([0-9.]+) s", r.stderr)[1])
    size = bundle.size_bytes(out)
    t0 = time.perf_counter()
    for p in out.rglob("*.img"):
        bundle.file_digest(p)
    t_hash = time.perf_counter() - t0
    t0 = time.perf_counter()
    rest = subprocess.Popen(
        [*CRIUCTL, "restore", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    line = wait_line(rest, r"restored .* in ([0-9.]+) s", stream="stderr")
    t_restore = time.perf_counter() - t0
    criu_restore = float(re.search(r" in ([0-9.]+) s", line)[1])
    rest.send_signal(signal.SIGTERM)
    rest.wait(60)
    drop(out)
    return dict(
        dump=t_dump, freeze=freeze, hash=t_hash, restore=t_restore, restore_criu=criu_restore, bytes=size
    )


def bench_plain_criu(gib: float, work: Path) -> dict:
    """The same job, checkpointed with the criu CLI and nothing else (no manifest, no checksums)."""
    job = start_job("bench-plain", gib)
    pid = root_pid("bench-plain")
    d = work / "plain"
    d.mkdir()
    base = ["criu", "-D", str(d), "--tcp-established", "--ext-unix-sk", "--network-lock", "nftables"]
    t_dump, _ = timed([*base[:3], "dump", *base[3:], "-t", str(pid)])
    job.wait(60)
    pidfile = work / "plain.pid"
    t_restore, _ = timed([*base[:3], "restore", *base[3:], "-d", "--pidfile", str(pidfile)])
    os.kill(int(pidfile.read_text()), signal.SIGKILL)
    drop(d)
    drop(pidfile)
    return dict(dump=t_dump, restore=t_restore)


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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.5, 2, 4])
    ap.add_argument("--dir", default="/var/tmp/criuctl-bench")
    ap.add_argument("--json", default=str(HERE / "results" / "dump_restore.json"))
    a = ap.parse_args()
    work = Path(a.dir)
    drop(work)
    work.mkdir(parents=True)
    os.environ["CRIUCTL_STATE_DIR"] = str(work / "state")
    rows = []
    for gib in a.sizes:
        console.print(f"[bold]{gib} GiB[/]: criuctl …", end=" ")
        c = bench_criuctl(gib, work)
        console.print("plain criu …", end=" ")
        p = bench_plain_criu(gib, work)
        console.print("torch.save/load …", end=" ")
        t = bench_torch(gib, work)
        console.print("dd …")
        d = bench_dd(c["bytes"], work)
        rows.append(dict(gib=gib, criuctl=c, criu=p, torch=t, dd=d))
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


def report(rows: list[dict]) -> None:
    t = Table(title=f"seconds — {machine()}, {time.strftime('%Y-%m-%d')}")
    for col in (
        "state",
        "bundle",
        "criuctl dump",
        "(CRIU part)",
        "plain criu dump",
        "torch.save",
        "dd",
        "dd+fdatasync",
        "criuctl restore",
        "plain criu restore",
        "torch.load",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        c, p, tt, d = r["criuctl"], r["criu"], r["torch"], r["dd"]
        t.add_row(
            f"{r['gib']} GiB",
            f"{c['bytes'] / 2**30:.2f} GiB",
            *(
                f"{v:.2f}"
                for v in (
                    c["dump"],
                    c["freeze"],
                    p["dump"],
                    tt["save"],
                    d["cache"],
                    d["sync"],
                    c["restore"],
                    p["restore"],
                    tt["load"],
                )
            ),
        )
    console.print(t)
    t = Table(title="ratios (measured side by side above)")
    for col in (
        "state",
        "criuctl dump GB/s",
        "dd GB/s",
        "dump ÷ dd throughput",
        "criuctl ÷ criu dump",
        "criuctl ÷ criu restore",
        "criuctl dump ÷ torch.save",
        "criuctl restore ÷ torch.load",
    ):
        t.add_column(col, justify="right")
    for r in rows:
        c, p, tt, d = r["criuctl"], r["criu"], r["torch"], r["dd"]
        n = c["bytes"]
        t.add_row(
            f"{r['gib']} GiB",
            f"{n / c['dump'] / 1e9:.2f}",
            f"{n / d['cache'] / 1e9:.2f}",
            f"{d['cache'] / c['dump']:.2f}",
            f"{c['dump'] / p['dump']:.2f}",
            f"{c['restore'] / p['restore']:.2f}",
            f"{c['dump'] / tt['save']:.2f}",
            f"{c['restore'] / tt['load']:.2f}",
        )
    console.print(t)
    for r in rows:
        c = r["criuctl"]
        other = c["dump"] - c["freeze"] - c["hash"]
        console.print(
            f"{r['gib']} GiB dump breakdown: CRIU {c['freeze']:.2f} s "
            f"({c['bytes'] / c['freeze'] / 1e9:.2f} GB/s), sha256 of the images {c['hash']:.2f} s, "
            f"the rest (Python start-up, process facts, manifest, kill) {max(0.0, other):.2f} s"
        )


if __name__ == "__main__":
    sys.exit(main())
