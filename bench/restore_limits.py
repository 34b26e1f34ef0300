"""Benchmark: how fast can anything fill a restored job's memory on this machine — the ceiling that
`criu restore` (and so `criuctl restore`) works against.

CRIU 4.2's restorer fills a job's private memory with one `preadv` per run of pages, from the pages
image into memory it has just mapped: one thread copying from the page cache into fresh memory. On
a VM every fresh page is a first touch (the host backs it then), which costs more than the copy.
This measures that pattern and the two levers issue 25 names for it, side by side in each round:

  1 thread, 4 KiB pages     what CRIU 4.2 does
  2 threads, 4 KiB pages    the same memory filled in parallel (as a restorer could)
  1 / 2 threads, THP        MADV_HUGEPAGE set before the read (CRIU 4.2 sets a job's madvise
                            flags after its pages are read, so its restored memory is 4 KiB pages)

The image is a file of random bytes read once first (in the page cache, as a just-written bundle
is); each contender maps fresh anonymous memory, fills it and unmaps it. The order alternates per
round. Medians, min–max.
Usage: python bench/restore_limits.py [--gib 2] [--reps 5] [--dir /var/tmp/criuctl-bench]
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import shutil
import statistics
import threading
import time
from pathlib import Path

from rounds import arguments  # bench/, the script's own folder, is on the path

HERE = Path(__file__).resolve().parent
CHUNK = 64 << 20  # bytes per preadv: CRIU caps one preadv too (preadv_limited)
HUGE = 2 << 20


def fill(image: Path, size: int, threads: int, thp: bool) -> float:
    """Seconds to read `size` bytes of `image` into fresh anonymous memory on `threads` threads."""
    m = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if thp:
        m.madvise(mmap.MADV_HUGEPAGE)
    view = memoryview(m)
    fd = os.open(image, os.O_RDONLY)
    part = size // threads

    def one(i: int) -> None:
        off, end = i * part, (i + 1) * part
        while off < end:
            off += os.preadv(fd, [view[off : min(end, off + CHUNK)]], off)

    started = time.perf_counter()
    workers = [threading.Thread(target=one, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.perf_counter() - started
    os.close(fd)
    view.release()
    m.close()
    return seconds


CONTENDERS = {
    "1 thread": (1, False),
    "2 threads": (2, False),
    "1 thread, THP": (1, True),
    "2 threads, THP": (2, True),
}


def main() -> int:
    ap = arguments("restore_limits", reps=5)
    ap.add_argument("--gib", type=float, default=2.0)
    a = ap.parse_args()
    work = Path(a.dir)
    work.mkdir(parents=True, exist_ok=True)
    image = work / "restore-limits.img"
    size = int(a.gib * (1 << 30)) & ~(HUGE - 1)
    with image.open("wb") as f:  # random bytes: nothing to gain from zero pages
        for _ in range(size // CHUNK):
            f.write(os.urandom(CHUNK))
    with image.open("rb") as f:  # in the page cache, as a bundle just written
        while f.read(CHUNK):
            pass
    names = list(CONTENDERS)
    rounds: list[dict[str, float]] = []
    for turn in range(a.reps):
        order = names if turn % 2 == 0 else names[::-1]
        rounds.append({n: fill(image, size, *CONTENDERS[n]) for n in order})
        print(f"round {turn + 1}: " + ", ".join(f"{n} {rounds[-1][n]:.2f} s" for n in names), flush=True)
    shutil.rmtree(work, ignore_errors=True)
    gb = size / 1e9
    print(f"{a.gib} GiB into fresh memory, GB/s median (min–max) over {a.reps} rounds:")
    for n in names:
        rates = [gb / r[n] for r in rounds]
        print(f"  {n:15} {statistics.median(rates):.2f} ({min(rates):.2f}–{max(rates):.2f})")
    two = [r["1 thread"] / r["2 threads"] for r in rounds]
    mid, lo, hi = statistics.median(two), min(two), max(two)
    print(f"  2 threads ÷ 1, speed-up per round: {mid:.2f} ({lo:.2f}–{hi:.2f})")
    machine = f"{platform.node()}: {os.cpu_count()} cores, kernel {platform.release()}"
    Path(a.json).write_text(
        json.dumps(dict(machine=machine, date=time.strftime("%Y-%m-%d"), bytes=size, rounds=rounds), indent=2)
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
