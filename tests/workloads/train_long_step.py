"""A job whose steps are long (a big model's step, a slow input pipeline): a dump asked in the middle
of one should land after it."""

import argparse
import time

import torch

import _report

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=6)
p.add_argument("--step-time", type=float, default=4.0, help="seconds each step takes, inside the step")
a = p.parse_args()

torch.manual_seed(3)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
x, y = torch.randn(256, 16), torch.randn(256, 1)
for i in range(a.steps):
    print(f"step {i} started", flush=True)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    time.sleep(a.step_time)  # the step's slow part, between backward and the update
    opt.step()
    _report.step(i, loss.item())
_report.final(model)
