"""Run a function once a module has been imported, without importing it ourselves.

The hook is loaded into every Python process of a workload, most of which never import torch; it
must not pay torch's start-up for them. A finder at the head of `sys.meta_path` waits for the
module's import, lets the regular finders and loader do it, then calls the function with the
module and steps aside. A failing function is reported on stderr in one line; the user's import
never fails because of criuctl.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from types import ModuleType


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name = name
        self.then = then
        self._looking = False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self._looking:
            return None
        self._looking = True
        try:
            spec = importlib.util.find_spec(fullname)  # the other finders (we answer None while looking)
        finally:
            self._looking = False
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            self._done(module)

        loader.exec_module = exec_module  # this module's loader instance only
        return spec

    def _done(self, module: ModuleType) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        try:
            self.then(module)
        except Exception as exc:  # the user's import must go on
            print(f"criuctl hook: disabled for {self.name} ({type(exc).__name__}: {exc})", file=sys.stderr)


def when_imported(name: str, then: Callable[[ModuleType], None]) -> None:
    """Call `then(module)` right after `name` is imported (now, if it already is)."""
    if name in sys.modules:
        _AfterImport(name, then)._done(sys.modules[name])
        return
    sys.meta_path.insert(0, _AfterImport(name, then))
