"""The registry's domain service: validates requests, applies them to the store, hands event
reports and node removals to the index feed (kvshuttle.registry.feeds.index: this process's block
index, or every replica's through one Redis Stream), hands each applied change to the change feed
(kvshuttle.registry.feeds.change: in this process, or one Redis Stream all replicas share), whence this
process's watchers (kvshuttle.registry.feeds.watchers) get them, and runs the expiry timer. One cohesive
thing, the facade every RegistryService RPC calls: each method is one RPC's validation followed by
one store operation; the rules that depend on state live in the store.

In parts, one concern each, every one holding the one RegistryShared
(kvshuttle.registry.service.shared: the collaborators, counters, field checks and change publishing):
nodes (.nodes), retentions (.retentions), block events and lookups (.blocks), the expiry timer
(.expiry); this class hands each operation to its part, and has here the watch streams, the
feeds' readers and close.

No grpc here. Every method validates all of its input before it touches the store, so a
rejected request changes nothing; InvalidArgument names the request field (the proto path).
"""

from __future__ import annotations

import asyncio
from array import array
from collections.abc import Sequence

from kvshuttle.core.clock import Clock
from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.kv_events import ApplyResult, EventBatch
from kvshuttle.core.names import parse_tenant
from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.feeds.change import ChangeFeed
from kvshuttle.registry.feeds.index import IndexFeed
from kvshuttle.registry.feeds.watchers import Subscription
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.model import Conversation, ExpiryResult, Found, Move, Node, PutResult, Retention
from kvshuttle.registry.service.blocks import RegistryBlocks
from kvshuttle.registry.service.expiry import RegistryExpiry
from kvshuttle.registry.service.nodes import RegistryNodes
from kvshuttle.registry.service.retentions import RegistryRetentions
from kvshuttle.registry.service.shared import RegistryShared, RegistryStats
from kvshuttle.registry.store.contract import RegistryStore

__all__ = ["Registry"]


class Registry:
    """See the module docstring: the parts over one RegistryShared, with watch, the feeds'
    readers and close."""

    def __init__(
        self,
        store: RegistryStore,
        clock: Clock,
        index: BlockIndex,
        limits: RegistryLimits | None = None,
        feed: ChangeFeed | None = None,
        index_feed: IndexFeed | None = None,
    ) -> None:
        self._shared = RegistryShared(store, clock, index, limits, feed, index_feed)
        self._nodes = RegistryNodes(self._shared)
        self._retentions = RegistryRetentions(self._shared)
        self._blocks = RegistryBlocks(self._shared)
        self._expiry = RegistryExpiry(self._shared)

    # ---- what it is built with -------------------------------------------------------------

    @property
    def limits(self) -> RegistryLimits:
        return self._shared.limits

    @property
    def stats(self) -> RegistryStats:
        return self._shared.stats

    @property
    def store(self) -> RegistryStore:
        return self._shared.store

    @property
    def clock(self) -> Clock:
        return self._shared.clock

    @property
    def index(self) -> BlockIndex:
        return self._shared.index

    @property
    def feed(self) -> ChangeFeed:
        return self._shared.feed

    @property
    def index_feed(self) -> IndexFeed:
        return self._shared.index_feed

    # ---- nodes -----------------------------------------------------------------------------

    async def register_node(self, spec: NodeSpec, ttl: float | None) -> Node:
        return await self._nodes.register_node(spec, ttl)

    async def heartbeat_node(self, name: str, incarnation: int, ttl: float | None, load: NodeLoad) -> Node:
        return await self._nodes.heartbeat_node(name, incarnation, ttl, load)

    async def deregister_node(self, name: str, incarnation: int) -> int:
        return await self._nodes.deregister_node(name, incarnation)

    async def get_node(self, name: str) -> Node:
        return await self._nodes.get_node(name)

    async def list_nodes(
        self, *, role: NodeRole | None, model: str, page_size: int, page_token: str
    ) -> tuple[list[Node], str]:
        return await self._nodes.list_nodes(
            role=role, model=model, page_size=page_size, page_token=page_token
        )

    # ---- retentions ------------------------------------------------------------------------

    async def put_retention(
        self, *, request_id: str, parent: str, retention: Retention, ttl: float | None
    ) -> PutResult:
        return await self._retentions.put_retention(
            request_id=request_id, parent=parent, retention=retention, ttl=ttl
        )

    async def get_retention(self, name: str) -> Retention:
        return await self._retentions.get_retention(name)

    async def get_conversation(self, name: str) -> Conversation:
        return await self._retentions.get_conversation(name)

    async def renew_retention(self, name: str, ttl: float | None) -> Retention:
        return await self._retentions.renew_retention(name, ttl)

    async def claim_retention(
        self, *, request_id: str, name: str, holder: str, claim_ttl: float | None, shared: bool = False
    ) -> Retention:
        return await self._retentions.claim_retention(
            request_id=request_id, name=name, holder=holder, claim_ttl=claim_ttl, shared=shared
        )

    async def release_retention(self, name: str, *, claim_id: str, force: bool, keep: bool = False) -> None:
        await self._retentions.release_retention(name, claim_id=claim_id, force=force, keep=keep)

    async def move_retention(self, *, request_id: str, move: Move, ttl: float | None) -> Retention:
        """Hand a claimed retention to another node (an agent's pool node) in one step."""
        return await self._retentions.move_retention(request_id=request_id, move=move, ttl=ttl)

    async def evict_retention(self, name: str, *, node: str) -> None:
        """Remove a retention its holder `node` needs the room of (never a claimed one)."""
        await self._retentions.evict_retention(name, node=node)

    async def find_retention(
        self, *, parent: str, model: str, block_size: int, block_hashes: array[int], transcript_key: bytes
    ) -> Found:
        return await self._retentions.find_retention(
            parent=parent,
            model=model,
            block_size=block_size,
            block_hashes=block_hashes,
            transcript_key=transcript_key,
        )

    async def list_retentions(
        self, *, parent: str, node: str, page_size: int, page_token: str
    ) -> tuple[list[Retention], str]:
        return await self._retentions.list_retentions(
            parent=parent, node=node, page_size=page_size, page_token=page_token
        )

    # ---- block events and lookups ----------------------------------------------------------

    def indexed_blocks(self, node: str) -> int:
        return self._blocks.indexed_blocks(node)

    async def report_block_events(
        self, node: str, incarnation: int, batches: Sequence[EventBatch]
    ) -> ApplyResult:
        return await self._blocks.report_block_events(node, incarnation, batches)

    async def lookup_blocks(
        self, block_hashes: Sequence[int], *, model: str, role: NodeRole | None
    ) -> list[tuple[str, int]]:
        return await self._blocks.lookup_blocks(block_hashes, model=model, role=role)

    # ---- expiry ----------------------------------------------------------------------------

    async def expire_due(self) -> ExpiryResult:
        """Apply every lapse up to now. The timer calls this; tests call it after a FakeClock step."""
        return await self._expiry.expire_due()

    async def run_expiry(self, *, max_sleep: float = 1.0) -> None:
        """The expiry timer (kvshuttle.registry.service.expiry), until close."""
        await self._expiry.run_expiry(max_sleep=max_sleep)

    # ---- watch streams, the feeds' readers, close ------------------------------------------

    def watch(self, *, parent: str, node: str, resume_token: str = "") -> Subscription:
        """A subscription to changes of one tenant's or one node's retentions; with
        `resume_token` (a change's token), it starts with the feed's changes after that one
        (iterating it raises FailedPrecondition WATCH_RESUME_EXPIRED if the feed no longer holds
        them all)."""
        if bool(parent) == bool(node):
            raise InvalidArgument("parent", "set exactly one of parent or node")
        tenant = parse_tenant(parent, "parent", max_length=self.limits.max_id_length) if parent else None
        if node:
            self._shared.checks.node_name(node, "node")
        if len(resume_token) > self.limits.max_id_length:
            raise InvalidArgument("resume_token", "malformed")
        feed = self._shared.feed
        if resume_token:
            feed.position(resume_token)  # InvalidArgument if malformed
        sub = self._shared.watchers.add(tenant, node or None)
        if resume_token:
            sub.resume(lambda: feed.replay(resume_token), feed.position)
        return sub

    def unwatch(self, sub: Subscription) -> None:
        self._shared.watchers.discard(sub)

    async def run_feed(self) -> None:
        """What the change feed and the index feed need running (the Redis feeds' readers),
        until cancelled."""
        await asyncio.gather(self._shared.feed.run(), self._shared.index_feed.run())

    def close(self) -> None:
        """End every watch stream and the expiry timer."""
        self._expiry.close()
        self._shared.watchers.close()
        self._shared.feed.close()

    def counts_by_kind(self) -> dict[str, int]:
        counts = self._shared.store.counts()
        return {
            "node": counts.nodes,
            "retention": counts.retentions - counts.claimed,
            "claim": counts.claimed,
        }
