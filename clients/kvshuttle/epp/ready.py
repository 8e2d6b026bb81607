"""The decode engines the router says are ready now (ListReadyDecodes: registered, lease not
lapsed, engine healthy), per model, for the picks that need no plan (`GET /v1/models`, a
bodyless request) and for a turn the router cannot place for want of a prefill node.

A model's list serves picks until it is `ttl_s` old (0: every pick asks); one read per model at
a time, which every pick that needs it waits for. `forget()` drops a model's list, and the
answer of a read begun before it: the router's word that no decode node is ready (a PlanTurn's
NO_DECODE_NODE) is not outlived by a list read earlier. Bounded by the configured models.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Awaitable, Callable

from kvshuttle.core.endpoints import endpoint_host_port
from kvshuttle.router.v1 import router_service_pb2 as pb

__all__ = ["ReadyDecodes"]

# A ready decode engine: its canonical host:port and its placement, least loaded first.
Ready = list[tuple[str, pb.Placement]]


class ReadyDecodes:
    def __init__(
        self,
        read: Callable[[str], Awaitable[list[pb.Placement]]],
        *,
        ttl_s: float,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        """`read(model)` is ListReadyDecodes (its failures, RouterFailure, reach the caller)."""
        self._read = read
        self._ttl_s = ttl_s
        self._monotonic = monotonic
        self._lists: dict[str, tuple[float, Ready]] = {}
        self._reads: dict[str, asyncio.Future[Ready]] = {}
        self._generation: dict[str, int] = {}

    async def get(self, model: str) -> Ready:
        """The model's ready decode engines with a host:port endpoint, least loaded first."""
        cached = self._lists.get(model)
        if cached is not None and self._monotonic() - cached[0] < self._ttl_s:
            return cached[1]
        task = self._reads.get(model)
        if task is None:
            # In a context of its own: not a part of the request that happened to start it.
            task = asyncio.get_running_loop().create_task(
                self._reading(model, self._generation.get(model, 0)), context=contextvars.Context()
            )
            self._reads[model] = task
            task.add_done_callback(lambda t: self._done(model, t))
        # Shielded: a request that gives up does not cancel the read the others wait for.
        return await asyncio.shield(task)

    def forget(self, model: str) -> None:
        """Drop the model's list; a read in flight is still answered but not kept."""
        self._lists.pop(model, None)
        self._generation[model] = self._generation.get(model, 0) + 1
        self._reads.pop(model, None)

    async def _reading(self, model: str, generation: int) -> Ready:
        started = self._monotonic()
        placements = await self._read(model)
        ready = [(e, p) for p in placements if (e := endpoint_host_port(p.http_endpoint)) is not None]
        if self._generation.get(model, 0) == generation:
            self._lists[model] = (started, ready)
        return ready

    def _done(self, model: str, task: asyncio.Future[Ready]) -> None:
        if self._reads.get(model) is task:
            del self._reads[model]
        if not task.cancelled():
            task.exception()  # retrieved: every waiter may have left
