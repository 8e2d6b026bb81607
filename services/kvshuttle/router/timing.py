"""One router call's time, split into the router's own and the registry's."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class CallTimer:
    """Own time is reported both as wall time and as this thread's CPU time: while the call
    awaits the registry, the event loop runs other calls, so both clocks subtract those waits.
    On a busy host the wall figure also counts time the process was not scheduled; the CPU
    figure is what the router's work costs.
    """

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._start_cpu = time.thread_time()
        self._registry_s = 0.0
        self._registry_cpu_s = 0.0

    async def registry(self, call: Awaitable[T]) -> T:
        """Await `call` (a registry round trip, or a wait on one), its time not the router's."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return await call
        finally:
            self._registry_s += time.perf_counter() - t0
            self._registry_cpu_s += time.thread_time() - c0

    def elapsed_s(self) -> float:
        return time.perf_counter() - self._start

    def own_s(self) -> float:
        return self.elapsed_s() - self._registry_s

    def own_cpu_s(self) -> float:
        return time.thread_time() - self._start_cpu - self._registry_cpu_s

    def log_fields(self) -> dict[str, float]:
        return {
            "own_ms": round(self.own_s() * 1e3, 3),
            "own_cpu_ms": round(self.own_cpu_s() * 1e3, 3),
            "registry_ms": round(self._registry_s * 1e3, 3),
        }
