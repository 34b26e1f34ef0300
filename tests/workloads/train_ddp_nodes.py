"""One rank of a multi-node DistributedDataParallel job on gloo: TCP store on rank 0, gloo pairs.

Started once per node (`criuctl run` per rank, like torchrun's workers on each host of a job), with
the rank-0 node's address as the rendezvous; or in a PyTorchJob's pod, from the operator's
environment (`env://`: MASTER_ADDR, a Service's DNS name, MASTER_PORT, RANK, WORLD_SIZE).
Each rank draws its own batches, DDP averages the gradients over TCP, rank 0 reports the
all-reduced loss of every step and the final weights.
Nothing here knows about criuctl: a rank that moves must simply go on.

`--dcp DIR --save-every K` is the application-level contender (bench/multinode.py): every K steps
the ranks write a `torch.distributed.checkpoint` (model, optimizer, scheduler, RNG, step), and a
restarted job (what torchrun elastic does on a membership change) resumes from the newest one.
"""

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import _report

p = argparse.ArgumentParser()
p.add_argument("--rank", type=int, default=None, help="default: $RANK (as a PyTorchJob's pod has it)")
p.add_argument("--world", type=int, default=None, help="default: $WORLD_SIZE")
p.add_argument("--master", help="HOST:PORT of rank 0's store; default: $MASTER_ADDR:$MASTER_PORT (env://)")
p.add_argument("--ifname", default="eth0", help="the interface gloo talks over")
p.add_argument("--steps", type=int, default=100)
p.add_argument("--step-time", type=float, default=0.05)
p.add_argument("--width", type=int, default=64, help="hidden width: the state's size")
p.add_argument("--depth", type=int, default=0, help="hidden width x width layers")
p.add_argument("--times", action="store_true", help="rank 0 also prints `time STEP UNIX-TIME`")
p.add_argument("--dcp", help="checkpoint folder (shared by the ranks): resume from it, save to it")
p.add_argument("--save-every", type=int, default=10)
p.add_argument(
    "--state-mb",
    type=int,
    default=0,
    help="MiB of live state besides the model on the ranks of --state-ranks (a sharded optimizer's "
    "state, a replay buffer): random, one MiB of it updated each step, in its DCP checkpoint too",
)
p.add_argument("--state-ranks", default="", help="comma-separated ranks that hold --state-mb (default: all)")
a = p.parse_args()

os.environ.setdefault("GLOO_SOCKET_IFNAME", a.ifname)
if a.master:
    dist.init_process_group("gloo", init_method=f"tcp://{a.master}", rank=a.rank, world_size=a.world)
else:  # what a training operator's pod does: MASTER_ADDR is a Service's DNS name
    dist.init_process_group("gloo", init_method="env://")
    a.rank = dist.get_rank()
torch.manual_seed(0)
hidden = [m for _ in range(a.depth) for m in (torch.nn.Linear(a.width, a.width), torch.nn.ReLU())]
layers = [torch.nn.Linear(16, a.width), torch.nn.ReLU(), *hidden, torch.nn.Linear(a.width, 1)]
model = DDP(torch.nn.Sequential(*layers))
opt = torch.optim.Adam(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.7)
g = torch.Generator().manual_seed(100 + a.rank)
holds = not a.state_ranks or str(a.rank) in a.state_ranks.split(",")
state_mb = a.state_mb if holds else 0
live = torch.rand(state_mb, 1 << 18, generator=torch.Generator().manual_seed(200 + a.rank))  # MiB rows
first = 0
if a.dcp:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def _state() -> dict:
        msd, osd = get_state_dict(model, opt)
        return {
            "model": msd,
            "optim": osd,
            "sched": sched.state_dict(),
            f"rng-{a.rank}": g.get_state(),  # per rank: DCP keeps one copy of a key all ranks share
            f"live-{a.rank}": live,
            "step": torch.tensor(0),
        }

    saved = sorted(Path(a.dcp).glob("step-*/.metadata"), key=lambda m: int(m.parent.name[5:]))
    if saved:
        state = _state()
        dcp.load(state, checkpoint_id=saved[-1].parent)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        sched.load_state_dict(state["sched"])
        g.set_state(state[f"rng-{a.rank}"])
        live = state[f"live-{a.rank}"]
        first = int(state["step"])
        if a.rank == 0:
            print(f"resumed {first}", flush=True)
for i in range(first, a.steps):
    x = torch.randn(32, 16, generator=g)
    y = x.sum(dim=1, keepdim=True).cos()
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()  # gloo all-reduce of the gradients, over TCP to every other rank
    opt.step()
    sched.step()
    if state_mb:
        live[i % state_mb].add_(loss.item())
    summed = loss.detach().clone()
    dist.all_reduce(summed)
    if a.rank == 0:
        _report.step(i, summed.item())
        if a.times:
            print(f"time {i} {time.time():.6f}", flush=True)
    if a.dcp and (i + 1) % a.save_every == 0:
        state = _state()
        state["step"] = torch.tensor(i + 1)
        dcp.save(state, checkpoint_id=Path(a.dcp) / f"step-{i + 1}")
    time.sleep(a.step_time)
if a.rank == 0:
    _report.final(model.module)
dist.barrier()
dist.destroy_process_group()
