"""A job holding N GiB of model + Adam state (params, grads, exp_avg, exp_avg_sq: 16 bytes/param).

Prints `ready` once the state exists, then keeps training a small head (a step every 50 ms); with
--dense every step is an Adam step of the whole model instead, as real training takes, so every
page of the state is written each step (what post-copy's page pull meets in a real job). With
--save/--load it instead times torch.save / torch.load of the same state (the app-level checkpoint
criuctl replaces).
"""

import argparse
import os
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--gib", type=float, required=True)
p.add_argument("--save", help="time torch.save of the state to this file, then torch.load of it")
p.add_argument("--resume", help="the app-level restart: load this file into a fresh model, take one step")
p.add_argument("--dense", action="store_true", help="each step updates the whole model (prints `step N`)")
a = p.parse_args()

if a.resume:  # a new process (started by the bench): import torch, build, load, one step
    t0 = time.perf_counter()
    state = torch.load(a.resume)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(4096, 4096, bias=False) for _ in range(len(state["model"]))]
    )
    model.load_state_dict(state["model"])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    opt.load_state_dict(state["optim"])
    for prm in model.parameters():
        prm.grad = torch.zeros_like(prm)
    opt.step()
    print(f"resumed load+step {time.perf_counter() - t0:.3f}", flush=True)
    raise SystemExit(0)

torch.manual_seed(0)
n_params = int(a.gib * (1 << 30) / 16)
width = 4096
layers = max(1, n_params // (width * width))
model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
for prm in model.parameters():
    prm.grad = torch.randn_like(prm)  # a backward pass' worth of gradients, without the compute
opt.step()  # materialises exp_avg and exp_avg_sq

if a.save:
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    t0 = time.perf_counter()
    torch.save(state, a.save)
    t_save = time.perf_counter() - t0
    del state
    t0 = time.perf_counter()
    loaded = torch.load(a.save)
    t_load = time.perf_counter() - t0
    size = os.path.getsize(a.save)
    print(f"save {t_save:.3f} load {t_load:.3f} bytes {size} tensors {len(loaded['model'])}", flush=True)
elif a.dense:
    print(f"ready {layers} layers", flush=True)
    step = 0
    while True:
        opt.step()  # reads params, grads and both moments, writes params and moments: every page
        step += 1
        print(f"step {step} {time.time():.3f}", flush=True)
else:
    # Training goes on in a small head, a step every 50 ms, so that criuctl's step boundary comes at
    # once (the hook holds a trainer at its next optimizer step), while the big state stays as it is.
    head = torch.nn.Linear(64, 64)
    head_opt = torch.optim.SGD(head.parameters(), lr=1e-3)
    x = torch.randn(8, 64)
    print(f"ready {layers} layers", flush=True)
    while True:
        head_opt.zero_grad()
        head(x).square().mean().backward()
        head_opt.step()
        time.sleep(0.05)
