"""The in-process side of criuctl, loaded into every Python process of a workload.

`criuctl run` puts the `hooks/` directory on the workload's PYTHONPATH; its `sitecustomize` imports
this package. It must stay cheap: standard library only, no torch import, nothing done at start-up
but reading the environment and asking to be told when torch is imported (`postimport`); the
step boundary (`boundary`) is installed then. It never imports `criuctl` (the workload may run
another interpreter).
"""

from __future__ import annotations

import os

from criuctl_hook.contract import ENV_CONTROL_DIR, ENV_HOOKED_PID, ENV_RESUME_STATE, ENV_WORKLOAD


def workload_name() -> str | None:
    """The criuctl workload this process belongs to, or None outside criuctl."""
    return os.environ.get(ENV_WORKLOAD) or None


def _torch_imported(torch) -> None:
    from criuctl_hook import boundary

    boundary.install(torch)


def activate() -> None:
    """Mark this interpreter as hooked (children see which process loaded the hook first)."""
    if workload_name() is None:
        return
    os.environ.setdefault(ENV_HOOKED_PID, str(os.getpid()))
    if os.environ.get(ENV_CONTROL_DIR) or os.environ.get(ENV_RESUME_STATE):
        from criuctl_hook import postimport

        postimport.when_imported("torch", _torch_imported)
