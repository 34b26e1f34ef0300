"""Names shared by criuctl (supervisor, agent) and the in-process hook. Constants only; the one I/O is
the stat that finds HOOKS_DIR, once per process."""

from pathlib import Path


def _hooks_dir() -> Path:
    """The folder holding sitecustomize.py and this package, and nothing else: hooks/ in a checkout
    (and in a container's inject dir), the folder above this package. An installed wheel imports this
    package from site-packages, a folder that must never go on a workload's PYTHONPATH nor into the
    inject dir: the wheel carries the same tree as criuctl's package data, criuctl/hooks/ (setup.py)."""
    above = Path(__file__).resolve().parent.parent
    shipped = above / "criuctl" / "hooks"
    return shipped if (shipped / "criuctl_hook" / "contract.py").is_file() else above


# The folder to put on PYTHONPATH for the hook, and what the inject dir copies.
HOOKS_DIR = _hooks_dir()

# Set by `criuctl run` in the workload's environment.
ENV_WORKLOAD = "CRIUCTL_WORKLOAD"  # the workload's name
ENV_HOOKS_DIR = "CRIUCTL_HOOKS_DIR"  # the hooks/ directory put on PYTHONPATH
ENV_CONTROL_DIR = "CRIUCTL_CONTROL_DIR"  # where criuctl asks the hook for a step boundary
ENV_RESUME_STATE = "CRIUCTL_RESUME_STATE"  # a state bundle: load it into the objects the script builds
# Set by the hook in the first Python process that loads it.
ENV_HOOKED_PID = "CRIUCTL_HOOKED_PID"

# The control directory: criuctl writes REQUEST, each trainer answers in HELD.
REQUEST = "request"  # JSON {"id": str, "mode": HOLD | SAVE, "out": state directory (SAVE)}
TRAINERS = "trainers"  # one file per process that has run an optimizer step, named by its PID
HELD = "held"  # one JSON report per trainer, named by its PID, written at the boundary
HEARTBEAT = 1.0  # seconds between criuctl's touches of the request while it holds the trainers
STALE_AFTER = 10.0  # a request untouched this long has lost its requester: the hook goes on
RELEASED = "released"  # a file per request id, written by the node that restored the held copy
HOLD = "hold"  # stop at the next step boundary, synchronise CUDA, and wait there
SAVE = "save"  # also write the training state into "out" (the CUDA-aware pre-dump)

STATE_FORMAT = 1
STATE_FILE = "state-{rank}.pt"  # torch.save of {"objects", "rng", "step", ...}, one per trainer
STATE_INDEX = "state-{rank}.json"  # what it holds, readable without torch

# NCCL's ncclCommSuspend / ncclCommResume came in this version (NVIDIA/nccl src/nccl.h.in): the hook
# suspends communicators from it on (criuctl_hook.nccl), criuctl refuses older ones (criuctl.gpu.nccl)
NCCL_SUSPEND_SINCE = (2, 29, 7)
