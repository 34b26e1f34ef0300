"""Step boundaries: where criuctl stops a trainer without cutting a step in half.

Installed once torch is imported (`postimport`), through hooks that PyTorch offers:

- an optimizer step post-hook: a step has ended. Every 50 ms at most it looks for criuctl's
  request in the control directory (one `stat`); that is the whole idle cost.
- a module forward pre-hook, only while a capture or a resume waits for it (`_want_forwards`):
  the next step is starting. A pending capture happens at the first
  *training* forward (grad enabled, module in train mode) after a step, once the script's
  registered position records (the `migrator` API's dicts) have moved on since that step: then
  the model, the optimizer, the scheduler and those records all describe the same instant.
- `DataLoader.__iter__`, only for a script that uses the `migrator` API (`track_epochs`): the RNG
  state just before an epoch's iterator draws its seeds, so that a resumed script that builds its
  iterator again draws the same shuffle.

HOLD (the CRIU path): at the step's end, synchronise CUDA, empty the caching allocator so less
device memory must be copied, report, and wait until criuctl removes the request (the dump is
done: the source ends, or it thawed) or until the request is gone because this is the restored
copy on another node. SAVE (the CUDA-aware pre-dump): the capture writes the state and then holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from criuctl_hook import contract, durable

_CHECK_EVERY = 0.05  # seconds between looks at the control directory while training
_HOLD_POLL = 0.005


def _write_json(path: str, data: dict, sync: bool = True) -> None:
    """Whole or not at all (`durable`); `sync=False` for what a power cut makes moot anyway (a
    registration, the word "held" just before the freeze: the process it speaks of dies with it)."""
    durable.replace(Path(path), json.dumps(data).encode(), 0o644, sync=sync)


def _same(a: dict, b: dict) -> bool:
    """Two snapshots of a position record hold the same values (a tensor compares by identity)."""
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if v is w:
            continue
        if not isinstance(v, (int, float, str, bool, type(None))) or v != w:
            return False
    return True


@dataclass
class Capture:
    """A capture that waits for a consistent instant, then runs with the boundary."""

    run: Callable[[Boundary], None]
    request_id: str = ""


@dataclass
class Boundary:
    control: str | None
    torch: Any
    steps: int = 0
    positions: list[dict] = field(default_factory=list)  # the migrator's registered dicts
    epoch_rng: dict | None = None  # RNG state before the latest DataLoader iterator was made
    on_first_forward: list[Callable[[], None]] = field(default_factory=list)
    saver: Callable[[Boundary, dict], None] | None = None  # the migrator's, when the script uses it
    _capture: Capture | None = None
    _tracking_epochs: bool = False
    _forward_hook: Any = None  # the forward pre-hook's handle, while something waits for a forward
    _snapshot: list[dict] = field(default_factory=list)
    _next_check: float = 0.0
    _registered: bool = False
    _handled: str = ""
    _seen: tuple[int, int] | None = None  # the request file's (inode, mtime) when last read

    # -- the three hooks ---------------------------------------------------------------------
    def after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        if self._forward_hook is not None and self._capture is None and not self.on_first_forward:
            self._forward_hook.remove()  # nothing waits for a forward: idle steps skip the hook
            self._forward_hook = None
        if self.positions:
            self._snapshot = [dict(d) for d in self.positions]
        if self.control is None:
            return
        if not self._registered:
            self._register()
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + _CHECK_EVERY
            self._poll()

    def before_forward(self, module: Any, args: Any) -> None:
        if not (self.torch.is_grad_enabled() and module.training):
            return
        if self.on_first_forward:
            todo, self.on_first_forward = self.on_first_forward, []
            for fn in todo:
                fn()
        cap = self._capture
        if cap is None or self.steps == 0:
            return
        if self.positions and self._snapshot and all(map(_same, self.positions, self._snapshot)):
            return  # the script has not yet recorded where it stands after this step
        self._capture = None
        cap.run(self)

    def before_epoch(self) -> None:
        from criuctl_hook import state

        self.epoch_rng = state.rng_state()

    def track_epochs(self) -> None:
        """Keep the RNG of each epoch's start (80 µs an epoch): the migrator's resume needs it."""
        if self._tracking_epochs:
            return
        from torch.utils.data import DataLoader

        make_iter = DataLoader.__iter__

        def __iter__(loader: Any) -> Any:
            self.before_epoch()
            return make_iter(loader)

        DataLoader.__iter__ = __iter__
        self._tracking_epochs = True

    # -- requests ----------------------------------------------------------------------------
    def request_capture(self, cap: Capture) -> None:
        self._capture = cap
        self._want_forwards()

    def at_first_forward(self, fn: Callable[[], None]) -> None:
        """Run `fn` at the next training forward (resume: once the script's objects exist)."""
        self.on_first_forward.append(fn)
        self._want_forwards()

    def _want_forwards(self) -> None:
        if self._forward_hook is None:
            from torch.nn.modules.module import register_module_forward_pre_hook

            self._forward_hook = register_module_forward_pre_hook(self.before_forward)

    def _path(self, *parts: str) -> str:
        return os.path.join(self.control or "", *parts)

    def _register(self) -> None:
        try:
            os.makedirs(self._path(contract.TRAINERS), exist_ok=True)
            _write_json(
                self._path(contract.TRAINERS, str(os.getpid())),
                {"rank": rank(), "steps": self.steps},
                sync=False,
            )
            self._registered = True
        except OSError:
            self.control = None  # no control directory here: nothing can ask us anything

    def _read_request(self) -> dict | None:
        try:
            with open(self._path(contract.REQUEST)) as f:
                req = json.load(f)
        except (OSError, ValueError):
            return None
        return req if isinstance(req, dict) and isinstance(req.get("id"), str) else None

    def _request_file(self) -> tuple[int, int] | None:
        """The request file's identity, by stat: no descriptor. CRIU records every file a frozen
        process holds open and reopens it by path on restore; a request read open at the freeze
        would be gone there (criuctl removes it; another host never had it) and fail the restore."""
        try:
            st = os.stat(self._path(contract.REQUEST))
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns

    def _poll(self) -> None:
        seen = self._request_file()
        if seen is None or seen == self._seen:
            return  # nothing new: the file is opened only when it changed (a new request, a beat)
        self._seen = seen
        req = self._read_request()
        if req is None or req["id"] == self._handled:
            return
        self._handled = req["id"]
        if self._stale():
            return  # its requester is gone
        if req.get("mode") == contract.SAVE and isinstance(req.get("out"), str):
            save = self.saver or Boundary._save_discovered
            self.request_capture(Capture(lambda b: save(b, req), req["id"]))
        else:
            self.hold(req["id"], {})

    def hold(self, request_id: str, report: dict, *, suspend_nccl: bool = True) -> None:
        """Stop here until criuctl is done with the request; report what this process holds. For a
        freeze (not a state save), the NCCL communicators' own device memory is released first, so
        that the driver's checkpoint need not carry it, and allocated again on the way out."""
        from criuctl_hook import nccl

        torch = self.torch
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        suspension = nccl.Suspension()
        if cuda:
            torch.cuda.synchronize()
            if suspend_nccl:
                suspension = nccl.suspend(torch)
            torch.cuda.empty_cache()
        held = {
            "id": request_id,
            "pid": os.getpid(),
            "rank": rank(),
            "step": self.steps,
            "cuda_allocated": torch.cuda.memory_allocated() if cuda else 0,
            "cuda_reserved": torch.cuda.memory_reserved() if cuda else 0,
            "at": time.time(),
            **process_groups(torch),
            **suspension.report(),
            **report,
        }
        req = self._read_request()  # read before HELD is written: criuctl freezes only after
        held_on = self._request_file() if req is not None and req["id"] == request_id else None
        os.makedirs(self._path(contract.HELD), exist_ok=True)
        mine = self._path(contract.HELD, str(os.getpid()))
        _write_json(mine, held, sync=False)
        released = self._path(contract.RELEASED, request_id)
        # held while the same request file stays (by inode: a beat changes only its mtime); never
        # opened here, since the freeze comes now (see _request_file)
        while held_on is not None and (now := self._request_file()) is not None and now[0] == held_on[0]:
            if os.path.exists(released):
                break
            if self._stale():
                log(f"the request {request_id} is no longer kept alive (criuctl died?): training on")
                break
            time.sleep(_HOLD_POLL)
        # Released: criuctl thawed us (the request is gone), or this is the restored copy (the
        # target wrote RELEASED; the request may still be there if the source shares this path).
        suspension.resume()
        with contextlib.suppress(OSError):
            os.unlink(mine)
        self._register()

    def _stale(self) -> bool:
        try:
            age = time.time() - os.stat(self._path(contract.REQUEST)).st_mtime
        except OSError:
            return False
        return age > contract.STALE_AFTER

    def _save_discovered(self, req: dict) -> None:
        from criuctl_hook import state

        saved, found = state.capture(self.steps, epoch_rng=self.epoch_rng)
        objects = [{"key": f.key, "kind": f.kind, "class": type(f.obj).__qualname__} for f in found]
        self.save_and_hold(req, saved, "discovered", objects)

    def save_and_hold(self, req: dict, saved: Any, kind: str, objects: list[dict]) -> None:
        """Write `saved` (a `state.Saved`) and what it holds into criuctl's state directory, report
        it, and hold until released. `kind` says who loads it back: "discovered" (`resume`) or
        "migrator" (the script's own `load_ckpt`)."""
        from criuctl_hook import state

        r = rank()
        path = os.path.join(req["out"], contract.STATE_FILE.format(rank=r))
        size = state.write(saved, path)
        index = {"kind": kind, "format": contract.STATE_FORMAT, "step": saved.step, "rank": r, "bytes": size}
        _write_json(
            os.path.join(req["out"], contract.STATE_INDEX.format(rank=r)), {**index, "objects": objects}
        )
        self.hold(req["id"], {"saved": os.path.basename(path), "bytes": size}, suspend_nccl=False)


def process_groups(torch: Any) -> dict[str, Any]:
    """The job's torch.distributed process groups (backend, size, NCCL version), and its NCCL_*
    settings: criuctl refuses to checkpoint NCCL communicators through the driver (criuctl.gpu.nccl)."""
    dist = getattr(torch, "distributed", None)
    try:
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return {}
        groups = []
        for pg in list(dist.distributed_c10d._world.pg_map):  # every group the job made, WORLD first
            entry: dict[str, Any] = {"backend": str(dist.get_backend(pg)), "size": pg.size()}
            if entry["backend"] == "nccl":
                version = torch.cuda.nccl.version()
                entry["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
            groups.append(entry)
    except Exception as exc:  # a torch whose internals moved: report nothing rather than fail the hold
        log(f"cannot list the process groups: {exc!r}")
        return {}
    nccl_env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
    return {"groups": groups, "nccl_env": nccl_env}


def rank() -> str:
    """Which trainer of a job this process is: its RANK, else "0"."""
    value = os.environ.get("RANK", "0")
    return value if value.isdigit() else "0"


_current: Boundary | None = None


def install(torch: Any) -> Boundary:
    """Register the hooks with torch (once per process) and return the boundary."""
    global _current
    if _current is not None:
        return _current
    # torch.optim hides its submodules' names: import the functions, not attributes
    from torch.optim.optimizer import register_optimizer_step_post_hook

    b = Boundary(os.environ.get(contract.ENV_CONTROL_DIR) or None, torch)
    register_optimizer_step_post_hook(b.after_step)  # the forward pre-hook only when needed
    _current = b
    resume_dir = os.environ.get(contract.ENV_RESUME_STATE)
    if resume_dir:
        from criuctl_hook import resume

        resume.arm(b, resume_dir)
    return b


def installed_with_torch() -> Boundary:
    """The boundary, installing it now if torch is imported but the hook was not on the path."""
    import torch

    return install(torch)


def log(msg: str) -> None:
    print(f"criuctl: {msg}", file=sys.stderr, flush=True)
