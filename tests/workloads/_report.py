"""How test workloads report progress: exact losses (float.hex) and a digest of the final weights.

Imported by the workload scripts next to it (their directory is on sys.path); the tests parse these
lines. Kept apart from criuctl on purpose: these are user jobs, criuctl never sees inside them.
"""

import hashlib
import sys


def step(i: int, loss: float, stream=sys.stdout) -> None:
    print(f"step {i} loss {float(loss).hex()}", file=stream, flush=True)


def final(model, *more) -> None:
    """The digest of the model's weights, and of any other state (tensors) the job kept."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    for t in more:
        h.update(t.detach().contiguous().numpy().tobytes())
    print(f"final {h.hexdigest()}", flush=True)
