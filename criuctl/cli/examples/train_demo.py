"""The demo's training job: an ordinary PyTorch script that knows nothing about criuctl.

A classifier on synthetic two-spiral data, fed by a DataLoader with worker processes, trained with
AdamW and a OneCycle schedule. It prints each step's loss exactly (float.hex) and a digest of the
final weights, so that an interrupted run can be compared bit for bit with an uninterrupted one.

Started by a launcher that sets `WORLD_SIZE` (a PyTorchJob's operator, torchrun), it is one rank of
a DistributedDataParallel job on gloo (`env://`: MASTER_ADDR, MASTER_PORT, RANK): each rank draws
its own batches, DDP averages the gradients over TCP, and rank 0 alone prints.
"""

import argparse
import hashlib
import math
import os
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset


class Spirals(Dataset):
    def __len__(self):
        return 8192

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        label = i % 2
        t = torch.rand(1, generator=g).item() * 3 * math.pi
        r = t / (3 * math.pi)
        sign = 1 if label else -1
        xy = torch.tensor([sign * r * math.cos(t), sign * r * math.sin(t)])
        time.sleep(0.002)  # reading a sample from storage
        return xy + 0.03 * torch.randn(2, generator=g), label


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--workers", type=int, default=2)
    a = p.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(2, 256),
        torch.nn.SiLU(),
        torch.nn.Linear(256, 256),
        torch.nn.SiLU(),
        torch.nn.Linear(256, 2),
    )
    model = torch.nn.parallel.DistributedDataParallel(net) if world > 1 else net
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=a.steps)
    loader = DataLoader(
        Spirals(),
        batch_size=64,
        shuffle=True,
        num_workers=a.workers,
        generator=torch.Generator().manual_seed(1 + rank),
        persistent_workers=a.workers > 0,
    )
    step = 0
    while step < a.steps:
        for xb, yb in loader:
            loss = torch.nn.functional.cross_entropy(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if rank == 0:
                print(f"step {step} loss {loss.item().hex()}", flush=True)
            step += 1
            if step == a.steps:
                break
    h = hashlib.sha256()
    for name, t in sorted(net.state_dict().items()):
        h.update(name.encode() + t.numpy().tobytes())
    if rank == 0:
        print(f"final {h.hexdigest()}", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
