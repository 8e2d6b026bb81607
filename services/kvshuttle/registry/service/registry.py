"""The registry's domain service: validates requests, applies them to the store, hands event
reports and node removals to the index feed (kvshuttle.registry.feeds.index: this process's block
index, or every replica's through one Redis Stream), hands each applied change to the change feed
(kvshuttle.registry.feeds.change: in this process, or one Redis Stream all replicas share), whence this
process's watchers (kvshuttle.registry.feeds.watchers) get them, and runs the expiry timer. One cohesive
thing, the facade every RegistryService RPC calls: each method is one RPC's validation followed by
one store operation; the rules that depend on state live in the store.

In parts, one concern each, over what they share (kvshuttle.registry.service.base: the
collaborators, counters, shared field checks and change publishing): nodes (registry_nodes),
retentions (registry_retentions), block events and lookups (registry_blocks), the expiry timer
(registry_expiry); and here the watch streams, the feeds' readers and close.

No grpc here. Every method validates all of its input before it touches the store, so a
rejected request changes nothing; InvalidArgument names the request field (the proto path).
"""

from __future__ import annotations

import asyncio

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.names import parse_tenant
from kvshuttle.registry.feeds.watchers import Subscription
from kvshuttle.registry.service.blocks import RegistryBlocks
from kvshuttle.registry.service.expiry import RegistryExpiry
from kvshuttle.registry.service.nodes import RegistryNodes
from kvshuttle.registry.service.retentions import RegistryRetentions

__all__ = ["Registry"]


class Registry(RegistryNodes, RegistryRetentions, RegistryBlocks, RegistryExpiry):
    """See the module docstring: the parts composed, with watch, the feeds' readers and close."""

    def watch(self, *, parent: str, node: str, resume_token: str = "") -> Subscription:
        """A subscription to changes of one tenant's or one node's retentions; with
        `resume_token` (a change's token), it starts with the feed's changes after that one
        (iterating it raises FailedPrecondition WATCH_RESUME_EXPIRED if the feed no longer holds
        them all)."""
        if bool(parent) == bool(node):
            raise InvalidArgument("parent", "set exactly one of parent or node")
        tenant = parse_tenant(parent, "parent", max_length=self.limits.max_id_length) if parent else None
        if node:
            self._node_name(node, "node")
        if len(resume_token) > self.limits.max_id_length:
            raise InvalidArgument("resume_token", "malformed")
        if resume_token:
            self._feed.position(resume_token)  # InvalidArgument if malformed
        sub = self._watchers.add(tenant, node or None)
        if resume_token:
            feed = self._feed
            sub.resume(lambda: feed.replay(resume_token), feed.position)
        return sub

    def unwatch(self, sub: Subscription) -> None:
        self._watchers.discard(sub)

    async def run_feed(self) -> None:
        """What the change feed and the index feed need running (the Redis feeds' readers),
        until cancelled."""
        await asyncio.gather(self._feed.run(), self._index_feed.run())

    def close(self) -> None:
        """End every watch stream and the expiry timer."""
        self._closed = True
        self._wake.set()
        self._watchers.close()
        self._feed.close()

    def counts_by_kind(self) -> dict[str, int]:
        counts = self._store.counts()
        return {
            "node": counts.nodes,
            "retention": counts.retentions - counts.claimed,
            "claim": counts.claimed,
        }
