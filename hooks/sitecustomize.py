"""criuctl's entry into a workload's Python processes (found through PYTHONPATH).

Python imports only the first `sitecustomize` on sys.path, so this one loads the hook and then
runs the next `sitecustomize` further down the path, if any: the user's own one keeps working.
"""

import importlib.util
import os
import sys


def _chain_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_criuctl_next_sitecustomize", candidate)
            if spec and spec.loader:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


try:
    import criuctl_hook

    criuctl_hook.activate()
finally:
    _chain_next_sitecustomize()
