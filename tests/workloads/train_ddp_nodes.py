"""One rank of a multi-node DistributedDataParallel job on gloo: TCP store on rank 0, gloo pairs.

Started once per node (`criuctl run` per rank, like torchrun's workers on each host of a job), with
the rank-0 node's address as the rendezvous. Each rank draws its own batches, DDP averages the
gradients over TCP, rank 0 reports the all-reduced loss of every step and the final weights.
Nothing here knows about criuctl: a rank that moves must simply go on.
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import _report

p = argparse.ArgumentParser()
p.add_argument("--rank", type=int, required=True)
p.add_argument("--world", type=int, required=True)
p.add_argument("--master", required=True, help="HOST:PORT of rank 0's store")
p.add_argument("--ifname", default="eth0", help="the interface gloo talks over")
p.add_argument("--steps", type=int, default=100)
p.add_argument("--step-time", type=float, default=0.05)
p.add_argument("--width", type=int, default=64, help="hidden width: the state's size")
a = p.parse_args()

os.environ.setdefault("GLOO_SOCKET_IFNAME", a.ifname)
dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank, world_size=a.world)
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, a.width), torch.nn.ReLU(), torch.nn.Linear(a.width, 1)))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.7)
g = torch.Generator().manual_seed(100 + a.rank)
for i in range(a.steps):
    x = torch.randn(32, 16, generator=g)
    y = x.sum(dim=1, keepdim=True).cos()
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()  # gloo all-reduce of the gradients, over TCP to every other rank
    opt.step()
    sched.step()
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    if a.rank == 0:
        _report.step(i, summed.item())
    time.sleep(a.step_time)
if a.rank == 0:
    _report.final(model.module)
dist.barrier()
dist.destroy_process_group()
