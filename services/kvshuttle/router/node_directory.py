"""The live nodes serving each model, as the registry last listed them.

A plan needs the node list, and ListNodes is a round trip: the list in hand serves plans until
it is `max_age_s` old, and once it is `refresh_s` old a background read replaces it, so a plan
rarely waits for the registry. A failed background read is logged; the next plan past
`refresh_s` tries again, and past `max_age_s` a plan reads (and fails) itself.

A plan the list in hand cannot place (no healthy node of a role it needs: a node that just
registered, or just reported its engine healthy, is not in it yet) asks for the registry's list
now (`reread`) instead of failing for up to `refresh_s`. One read serves every plan that asks
while it runs (the background refresh included), and none is made while the last read, answered
or failed, began less than `miss_refresh_s` ago: with a role really missing (or the registry
down), the registry sees at most one ListNodes per `miss_refresh_s` from this replica, however
many plans fail.

The last list a read returned stays in hand after reads fail: with the registry unreachable, a
plan falls back to it (`last_known`) while it is younger than `degraded_max_age_s`, so turns
are still served, plain P->D, on the nodes that were healthy then.
"""

from __future__ import annotations

import asyncio
import contextvars
import math
import time
from collections.abc import Callable

import structlog

from kvshuttle.router.model import NodeInfo
from kvshuttle.router.ports import RegistryPort

log = structlog.get_logger("kvshuttle.router")


class NodeDirectory:
    def __init__(
        self,
        port: RegistryPort,
        *,
        refresh_s: float,
        max_age_s: float,
        miss_refresh_s: float = 0.0,
        degraded_max_age_s: float = 0.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._port = port
        self._refresh_s = refresh_s
        self._max_age_s = max_age_s
        self._miss_refresh_s = miss_refresh_s
        self._degraded_max_age_s = degraded_max_age_s
        self._monotonic = monotonic
        self._lists: dict[str, tuple[float, list[NodeInfo]]] = {}
        self._asked_at: dict[str, float] = {}  # when the last read began, answered or not
        self._refreshes: dict[str, asyncio.Task[None]] = {}

    async def nodes(self, model: str) -> list[NodeInfo]:
        """Live nodes serving `model` (the registry's errors propagate when it must be read)."""
        cached = self._lists.get(model)
        age = math.inf if cached is None else self._monotonic() - cached[0]
        if cached is None or age >= self._max_age_s:
            return await self._read(model)
        if age >= self._refresh_s:
            self._refreshing(model)
        return cached[1]

    async def reread(self, model: str) -> list[NodeInfo]:
        """The registry's list of `model`'s nodes now, for a plan the list in hand cannot place:
        the read in flight if there is one, else a new one unless the last began less than
        `miss_refresh_s` ago (then the list in hand). A failed read is logged and the list in
        hand returned: the plan then fails as it would have (the registry's outage is the
        background refresh's and `nodes()`'s to report)."""
        cached = self._lists.get(model)
        if cached is None:
            return await self.nodes(model)
        asked = self._monotonic() - self._asked_at.get(model, -math.inf)
        if model not in self._refreshes and asked < self._miss_refresh_s:
            return cached[1]
        # Shielded: a plan that gives up (its caller's deadline) does not cancel the others' read.
        await asyncio.shield(self._refreshing(model))
        return self._lists[model][1]

    def last_known(self, model: str) -> tuple[list[NodeInfo], float] | None:
        """The last list the registry gave for `model` and its age in seconds, while younger
        than `degraded_max_age_s`; None otherwise (never read, or too old to trust)."""
        cached = self._lists.get(model)
        if cached is None:
            return None
        age = self._monotonic() - cached[0]
        return (cached[1], age) if age < self._degraded_max_age_s else None

    def _refreshing(self, model: str) -> asyncio.Task[None]:
        """The background read of `model`'s list: the one in flight, or a new one."""
        task = self._refreshes.get(model)
        if task is None:
            # In a context of its own: not a part of the plan that happened to start it.
            task = asyncio.create_task(self._refresh(model), context=contextvars.Context())
            self._refreshes[model] = task
            task.add_done_callback(lambda _: self._refreshes.pop(model, None))
        return task

    async def _read(self, model: str) -> list[NodeInfo]:
        read_at = self._asked_at[model] = self._monotonic()
        nodes = await self._port.list_nodes(model)
        self._lists[model] = (read_at, nodes)
        return nodes

    async def _refresh(self, model: str) -> None:
        try:
            await self._read(model)
        except Exception as exc:  # the next plan retries; past max_age_s it reads itself
            log.warning("router.nodes_refresh_failed", model=model, error=repr(exc)[:300])
