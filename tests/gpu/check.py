"""The GPU check: criuctl on a real NVIDIA GPU, in one short run (tests/gpu/check.sh sets it up).

1. the driver's checkpoint API as criuctl sees it (`criuctl doctor`, tests/gpu/test_cuda_driver.py);
2. a single-GPU training job (tests/workloads/train_gpu.py) checkpointed through the driver API and
   CRIU, restored, compared loss by loss and by its final weights with an uninterrupted run:
   once with the old -> new GPU UUID map passed to the driver (r580+), once without;
3. the same job through the state pre-dump (`dump --state`): AdamW's step goes on after the restart;
4. the time the driver took to move the job's device memory to host memory, against a plain
   device-to-host copy of the same size measured here.

Prints one results table (Markdown) at the end; exits non-zero if a check failed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from tests.jobs import CRIUCTL, Job, Reference, assert_continues_exactly, criuctl  # noqa: E402

ARGS = ("--steps", "40", "--width", os.environ.get("GPU_CHECK_WIDTH", "2048"), "--layers", "4")
OUT = Path(os.environ.get("OUT", "/tmp")) if os.environ.get("OUT") else Path("/tmp")
rows: list[tuple[str, str, str]] = []
failed = False


def record(name: str, ok: bool, detail: str) -> None:
    global failed
    failed |= not ok
    rows.append((name, "ok" if ok else "FAIL", detail))
    print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)


def manifest(bundle: Path) -> dict:
    return json.loads(criuctl("inspect", str(bundle), "--output", "json").stdout)


def moved_through_driver(ref: Reference, tag: str, env: dict[str, str]) -> dict | None:
    """Run, dump at step 15 (driver + CRIU), restore, compare; the bundle's manifest."""
    bundle = Path(f"/tmp/criuctl-gpu-{tag}")
    subprocess.run(["rm", "-rf", str(bundle)], check=False)
    job = Job.run(f"gpu-{tag}", "train_gpu.py", *ARGS, "--step-time", "0.05")
    try:
        job.wait_for_step(15, timeout=180)
        t = time.monotonic()
        r = criuctl("dump", f"gpu-{tag}", "-o", str(bundle), env={**os.environ, **env})
        dump_s = time.monotonic() - t
        if r.returncode != 0:
            record(f"dump ({tag})", False, r.stderr.strip()[-600:])
            return None
        assert job.wait(60) == 0
        m = manifest(bundle)
        t = time.monotonic()
        restored = Job([*CRIUCTL, "restore", str(bundle)], env={**os.environ, **env})
        rc = restored.wait(300)
        if rc != 0:
            record(f"restore ({tag})", False, " | ".join(restored.err[-6:]))
            return None
        try:
            assert_continues_exactly(ref, job.steps, restored)
            same = True
            detail = f"{len(restored.steps)} steps after restore, final weights equal the uninterrupted run's"
        except AssertionError as exc:
            same, detail = False, str(exc)[:600]
        gpu = m.get("gpu") or {}
        record(
            f"driver API + CRIU ({tag})",
            same,
            f"{detail}; dump {dump_s:.2f} s (lock+checkpoint {gpu.get('checkpoint_s', '?')} s), "
            f"restore+run {time.monotonic() - t:.1f} s; bundle {m.get('rss_bytes', 0) / 2**30:.2f} GiB RSS",
        )
        return m
    finally:
        job.kill()


def state_predump() -> None:
    bundle = Path("/tmp/criuctl-gpu-predump")
    subprocess.run(["rm", "-rf", str(bundle)], check=False)
    job = Job.run("gpu-state", "train_gpu.py", *ARGS, "--step-time", "0.05", "--show-state")
    try:
        job.wait_for_step(15, timeout=180)
        t = time.monotonic()
        r = criuctl("dump", "gpu-state", "--state", "-o", str(bundle))
        if r.returncode != 0:
            record("state pre-dump", False, r.stderr.strip()[-600:])
            return
        dump_s = time.monotonic() - t
        job.wait(60)
        saved = manifest(bundle)["state"]
        restored = Job.restore(bundle)
        restored.wait(300)
        first = next((x for x in restored.out if x.startswith("state adam")), "")
        ok = first.startswith(f"state adam {saved['step'] + 1} ") and restored.final is not None
        record(
            "state pre-dump (no CRIU)",
            ok,
            f"saved at step {saved['step']} ({saved['bytes'] / 2**20:.0f} MiB) in {dump_s:.2f} s; "
            f"restarted job's AdamW says {first!r}",
        )
    finally:
        job.kill()


def stage(name: str, fn):
    """Run one check; a crash is a failed row, and the next check still runs."""
    try:
        return fn()
    except Exception as exc:  # a check script reports, it does not stop
        record(name, False, f"{type(exc).__name__}: {str(exc)[-800:]}")
        return None


def copy_bandwidth(nbytes: int) -> tuple[float, float]:
    """GB/s of a device-to-host copy of `nbytes` into pageable and into pinned memory."""
    import torch

    src = torch.empty(max(nbytes, 1 << 20), dtype=torch.uint8, device="cuda")
    out = []
    for pinned in (False, True):
        dst = torch.empty(src.numel(), dtype=torch.uint8, pin_memory=pinned)
        dst.copy_(src)  # warm-up
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        out.append(src.numel() / best / 1e9)
    return out[0], out[1]


def main() -> int:
    print(criuctl("doctor").stdout, flush=True)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "test_cuda_driver.py")],
        capture_output=True,
        text=True,
    )
    record(
        "driver API probe (pytest)",
        r.returncode == 0,
        r.stdout.strip().splitlines()[-1] if r.stdout else r.stderr[-300:],
    )
    ref = stage(
        "uninterrupted reference run", lambda: Reference("gpu-ref", "train_gpu.py", *ARGS, "--step-time", "0")
    )
    m = stage("with the UUID map", lambda: moved_through_driver(ref, "map", {})) if ref else None
    if ref:
        stage("without the UUID map", lambda: moved_through_driver(ref, "nomap", {"CRIUCTL_CUDA_REMAP": "0"}))
    stage("state pre-dump", state_predump)
    if m and m.get("gpu") and m.get("boundary"):
        held = int(m["boundary"].get("cuda_bytes") or 0)
        pageable, pinned = copy_bandwidth(held)
        took = float(m["gpu"]["checkpoint_s"])
        record(
            "GPU -> host copy",
            True,
            f"driver lock+checkpoint moved {held / 2**30:.2f} GiB in {took:.2f} s "
            f"({held / max(took, 1e-9) / 1e9:.1f} GB/s); torch D2H here: {pageable:.1f} GB/s pageable, "
            f"{pinned:.1f} GB/s pinned",
        )
    print("\n| check | result | detail |\n| --- | --- | --- |")
    for name, ok, detail in rows:
        print(f"| {name} | {ok} | {detail.replace('|', '/')} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
