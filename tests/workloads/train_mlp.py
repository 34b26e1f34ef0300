"""A plain training loop: MLP regression, SGD with momentum, no DataLoader.

With FAKE_CUDA_CONTEXTS and STANDIN_CUDA_DEVICE set it also holds a stand-in CUDA context
(_standin_cuda.py) and makes one "CUDA call" per step, for the GPU tests on hosts without a GPU.
"""

import argparse
import signal
import sys
import time

import torch

import _report
import _standin_cuda

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=40)
p.add_argument("--step-time", type=float, default=0.05, help="seconds of simulated input latency per step")
p.add_argument("--exit-code", type=int, default=0)
p.add_argument("--hold-io-uring", action="store_true", help="keep an io_uring open, as async-IO readers do")
a = p.parse_args()

if a.hold_io_uring:
    import ctypes

    params = ctypes.create_string_buffer(120)  # struct io_uring_params, zeroed
    ring_fd = ctypes.CDLL(None, use_errno=True).syscall(425, 8, params)  # io_uring_setup(8, &params)
    if ring_fd < 0:
        sys.exit(f"io_uring_setup failed: errno {ctypes.get_errno()}")


def on_term(signum, _frame):
    print(f"got signal {signum}, stopping cleanly", flush=True)
    sys.exit(0)


signal.signal(signal.SIGTERM, on_term)
cuda = _standin_cuda.from_environment()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
x = torch.randn(512, 32)
y = (x[:, :4].sum(dim=1, keepdim=True)).sin()
for i in range(a.steps):
    idx = torch.randint(0, 512, (64,))
    if cuda is not None:
        cuda.call()
    loss = torch.nn.functional.mse_loss(model(x[idx]), y[idx])
    opt.zero_grad()
    loss.backward()
    opt.step()
    _report.step(i, loss.item())
    if i % 10 == 0:
        print(f"stderr heartbeat {i}", file=sys.stderr, flush=True)
    time.sleep(a.step_time)
_report.final(model)
sys.exit(a.exit_code)
