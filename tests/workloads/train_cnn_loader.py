"""A job with the moving parts of real training: DataLoader workers, a background thread, a log file
open for appending, Adam with a cosine LR schedule, a small CNN on synthetic images."""

import argparse
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

import _report

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--workers", type=int, default=2)
p.add_argument("--log", required=True)
p.add_argument("--read-latency", type=float, default=0.004, help="simulated seconds per sample read")
p.add_argument("--scratch", help="a folder (an emptyDir in a pod) to keep a progress file open in")
p.add_argument("--show-state", action="store_true", help="print Adam's step count and the LR after each step")
p.add_argument(
    "--state-mb",
    type=int,
    default=0,
    help="MiB of live state besides the model (a larger model's optimizer state, a replay buffer): "
    "random, one MiB of it updated each step, all of it in the final digest",
)
a = p.parse_args()


class Shapes(Dataset):
    """Images of noise whose label depends on their mean in the centre; each read 'hits the disk'."""

    def __len__(self):
        return 4096

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        img = torch.randn(1, 16, 16, generator=g)
        time.sleep(a.read_latency)
        return img, int(img[0, 4:12, 4:12].mean() > 0)


class Heartbeat(threading.Thread):
    """What real jobs run beside training: a thread that writes progress to the log."""

    def __init__(self, log):
        super().__init__(daemon=True)
        self.log, self.step, self.beats = log, 0, 0
        self.stop = threading.Event()

    def run(self):
        while not self.stop.wait(0.05):
            self.beats += 1
            self.log.write(f"heartbeat {self.beats} at step {self.step}\n")
            self.log.flush()


torch.manual_seed(1)
model = torch.nn.Sequential(
    torch.nn.Conv2d(1, 8, 3, padding=1),
    torch.nn.ReLU(),
    torch.nn.MaxPool2d(2),
    torch.nn.Conv2d(8, 16, 3, padding=1),
    torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1),
    torch.nn.Flatten(),
    torch.nn.Linear(16, 2),
)
opt = torch.optim.Adam(model.parameters(), lr=3e-3)
state = torch.rand(a.state_mb, 1 << 18, generator=torch.Generator().manual_seed(3))  # MiB rows
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps)
loader = DataLoader(
    Shapes(),
    batch_size=32,
    shuffle=True,
    num_workers=a.workers,
    generator=torch.Generator().manual_seed(2),
    persistent_workers=a.workers > 0,
)
log = open(a.log, "a")  # noqa: SIM115 - held open for the job's life, like a real training log
progress = open(f"{a.scratch}/progress", "a") if a.scratch else None  # noqa: SIM115 - held open
beat = Heartbeat(log)
beat.start()
step = 0
while step < a.steps:
    for xb, yb in loader:
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if a.state_mb:
            state[step % a.state_mb].add_(loss.item())
        beat.step = step
        log.write(f"step {step} loss {loss.item():.6f} lr {sched.get_last_lr()[0]:.6f}\n")
        _report.step(step, loss.item())
        if a.show_state:
            first = next(iter(opt.state.values()))
            print(f"state adam {int(first['step'])} lr {sched.get_last_lr()[0]!r}", flush=True)
        if progress:
            progress.write(f"{step}\n")
            progress.flush()
        step += 1
        if step == a.steps:
            break
beat.stop.set()
beat.join()
log.write("done\n")
log.close()
_report.final(model, state)
