"""A trainer's state found without the user's help, written to a file and loaded back into a new run.

Imported only once torch is (the CUDA-aware pre-dump and resume mode need it). The objects are
found by walking the garbage collector's list: every top-level `nn.Module` that holds state,
every optimizer, LR scheduler and GradScaler. Each gets a key that a new run of the same script
reproduces: its class and the names and shapes of what it holds (a module's state_dict, an
optimizer's parameter groups, a scheduler's optimizer), so the state goes back into "the same"
object however the script orders its code. Two objects with the same key are told apart by the
order the collector lists them in, which follows creation in CPython; that is the one guess here.

RNG states (python, numpy, torch CPU and every CUDA device) are kept as plain lists and tensors,
so `torch.load(weights_only=True)` reads the file: loading it executes no pickled code.
"""

from __future__ import annotations

import gc
import hashlib
import os
import random
import sys
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from criuctl_hook import durable

MODULE, OPTIMIZER, SCHEDULER, SCALER = "module", "optimizer", "scheduler", "scaler"


@dataclass
class Found:
    key: str
    kind: str
    obj: Any


def _digest(*parts: object) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:12]


def _shapes(tensors: dict[str, Any]) -> tuple:
    return tuple((k, tuple(v.shape)) for k, v in tensors.items() if isinstance(v, torch.Tensor))


def _optimizer_sig(opt: torch.optim.Optimizer) -> str:
    groups = tuple(tuple(tuple(p.shape) for p in g["params"]) for g in opt.param_groups)
    return _digest(type(opt).__qualname__, groups)


def _schedulers() -> tuple[type, ...]:
    sched = torch.optim.lr_scheduler
    return tuple(t for t in (getattr(sched, "LRScheduler", None), sched.ReduceLROnPlateau) if t)


def _scalers() -> tuple[type, ...]:
    amp = getattr(torch, "amp", None)
    return tuple(
        t for t in (getattr(amp, "GradScaler", None), getattr(torch.cuda.amp, "GradScaler", None)) if t
    )


def _by_kind() -> dict[str, list]:
    """The live objects of each kind, in the collector's order (creation order, in CPython)."""
    kinds = [(MODULE, (torch.nn.Module,)), (OPTIMIZER, (torch.optim.Optimizer,))]
    kinds += [(SCHEDULER, _schedulers()), (SCALER, _scalers())]
    out: dict[str, list] = {kind: [] for kind, _ in kinds}
    with warnings.catch_warnings():  # isinstance wakes deprecated lazy objects, which warn
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            for kind, types in kinds:
                if types and isinstance(obj, types):
                    out[kind].append(obj)
                    break
    return out


def discover() -> list[Found]:
    """Every stateful training object alive in this process, keyed so that a new run finds it again."""
    live = _by_kind()
    modules, optimizers, schedulers, scalers = (live[k] for k in (MODULE, OPTIMIZER, SCHEDULER, SCALER))
    children = {id(c) for m in modules for c in m.children()}
    found: list[Found] = []
    for m in modules:
        if id(m) in children:
            continue
        shapes = _shapes(m.state_dict())
        if shapes:  # a loss or an activation holds nothing to carry
            found.append(Found(f"{MODULE}:{type(m).__qualname__}:{_digest(shapes)}", MODULE, m))
    for o in optimizers:
        found.append(Found(f"{OPTIMIZER}:{type(o).__qualname__}:{_optimizer_sig(o)}", OPTIMIZER, o))
    for s in schedulers:
        opt = getattr(s, "optimizer", None)
        sig = _optimizer_sig(opt) if isinstance(opt, torch.optim.Optimizer) else ""
        found.append(Found(f"{SCHEDULER}:{type(s).__qualname__}:{sig}", SCHEDULER, s))
    for s in scalers:
        found.append(Found(f"{SCALER}:{type(s).__qualname__}", SCALER, s))
    return _numbered(found)


def _numbered(found: list[Found]) -> list[Found]:
    seen: Counter[str] = Counter()
    for f in found:
        seen[f.key] += 1
        if seen[f.key] > 1:
            f.key = f"{f.key}#{seen[f.key]}"
    return found


def rng_state() -> dict[str, Any]:
    """Every random generator a training step draws from, as lists and tensors."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass
class Saved:
    step: int | None  # optimizer steps done (None: saved outside a step, `migrator.save_ckpt()`)
    objects: dict[str, dict]  # key -> state_dict
    rng: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)


def capture(step: int, rng: dict[str, Any] | None = None, **extra: Any) -> tuple[Saved, list[Found]]:
    found = discover()
    objects = {f.key: f.obj.state_dict() for f in found}
    return Saved(step, objects, rng if rng is not None else rng_state(), extra), found


def write(saved: Saved, path: str) -> int:
    """torch.save, durably (`durable.replace_with`): a reader finds the whole file or none, after a
    power cut too."""
    payload = {"step": saved.step, "objects": saved.objects, "rng": saved.rng, **saved.extra}
    durable.replace_with(Path(path), lambda f: torch.save(payload, f))
    return os.path.getsize(path)


def read(path: str) -> Saved:
    raw = torch.load(path, map_location="cpu", weights_only=True)
    extra = {k: v for k, v in raw.items() if k not in ("step", "objects", "rng")}
    return Saved(int(raw["step"]), raw["objects"], raw["rng"], extra)


def load_into(saved: Saved) -> tuple[list[str], list[str]]:
    """Load each saved state into the live object with the same key: (loaded keys, keys with no object)."""
    live = {f.key: f for f in discover()}
    loaded, missing = [], []
    for key, sd in saved.objects.items():
        f = live.get(key)
        if f is None:
            missing.append(key)
            continue
        f.obj.load_state_dict(sd)
        loaded.append(key)
    return loaded, missing
