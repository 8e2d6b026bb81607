"""The in-memory store's records and indexes (kvshuttle.registry.store.memory.store), and the steps
every part shares: pushing an expiry heap entry (the heap rebuilt when stale entries outnumber
live ones), removing a retention, and a fence lingering after its conversation's last retention,
bounded by count and bytes."""

from __future__ import annotations

import bisect
import copy
import heapq
import math
from collections import OrderedDict
from dataclasses import dataclass

from kvshuttle.registry.idempotency import IdempotencyCache
from kvshuttle.registry.model import ChangeKind, Node, Retention, RetentionChange
from kvshuttle.registry.store.contract import FENCE_OVERHEAD, StoreLimits

# The kinds of the expiry heap's entries.
_NODE, _RETENTION, _FENCE = 0, 1, 2


@dataclass(slots=True)
class _Fence:
    generation: int
    forget_at: float


def _snapshot_node(node: Node) -> Node:
    return copy.copy(node)


def _snapshot(retention: Retention) -> Retention:
    return copy.copy(retention)


class MemoryState:
    """Every record, index and counter the store's parts share; each method here is a step of an
    operation, never an operation itself."""

    def __init__(self, limits: StoreLimits | None = None, *, incarnation_base: int = 0) -> None:
        self._limits = limits or StoreLimits()
        self._nodes: dict[str, Node] = {}
        self._node_retentions: dict[str, set[str]] = {}
        self._retentions: dict[str, Retention] = {}
        self._by_conversation: dict[str, str] = {}
        self._fences: dict[str, _Fence] = {}
        # Conversations whose fence outlives their last retention, oldest first, and their bytes.
        self._lingering: OrderedDict[str, int] = OrderedDict()
        self._lingering_bytes = 0
        self._fences_forgotten_early = 0
        # Sorted retention names per tenant, for stable paging.
        self._tenant_names: dict[str, list[str]] = {}
        self._heap: list[tuple[float, int, str]] = []
        self._idempotency = IdempotencyCache(
            self._limits.idempotency_ttl,
            self._limits.idempotency_max_entries,
            self._limits.idempotency_max_bytes,
        )
        # Incarnations grow across registry restarts too (callers seed the base from the clock).
        self._next_incarnation = incarnation_base + 1
        self._claimed = 0

    def _remove_retention(self, name: str, kind: ChangeKind, now: float) -> RetentionChange:
        record = self._retentions.pop(name)
        conversation = record.conversation
        if self._by_conversation.get(conversation) == name:
            del self._by_conversation[conversation]
        self._node_retentions[record.node].discard(name)
        node = self._nodes.get(record.node)
        if node is not None:
            node.retained_bytes -= record.kv_bytes
            node.retention_count -= 1
        fence = self._fences.get(conversation)
        if fence is not None:
            fence.forget_at = now + self._limits.fence_ttl
            self._push(fence.forget_at, _FENCE, conversation)
            self._linger(conversation)
        names = self._tenant_names[record.tenant]
        del names[bisect.bisect_left(names, name)]
        if not names:
            del self._tenant_names[record.tenant]
        if record.claim is not None:
            self._claimed -= 1
        return RetentionChange(kind, record, now)

    def _linger(self, conversation: str) -> None:
        """The conversation's fence outlives its last retention: counted against the lingering
        bounds, and the oldest lingering fences forgotten while either is exceeded."""
        if conversation in self._lingering:
            self._lingering.move_to_end(conversation)
        else:
            size = FENCE_OVERHEAD + len(conversation)
            self._lingering[conversation] = size
            self._lingering_bytes += size
        limits = self._limits
        while self._lingering and (
            len(self._lingering) > limits.max_lingering_fences
            or self._lingering_bytes > limits.lingering_fence_max_bytes
        ):
            oldest, size = self._lingering.popitem(last=False)
            self._lingering_bytes -= size
            del self._fences[oldest]
            self._fences_forgotten_early += 1

    def _stop_lingering(self, conversation: str) -> None:
        size = self._lingering.pop(conversation, None)
        if size is not None:
            self._lingering_bytes -= size

    def _push(self, deadline: float, kind: int, name: str) -> None:
        heapq.heappush(self._heap, (deadline, kind, name))
        live = len(self._nodes) + len(self._retentions) + len(self._fences)
        if len(self._heap) > 4 * live + 1024:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        heap = [(n.expire_at, _NODE, name) for name, n in self._nodes.items()]
        heap += [(r.expire_at, _RETENTION, name) for name, r in self._retentions.items()]
        heap += [(f.forget_at, _FENCE, name) for name, f in self._fences.items() if f.forget_at != math.inf]
        heapq.heapify(heap)
        self._heap = heap
