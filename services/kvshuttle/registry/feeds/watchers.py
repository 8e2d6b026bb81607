"""WatchRetentions fan-out: each watcher's bounded queue of retention changes, and the set of
watchers of this process that the change feed (kvshuttle.registry.feeds.change) delivers to. A watcher
that falls behind its queue is dropped: its stream ends, after the changes it had queued (so
its last change's token is a gapless place to resume from), with RESOURCE_EXHAUSTED
(WATCH_OVERFLOW); the client watches again with that token.

A resumed watcher is subscribed first and replays the feed after its token second: live changes
queue up meanwhile, and those the replay already yielded (a position not after the replay's
last) are skipped, so each change reaches it once and in the feed's order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence

from kvshuttle.core.errors import KvshuttleError, ResourceExhausted, Unavailable
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.model import RetentionChange

__all__ = ["Position", "Replay", "Subscription", "Watchers"]

# A change's place in the feed, comparable: what a feed reads from a token.
Position = tuple[int, ...]
# The feed's changes after a token, in pages (raises if the feed no longer holds them).
Replay = Callable[[], AsyncIterator[Sequence[RetentionChange]]]


class Subscription:
    """One WatchRetentions stream: a bounded queue, closed when the watcher falls behind."""

    def __init__(self, tenant: str | None, node: str | None, size: int) -> None:
        self.tenant = tenant
        self.node = node
        self._size = size
        # Unbounded as a queue (the bound is `size`, checked by offer): the end marker always fits.
        self._queue: asyncio.Queue[RetentionChange | None] = asyncio.Queue()
        self._closed = False
        self._error: KvshuttleError | None = None
        self._replay: Replay | None = None
        self._position: Callable[[str], Position] | None = None
        self.overflowed = False

    def resume(self, replay: Replay, position: Callable[[str], Position]) -> None:
        """Start the stream with `replay` (the feed after the watcher's token)."""
        self._replay, self._position = replay, position

    def matches(self, change: RetentionChange) -> bool:
        if self.node is not None:
            # A moved retention leaves one node and reaches another: both nodes' watchers see it.
            return self.node in (change.retention.node, change.previous_node)
        return change.retention.tenant == self.tenant

    def offer(self, change: RetentionChange) -> bool:
        if self._closed:
            return True
        if self._queue.qsize() >= self._size:
            self.overflowed = True
            return False
        self._queue.put_nowait(change)
        return True

    def close(self, error: KvshuttleError | None = None) -> None:
        """End the stream after what is queued; with `error`, the stream raises it there."""
        if self._closed:
            return
        self._closed = True
        if error is None and self.overflowed:
            error = ResourceExhausted("watcher fell behind; watch again", reason=ErrorReason.WATCH_OVERFLOW)
        self._error = error
        self._queue.put_nowait(None)

    async def __aiter__(self) -> AsyncGenerator[RetentionChange, None]:
        last: Position | None = None
        if self._replay is not None and self._position is not None:
            async for page in self._replay():
                for change in page:
                    last = self._position(change.token)
                    if self.matches(change):
                        yield change
        while True:
            live = await self._queue.get()
            if live is None:
                if self._error is not None:
                    raise self._error
                return
            if last is not None and self._position is not None and self._position(live.token) <= last:
                continue  # the replay yielded it already
            yield live


class Watchers:
    """The open subscriptions of this process, at most `max_watchers` of them."""

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

    def fail(self, error: KvshuttleError) -> None:
        """End every stream with `error` (the feed lost changes they would have seen). Later
        watches are accepted."""
        subs = list(self._subscriptions)
        self._subscriptions.clear()
        for sub in subs:
            sub.close(error)

    def close(self) -> None:
        """End every stream; later watches are refused."""
        self._closed = True
        for sub in list(self._subscriptions):
            sub.close()
        self._subscriptions.clear()
