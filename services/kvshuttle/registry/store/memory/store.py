"""In-memory RegistryStore: one process, every operation atomic because it never awaits. One
cohesive thing: the store contract (kvshuttle.registry.store.contract) over dicts and one expiry heap, made
of parts as the Redis store is: one MemoryState (kvshuttle.registry.store.memory.state: the records and
the steps the parts share) held by each part, nodes (.nodes), retentions (.retentions) and claims
(.claims), to which this class hands each operation; and here the expiry sweep and the counts.

Expiry runs off one min-heap of (deadline, kind, name) entries. Renewals push a new entry and
leave the old one in place; a popped entry whose record has moved on is skipped, and the heap
is rebuilt when stale entries outnumber live ones.

Memory is bounded by bytes as well as counts: retentions by `max_retentions` (and the request
bounds on each); request ids by the idempotency cache's entries, bytes and age
(kvshuttle.registry.idempotency); fences of conversations without a retention ("lingering",
kept `fence_ttl` to refuse a late commit of an older turn) by count and bytes, the oldest
forgotten first when either bound is reached (a stale commit it would have refused is then
stored, which the router's verification still never serves as wrong KV).
"""

from __future__ import annotations

import heapq
from array import array

from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec
from kvshuttle.registry.model import (
    ChangeKind,
    Conversation,
    ExpiryResult,
    Found,
    Move,
    Node,
    NodeExpiry,
    PutResult,
    Retention,
    RetentionChange,
    StoreCounts,
)
from kvshuttle.registry.store.contract import StoreLimits
from kvshuttle.registry.store.memory.claims import MemoryClaims
from kvshuttle.registry.store.memory.nodes import MemoryNodes
from kvshuttle.registry.store.memory.retentions import MemoryRetentions
from kvshuttle.registry.store.memory.state import NODE, RETENTION, MemoryState, prune_shared, snapshot_node

__all__ = ["InMemoryStore"]


class InMemoryStore:
    """See the module docstring: the parts over one state, with the expiry sweep and the counts."""

    def __init__(self, limits: StoreLimits | None = None, *, incarnation_base: int = 0) -> None:
        self._state = MemoryState(limits, incarnation_base=incarnation_base)
        self._nodes = MemoryNodes(self._state)
        self._retentions = MemoryRetentions(self._state)
        self._claims = MemoryClaims(self._state)

    # ---- nodes -----------------------------------------------------------------------------

    async def register_node(
        self, spec: NodeSpec, ttl: float, now: float
    ) -> tuple[Node, list[RetentionChange], bool]:
        return await self._nodes.register_node(spec, ttl, now)

    async def heartbeat_node(
        self, name: str, incarnation: int, ttl: float, load: NodeLoad, now: float
    ) -> Node:
        return await self._nodes.heartbeat_node(name, incarnation, ttl, load, now)

    async def deregister_node(self, name: str, incarnation: int | None, now: float) -> list[RetentionChange]:
        return await self._nodes.deregister_node(name, incarnation, now)

    async def get_node(self, name: str) -> Node:
        return await self._nodes.get_node(name)

    async def list_nodes(
        self, *, role: NodeRole | None, model: str | None, after: str, limit: int
    ) -> list[Node]:
        return await self._nodes.list_nodes(role=role, model=model, after=after, limit=limit)

    # ---- retentions ------------------------------------------------------------------------

    async def put_retention(
        self, retention: Retention, ttl: float, now: float, *, request_id: str
    ) -> tuple[PutResult, list[RetentionChange]]:
        return await self._retentions.put_retention(retention, ttl, now, request_id=request_id)

    async def get_retention(self, name: str) -> Retention:
        return await self._retentions.get_retention(name)

    async def get_conversation(self, name: str) -> Conversation:
        return await self._retentions.get_conversation(name)

    async def renew_retention(
        self, name: str, ttl: float, max_ttl: float, now: float
    ) -> tuple[Retention, list[RetentionChange]]:
        return await self._retentions.renew_retention(name, ttl, max_ttl, now)

    async def list_retentions(
        self, *, tenant: str, conversation: str | None, node: str | None, after: str, limit: int
    ) -> list[Retention]:
        return await self._retentions.list_retentions(
            tenant=tenant, conversation=conversation, node=node, after=after, limit=limit
        )

    async def find_retention(
        self,
        *,
        tenant: str,
        model: str,
        block_size: int,
        chain: array[int] | None,
        transcript_key: bytes | None,
        now: float,
    ) -> Found:
        return await self._retentions.find_retention(
            tenant=tenant,
            model=model,
            block_size=block_size,
            chain=chain,
            transcript_key=transcript_key,
            now=now,
        )

    # ---- claims ----------------------------------------------------------------------------

    async def claim_retention(
        self, name: str, holder: str, claim_ttl: float, now: float, *, request_id: str, shared: bool = False
    ) -> tuple[Retention, list[RetentionChange]]:
        return await self._claims.claim_retention(
            name, holder, claim_ttl, now, request_id=request_id, shared=shared
        )

    async def release_retention(
        self, name: str, claim_id: str, force: bool, now: float, *, keep: bool = False
    ) -> list[RetentionChange]:
        return await self._claims.release_retention(name, claim_id, force, now, keep=keep)

    async def move_retention(
        self, move: Move, ttl: float, now: float, *, request_id: str
    ) -> tuple[Retention, list[RetentionChange]]:
        return await self._claims.move_retention(move, ttl, now, request_id=request_id)

    async def evict_retention(self, name: str, node: str, now: float) -> list[RetentionChange]:
        return await self._claims.evict_retention(name, node, now)

    # ---- expiry and counts -----------------------------------------------------------------

    async def expire_due(self, now: float) -> ExpiryResult:
        state = self._state
        nodes: list[NodeExpiry] = []
        retentions: list[RetentionChange] = []
        while state.heap and state.heap[0][0] <= now:
            _, kind, name = heapq.heappop(state.heap)
            if kind == NODE:
                node = state.nodes.get(name)
                if node is not None and node.expire_at <= now:
                    snapshot = snapshot_node(node)
                    nodes.append(NodeExpiry(snapshot, tuple(state.remove_node(name, now))))
            elif kind == RETENTION:
                record = state.retentions.get(name)
                if record is None or record.expire_at > now:
                    continue
                if shared := prune_shared(record, now):  # readers hold it past its lease
                    state.push(max(c.expire_at for c in shared), RETENTION, name)
                else:
                    retentions.append(state.remove_retention(name, ChangeKind.EXPIRED, now))
            else:
                fence = state.fences.get(name)
                if fence is not None and fence.forget_at <= now:
                    del state.fences[name]
                    state.stop_lingering(name)
        state.idempotency.expire(now)
        return ExpiryResult(tuple(nodes), tuple(retentions))

    def next_deadline(self) -> float | None:
        heap = self._state.heap
        return heap[0][0] if heap else None

    def counts(self) -> StoreCounts:
        state = self._state
        return StoreCounts(
            nodes=len(state.nodes),
            retentions=len(state.retentions),
            claimed=state.claimed,
            fenced_conversations=len(state.fences),
            lingering_fences=len(state.lingering),
            lingering_fence_bytes=state.lingering_bytes,
            fences_forgotten_early=state.fences_forgotten_early,
            remembered_requests=len(state.idempotency),
            remembered_request_bytes=state.idempotency.nbytes,
            transcripts=state.transcripts,
            transcript_bytes=state.transcript_total,
        )
