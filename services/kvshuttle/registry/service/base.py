"""What every part of the Registry facade (kvshuttle.registry.service.registry) shares: the store, clock,
block index and feeds it is built with, its counters (RegistryStats), the checks of the fields
several requests carry (ids, node names, bounded strings, page tokens), and publishing applied
changes to the change feed, whence this process's watchers get them."""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvshuttle.core.clock import Clock
from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.names import check_id, parse_node
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.feeds.change import ChangeFeed, LocalFeed
from kvshuttle.registry.feeds.index import IndexFeed, LocalIndexFeed
from kvshuttle.registry.feeds.watchers import Watchers
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.model import RetentionChange
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


class RegistryBase:
    """The facade's collaborators, counters, shared field checks and change publishing; no RPC of
    its own."""

    def __init__(
        self,
        store: RegistryStore,
        clock: Clock,
        index: BlockIndex,
        limits: RegistryLimits | None = None,
        feed: ChangeFeed | None = None,
        index_feed: IndexFeed | None = None,
    ) -> None:
        self._store = store
        self._clock = clock
        self._index = index
        self._index_feed: IndexFeed = index_feed or LocalIndexFeed(index)
        self.limits = limits or RegistryLimits()
        self.stats = RegistryStats()
        self._watchers = Watchers(self.limits.max_watchers, self.limits.watch_queue_size)
        self._feed: ChangeFeed = feed or LocalFeed(self.limits.watch_history)
        self._feed.bind(self._deliver, self._watchers.fail)
        self._wake = asyncio.Event()
        self._closed = False

    def _id(self, value: str, field_name: str) -> str:
        return check_id(value, field_name, max_length=self.limits.max_id_length)

    def _node_name(self, name: str, field_name: str) -> str:
        parse_node(name, field_name, max_length=self.limits.max_id_length)
        return name

    def _bounded(self, value: str, field_name: str, *, required: bool = True) -> str:
        if required and not value:
            raise InvalidArgument(field_name, "required")
        if len(value) > self.limits.max_endpoint_length:
            raise InvalidArgument(field_name, f"longer than {self.limits.max_endpoint_length} characters")
        return value

    def _page(self, page_size: int, page_token: str, scope: str) -> tuple[int, str]:
        if page_size < 0:
            raise InvalidArgument("page_size", "must not be negative")
        size = min(page_size or self.limits.default_page_size, self.limits.max_page_size)
        if not page_token:
            return size, ""
        try:
            token_scope, after = json.loads(base64.urlsafe_b64decode(page_token.encode()))
        except (ValueError, TypeError, binascii.Error) as exc:
            raise InvalidArgument("page_token", "malformed") from exc
        if token_scope != scope or not isinstance(after, str):
            raise InvalidArgument("page_token", "belongs to another listing")
        return size, after

    @staticmethod
    def _next_token(scope: str, names: list[str], size: int) -> str:
        if len(names) < size:
            return ""
        return base64.urlsafe_b64encode(json.dumps([scope, names[-1]]).encode()).decode()

    async def _publish(self, changes: Sequence[RetentionChange]) -> None:
        if changes:
            self.stats.feed_errors += await self._feed.publish(changes)

    def _deliver(self, changes: Sequence[RetentionChange]) -> None:
        self.stats.watchers_dropped += self._watchers.publish(changes)
