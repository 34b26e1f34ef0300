"""Migration between two nodes (network namespaces on this host), side by side in one run.

For each state size: a job holding N GiB of model + Adam state is moved by
  criuctl stop-and-copy      dump (pages hashed as CRIU writes them), sign, stream the bundle
                             (sendfile; the target hashes as it receives), verify, restore
  criuctl post-copy          restore at once, pages pulled from the source's page server
  criuctl direct             stop-and-copy with CRIUCTL_STREAM=direct: the dump sends the pages
                             into CRIU's page server on the target over TLS pinned to certificates
                             made for the move; the rest streams as above, verified with the
                             target's voucher
  plain CRIU                 `criu dump --page-server` into `criu page-server` on the target,
                             the other images copied, `criu restore` (no checks, no signature)
  plain CRIU + TLS           the same over CRIU's TLS, pinned as criuctl direct pins it: what the
                             encryption alone costs
  app-level                  torch.save on the source, then a new process: import torch,
                             torch.load, one optimizer step (the target's first resumed step)
and the ceilings: raw TCP throughput between the two namespaces (Python sockets, 1 MiB sends),
measured in every round, since the VM's network speed drifts, and (where the sealed stream runs)
the same bytes spliced into a new file on b: what any receiver that keeps them pays here.
The agents serve plain HTTP (`--insecure`), as for every earlier result: the numbers stay
comparable (TLS costs the stream its `sendfile`; not measured here).

Steady state, as far as a VM allows: guest memory is touched once first, one untimed round at the
smallest size warms every contender, then each size runs `--reps` rounds or more (until the median
of stop-and-copy's per-round ratio to plain CRIU settles: bench/rounds.py), stop-and-copy and plain
CRIU back to back in each round and the order rotating; each contender's job and files are gone
before the next starts. Medians, min–max (on the development VM freed memory goes straight back
to the host: see docs/benchmarks.md). `--post-copy-only`
sizes run post-copy alone (its downtime's growth with size). `--dense`: every job's step is an Adam
step of its whole state (bench/big_state.py), so that post-copy's pull races a job that faults on
every page, as a real training job does. Downtime is freeze → running on the
target. Run as root: `make bench-migrate` or `.venv/bin/python bench/migrate.py [--sizes 0.5 2 4]`.
"""

from __future__ import annotations

import argparse
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

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from bench.rounds import paired, settle  # noqa: E402 - paired rounds until the spread is known
from tests.cluster import PLAIN, Cluster  # noqa: E402 - the same nodes the tests use

JOB = [sys.executable, str(HERE / "big_state.py")]  # --dense appended by main() when asked
CONTENDERS = ("stop-and-copy", "plain", "direct", "plain-tls", "sealed", "post-copy", "app")
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


def bench_criuctl(c: Cluster, gib: float, mode: str, stream: str = "live") -> dict:
    """`stream="sealed"`: the bundle leaves only once sealed (the dump and the transfer in turn)."""
    name = f"m{mode[:4]}"
    job = _start(c, name, gib)
    os.environ["CRIUCTL_STREAM"] = stream  # the client's knob (`criuctl.core.env.STREAM`)
    r = c.migrate(name, "b", "--mode", mode)
    if r.returncode != 0:
        job.kill()
        raise SystemExit(f"criuctl migrate failed: {r.stderr[-2000:]}")
    job.wait(120)
    res = json.loads(r.stdout)
    _kill_everywhere(c, name)
    return res


def _kill_everywhere(c: Cluster, name: str) -> None:
    for node in c.nodes.values():
        for rec in node.records():
            if rec["name"] == name:
                for pid in (rec["root_pid"], rec["supervisor_pid"]):
                    subprocess.run(["kill", "-9", str(pid)], capture_output=True)


def _tls_pair(work: Path) -> tuple[list[str], list[str]]:
    """CRIU's TLS arguments for the page server and for the dump, pinned as criuctl's direct mode."""
    from criuctl.engine.criu import PageTls, tls_argv
    from criuctl.net import pagetls

    src, dst = pagetls.make_identity(work / "tls", "source"), pagetls.make_identity(work / "tls", "target")
    return tls_argv(PageTls(src.cert, dst.cert, dst.key)), tls_argv(PageTls(dst.cert, src.cert, src.key))


def bench_plain_criu(c: Cluster, gib: float, work: Path, tls: bool = False) -> dict:
    a, b = c.nodes["a"], c.nodes["b"]
    job = _start(c, "plain", gib)
    root = json.loads((a.state / "workloads" / "plain.json").read_text())["root_pid"]
    src, dst = work / "src", work / "dst"
    shutil.rmtree(work, ignore_errors=True)
    for d in (src, dst):
        d.mkdir(parents=True)
    server_tls, dump_tls = _tls_pair(work) if tls else ([], [])
    server = subprocess.Popen(
        [*b.inside(), "criu", "page-server", "-D", str(dst), "--port", str(PORT), *server_tls],
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
            *dump_tls,
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


_DISCARD = "b=bytearray(1<<20)\nwhile (k:=c.recv_into(b)):n+=k\n"
# what any receiver that keeps the bytes pays here: the socket spliced into a new file (the page
# cache's first touch, on this VM the host backing fresh memory), no hashing, no HTTP
_INTO_FILE = (
    "import os;f=os.open({path!r},os.O_WRONLY|os.O_CREAT|os.O_TRUNC,0o600);r,w=os.pipe()\n"
    "while (k:=os.splice(c.fileno(),w,1<<20)):\n"
    " while k:m=os.splice(r,f,k);k-=m;n+=m\n"
    "os.close(f);os.unlink({path!r})\n"
)


def bench_tcp(c: Cluster, nbytes: int = 2 << 30, into: Path | None = None) -> float:
    """Raw TCP a → b, GB/s: into a reused buffer (the wire's ceiling), or `into` a new file on b."""
    a, b = c.nodes["a"], c.nodes["b"]
    port = PORT + 1
    body = _INTO_FILE.format(path=str(into)) if into is not None else _DISCARD
    recv = (
        f"import socket,time;s=socket.create_server(('0.0.0.0',{port}));c,_=s.accept();n=0;"
        f"t=time.monotonic()\n{body}print(n/(time.monotonic()-t))"
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


def touch_memory() -> None:
    """Write all but 2 GiB of free memory once, so that the VM has backed it before anything is timed."""
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable"))
    n = int(line.split()[1]) * 1024 - (2 << 30)
    subprocess.run(
        [sys.executable, "-c", f"b = bytearray({n}); b[::4096] = b'x' * len(b[::4096])"], check=True
    )


def one_round(
    c: Cluster, gib: float, work: Path, turn: int, only_post: bool = False, contenders: tuple[str, ...] = ()
) -> dict:
    """Every contender once, in an order that rotates with `turn`; raw TCP measured in the same round."""
    jobs = {
        "stop-and-copy": lambda: bench_criuctl(c, gib, "stop-and-copy"),
        "sealed": lambda: bench_criuctl(c, gib, "stop-and-copy", "sealed"),
        "post-copy": lambda: bench_criuctl(c, gib, "post-copy"),
        "plain": lambda: bench_plain_criu(c, gib, work / "plain"),
        "direct": lambda: bench_criuctl(c, gib, "stop-and-copy", "direct"),
        "plain-tls": lambda: bench_plain_criu(c, gib, work / "plain", tls=True),
        "app": lambda: bench_app_level(gib, work),
    }
    # the stop-and-copy family and plain CRIU back to back (the order reversing every other round):
    # the rounds a ratio is of
    pair = ["stop-and-copy", "plain", "direct", "plain-tls"]
    pair = pair if turn % 2 == 0 else pair[::-1]
    units = [pair, ["sealed"], ["post-copy"], ["app"]]
    units = units[turn % len(units) :] + units[: turn % len(units)]
    names = [n for unit in units for n in unit if n in contenders]
    if only_post:
        names = ["post-copy"]
    out: dict = {"tcp": bench_tcp(c)}
    if "sealed" in names:  # the stream's other ceiling here: the target's fresh page cache
        out["tcp_file"] = bench_tcp(c, into=c.nodes["b"].state / "tcp-ceiling.bin")
    for name in names:
        console.print(f"  {gib} GiB {name} …")
        out[name] = jobs[name]()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=float, nargs="+", default=[0.5, 2, 4])
    ap.add_argument("--post-copy-only", type=float, nargs="*", default=[8], help="sizes for post-copy alone")
    ap.add_argument("--reps", type=int, default=3, help="rounds at least (bench/rounds.py)")
    ap.add_argument("--most", type=int, default=8, help="rounds at most, while the median ratio moves")
    ap.add_argument("--dir", default="/var/tmp/criuctl-bench-migrate")
    ap.add_argument("--json", default=str(HERE / "results" / "migrate.json"))
    ap.add_argument(
        "--only", nargs="+", choices=CONTENDERS, default=list(CONTENDERS), help="run these contenders alone"
    )
    ap.add_argument("--dense", action="store_true", help="jobs update their whole state every step")
    a = ap.parse_args()
    if a.dense:
        JOB.append("--dense")
    only = tuple(a.only)
    work = Path(a.dir)
    shutil.rmtree(work, ignore_errors=True)
    rows = []
    with Cluster(work / "cluster", tls=False) as c:
        console.print("touching guest memory, then one untimed round …")
        touch_memory()
        one_round(c, min(a.sizes), work, 0, contenders=only)
        for gib in [*a.sizes, *a.post_copy_only]:
            only_post = gib in a.post_copy_only and gib not in a.sizes
            if only_post:
                runs = [one_round(c, gib, work, 0, True, only)]
            else:
                runs = settle(
                    lambda turn, gib=gib: one_round(c, gib, work, turn, contenders=only),
                    settle_on(only),
                    a.reps,
                    max(a.reps, a.most),
                    say=console.print,
                )
            rows.append({"gib": gib, "runs": runs})
    Path(a.json).parent.mkdir(exist_ok=True)
    doc = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "transport": PLAIN,
        "dense": a.dense,
        "rows": rows,
    }
    Path(a.json).write_text(json.dumps(doc, indent=2))
    report(rows)
    return 0


def _ph(x: dict, k: str) -> float:
    return x.get("phases", {}).get(k, 0.0)  # a criuctl before 2026-12 reports none


def _vals(runs: list[dict], fn) -> str:
    vals = [fn(r) for r in runs]
    return f"{statistics.median(vals):.2f} ({min(vals):.2f}–{max(vals):.2f})"


def _stream_rate(r: dict) -> float:
    """The transport alone: the sealed stream, which starts once the bundle is complete."""
    s = r["sealed"]
    return s["bytes_moved"] / s["transfer_seconds"]


def _pages_done(r: dict) -> float:
    """Post-copy: the freeze until every page is on the target (downtime, then the pull)."""
    p = r["post-copy"]
    return p["downtime_seconds"] + (p["pages_seconds"] or 0.0)


def _down(x: dict, name: str) -> float:
    """A contender's downtime in one round (criuctl reports `downtime_seconds`, the others `downtime`)."""
    r = x[name]
    return r["downtime_seconds"] if "downtime_seconds" in r else r["downtime"]


# (numerator, denominator, title): the per-round ratios, where both ran; a size's rounds go on while
# one still moves (criuctl against plain CRIU, the goals' ratios)
RATIOS = [
    ("stop-and-copy", "plain", "stop&copy ÷ plain CRIU"),
    ("direct", "plain", "direct ÷ plain CRIU"),
    ("direct", "plain-tls", "direct ÷ plain CRIU + TLS"),
    ("plain-tls", "plain", "plain + TLS ÷ plain"),
    ("direct", "stop-and-copy", "direct ÷ stop&copy"),
]
SETTLE_ON = {"stop&copy ÷ plain CRIU", "direct ÷ plain CRIU"}


def _ratio(num: str, den: str):
    if num == "post-copy":
        return lambda x: _pages_done(x) / _down(x, den)
    return lambda x: _down(x, num) / _down(x, den)


def settle_on(contenders: tuple[str, ...]) -> list:
    fns = [_ratio(n, d) for n, d, title in RATIOS if title in SETTLE_ON and {n, d} <= set(contenders)]
    if {"post-copy", "plain"} <= set(contenders):
        fns.append(_ratio("post-copy", "plain"))
    return fns or [lambda x: 1.0]


COLUMNS = [  # (contender, column title, value of one round)
    ("stop-and-copy", "stop&copy down", lambda x: _down(x, "stop-and-copy")),
    ("direct", "direct down", lambda x: _down(x, "direct")),
    ("sealed", "… sealed stream", lambda x: _down(x, "sealed")),
    ("post-copy", "post-copy down", lambda x: _down(x, "post-copy")),
    ("post-copy", "post-copy: all pages on b", _pages_done),
    ("plain", "plain CRIU down", lambda x: _down(x, "plain")),
    ("plain-tls", "plain CRIU + TLS down", lambda x: _down(x, "plain-tls")),
    ("app", "app-level down", lambda x: _down(x, "app")),
    ("tcp", "raw TCP GB/s", lambda x: x["tcp"] / 1e9),
    ("tcp_file", "TCP into a new file GB/s", lambda x: x["tcp_file"] / 1e9),
    ("sealed", "stream GB/s", lambda x: _stream_rate(x) / 1e9),
]


def report(rows: list[dict]) -> None:
    out = Console(width=250)
    t = Table(
        title=f"migration a→b over {PLAIN}, seconds, median (min–max) — {machine()}, "
        f"{time.strftime('%Y-%m-%d')}"
    )
    ran = {k for r in rows for k in r["runs"][0]}
    cols = [c for c in COLUMNS if c[0] in ran]
    t.add_column("state", justify="right")
    for _, title, _fn in cols:
        t.add_column(title, justify="right")
    for r in rows:
        runs = r["runs"]
        t.add_row(f"{r['gib']} GiB", *(_vals(runs, fn) if name in runs[0] else "-" for name, _, fn in cols))
    out.print(t)
    t = Table(title="ratios: median of each round's ratio (min–max; rounds: until the median settles)")
    ratios = [(n, d, title) for n, d, title in RATIOS if {n, d} <= ran]
    t.add_column("state", justify="right")
    for *_, title in ratios:
        t.add_column(title, justify="right")
    extra = [("stream ÷ raw TCP", "sealed", lambda x: _stream_rate(x) / x["tcp"])]
    extra += [("stream ÷ TCP into a file", "tcp_file", lambda x: _stream_rate(x) / x["tcp_file"])]
    extra += (
        [("post-copy pages done ÷ plain CRIU", "post-copy", _ratio("post-copy", "plain"))]
        if "plain" in ran
        else []
    )
    extra = [e for e in extra if e[1] in ran]
    for title, _, _fn in extra:
        t.add_column(title, justify="right")
    for r in rows:
        runs = r["runs"]
        if not all(n in runs[0] and d in runs[0] for n, d, _ in ratios):
            continue
        t.add_row(
            f"{r['gib']} GiB",
            *(paired(runs, _ratio(n, d)) for n, d, _ in ratios),
            *(_vals(runs, fn) for _, _, fn in extra),
        )
    out.print(t)
    t = Table(title="where the time goes, median seconds (freeze and stream overlap in a live stream)")
    cols2 = (
        "state / mode",
        "handoff spawn",
        "step boundary",
        "facts",
        "CRIU dump",
        "seal",
        "stream after seal",
        "restore: handoff",
        "verify",
        "CRIU restore",
        "commit",
        "downtime",
    )
    for col in cols2:
        t.add_column(col, justify="right")
    inside = ("boundary", "prepare", "criu_dump", "seal")
    for r in rows:
        for mode in ("stop-and-copy", "direct", "sealed", "post-copy"):
            if mode not in r["runs"][0]:
                continue
            ms = [x[mode] for x in r["runs"]]

            def m(fn, ms=ms) -> str:
                return f"{statistics.median(fn(x) for x in ms):.2f}"

            t.add_row(
                f"{r['gib']} GiB {mode}",
                m(lambda x: x["freeze_seconds"] - sum(_ph(x, k) for k in inside)),
                *(m(lambda x, k=k: _ph(x, k)) for k in inside),
                m(lambda x: x["transfer_seconds"]),
                m(lambda x: x["restore_seconds"] - _ph(x, "verify") - _ph(x, "criu_restore")),
                m(lambda x: _ph(x, "verify")),
                m(lambda x: _ph(x, "criu_restore")),
                m(
                    lambda x: (
                        x["downtime_seconds"]
                        - sum(_ph(x, k) for k in inside)
                        - x["transfer_seconds"]
                        - x["restore_seconds"]
                    )
                ),
                m(lambda x: x["downtime_seconds"]),
            )
    out.print(t)


if __name__ == "__main__":
    sys.exit(main())
