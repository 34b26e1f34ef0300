"""The in-process side of criuctl, loaded into every Python process of a workload.

`criuctl run` puts the `hooks/` directory on the workload's PYTHONPATH; its `sitecustomize` imports
this package. It must stay cheap: standard library only, no torch import, nothing done at start-up
but reading the environment. It never imports `criuctl` (the workload may run another interpreter).
"""

from __future__ import annotations

import os

from criuctl_hook.contract import ENV_HOOKED_PID, ENV_WORKLOAD


def workload_name() -> str | None:
    """The criuctl workload this process belongs to, or None outside criuctl."""
    return os.environ.get(ENV_WORKLOAD) or None


def activate() -> None:
    """Mark this interpreter as hooked (children see which process loaded the hook first)."""
    if workload_name() is not None:
        os.environ.setdefault(ENV_HOOKED_PID, str(os.getpid()))
