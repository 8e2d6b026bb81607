"""The registry's domain service: validates requests, applies them to the store, hands event
reports and node removals to the index feed (kvshuttle.registry.index_feed: this process's block
index, or every replica's through one Redis Stream), hands each applied change to the change feed
(kvshuttle.registry.feed: in this process, or one Redis Stream all replicas share), whence this
process's watchers (kvshuttle.registry.watchers) get them, and runs the expiry timer. One cohesive
thing, the facade every RegistryService RPC calls: each method is one RPC's validation followed by
one store operation; the rules that depend on state live in the store.

No grpc here. Every method validates all of its input before it touches the store, so a
rejected request changes nothing; InvalidArgument names the request field (the proto path).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import structlog

from kvshuttle.core.clock import Clock
from kvshuttle.core.errors import FailedPrecondition, InvalidArgument, Unavailable
from kvshuttle.core.kv_events import ApplyResult, BlockStored, EventBatch
from kvshuttle.core.limits import MAX_EVENT_SEQ, MAX_GENERATION, MAX_KV_BYTES_PER_TOKEN
from kvshuttle.core.names import (
    check_id,
    parse_conversation,
    parse_node,
    parse_retention,
    parse_tenant,
    parse_tenant_or_conversation,
)
from kvshuttle.core.nodes import (
    POOL_CAPACITY_LABEL,
    POOL_OF_LABEL,
    NodeLoad,
    NodeRole,
    NodeSpec,
    is_pool_node_name,
    pool_node_name,
    pool_owner,
)
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.registry.feed import ChangeFeed, LocalFeed
from kvshuttle.registry.index_feed import IndexFeed, LocalIndexFeed
from kvshuttle.registry.limits import RegistryLimits
from kvshuttle.registry.model import (
    Conversation,
    ExpiryResult,
    Move,
    Node,
    PutResult,
    Retention,
    RetentionChange,
)
from kvshuttle.registry.store import RegistryStore
from kvshuttle.registry.watchers import Subscription, Watchers

log = structlog.get_logger("kvshuttle.registry")


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


class Registry:
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

    # ---- validation helpers ------------------------------------------------------------

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

    # ---- nodes -----------------------------------------------------------------------------

    def _check_spec(self, spec: NodeSpec) -> None:
        self._node_name(spec.name, "node.name")
        self._id(spec.engine_id, "node.engine_id")
        self._bounded(spec.http_endpoint, "node.http_endpoint")
        if not spec.http_endpoint.startswith(("http://", "https://")):
            raise InvalidArgument("node.http_endpoint", "must be an http:// or https:// URL")
        self._bounded(spec.side_channel_host, "node.side_channel_host")
        if not 0 < spec.side_channel_port < 65536:
            raise InvalidArgument("node.side_channel_port", "must be 1..65535")
        self._bounded(spec.agent_endpoint, "node.agent_endpoint", required=False)
        self._bounded(spec.model, "node.model")
        if not 0 < spec.block_size <= self.limits.max_block_size:
            raise InvalidArgument("node.block_size", f"must be 1..{self.limits.max_block_size}")
        if not 0 < spec.kv_bytes_per_token <= MAX_KV_BYTES_PER_TOKEN:
            raise InvalidArgument("node.kv_bytes_per_token", f"must be 1..{MAX_KV_BYTES_PER_TOKEN}")
        if len(spec.labels) > self.limits.max_labels:
            raise InvalidArgument("node.labels", f"at most {self.limits.max_labels} labels")
        for key, value in spec.labels.items():
            if (
                not key
                or len(key) > self.limits.max_label_length
                or len(value) > self.limits.max_label_length
            ):
                raise InvalidArgument(
                    "node.labels",
                    f"keys must be 1..{self.limits.max_label_length} "
                    f"characters, values at most {self.limits.max_label_length}",
                )
        self._check_pool(spec)

    def _check_pool(self, spec: NodeSpec) -> None:
        """A pool node is `pool_node_name(owner)`, labelled with its owner (and, if at all, a
        byte capacity); no other node takes a pool node's name, so an agent's scope over its
        pool node (kvshuttle.core.auth) never reaches an engine's node."""
        if spec.role is not NodeRole.POOL:
            if is_pool_node_name(spec.name):
                raise InvalidArgument("node.name", "names ending in -pool are reserved for NODE_ROLE_POOL")
            return
        owner = pool_owner(spec.name)
        if not owner:
            raise InvalidArgument("node.name", "a pool node is named nodes/{node}-pool")
        pool_node_name(owner, "node.name", max_length=self.limits.max_id_length)  # a valid owner
        if spec.labels.get(POOL_OF_LABEL) != owner:
            raise InvalidArgument("node.labels", f"a pool node's {POOL_OF_LABEL} label must be {owner}")
        capacity = spec.labels.get(POOL_CAPACITY_LABEL)
        if capacity is not None and not (capacity.isascii() and capacity.isdigit() and len(capacity) <= 20):
            raise InvalidArgument("node.labels", f"{POOL_CAPACITY_LABEL} must be a number of bytes")

    async def register_node(self, spec: NodeSpec, ttl: float | None) -> Node:
        self._check_spec(spec)
        lease = self.limits.node_ttl.pick(ttl, "ttl")
        node, changes, engine_changed = await self._store.register_node(spec, lease, self._clock.now())
        if engine_changed:  # the old engine's reports are refused from here on
            await self._index_feed.drop(spec.name, node.incarnation, self._clock.now())
        await self._publish(changes)
        self._wake.set()
        log.info(
            "node.registered", node=spec.name, incarnation=node.incarnation, engine_changed=engine_changed
        )
        return node

    async def heartbeat_node(self, name: str, incarnation: int, ttl: float | None, load: NodeLoad) -> Node:
        self._node_name(name, "name")
        if incarnation <= 0:
            raise InvalidArgument("incarnation", "required")
        lease = self.limits.node_ttl.pick(ttl, "ttl")
        if not (math.isfinite(load.kv_cache_usage) and 0.0 <= load.kv_cache_usage <= 1.0):
            raise InvalidArgument("load.kv_cache_usage", "must be within 0..1")
        # Renewals only push deadlines later, so the expiry timer need not wake.
        return await self._store.heartbeat_node(name, incarnation, lease, load, self._clock.now())

    async def deregister_node(self, name: str, incarnation: int) -> int:
        self._node_name(name, "name")
        # The incarnation removed, so that its reports in flight are refused after the removal.
        removed = incarnation or (await self._store.get_node(name)).incarnation
        changes = await self._store.deregister_node(name, incarnation or None, self._clock.now())
        await self._index_feed.drop(name, removed + 1, self._clock.now())
        await self._publish(changes)
        return len(changes)

    async def get_node(self, name: str) -> Node:
        return await self._store.get_node(self._node_name(name, "name"))

    async def list_nodes(
        self, *, role: NodeRole | None, model: str, page_size: int, page_token: str
    ) -> tuple[list[Node], str]:
        self._bounded(model, "model", required=False)
        size, after = self._page(page_size, page_token, "nodes")
        nodes = await self._store.list_nodes(role=role, model=model or None, after=after, limit=size)
        return nodes, self._next_token("nodes", [n.name for n in nodes], size)

    def indexed_blocks(self, node: str) -> int:
        return self._index.node_block_count(node)

    # ---- retentions ------------------------------------------------------------------------

    def _check_retention(self, retention: Retention) -> None:
        self._node_name(retention.node, "retention.node")
        # Below 2**63: the router plans generation + 1 into a uint64.
        if not 0 < retention.generation <= MAX_GENERATION:
            raise InvalidArgument("retention.generation", f"must be 1..{MAX_GENERATION}")
        self._bounded(retention.model, "retention.model")
        if not 0 < retention.block_size <= self.limits.max_block_size:
            raise InvalidArgument("retention.block_size", f"must be 1..{self.limits.max_block_size}")
        if not 0 < retention.num_tokens <= self.limits.max_num_tokens:
            raise InvalidArgument("retention.num_tokens", f"must be 1..{self.limits.max_num_tokens}")
        if len(retention.block_hashes) > self.limits.max_block_hashes:
            raise InvalidArgument("retention.block_hashes", f"at most {self.limits.max_block_hashes}")
        if len(retention.block_hashes) != retention.num_tokens // retention.block_size:
            raise InvalidArgument("retention.block_hashes", "must hold one hash per full block of num_tokens")
        if not retention.kv_transfer_params:
            raise InvalidArgument("retention.kv_transfer_params", "required")
        if len(retention.kv_transfer_params) > self.limits.max_kv_transfer_params_bytes:
            raise InvalidArgument(
                "retention.kv_transfer_params",
                f"larger than {self.limits.max_kv_transfer_params_bytes} bytes",
            )
        # A node's retained_bytes is a sum of these.
        if not 0 <= retention.kv_bytes <= self.limits.max_kv_bytes:
            raise InvalidArgument("retention.kv_bytes", f"must be 0..{self.limits.max_kv_bytes}")

    def _request_id(self, request_id: str) -> str:
        if request_id:
            self._id(request_id, "request_id")
        return request_id

    async def put_retention(
        self, *, request_id: str, parent: str, retention: Retention, ttl: float | None
    ) -> PutResult:
        self._request_id(request_id)
        conversation = parse_conversation(parent, "parent", max_length=self.limits.max_id_length)
        self._check_retention(retention)
        lease = self.limits.retention_ttl.pick(ttl, "ttl")
        if retention.pin_expire_at is not None and not math.isfinite(retention.pin_expire_at):
            raise InvalidArgument("retention.pin_expire_time", "must be a finite time")
        retention.name = conversation.retention(retention.generation)
        result, changes = await self._store.put_retention(
            retention, lease, self._clock.now(), request_id=request_id
        )
        if changes:
            self.stats.puts += 1
            self.stats.replaced += bool(result.replaced)
        await self._publish(changes)
        self._wake.set()
        return result

    def _retention_name(self, name: str, field_name: str = "name") -> str:
        parse_retention(name, field_name, max_length=self.limits.max_id_length)
        return name

    async def get_retention(self, name: str) -> Retention:
        return await self._store.get_retention(self._retention_name(name))

    async def get_conversation(self, name: str) -> Conversation:
        parse_conversation(name, "name", max_length=self.limits.max_id_length)
        return await self._store.get_conversation(name)

    async def renew_retention(self, name: str, ttl: float | None) -> Retention:
        self._retention_name(name)
        lease = self.limits.retention_ttl.pick(ttl, "ttl")
        retention, changes = await self._store.renew_retention(
            name, lease, self.limits.retention_ttl.maximum, self._clock.now()
        )
        await self._publish(changes)
        return retention

    async def claim_retention(
        self, *, request_id: str, name: str, holder: str, claim_ttl: float | None
    ) -> Retention:
        self._request_id(request_id)
        self._retention_name(name)
        self._bounded(holder, "holder")
        lease = self.limits.claim_ttl.pick(claim_ttl, "claim_ttl")
        try:
            retention, changes = await self._store.claim_retention(
                name, holder, lease, self._clock.now(), request_id=request_id
            )
        except Exception as exc:
            self.stats.claims[getattr(exc, "reason", "ERROR")] += 1
            raise
        self.stats.claims["GRANTED"] += 1
        await self._publish(changes)
        self._wake.set()
        return retention

    async def release_retention(self, name: str, *, claim_id: str, force: bool, keep: bool = False) -> None:
        self._retention_name(name)
        self._bounded(claim_id, "claim_id", required=keep)
        if keep and force:
            raise InvalidArgument("keep", "gives a claim back: not with force")
        changes = await self._store.release_retention(name, claim_id, force, self._clock.now(), keep=keep)
        await self._publish(changes)
        if keep:
            self._wake.set()  # its lease is the expiry timer's again

    async def move_retention(self, *, request_id: str, move: Move, ttl: float | None) -> Retention:
        """Hand a claimed retention to another node (an agent's pool node) in one step."""
        self._request_id(request_id)
        self._retention_name(move.name)
        self._bounded(move.claim_id, "claim_id")
        self._node_name(move.node, "node")
        if not move.kv_transfer_params:
            raise InvalidArgument("kv_transfer_params", "required")
        if len(move.kv_transfer_params) > self.limits.max_kv_transfer_params_bytes:
            raise InvalidArgument(
                "kv_transfer_params", f"larger than {self.limits.max_kv_transfer_params_bytes} bytes"
            )
        if not 0 <= move.kv_bytes <= self.limits.max_kv_bytes:
            raise InvalidArgument("kv_bytes", f"must be 0..{self.limits.max_kv_bytes}")
        lease = self.limits.retention_ttl.pick(ttl, "ttl")
        retention, changes = await self._store.move_retention(
            move, lease, self._clock.now(), request_id=request_id
        )
        if changes:
            self.stats.moves += 1
            log.info("retention.moved", node=move.node, previous_node=changes[0].previous_node)
        await self._publish(changes)
        self._wake.set()
        return retention

    async def evict_retention(self, name: str, *, node: str) -> None:
        """Remove a retention its holder `node` needs the room of (never a claimed one)."""
        self._retention_name(name)
        self._node_name(node, "node")
        changes = await self._store.evict_retention(name, node, self._clock.now())
        self.stats.evictions += len(changes)
        await self._publish(changes)

    async def list_retentions(
        self, *, parent: str, node: str, page_size: int, page_token: str
    ) -> tuple[list[Retention], str]:
        tenant, conversation = parse_tenant_or_conversation(
            parent, "parent", max_length=self.limits.max_id_length
        )
        if node:
            self._node_name(node, "node")
        scope = f"{parent}|{node}"
        size, after = self._page(page_size, page_token, scope)
        conv_name = f"tenants/{tenant}/conversations/{conversation}" if conversation else None
        retentions = await self._store.list_retentions(
            tenant=tenant, conversation=conv_name, node=node or None, after=after, limit=size
        )
        return retentions, self._next_token(scope, [r.name for r in retentions], size)

    # ---- watch -----------------------------------------------------------------------------

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

    async def _publish(self, changes: Sequence[RetentionChange]) -> None:
        if changes:
            self.stats.feed_errors += await self._feed.publish(changes)

    def _deliver(self, changes: Sequence[RetentionChange]) -> None:
        self.stats.watchers_dropped += self._watchers.publish(changes)

    async def run_feed(self) -> None:
        """What the change feed and the index feed need running (the Redis feeds' readers),
        until cancelled."""
        await asyncio.gather(self._feed.run(), self._index_feed.run())

    # ---- block index -----------------------------------------------------------------------

    async def report_block_events(
        self, node: str, incarnation: int, batches: Sequence[EventBatch]
    ) -> ApplyResult:
        self._node_name(node, "node")
        if incarnation <= 0:
            raise InvalidArgument("incarnation", "required")
        if len(batches) > self.limits.max_event_batches:
            raise InvalidArgument("batches", f"at most {self.limits.max_event_batches} batches")
        for i, batch in enumerate(batches):
            # Below 2**63: the answer's next_seq is seq + 1, in a uint64.
            if not 0 <= batch.seq <= MAX_EVENT_SEQ:
                raise InvalidArgument(f"batches[{i}].seq", f"must be 0..{MAX_EVENT_SEQ}")
            if len(batch.events) > self.limits.max_events_per_batch:
                raise InvalidArgument(
                    f"batches[{i}].events", f"at most {self.limits.max_events_per_batch} events"
                )
            for j, event in enumerate(batch.events):
                blocks = getattr(event, "block_hashes", ())
                if len(blocks) > self.limits.max_event_blocks:
                    raise InvalidArgument(
                        f"batches[{i}].events[{j}].block_hashes",
                        f"at most {self.limits.max_event_blocks} blocks",
                    )
                if isinstance(event, BlockStored) and (
                    len(event.token_ids) > self.limits.max_event_blocks * self.limits.max_block_size
                ):
                    raise InvalidArgument(f"batches[{i}].events[{j}].token_ids", "too many tokens")
        # The node must be alive and this incarnation current: events of a dead or replaced
        # agent would resurrect blocks the registry already dropped.
        known = await self._store.get_node(node)
        if known.incarnation != incarnation:
            raise FailedPrecondition(
                f"node {node} is at incarnation {known.incarnation}",
                reason=ErrorReason.NODE_INCARNATION_MISMATCH,
                metadata={"node": node, "incarnation": str(known.incarnation)},
            )
        result = await self._index_feed.report(node, incarnation, batches)
        self.stats.event_batches += result.applied_batches
        self.stats.event_gaps += result.gap_detected
        self.stats.engine_restarts += result.engine_restarted
        return result

    async def lookup_blocks(
        self, block_hashes: Sequence[int], *, model: str, role: NodeRole | None
    ) -> list[tuple[str, int]]:
        if len(block_hashes) > self.limits.max_lookup_hashes:
            raise InvalidArgument("block_hashes", f"at most {self.limits.max_lookup_hashes}")
        self._bounded(model, "model", required=False)
        if not block_hashes:
            return []
        nodes: list[str] = []
        after = ""
        while True:
            page = await self._store.list_nodes(
                role=role, model=model or None, after=after, limit=self.limits.max_page_size
            )
            nodes.extend(n.name for n in page)
            if len(page) < self.limits.max_page_size:
                break
            after = page[-1].name
        return self._index.lookup(block_hashes, nodes)

    # ---- expiry ----------------------------------------------------------------------------

    async def expire_due(self) -> ExpiryResult:
        """Apply every lapse up to now. The timer calls this; tests call it after a FakeClock step."""
        result = await self._store.expire_due(self._clock.now())
        for expired in result.nodes:
            try:
                await self._index_feed.drop(
                    expired.node.name, expired.node.incarnation + 1, self._clock.now()
                )
            except Unavailable as err:  # the expiry committed: its changes are published still
                self.stats.feed_errors += 1
                log.warning("index_feed.drop_failed", node=expired.node.name, error=err.message[:300])
            self.stats.expirations["node"] += 1
            log.info("node.expired", node=expired.node.name, retentions=len(expired.changes))
        for change in result.retentions:
            kind = "claim" if change.retention.claim is not None else "retention"
            self.stats.expirations[kind] += 1
        await self._publish(result.changes())
        return result

    async def run_expiry(self, *, max_sleep: float = 1.0) -> None:
        """The expiry timer: sleeps until the next deadline (or a new, possibly earlier one).
        A store that does not answer (Redis down) is swept again after `max_sleep`: the timer
        outlives an outage, and what fell due meanwhile expires at the first sweep after it."""
        failing = False
        while not self._closed:
            deadline = self._store.next_deadline()
            delay = max_sleep if deadline is None else min(max(deadline - self._clock.now(), 0.0), max_sleep)
            if failing:
                delay = max_sleep
            self._wake.clear()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=delay)
            try:
                await self.expire_due()
            except Unavailable as err:
                if not failing:
                    log.warning("expiry.store_unavailable", error=err.message[:300], retry_s=max_sleep)
                failing = True
                continue
            if failing:
                log.info("expiry.store_back")
            failing = False

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

    @property
    def index(self) -> BlockIndex:
        return self._index


__all__ = ["Registry", "RegistryStats"]
