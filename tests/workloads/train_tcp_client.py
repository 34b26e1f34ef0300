"""A trainer that reports each step's loss to a server outside its tree and waits for the ack.

Like a job streaming metrics to a tracking service over one long-lived TCP connection: if that
connection breaks (CRIU's network lock left in place, a socket left in repair mode) the job fails
at its next send or receive instead of training on.
"""

import argparse
import socket
import time

import torch

import _report

p = argparse.ArgumentParser()
p.add_argument("--server", help="HOST:PORT of the ack server (none: train without reporting)")
p.add_argument("--steps", type=int, default=40)
p.add_argument("--step-time", type=float, default=0.05)
a = p.parse_args()

conn = replies = None
if a.server:
    host, port = a.server.rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=60)
    replies = conn.makefile("r")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(256, 16)
y = x[:, :3].sum(dim=1, keepdim=True).cos()
for i in range(a.steps):
    idx = torch.randint(0, 256, (32,))
    loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    if conn is not None:
        conn.sendall(f"step {i} loss {loss.item().hex()}\n".encode())
        ack = replies.readline().strip()
        if ack != f"ack {i}":
            raise SystemExit(f"server answered {ack!r} to step {i}")
    _report.step(i, loss.item())
    time.sleep(a.step_time)
if conn is not None:
    conn.sendall(b"bye\n")
_report.final(model)
