"""The GPU check: criuctl on a real NVIDIA GPU, in one short run (tests/gpu/check.sh sets it up).

1. the driver's checkpoint API as criuctl sees it (`criuctl doctor`, tests/gpu/test_cuda_driver.py);
2. a single-GPU training job (tests/workloads/train_gpu.py) checkpointed through the driver API and
   CRIU, restored, compared loss by loss and by its final weights with an uninterrupted run:
   once with the old -> new GPU UUID map passed to the driver (r580+), once without, once with the
   allocator criuctl advises when the checkpoint carried idle cache (expandable segments);
3. the same job through the state pre-dump (`dump --state`): AdamW's step goes on after the restart;
4. the time the driver took to move the job's device memory to host memory, against a plain
   device-to-host copy of the same size measured here;
5. what the driver returns for each case the stand-in driver claims to reproduce (tests/gpu/probe.py);
6. a job with a real NCCL communicator (DDP over a world of one NCCL rank): with NCCL 2.29.7+,
   suspended by the hook at the step boundary, checkpointed, restored and resumed, loss for loss;
   with an older NCCL, refused in one line, then through the driver with CRIUCTL_NCCL_TRY=1;
7. what the boundary's empty_cache() saves the driver, with torch's default allocator and with
   expandable segments (GPU_CHECK_ONLY=cache runs this alone);
8. the hook's NCCL suspension called on a live one-rank communicator, outside CRIU;
9. which kind of memory the driver's host copy of the device memory is (private anonymous: served
   lazily by post-copy; shared: dumped whole), as the stand-in assumes.

Not here: a move between two agents. On a GPU node `criuctl run` keeps the node's PIDs (CUDA reads
/proc by them), and on one host the frozen source still holds them while the target restores; two
GPU hosts (or GPU pods) are needed, which the device tool does not lend.

Writes every result (commit, driver, GPU, versions, every step's loss as hex, every timing, the probed
driver codes) to gpu-check.json: under $OUT when the device tool runs it, else bench/results/.
`bench/gpu_table.py` makes docs/benchmarks.md's GPU table from that file. Exits non-zero if a check
failed.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from criuctl.gpu.gpustate import CACHE_FIX  # noqa: E402  (what criuctl tells a job to run with)
from tests.jobs import CRIUCTL, Job, Reference, assert_continues_exactly, criuctl, workload_cmd  # noqa: E402

ARGS = ("--steps", "40", "--width", os.environ.get("GPU_CHECK_WIDTH", "2048"), "--layers", "4")
REPO = HERE.parent.parent
RESULTS = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "bench" / "results"
rows: list[dict] = []
failed = False


def record(name: str, ok: bool, detail: str, **data: object) -> None:
    """One check's row: its one-line detail for the table, and its raw numbers for the JSON."""
    global failed
    failed |= not ok
    rows.append({"check": name, "ok": ok, "detail": detail, **data})
    print(f"[{'ok' if ok else 'FAIL'}] {name}: {detail}", flush=True)


def commit() -> str:
    """The commit this ran on: gpu-carry.sh writes it (the device machine's copy has no .git)."""
    carried = Path(os.environ.get("CRIUCTL_GPU_CARRY", REPO / ".gpu-carry")) / "COMMIT"
    if carried.exists():
        return carried.read_text().strip()
    r = subprocess.run(
        ["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True, text=True
    )
    return r.stdout.strip() or "unknown"


def environment() -> dict[str, object]:
    import torch

    from criuctl.gpu import cuda, gpus

    devices = gpus.list_gpus()
    info = cuda.probe()
    return {
        "commit": commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kernel": platform.release(),
        "driver": gpus.driver_version(),
        "driver_cuda": cuda.version_text(info.driver_version) if info.driver_version else None,
        "gpus": [g.to_dict() for g in devices],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "criu": subprocess.run(
            [os.environ.get("CRIUCTL_CRIU", "criu"), "--version"], capture_output=True, text=True
        )
        .stdout.strip()
        .replace("\n", "; "),
    }


def manifest(bundle: Path) -> dict:
    return json.loads(criuctl("inspect", str(bundle), "--output", "json").stdout)


def moved_through_driver(
    ref: Reference, tag: str, env: dict[str, str], *extra: str, job_env: dict[str, str] | None = None
) -> dict | None:
    """Run (the job's environment plus `job_env`), dump at step 15 (driver + CRIU), restore (criuctl's
    environment plus `env`), compare; the bundle's manifest."""
    bundle = Path(f"/tmp/criuctl-gpu-{tag}")
    subprocess.run(["rm", "-rf", str(bundle)], check=False)
    argv = [*CRIUCTL, "run", "--name", f"gpu-{tag}", "--", *workload_cmd("train_gpu.py", *ARGS, *extra)]
    job = Job([*argv, "--step-time", "0.05"], env={**os.environ, **(job_env or {})})
    try:
        job.wait_for_step(15, timeout=180)
        t = time.monotonic()
        r = criuctl("dump", f"gpu-{tag}", "--bundle", str(bundle), env={**os.environ, **env})
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
            dump_s=round(dump_s, 3),
            checkpoint_s=gpu.get("checkpoint_s"),
            restore_and_run_s=round(time.monotonic() - t, 3),
            rss_bytes=m.get("rss_bytes"),
            cuda_bytes=(m.get("boundary") or {}).get("cuda_bytes"),
            device_bytes=gpu.get("device_bytes"),
            losses_before=job.steps,
            losses_after=restored.steps,
            reference_losses=ref.steps,
            final=restored.final,
            reference_final=ref.final,
            stderr_tail=restored.err[-5:],
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
        r = criuctl("dump", "gpu-state", "--state", "--bundle", str(bundle))
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


def driver_codes() -> dict:
    """tests/gpu/probe.py on the real driver: the record the stand-in is compared with."""
    from criuctl.gpu import cuda
    from tests.gpu import probe

    py = sys.executable
    idle = (
        "import torch, time; x = torch.ones(1 << 20, device='cuda'); torch.cuda.synchronize()\n"
        "print(1, flush=True); time.sleep(600)"
    )
    # a queue of spin kernels keeps the GPU busy, so the lock must wait for them
    spin = (
        "import torch; x = torch.ones(1, device='cuda'); torch.cuda.synchronize(); print(1, flush=True)\n"
        "while True: torch.cuda._sleep(2_000_000_000)"
    )

    def started(code: str):
        def start() -> subprocess.Popen:
            p = subprocess.Popen([py, "-c", code], stdout=subprocess.PIPE, text=True)
            assert p.stdout is not None and p.stdout.readline().strip() == "1", (
                "the CUDA process did not start"
            )
            time.sleep(0.5)
            return p

        return start

    procs = probe.Processes(
        cuda=started(idle), busy=started(spin), plain=lambda: subprocess.Popen(["sleep", "600"])
    )
    codes = probe.probe(cuda.Driver.load(), procs)
    record("driver codes (tests/gpu/probe.py)", True, json.dumps({k: v["name"] for k, v in codes.items()}))
    return codes


def _rss(pid: int) -> dict[str, int]:
    fields = ("RssAnon", "RssShmem", "RssFile")
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {k: int(x.split()[1]) << 10 for x in lines for k in fields if x.startswith(k + ":")}


def host_copy_kind() -> None:
    """Where the driver puts its host copy of the device memory: private anonymous memory is what
    CRIU's lazy pages serve after the restore (post-copy), shared memory CRIU dumps whole before
    it. The stand-in driver's copy is private (tests/workloads/_standin_cuda.py): this checks that."""
    from criuctl.gpu import cuda

    code = (
        "import torch, time; x = torch.ones(1 << 28, device='cuda'); torch.cuda.synchronize()\n"
        "print(1, flush=True); time.sleep(600)"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    driver = cuda.Driver.load()
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "1", "the CUDA process did not start"
        before = _rss(p.pid)
        driver.lock(p.pid, 10.0)
        driver.checkpoint(p.pid)
        grew = {k: v - before.get(k, 0) for k, v in _rss(p.pid).items()}
        driver.restore(p.pid)
        driver.unlock(p.pid)
        private = grew.get("RssAnon", 0) >= grew.get("RssShmem", 0)
        record(
            "the driver's host copy",
            private,
            f"1 GiB on the device; after the checkpoint RSS grew {grew.get('RssAnon', 0) / 2**30:.2f} GiB "
            f"private anonymous, {grew.get('RssShmem', 0) / 2**30:.2f} GiB shared, "
            f"{grew.get('RssFile', 0) / 2**30:.2f} GiB file-backed"
            + ("" if private else ": CRIU dumps shared memory whole, so post-copy saves none of it"),
            grew=grew,
        )
    finally:
        p.kill()
        p.wait()


# what each run of the empty_cache check does with a 4 GiB buffer a step, and the allocator it runs with
CACHE_VARIANTS = {
    "freed": ((), {}),
    "freed, expandable segments": ((), dict([CACHE_FIX.split("=", 1)])),
    "kept": (("--scratch-keep",), {}),
}


def cache_emptied() -> None:
    """What the hook's empty_cache() at the boundary saves the driver: the same job with a 4 GiB
    temporary buffer each step, freed or kept alive. Freed, its segment is split for the step's
    gradients and stays reserved (2026-12-04); with expandable segments the allocator can unmap the
    free pages inside a segment, so the boundary should shed it."""
    got: dict[str, dict[str, object]] = {}
    for tag, (flags, extra) in CACHE_VARIANTS.items():
        name = "gpu-scratch-" + tag.replace(",", "").replace(" ", "-")
        bundle = Path(f"/tmp/criuctl-{name}")
        subprocess.run(["rm", "-rf", str(bundle)], check=False)
        argv = [*CRIUCTL, "run", "--name", name, "--", *workload_cmd("train_gpu.py", *ARGS)]
        argv += ["--scratch-mib", "4096", *flags, "--step-time", "0.05"]
        job = Job(argv, env={**os.environ, **extra})
        try:
            job.wait_for_step(5, timeout=180)
            smi = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                capture_output=True,
                text=True,
            ).stdout.strip()
            r = criuctl("dump", name, "--bundle", str(bundle))
            if r.returncode != 0:
                record(f"boundary empty_cache ({tag})", False, r.stderr.strip()[-600:])
                return
            m = manifest(bundle)
            gpu = m.get("gpu") or {}
            got[tag] = {
                "checkpoint_s": float(gpu.get("checkpoint_s") or 0),
                "device_bytes": int(gpu.get("device_bytes") or 0),
                "cuda_reserved": int((m.get("boundary") or {}).get("cuda_reserved") or 0),
                "cuda_allocated": int((m.get("boundary") or {}).get("cuda_bytes") or 0),
                "bundle_rss_bytes": int(m.get("rss_bytes") or 0),  # read after the checkpoint
                "nvidia_smi_before": smi,
            }
        finally:
            job.kill()
            subprocess.run(["rm", "-rf", str(bundle)], check=False)
    gib = 2**30
    record(
        "boundary empty_cache",
        True,
        "a 4 GiB buffer each step; "
        + "; ".join(
            f"{tag}: lock+checkpoint {g['checkpoint_s']:.2f} s, {g['device_bytes'] / gib:.2f} GiB moved, "
            f"{g['cuda_reserved'] / gib:.2f} GiB still reserved after empty_cache, "
            f"bundle {g['bundle_rss_bytes'] / gib:.2f} GiB RSS"
            for tag, g in got.items()
        ),
        variants=got,
    )


def nccl_refused() -> None:
    """A job holding an NCCL communicator is refused before the driver's lock, and trains on."""
    job = Job.run("gpu-nccl-refused", "train_gpu.py", *ARGS, "--nccl", "--step-time", "0.05")
    try:
        job.wait_for_step(15, timeout=180)
        r = criuctl("dump", "gpu-nccl-refused", "--bundle", "/tmp/criuctl-gpu-nccl-refused")
        code = job.wait(300)
        line = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
        ok = r.returncode != 0 and "NCCL process group" in line and code == 0 and job.final is not None
        record(
            "one-rank NCCL job refused",
            ok,
            f"{line[:400]}; the job ended with {code}",
            stderr=r.stderr[-2000:],
        )
    finally:
        job.kill()


# A one-rank NCCL communicator in a process of its own; the hook's suspension called on it directly.
NCCL_PROBE = r"""
import json, socket, torch, torch.distributed as dist
from criuctl_hook import nccl
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
x = torch.ones(1 << 20, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
backend = dist.group.WORLD._get_backend(torch.device("cuda", 0))
out = {"torch_suspend": callable(getattr(backend, "suspend", None))}
out["comm_ptr"] = hex(int(backend._comm_ptr())) if hasattr(backend, "_comm_ptr") else None
lib = nccl.library()
out["libnccl"] = getattr(lib, "_name", None)
free = torch.cuda.mem_get_info()[0]
done = nccl.suspend(torch)
out["report"] = done.report()
out["freed_bytes"] = torch.cuda.mem_get_info()[0] - free
done.resume()
dist.all_reduce(x)
torch.cuda.synchronize()
out["collective_after_resume"] = float(x[0].item())
dist.destroy_process_group()
print(json.dumps(out))
"""


def nccl_suspension_probe() -> None:
    """What the hook's NCCL suspension does on this machine's torch and NCCL, outside CRIU: with
    NCCL 2.29.7+ it suspends the communicator (its memory given back), resumes it, and a collective
    works after; older, it finds the loaded libnccl and says why it cannot."""
    import torch

    r = subprocess.run([sys.executable, "-c", NCCL_PROBE], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        record("NCCL suspension probe (hook)", False, r.stderr.strip()[-600:])
        return
    out = json.loads(r.stdout.strip().splitlines()[-1])
    rep = (out.get("report") or {}).get("nccl_suspend") or {}
    if tuple(torch.cuda.nccl.version()) >= (2, 29, 7):
        ok = rep.get("suspended") == 1 and not rep.get("error") and out["collective_after_resume"] == 1.0
    else:
        ok = "has no ncclCommSuspend" in str(rep.get("error")) and bool(out.get("libnccl"))
    record(
        "NCCL suspension probe (hook)",
        ok,
        f"libnccl {out.get('libnccl')}; _comm_ptr {out.get('comm_ptr')}; torch suspend(): "
        f"{out.get('torch_suspend')}; {json.dumps(rep)}; {out.get('freed_bytes', 0) / 2**20:.0f} MiB freed; "
        f"all_reduce after resume: {out.get('collective_after_resume')}",
        **out,
    )


def nccl_moved(ref: Reference) -> None:
    """NCCL 2.29.7+: the hook suspends the communicator at the boundary, the driver checkpoints the
    rest, the restored job resumes it and trains on, loss for loss. Older: refused in one line, then
    moved anyway with CRIUCTL_NCCL_TRY=1 (what the driver does with a live communicator)."""
    import torch

    version = tuple(torch.cuda.nccl.version())
    if version >= (2, 29, 7):
        m = moved_through_driver(ref, "nccl", {}, "--nccl")
        suspended = int(((m or {}).get("boundary") or {}).get("nccl_suspended") or 0)
        record(
            "NCCL communicator suspended at the boundary",
            suspended >= 1,
            f"NCCL {'.'.join(map(str, version))}: {suspended} communicator(s) suspended by the hook",
            nccl_suspended=suspended,
        )
        return
    nccl_refused()
    moved_through_driver(ref, "nccl-try", {"CRIUCTL_NCCL_TRY": "1"}, "--nccl")


def write_results(env: dict[str, object], codes: dict | None, name: str = "gpu-check.json") -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    doc = {**env, "checks": rows, "driver_codes": codes or {}, "failed": failed}
    path.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n")
    return path


# GPU_CHECK_ONLY=KEY runs that stage alone (a short device call), into gpu-check-KEY.json
ALONE = {"cache": ("boundary empty_cache", cache_emptied)}


def main() -> int:
    print(criuctl("doctor").stdout, flush=True)
    env = stage("environment", environment) or {}
    if only := os.environ.get("GPU_CHECK_ONLY"):
        if only not in ALONE:
            sys.exit(f"check.py: GPU_CHECK_ONLY={only!r}: one of {sorted(ALONE)}")
        stage(*ALONE[only])
        print(f"\nresults: {write_results(env, None, f'gpu-check-{only}.json')}")
        return 1 if failed else 0
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE / "test_cuda_driver.py")],
        capture_output=True,
        text=True,
    )
    record(
        "driver API probe (pytest)",
        r.returncode == 0,
        r.stdout.strip().splitlines()[-1] if r.stdout else r.stderr[-300:],
        output=(r.stdout + r.stderr)[-3000:],
    )
    codes = stage("driver codes", driver_codes)
    stage("the driver's host copy", host_copy_kind)
    ref = stage(
        "uninterrupted reference run", lambda: Reference("gpu-ref", "train_gpu.py", *ARGS, "--step-time", "0")
    )
    m = stage("with the UUID map", lambda: moved_through_driver(ref, "map", {})) if ref else None
    if ref:
        stage("without the UUID map", lambda: moved_through_driver(ref, "nomap", {"CRIUCTL_CUDA_REMAP": "0"}))
        # what criuctl tells a job whose cache the checkpoint carried (gpustate.stranded_cache): exact too?
        stage(
            "with expandable segments",
            lambda: moved_through_driver(ref, "expandable", {}, job_env=dict([CACHE_FIX.split("=", 1)])),
        )
    stage("state pre-dump", state_predump)
    if m and m.get("gpu") and m.get("boundary"):
        # what the checkpoint moved (RSS growth), else what the trainers still had allocated
        held = int(m["gpu"].get("device_bytes") or m["boundary"].get("cuda_bytes") or 0)
        pageable, pinned = copy_bandwidth(held)
        took = float(m["gpu"]["checkpoint_s"])
        record(
            "GPU -> host copy",
            True,
            f"driver lock+checkpoint moved {held / 2**30:.2f} GiB in {took:.2f} s "
            f"({held / max(took, 1e-9) / 1e9:.1f} GB/s); torch D2H here: {pageable:.1f} GB/s pageable, "
            f"{pinned:.1f} GB/s pinned; checkpoint ÷ pinned copy {took / max(held / pinned / 1e9, 1e-9):.1f}",
            bytes=held,
            checkpoint_s=took,
            d2h_pageable_gbs=round(pageable, 2),
            d2h_pinned_gbs=round(pinned, 2),
        )
    stage("boundary empty_cache", cache_emptied)
    nccl_ref = stage(
        "uninterrupted NCCL run",
        lambda: Reference("gpu-nccl-ref", "train_gpu.py", *ARGS, "--nccl", "--step-time", "0"),
    )
    stage("NCCL suspension probe (hook)", nccl_suspension_probe)
    if nccl_ref:
        stage("one-rank NCCL job", lambda: nccl_moved(nccl_ref))
    path = write_results(env, codes)
    print(f"\nresults: {path}  (python bench/gpu_table.py {path} makes the table)")
    print("\n| check | result | detail |\n| --- | --- | --- |")
    for row in rows:
        detail = str(row["detail"]).replace("|", "/")
        print(f"| {row['check']} | {'ok' if row['ok'] else 'FAIL'} | {detail} |")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
