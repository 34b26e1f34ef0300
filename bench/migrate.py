"""Migration between two nodes (network namespaces on this host), side by side in one run.

For each state size: a job holding N GiB of model + Adam state is moved by
  criuctl stop-and-copy      dump, stream the signed bundle, verify, restore
  criuctl post-copy          restore at once, pages pulled from the source's page server
  plain CRIU                 `criu dump --page-server` into `criu page-server` on the target,
                             the other images copied, `criu restore` (no checks, no signature)
  app-level                  torch.save on the source, then a new process: import torch,
                             torch.load, one optimizer step (the target's first resumed step)
and the ceiling: raw TCP throughput between the two namespaces (Python sockets, 1 MiB sends).

Downtime is freeze → running on the target. Run as root: `make bench-migrate` or
`.venv/bin/python bench/migrate.py [--sizes 0.5 2 4]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from tests.cluster import Cluster  # noqa: E402 - the same nodes the tests use

JOB = [sys.executable, str(HERE / "big_state.py")]
console = Console(stderr=True)
PORT = 7310


def _start(c: Cluster, name: str, gib: float):
    n = c.nodes["a"]
    from tests.jobs import CRIUCTL, Job

    job = Job(
        [
            *n.inside(),
            *CRIUCTL,
            "run",
            "--state-dir",
            str(n.state),
            "--name",
            name,
            "--",
            *JOB,
            "--gib",
            str(gib),
        ]
    )
    job.wait_for(r"^ready", timeout=900)
    return job


def bench_criuctl(c: Cluster, gib: float, mode: str) -> dict:
    name = f"m{mode[:4]}"
    job = _start(c, name, gib)
    r = c.migrate(name, "b", "--mode", mode)
    job.wait(120)
    if r.returncode != 0:
        raise SystemExit(f"criuctl migrate failed: {r.stderr[-2000:]}")
    res = json.loads(r.stdout)
    _kill_everywhere(c, name)
    return res


def with_spool(c: Cluster, spool: Path | None) -> None:
    """Restart both agents with bundles in flight spooled under `spool` (None: the state dir)."""
    for node in c.nodes.values():
        node.stop_agent()
        node.start_agent(spool=spool / node.name if spool else None)


def ram_for(gib: float) -> bool:
    """Room for a RAM-spooled move: job + restored copy + a bundle on each side, with margin."""
    avail = int(
        next(
            x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable")
        ).split()[1]
    )
    return avail * 1024 > 4.5 * gib * (1 << 30)


def _kill_everywhere(c: Cluster, name: str) -> None:
    for node in c.nodes.values():
        for rec in node.records():
            if rec["name"] == name:
                for pid in (rec["root_pid"], rec["supervisor_pid"]):
                    subprocess.run(["kill", "-9", str(pid)], capture_output=True)


def bench_plain_criu(c: Cluster, gib: float, work: Path) -> dict:
    a, b = c.nodes["a"], c.nodes["b"]
    job = _start(c, "plain", gib)
    root = json.loads((a.state / "workloads" / "plain.json").read_text())["root_pid"]
    src, dst = work / "src", work / "dst"
    shutil.rmtree(work, ignore_errors=True)
    for d in (src, dst):
        d.mkdir(parents=True)
    server = subprocess.Popen(
        [*b.inside(), "criu", "page-server", "-D", str(dst), "--port", str(PORT)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(0.5)
    t0 = time.monotonic()
    subprocess.run(
        [
            *a.inside(),
            "criu",
            "dump",
            "-t",
            str(root),
            "-D",
            str(src),
            "--page-server",
            "--address",
            b.addr,
            "--port",
            str(PORT),
            "--leave-stopped",
            "--ext-unix-sk",
            "--ghost-limit",
            "1G",
            "-o",
            "dump.log",
        ],
        check=True,
    )
    t_dump = time.monotonic() - t0
    server.wait(60)
    for f in src.glob("*.img"):
        shutil.copy(f, dst / f.name)
    t1 = time.monotonic()
    subprocess.run(
        [
            *b.inside(),
            "criu",
            "restore",
            "-D",
            str(dst),
            "--restore-detached",
            "--ext-unix-sk",
            "--pidfile",
            str(work / "pid"),
            "-o",
            "restore.log",
        ],
        check=True,
    )
    t_end = time.monotonic()
    subprocess.run(["kill", "-9", (work / "pid").read_text().strip(), str(root)], capture_output=True)
    job.wait(60)
    _kill_everywhere(c, "plain")
    return dict(downtime=t_end - t0, dump=t_dump, restore=t_end - t1)


def bench_app_level(gib: float, work: Path) -> dict:
    f = work / "state.pt"
    r = subprocess.run(
        [*JOB, "--gib", str(gib), "--save", str(f)], capture_output=True, text=True, check=True
    )
    save = float(re.search(r"save ([0-9.]+)", r.stdout)[1])
    t0 = time.monotonic()
    subprocess.run([*JOB, "--gib", str(gib), "--resume", str(f)], capture_output=True, text=True, check=True)
    restart = time.monotonic() - t0
    f.unlink()
    return dict(save=save, restart=restart, downtime=save + restart)


def bench_tcp(c: Cluster, nbytes: int = 2 << 30) -> float:
    a, b = c.nodes["a"], c.nodes["b"]
    port = PORT + 1
    recv = (
        f"import socket,time;s=socket.create_server(('0.0.0.0',{port}));c,_=s.accept();n=0;"
        "b=bytearray(1<<20);t=time.monotonic()\nwhile (k:=c.recv_into(b)):n+=k\n"
        "print(n/(time.monotonic()-t))"
    )
    send = (
        f"import socket;s=socket.create_connection(('{b.addr}',{port}));b=bytes(1<<20)\n"
        f"for _ in range({nbytes >> 20}):s.sendall(b)\ns.close()"
    )
    rx = subprocess.Popen([*b.inside(), sys.executable, "-c", recv], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    subprocess.run([*a.inside(), sys.executable, "-c", send], check=True)
    return float(rx.communicate(timeout=120)[0])


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    return f"{platform.node()}: {os.cpu_count()} cores, {mem:.0f} GiB, kernel {platform.release()}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.5, 2, 4])
    ap.add_argument("--dir", default="/var/tmp/criuctl-bench-migrate")
    ap.add_argument("--json", default=str(HERE / "results" / "migrate.json"))
    a = ap.parse_args()
    work = Path(a.dir)
    shutil.rmtree(work, ignore_errors=True)
    rows = []
    with Cluster(work / "cluster") as c:
        tcp = bench_tcp(c)
        console.print(f"raw TCP a→b: {tcp / 1e9:.2f} GB/s")
        for gib in a.sizes:
            row = {"gib": gib}
            for mode in ("stop-and-copy", "post-copy"):
                console.print(f"{gib} GiB criuctl {mode} …")
                row[mode] = bench_criuctl(c, gib, mode)
            if ram_for(gib):
                console.print(f"{gib} GiB criuctl stop-and-copy, bundles spooled in tmpfs …")
                with_spool(c, Path("/dev/shm/criuctl-bench"))
                row["stop-ram"] = bench_criuctl(c, gib, "stop-and-copy")
                with_spool(c, None)
                shutil.rmtree("/dev/shm/criuctl-bench", ignore_errors=True)
            console.print(f"{gib} GiB plain CRIU page server …")
            row["plain"] = bench_plain_criu(c, gib, work / "plain")
            console.print(f"{gib} GiB app-level torch.save → new process → torch.load …")
            row["app"] = bench_app_level(gib, work)
            rows.append(row)
            console.print(row)
    Path(a.json).parent.mkdir(exist_ok=True)
    Path(a.json).write_text(
        json.dumps(
            {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "tcp_bytes_per_s": tcp, "rows": rows},
            indent=2,
        )
    )
    report(rows, tcp)
    return 0


def report(rows: list[dict], tcp: float) -> None:
    t = Table(title=f"migration a→b, seconds — {machine()}, {time.strftime('%Y-%m-%d')}")
    cols = [
        "state",
        "stop&copy down",
        "… RAM spool",
        "post-copy down",
        "post-copy total",
        "plain CRIU down",
        "app-level down",
        "post ÷ stop",
        "stop ÷ plain",
        "stop ÷ app",
        "stream GB/s disk / RAM",
        "stream ÷ TCP",
    ]
    for col in cols:
        t.add_column(col, justify="right")
    for r in rows:
        s, p, pl, app, ram = r["stop-and-copy"], r["post-copy"], r["plain"], r["app"], r.get("stop-ram")
        disk_rate = s["bytes_moved"] / s["transfer_seconds"]
        ram_rate = ram["bytes_moved"] / ram["transfer_seconds"] if ram else None
        best = max(disk_rate, ram_rate or 0)
        t.add_row(
            f"{r['gib']} GiB",
            f"{s['downtime_seconds']:.2f}",
            f"{ram['downtime_seconds']:.2f}" if ram else "-",
            f"{p['downtime_seconds']:.2f}",
            f"{p['total_seconds']:.2f}",
            f"{pl['downtime']:.2f}",
            f"{app['downtime']:.2f}",
            f"{p['downtime_seconds'] / s['downtime_seconds']:.3f}",
            f"{s['downtime_seconds'] / pl['downtime']:.2f}",
            f"{s['downtime_seconds'] / app['downtime']:.2f}",
            f"{disk_rate / 1e9:.2f} / " + (f"{ram_rate / 1e9:.2f}" if ram_rate else "-"),
            f"{best / tcp:.2f}",
        )
    Console().print(t)
    console.print(f"raw TCP between the namespaces: {tcp / 1e9:.2f} GB/s")


if __name__ == "__main__":
    sys.exit(main())
