"""In-memory RegistryStore: one process, every operation atomic because it never awaits. One
cohesive thing: the store contract (kvshuttle.registry.store.contract) over dicts and one expiry heap, in
parts as the Redis store is: the records and shared steps (kvshuttle.registry.store.memory.state), nodes
(memory_nodes), retentions (memory_retentions), claims (memory_claims), and here the expiry sweep
and the counts.

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

from kvshuttle.registry.model import ChangeKind, ExpiryResult, NodeExpiry, RetentionChange, StoreCounts
from kvshuttle.registry.store.memory.claims import MemoryClaims
from kvshuttle.registry.store.memory.state import _NODE, _RETENTION, _snapshot_node

__all__ = ["InMemoryStore"]


class InMemoryStore(MemoryClaims):
    """See the module docstring: the parts composed, with the expiry sweep and the counts."""

    async def expire_due(self, now: float) -> ExpiryResult:
        nodes: list[NodeExpiry] = []
        retentions: list[RetentionChange] = []
        while self._heap and self._heap[0][0] <= now:
            _, kind, name = heapq.heappop(self._heap)
            if kind == _NODE:
                node = self._nodes.get(name)
                if node is not None and node.expire_at <= now:
                    snapshot = _snapshot_node(node)
                    nodes.append(NodeExpiry(snapshot, tuple(self._remove_node(name, now))))
            elif kind == _RETENTION:
                record = self._retentions.get(name)
                if record is not None and record.expire_at <= now:
                    retentions.append(self._remove_retention(name, ChangeKind.EXPIRED, now))
            else:
                fence = self._fences.get(name)
                if fence is not None and fence.forget_at <= now:
                    del self._fences[name]
                    self._stop_lingering(name)
        self._idempotency.expire(now)
        return ExpiryResult(tuple(nodes), tuple(retentions))

    def next_deadline(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def counts(self) -> StoreCounts:
        return StoreCounts(
            nodes=len(self._nodes),
            retentions=len(self._retentions),
            claimed=self._claimed,
            fenced_conversations=len(self._fences),
            lingering_fences=len(self._lingering),
            lingering_fence_bytes=self._lingering_bytes,
            fences_forgotten_early=self._fences_forgotten_early,
            remembered_requests=len(self._idempotency),
            remembered_request_bytes=self._idempotency.nbytes,
        )
