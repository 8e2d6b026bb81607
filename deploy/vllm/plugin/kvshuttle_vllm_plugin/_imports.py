"""Run a callback right after a module has been imported, whoever imports it (a post-import hook).

The plugin patches vLLM (and NIXL) classes without importing their modules itself: vLLM loads
plugins in every process it starts, and importing, say, the OpenAI serving modules costs tens of
seconds on a small CPU where they are never used.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

Callback = Callable[[types.ModuleType], object]
_lock = threading.RLock()


def when_imported(name: str, callback: Callback) -> None:
    """Call `callback(module)` once `name` is imported: now if it already is, else right after
    its import executes. The callback must not raise (exceptions propagate into the import)."""
    with _lock:
        module = sys.modules.get(name)
        if module is not None:
            callback(module)
            return
        _hook().watch(name, callback)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs a callback right after a watched module has been executed, whoever imports it."""

    def __init__(self) -> None:
        self._callbacks: dict[str, list[Callable[[types.ModuleType], object]]] = {}
        self._resolving: set[str] = set()

    def watch(self, name: str, callback: Callable[[types.ModuleType], object]) -> None:
        self._callbacks.setdefault(name, []).append(callback)

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self._callbacks or fullname in self._resolving:
            return None
        self._resolving.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._resolving.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        callbacks = self._callbacks.pop(fullname)
        spec.loader = _CallbackLoader(spec.loader, callbacks)
        return spec


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, callbacks: list[Callable[[types.ModuleType], object]]) -> None:
        self._loader = loader
        self._callbacks = callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        for callback in self._callbacks:
            callback(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_resource_reader, ...
        return getattr(self._loader, name)


@functools.cache
def _hook() -> _PatchOnImport:
    """The process's one post-import hook, first on sys.meta_path."""
    hook = _PatchOnImport()
    sys.meta_path.insert(0, hook)
    return hook
