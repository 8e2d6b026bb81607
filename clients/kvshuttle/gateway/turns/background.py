"""The gateway's background work: commits, aborts and tokenizer checks that outlive the
request that started them."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

__all__ = ["BackgroundTasks"]

log = structlog.get_logger("kvshuttle.gateway")


class BackgroundTasks:
    """Tasks referenced until they end (the event loop keeps only weak references), their
    failures logged; `settle()` waits for them."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any], what: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._tasks.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._tasks.discard(t)
            if not t.cancelled() and (exc := t.exception()) is not None:
                log.error("gateway.background_failed", what=what, error=repr(exc)[:500])

        task.add_done_callback(done)
        return task

    async def settle(self) -> None:
        """Wait until none is in flight (one may start another)."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))
