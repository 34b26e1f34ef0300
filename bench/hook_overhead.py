"""What the in-process hook costs a training job that is never checkpointed (target: <= 0.5 % of step time).

Contenders, in one run, alternated and repeated (these are VMs: warm up, then take medians):
- plain: the training script as the user runs it;
- hooked: the same script with criuctl's hook loaded as `criuctl run` loads it (sitecustomize on
  PYTHONPATH, a control directory): an optimizer step post-hook, a forward pre-hook and the
  DataLoader wrapper, idle.
Three step sizes (a small, a medium and a larger MLP on CPU), because the hook's cost is per step,
not per FLOP: the smaller the step, the larger its share. Also the hook's absolute cost per step,
measured in-process on a do-nothing step.

    .venv/bin/python bench/hook_overhead.py [--repeats 5] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = r"""
import sys, time, torch
width, steps = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.utils.data.TensorDataset(torch.randn(64 * 8, width), torch.randn(64 * 8, width))
loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True)
done, t0 = 0, None
while done < steps:
    for x, y in loader:
        if done == 20:
            t0 = time.perf_counter()  # after warm-up
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        done += 1
        if done == steps:
            break
print((time.perf_counter() - t0) / (steps - 20))
"""


def run_job(script: Path, width: int, steps: int, hooked: bool, control: Path) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CRIUCTL_")}
    if hooked:
        env.update(
            CRIUCTL_WORKLOAD="bench",
            CRIUCTL_CONTROL_DIR=str(control),
            PYTHONPATH=os.pathsep.join([str(ROOT / "hooks"), env.get("PYTHONPATH", "")]),
        )
    out = subprocess.run(
        [sys.executable, str(script), str(width), str(steps)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def per_step_cost(n: int = 20000) -> float:
    """Seconds the idle hook adds per step (its optimizer post-hook; the forward pre-hook is only
    installed while a capture or a resume waits), on a step that does almost nothing (a 3-layer
    model's forward and an SGD step), in this process: the cost without the VM's noise around it."""
    sys.path.insert(0, str(ROOT / "hooks"))
    import torch

    from criuctl_hook import boundary

    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    lin = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.ReLU(), torch.nn.Linear(1, 1))  # 4 forwards
    x = torch.zeros(1, 1)

    def loop() -> float:
        t = time.perf_counter()
        for _ in range(n):
            lin(x)
            opt.step()
        return (time.perf_counter() - t) / n

    loop()
    bare = min(loop() for _ in range(5))
    os.environ["CRIUCTL_CONTROL_DIR"] = tempfile.mkdtemp()
    boundary.install(torch)
    loop()
    hooked = min(loop() for _ in range(5))
    return hooked - bare


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args()
    widths = (256, 1024, 2048)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "job.py"
        script.write_text(JOB)
        control = Path(tmp) / "control"
        control.mkdir()
        results: dict[int, dict[str, list[float]]] = {w: {"plain": [], "hooked": []} for w in widths}
        for w in widths:
            run_job(script, w, 60, False, control)  # warm the page cache and the CPU
        for i in range(a.repeats):
            for w in widths:
                order = ("plain", "hooked") if i % 2 == 0 else ("hooked", "plain")
                for who in order:
                    results[w][who].append(run_job(script, w, a.steps, who == "hooked", control))
    cost = per_step_cost()
    rows = []
    print("| step (plain, median) | with the hook | overhead | runs |\n| --- | --- | --- | --- |")
    for w in widths:
        plain, hooked = statistics.median(results[w]["plain"]), statistics.median(results[w]["hooked"])
        pct = (hooked - plain) / plain * 100
        rows.append({"width": w, "plain_s": plain, "hooked_s": hooked, "overhead_pct": pct, **results[w]})
        print(f"| MLP {w}: {plain * 1e3:.2f} ms | {hooked * 1e3:.2f} ms | {pct:+.2f} % | {a.repeats} each |")
    print(f"\nthe idle hook's own cost per step (in-process, without the VM's noise): {cost * 1e6:.2f} µs")
    for w in widths:
        plain = statistics.median(results[w]["plain"])
        print(f"  = {cost / plain * 100:.3f} % of the MLP {w} step")
    out = ROOT / "bench" / "results" / "hook_overhead.json"
    out.write_text(json.dumps({"rows": rows, "per_step_cost_s": cost, "when": time.time()}, indent=2))


if __name__ == "__main__":
    main()
