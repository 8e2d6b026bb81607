"""The in-memory store's records and indexes (kvshuttle.registry.store.memory.store), one object every
part of the store holds, and the steps the parts share: pushing an expiry heap entry (the heap rebuilt
when stale entries outnumber live ones), reading a retention, removing a retention or a node (with its
retentions, NODE_LOST), and a fence lingering after its conversation's last retention, bounded by
count and bytes."""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import operator
from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeVar

from kvshuttle.registry.idempotency import IdempotencyCache
from kvshuttle.registry.model import ChangeKind, Claim, Node, Retention, RetentionChange, Transcript
from kvshuttle.registry.store.contract import FENCE_OVERHEAD, StoreLimits
from kvshuttle.registry.store.errors import already_claimed, retention_expired, retention_not_found

_K = TypeVar("_K")

# The kinds of the expiry heap's entries.
NODE, RETENTION, FENCE = 0, 1, 2


@dataclass(slots=True)
class Fence:
    generation: int
    forget_at: float


# Shallow copies, field by field through the constructor: copy.copy of a slots dataclass goes
# through __reduce_ex__ and costs 5x more, and every read of a record makes one.
_NODE_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(Node)))
_RETENTION_FIELDS = operator.attrgetter(*(f.name for f in dataclasses.fields(Retention)))


def snapshot_node(node: Node) -> Node:
    return Node(*_NODE_FIELDS(node))


def snapshot_retention(retention: Retention) -> Retention:
    return Retention(*_RETENTION_FIELDS(retention))


def prune_shared(record: Retention, now: float) -> tuple[Claim, ...]:
    """`record`'s live shared claims, the lapsed ones dropped."""
    if record.shared:
        live = record.live_shared(now)
        if len(live) != len(record.shared):
            record.shared = live
    return record.shared


class MemoryState:
    """Every record, index and counter the store's parts share; each method here is a step of an
    operation, never an operation itself."""

    def __init__(self, limits: StoreLimits | None = None, *, incarnation_base: int = 0) -> None:
        self.limits = limits or StoreLimits()
        self.nodes: dict[str, Node] = {}
        self.node_retentions: dict[str, set[str]] = {}
        self.retentions: dict[str, Retention] = {}
        self.by_conversation: dict[str, str] = {}
        self.fences: dict[str, Fence] = {}
        # Conversations whose fence outlives their last retention, oldest first, and their bytes.
        self.lingering: OrderedDict[str, int] = OrderedDict()
        self.lingering_bytes = 0
        self.fences_forgotten_early = 0
        # Sorted retention names per tenant, for stable paging.
        self.tenant_names: dict[str, list[str]] = {}
        self.heap: list[tuple[float, int, str]] = []
        self.idempotency = IdempotencyCache(
            self.limits.idempotency_ttl,
            self.limits.idempotency_max_entries,
            self.limits.idempotency_max_bytes,
        )
        # Incarnations grow across registry restarts too (callers seed the base from the clock).
        self.next_incarnation = incarnation_base + 1
        self.claimed = 0
        # What find_retention looks up, per tenant: (model, block size, the chain's last hash or
        # its prompt's) and (model, transcript key) -> the retention name (the latest put wins a
        # shared key).
        self.chain_ends: dict[str, dict[tuple[str, int, int], str]] = {}
        self.transcript_keys: dict[str, dict[tuple[str, bytes], str]] = {}
        # Transcript bytes per tenant and in all, and how many transcripts are kept.
        self.transcript_bytes: dict[str, int] = {}
        self.transcript_total = 0
        self.transcripts = 0

    def retention(self, name: str) -> Retention:
        """The live record `name` (RETENTION_NOT_FOUND when there is none)."""
        record = self.retentions.get(name)
        if record is None:
            raise retention_not_found(name)
        return record

    @staticmethod
    def check_claimable(record: Retention, now: float) -> None:
        if record.claim is not None or prune_shared(record, now):
            raise already_claimed(record.name)
        if record.expire_at <= now:
            raise retention_expired(record.name)

    def remove_node(self, name: str, now: float) -> list[RetentionChange]:
        changes = self.drop_node_retentions(name, ChangeKind.NODE_LOST, now)
        del self.nodes[name]
        self.node_retentions.pop(name, None)
        return changes

    def drop_node_retentions(self, name: str, kind: ChangeKind, now: float) -> list[RetentionChange]:
        return [self.remove_retention(r, kind, now) for r in sorted(self.node_retentions.get(name, ()))]

    def transcript_fits(self, tenant: str, transcript: Transcript) -> bool:
        """Whether the tenant's and the store's transcript bytes have room for `transcript`."""
        size = transcript.nbytes
        return (
            self.transcript_bytes.get(tenant, 0) + size <= self.limits.transcript_max_bytes_per_tenant
            and self.transcript_total + size <= self.limits.transcript_max_bytes
        )

    def index(self, record: Retention) -> None:
        """Make the live `record` findable by its chain's end and its transcript's key."""
        tenant = record.tenant
        for k in record.lookup_blocks():
            key = (record.model, record.block_size, record.block_hashes[k - 1])
            self.chain_ends.setdefault(tenant, {})[key] = record.name
        if record.transcript is not None:
            self.transcript_keys.setdefault(tenant, {})[(record.model, record.transcript.lookup_key)] = (
                record.name
            )
            size = record.transcript.nbytes
            self.transcript_bytes[tenant] = self.transcript_bytes.get(tenant, 0) + size
            self.transcript_total += size
            self.transcripts += 1

    def unindex(self, record: Retention) -> None:
        tenant = record.tenant
        for k in record.lookup_blocks():
            key = (record.model, record.block_size, record.block_hashes[k - 1])
            _drop(self.chain_ends, tenant, key, record.name)
        if record.transcript is not None:
            _drop(self.transcript_keys, tenant, (record.model, record.transcript.lookup_key), record.name)
            size = record.transcript.nbytes
            left = self.transcript_bytes[tenant] - size
            if left:
                self.transcript_bytes[tenant] = left
            else:
                del self.transcript_bytes[tenant]
            self.transcript_total -= size
            self.transcripts -= 1

    def remove_retention(self, name: str, kind: ChangeKind, now: float) -> RetentionChange:
        record = self.retentions.pop(name)
        self.unindex(record)
        conversation = record.conversation
        if self.by_conversation.get(conversation) == name:
            del self.by_conversation[conversation]
        self.node_retentions[record.node].discard(name)
        node = self.nodes.get(record.node)
        if node is not None:
            node.retained_bytes -= record.kv_bytes
            node.retention_count -= 1
        fence = self.fences.get(conversation)
        if fence is not None:
            fence.forget_at = now + self.limits.fence_ttl
            self.push(fence.forget_at, FENCE, conversation)
            self.linger(conversation)
        names = self.tenant_names[record.tenant]
        del names[bisect.bisect_left(names, name)]
        if not names:
            del self.tenant_names[record.tenant]
        if record.claim is not None:
            self.claimed -= 1
        return RetentionChange(kind, record, now)

    def linger(self, conversation: str) -> None:
        """The conversation's fence outlives its last retention: counted against the lingering
        bounds, and the oldest lingering fences forgotten while either is exceeded."""
        if conversation in self.lingering:
            self.lingering.move_to_end(conversation)
        else:
            size = FENCE_OVERHEAD + len(conversation)
            self.lingering[conversation] = size
            self.lingering_bytes += size
        limits = self.limits
        while self.lingering and (
            len(self.lingering) > limits.max_lingering_fences
            or self.lingering_bytes > limits.lingering_fence_max_bytes
        ):
            oldest, size = self.lingering.popitem(last=False)
            self.lingering_bytes -= size
            del self.fences[oldest]
            self.fences_forgotten_early += 1

    def stop_lingering(self, conversation: str) -> None:
        size = self.lingering.pop(conversation, None)
        if size is not None:
            self.lingering_bytes -= size

    def push(self, deadline: float, kind: int, name: str) -> None:
        heapq.heappush(self.heap, (deadline, kind, name))
        live = len(self.nodes) + len(self.retentions) + len(self.fences)
        if len(self.heap) > 4 * live + 1024:
            self.rebuild_heap()

    def rebuild_heap(self) -> None:
        heap = [(n.expire_at, NODE, name) for name, n in self.nodes.items()]
        heap += [(r.expire_at, RETENTION, name) for name, r in self.retentions.items()]
        heap += [(f.forget_at, FENCE, name) for name, f in self.fences.items() if f.forget_at != math.inf]
        heapq.heapify(heap)
        self.heap = heap


def _drop(index: dict[str, dict[_K, str]], tenant: str, key: _K, name: str) -> None:
    """Remove `key` from the tenant's `index` if it still names `name` (a later put may own it)."""
    entries = index.get(tenant)
    if entries is not None and entries.get(key) == name:
        del entries[key]
        if not entries:
            del index[tenant]
