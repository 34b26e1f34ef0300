"""Resume mode of the CUDA-aware pre-dump: a new run of the script gets the saved state back.

criuctl starts the original command again with `CRIUCTL_RESUME_STATE` naming the verified
state directory. At the script's first training forward (its model, optimizer, scheduler and
scaler exist by then) each saved state is loaded into the object with the same key, the RNG
states are set to those of the saved instant, and the step count continues from the saved one.
What is not restored, and why, is in docs/gpu.md: the script's own loop variables start over.
"""

from __future__ import annotations

import json
import os

from criuctl_hook import contract, state
from criuctl_hook.boundary import Boundary, log, rank


def arm(b: Boundary, directory: str) -> None:
    path = os.path.join(directory, contract.STATE_FILE.format(rank=rank()))
    if not os.path.exists(path):
        log(f"resume: no saved state for rank {rank()} in {directory}; starting from scratch")
        return
    if index(directory).get("kind") == "migrator":
        return  # the script's own `migrator.load_ckpt` loads it (criuctl.migration)
    b.at_first_forward(lambda: _load(b, path))


def index(directory: str) -> dict:
    try:
        with open(os.path.join(directory, contract.STATE_INDEX.format(rank=rank()))) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _load(b: Boundary, path: str) -> None:
    saved = state.read(path)
    loaded, missing = state.load_into(saved)
    state.set_rng_state(saved.rng)
    b.steps = saved.step
    log(f"resumed {len(loaded)} objects at step {saved.step} from {path}")
    for key in missing:
        log(f"resume: nothing in this run matches saved {key}; its state was not loaded")
