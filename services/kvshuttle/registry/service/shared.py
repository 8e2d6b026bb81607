"""What every part of the Registry facade (kvshuttle.registry.service.registry) holds: one RegistryShared
with the store, clock, block index and feeds the facade is built with, its counters (RegistryStats),
the field checks (kvshuttle.registry.service.checks), the expiry timer's wake-up, and publishing
applied changes to the change feed, whence this process's watchers get them."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvshuttle.core.clock import Clock
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.feeds.change import ChangeFeed, LocalFeed
from kvshuttle.registry.feeds.index import IndexFeed, LocalIndexFeed
from kvshuttle.registry.feeds.watchers import Watchers
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.model import RetentionChange
from kvshuttle.registry.service.checks import FieldChecks
from kvshuttle.registry.store.contract import RegistryStore


@dataclass(slots=True)
class RegistryStats:
    """Monotonic counters the metrics endpoint exposes."""

    expirations: Counter[str] = field(default_factory=Counter)  # node / retention / claim
    claims: Counter[str] = field(default_factory=Counter)  # granted / rejected reason
    puts: int = 0
    replaced: int = 0
    moves: int = 0
    evictions: int = 0
    event_batches: int = 0
    event_gaps: int = 0
    engine_restarts: int = 0
    watchers_dropped: int = 0
    feed_errors: int = 0  # changes whose event the feed could not take (watchers never see them)
    # and node removals the index feed could not take (other replicas keep the node's blocks,
    # never answered while the node is gone)


class RegistryShared:
    """The facade's collaborators, counters, field checks and change publishing, held by each of
    its parts; no RPC of its own."""

    def __init__(
        self,
        store: RegistryStore,
        clock: Clock,
        index: BlockIndex,
        limits: RegistryLimits | None = None,
        feed: ChangeFeed | None = None,
        index_feed: IndexFeed | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.index = index
        self.index_feed: IndexFeed = index_feed or LocalIndexFeed(index)
        self.limits = limits or RegistryLimits()
        self.checks = FieldChecks(self.limits)
        self.stats = RegistryStats()
        self.watchers = Watchers(self.limits.max_watchers, self.limits.watch_queue_size)
        self.feed: ChangeFeed = feed or LocalFeed(self.limits.watch_history)
        self.feed.bind(self._deliver, self.watchers.fail)
        # Set when an operation may have set an earlier deadline: the expiry timer wakes.
        self.wake = asyncio.Event()

    async def publish(self, changes: Sequence[RetentionChange]) -> None:
        if changes:
            self.stats.feed_errors += await self.feed.publish(changes)

    def _deliver(self, changes: Sequence[RetentionChange]) -> None:
        self.stats.watchers_dropped += self.watchers.publish(changes)
