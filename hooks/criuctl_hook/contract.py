"""Names shared by criuctl (supervisor, agent) and the in-process hook. Constants only, no I/O."""

from pathlib import Path

# The folder to put on PYTHONPATH for the hook (the one holding this package), and what the inject dir copies.
HOOKS_DIR = Path(__file__).resolve().parent.parent

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
