"""WatchRetentions fan-out: each watcher's bounded queue of retention changes, and the set of
watchers the registry publishes to. A watcher that falls behind its queue is dropped: its stream
ends with RESOURCE_EXHAUSTED (WATCH_OVERFLOW) and the client watches again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from kvshuttle.core.errors import ResourceExhausted, Unavailable
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.model import RetentionChange

__all__ = ["Subscription", "Watchers"]


class Subscription:
    """One WatchRetentions stream: a bounded queue, closed when the watcher falls behind."""

    def __init__(self, tenant: str | None, node: str | None, size: int) -> None:
        self.tenant = tenant
        self.node = node
        self._queue: asyncio.Queue[RetentionChange | None] = asyncio.Queue(maxsize=size)
        self.overflowed = False

    def matches(self, change: RetentionChange) -> bool:
        if self.node is not None:
            # A moved retention leaves one node and reaches another: both nodes' watchers see it.
            return self.node in (change.retention.node, change.previous_node)
        return change.retention.tenant == self.tenant

    def offer(self, change: RetentionChange) -> bool:
        try:
            self._queue.put_nowait(change)
        except asyncio.QueueFull:
            self.overflowed = True
            return False
        return True

    def close(self) -> None:
        # Drop the oldest change if need be: the stream ends either way.
        if self._queue.full():
            self._queue.get_nowait()
        self._queue.put_nowait(None)

    async def __aiter__(self) -> AsyncIterator[RetentionChange]:
        while True:
            change = await self._queue.get()
            if change is None:
                if self.overflowed:
                    raise ResourceExhausted(
                        "watcher fell behind; watch again", reason=ErrorReason.WATCH_OVERFLOW
                    )
                return
            yield change


class Watchers:
    """The open subscriptions, at most `max_watchers` of them."""

    def __init__(self, max_watchers: int, queue_size: int) -> None:
        self._max = max_watchers
        self._queue_size = queue_size
        self._subscriptions: set[Subscription] = set()
        self._closed = False

    def add(self, tenant: str | None, node: str | None) -> Subscription:
        if self._closed:
            raise Unavailable("registry is shutting down", reason=ErrorReason.SHUTTING_DOWN)
        if len(self._subscriptions) >= self._max:
            raise ResourceExhausted(
                f"at most {self._max} watchers",
                reason=ErrorReason.CAPACITY_EXCEEDED,
                metadata={"limit": "max_watchers"},
            )
        sub = Subscription(tenant, node, self._queue_size)
        self._subscriptions.add(sub)
        return sub

    def discard(self, sub: Subscription) -> None:
        self._subscriptions.discard(sub)

    def publish(self, changes: Sequence[RetentionChange]) -> int:
        """Offer `changes` to every matching watcher; returns how many were dropped for falling
        behind (their streams end)."""
        if not changes or not self._subscriptions:
            return 0
        dropped = 0
        for sub in list(self._subscriptions):
            for change in changes:
                if sub.matches(change) and not sub.offer(change):
                    dropped += 1
                    self._subscriptions.discard(sub)
                    sub.close()
                    break
        return dropped

    def close(self) -> None:
        """End every stream; later watches are refused."""
        self._closed = True
        for sub in list(self._subscriptions):
            sub.close()
        self._subscriptions.clear()
