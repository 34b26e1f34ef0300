"""A single-GPU training job: a residual MLP on CUDA with dropout, AdamW, a cosine schedule and
bf16 autocast; deterministic, so that an uninterrupted run and a checkpointed one can be compared
bit for bit. `--width` sets how much device memory it holds (weights, AdamW moments, activations)."""

import argparse
import os
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS

import torch

import _report

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=60)
p.add_argument("--step-time", type=float, default=0.05)
p.add_argument("--width", type=int, default=2048)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--show-state", action="store_true", help="print AdamW's step count after each step")
p.add_argument("--nccl", action="store_true", help="DDP over a world of one NCCL rank: a real communicator")
p.add_argument("--scratch-mib", type=int, default=0, help="a temporary device buffer each step (activations)")
p.add_argument("--scratch-keep", action="store_true", help="keep it alive: not freeable at the boundary")
a = p.parse_args()

torch.use_deterministic_algorithms(True)
torch.manual_seed(0)
dev = torch.device("cuda")


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 2 * d)
        self.down = torch.nn.Linear(2 * d, d)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(torch.nn.functional.gelu(self.up(self.norm(x)))))


model = torch.nn.Sequential(*[Block(a.width) for _ in range(a.layers)], torch.nn.Linear(a.width, 1)).to(dev)
trained = model
if a.nccl:  # every backward all-reduces through NCCL, as a multi-GPU job's does
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    trained = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    print(f"nccl {torch.cuda.nccl.version()}", flush=True)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=a.steps)
w = torch.randn(a.width, 1, device=dev) / a.width**0.5
kept = None
for step in range(a.steps):
    if a.scratch_mib:  # freed at the end of the step, it stays in the caching allocator's pool
        scratch = torch.ones(a.scratch_mib << 20, dtype=torch.uint8, device=dev)
        kept = scratch if a.scratch_keep else None
        del scratch
    x = torch.randn(64, a.width, device=dev)
    y = torch.sin(x @ w)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(trained(x).float(), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    _report.step(step, loss.item())
    if a.show_state:
        first = next(iter(opt.state.values()))
        print(f"state adam {int(first['step'])} lr {sched.get_last_lr()[0]!r}", flush=True)
    time.sleep(a.step_time)
_report.final(model.cpu())
if a.nccl:
    dist.destroy_process_group()
