"""Two-process DistributedDataParallel on gloo (TCP between the ranks), like a 2-GPU job on CPU."""

import argparse
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import _report

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--step-time", type=float, default=0.05)
a = p.parse_args()


def worker(rank: int, world: int, port: int, steps: int, step_time: float) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    g = torch.Generator().manual_seed(100 + rank)
    for i in range(steps):
        x = torch.randn(32, 16, generator=g)
        y = x.sum(dim=1, keepdim=True).cos()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # gloo all-reduce over TCP
        opt.step()
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        if rank == 0:
            _report.step(i, summed.item())
        time.sleep(step_time)
    if rank == 0:
        _report.final(model.module)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(worker, args=(2, port, a.steps, a.step_time), nprocs=2)
