"""A job written for pytorchjob-migration's `migrator` API, with only the import changed.

Model with dropout, AdamW, a per-step LR schedule, a shuffled DataLoader whose dataset adds
numpy noise: every random generator a real job draws from. `--style epoch` keeps its position as
that project's README does (a metrics dict updated after each epoch, then a test pass);
`--style step` records the batch too (MigratableVariable) and skips what it has done.
"""

import argparse
import math
import time

import numpy as np
import torch

from criuctl.migration import MigratableVariable, migrator

import _report

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=4)
p.add_argument("--style", choices=["epoch", "step"], default="epoch")
p.add_argument("--step-time", type=float, default=0.02)
a = p.parse_args()


class Noisy(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 16, generator=g)
        self.y = (self.x[:, :3].sum(dim=1, keepdim=True)).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        noise = torch.from_numpy(np.random.normal(0, 0.01, 16).astype("float32"))
        return self.x[i] + noise, self.y[i]


torch.manual_seed(0)
np.random.seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 1)
)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
train_loader = torch.utils.data.DataLoader(Noisy(256), batch_size=16, shuffle=True)
test_loader = torch.utils.data.DataLoader(Noisy(64), batch_size=32)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.02, total_steps=a.epochs * len(train_loader))

metrics = {"epoch": -1, "best_epoch": -1, "best_loss": math.inf}
migrator.register("model", model)
migrator.register("optimizer", optimizer)
migrator.register("scheduler", scheduler)
migrator.register("metrics", metrics)
progress = MigratableVariable({"step": 0}) if a.style == "step" else {"step": 0}
migrator.listening(interval=0.05)
if migrator.resume:
    migrator.load_ckpt()
    print(f"load migration ckpt from epoch {metrics['epoch']}, metrics: {metrics}", flush=True)


def test(epoch: int) -> None:
    model.eval()
    with torch.no_grad():
        loss = sum(torch.nn.functional.mse_loss(model(x), y).item() for x, y in test_loader)
    if loss < metrics["best_loss"]:
        metrics.update(best_epoch=epoch, best_loss=loss)
    model.train()


for epoch in range(metrics["epoch"] + 1, a.epochs):
    for i, (x, y) in enumerate(train_loader):
        if i < progress["step"]:
            continue
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        progress["step"] = i + 1
        _report.step(epoch * len(train_loader) + i, loss.item())
        time.sleep(a.step_time)
    metrics["epoch"] = epoch
    progress["step"] = 0
    test(epoch)
_report.final(model)
