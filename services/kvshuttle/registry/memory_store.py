"""In-memory RegistryStore: one process, every operation atomic because it never awaits. One
cohesive thing: the store contract (kvshuttle.registry.store) over dicts and one expiry heap.

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

import bisect
import copy
import heapq
import math
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from kvshuttle.core.errors import Aborted, FailedPrecondition, NotFound, ResourceExhausted
from kvshuttle.core.fingerprint import request_id_reused
from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.idempotency import (
    ClaimAnswer,
    IdempotencyCache,
    MoveAnswer,
    PutAnswer,
    claim_fingerprint,
    move_fingerprint,
    put_fingerprint,
)
from kvshuttle.registry.model import (
    ChangeKind,
    Claim,
    Conversation,
    ExpiryResult,
    Holder,
    Move,
    Node,
    NodeExpiry,
    PutResult,
    Retention,
    RetentionChange,
    StoreCounts,
)

_NODE, _RETENTION, _FENCE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class StoreLimits:
    max_nodes: int = 10_000
    max_retentions: int = 1_000_000
    max_retentions_per_tenant: int = 100_000
    # How long a conversation's fencing generation outlives its last retention, so a late
    # commit of an older turn is still rejected.
    fence_ttl: float = 3600.0
    # Lingering fences (their conversation holds no retention), by count and estimated bytes.
    max_lingering_fences: int = 1_000_000
    lingering_fence_max_bytes: int = 128 * 2**20
    # Request ids remembered (fingerprint and compact first answer), by age, count and bytes.
    idempotency_ttl: float = 600.0
    idempotency_max_entries: int = 100_000
    idempotency_max_bytes: int = 64 * 2**20


# Bytes one lingering fence costs beyond its name's characters: the name's string object, its
# _Fence, the dict and OrderedDict entries (measured with tracemalloc on CPython 3.11: 334 bytes
# with a 63-character name).
FENCE_OVERHEAD = 280

_PUT, _CLAIM, _MOVE = "put", "claim", "move"


@dataclass(slots=True)
class _Fence:
    generation: int
    forget_at: float


def _snapshot_node(node: Node) -> Node:
    return copy.copy(node)


def _snapshot(retention: Retention) -> Retention:
    return copy.copy(retention)


class InMemoryStore:
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

    # ---- nodes ---------------------------------------------------------------------------

    async def register_node(
        self, spec: NodeSpec, ttl: float, now: float
    ) -> tuple[Node, list[RetentionChange], bool]:
        existing = self._nodes.get(spec.name)
        if existing is None and len(self._nodes) >= self._limits.max_nodes:
            raise ResourceExhausted(
                f"at most {self._limits.max_nodes} nodes",
                reason=ErrorReason.CAPACITY_EXCEEDED,
                metadata={"limit": "max_nodes"},
            )
        changes: list[RetentionChange] = []
        engine_changed = existing is not None and existing.spec.engine_id != spec.engine_id
        if engine_changed:
            changes = self._drop_node_retentions(spec.name, ChangeKind.NODE_LOST, now)
        node = Node(
            spec=copy.deepcopy(spec),
            incarnation=self._next_incarnation,
            register_time=now,
            expire_at=now + ttl,
            load=NodeLoad(),
        )
        self._next_incarnation += 1
        if existing is not None and not engine_changed:
            node.retained_bytes = existing.retained_bytes
            node.retention_count = existing.retention_count
        self._nodes[spec.name] = node
        self._node_retentions.setdefault(spec.name, set())
        self._push(node.expire_at, _NODE, spec.name)
        return _snapshot_node(node), changes, engine_changed

    def _live_node(self, name: str, incarnation: int | None) -> Node:
        node = self._nodes.get(name)
        if node is None:
            raise NotFound(
                f"node {name} is not registered (or its lease lapsed)",
                reason=ErrorReason.NODE_NOT_FOUND,
                metadata={"node": name},
            )
        if incarnation is not None and node.incarnation != incarnation:
            raise FailedPrecondition(
                f"node {name} is at incarnation {node.incarnation}, not {incarnation}",
                reason=ErrorReason.NODE_INCARNATION_MISMATCH,
                metadata={"node": name, "incarnation": str(node.incarnation)},
            )
        return node

    async def heartbeat_node(
        self, name: str, incarnation: int, ttl: float, load: NodeLoad, now: float
    ) -> Node:
        node = self._live_node(name, incarnation)
        node.expire_at = now + ttl
        node.load = copy.copy(load)
        self._push(node.expire_at, _NODE, name)
        return _snapshot_node(node)

    async def deregister_node(self, name: str, incarnation: int | None, now: float) -> list[RetentionChange]:
        self._live_node(name, incarnation)
        return self._remove_node(name, now)

    async def get_node(self, name: str) -> Node:
        return _snapshot_node(self._live_node(name, None))

    async def list_nodes(
        self, *, role: NodeRole | None, model: str | None, after: str, limit: int
    ) -> list[Node]:
        names = sorted(n for n in self._nodes if n > after)
        out: list[Node] = []
        for name in names:
            node = self._nodes[name]
            if node.spec.role.serves(role) and (not model or node.spec.model == model):
                out.append(_snapshot_node(node))
                if len(out) >= limit:
                    break
        return out

    def _remove_node(self, name: str, now: float) -> list[RetentionChange]:
        changes = self._drop_node_retentions(name, ChangeKind.NODE_LOST, now)
        del self._nodes[name]
        self._node_retentions.pop(name, None)
        return changes

    def _drop_node_retentions(self, name: str, kind: ChangeKind, now: float) -> list[RetentionChange]:
        return [self._remove_retention(r, kind, now) for r in sorted(self._node_retentions.get(name, ()))]

    # ---- retentions ----------------------------------------------------------------------

    async def put_retention(
        self, retention: Retention, ttl: float, now: float, *, request_id: str
    ) -> tuple[PutResult, list[RetentionChange]]:
        # Scoped by the target, the request's parent: another conversation (or tenant) reusing an
        # id gets its own answer; another generation under the same id is another body.
        key = (_PUT, retention.conversation, request_id)
        fingerprint = put_fingerprint(retention) if request_id else b""
        if request_id:
            first = self._idempotency.get(key, now)
            if first is not None:
                if not isinstance(first, PutAnswer) or first.fingerprint != fingerprint:
                    raise request_id_reused()
                return self._first_put(retention, first), []
        node = self._holding_node(retention)
        conversation = retention.conversation
        fence = self._fences.get(conversation)
        if fence is not None and retention.generation <= fence.generation:
            raise Aborted(
                f"generation {retention.generation} is not newer than {fence.generation} for {conversation}",
                reason=ErrorReason.FENCING_GENERATION_STALE,
                metadata={"fence_generation": str(fence.generation)},
            )
        expire_at = now + ttl
        if retention.pin_expire_at is not None:
            if retention.pin_expire_at <= now:
                raise FailedPrecondition(
                    "pin_expire_time has already passed: the blocks are gone", reason=ErrorReason.PIN_EXPIRED
                )
            expire_at = min(expire_at, retention.pin_expire_at)
        old_name = self._by_conversation.get(conversation)
        tenant = retention.tenant
        if old_name is None:
            if len(self._retentions) >= self._limits.max_retentions:
                raise ResourceExhausted(
                    f"at most {self._limits.max_retentions} retentions",
                    reason=ErrorReason.CAPACITY_EXCEEDED,
                    metadata={"limit": "max_retentions"},
                )
            if len(self._tenant_names.get(tenant, ())) >= self._limits.max_retentions_per_tenant:
                raise ResourceExhausted(
                    f"tenant {tenant} holds {self._limits.max_retentions_per_tenant} retentions",
                    reason=ErrorReason.CAPACITY_EXCEEDED,
                    metadata={"limit": "max_retentions_per_tenant"},
                )
        # Everything is checked: from here on nothing raises.
        changes: list[RetentionChange] = []
        if old_name is not None:
            changes.append(self._remove_retention(old_name, ChangeKind.REPLACED, now))
        record = _snapshot(retention)
        record.create_time = now
        record.expire_at = expire_at
        record.claim = None
        self._retentions[record.name] = record
        self._by_conversation[conversation] = record.name
        self._node_retentions[record.node].add(record.name)
        node.retained_bytes += record.kv_bytes
        node.retention_count += 1
        bisect.insort(self._tenant_names.setdefault(tenant, []), record.name)
        # The fence lives as long as a retention does; its own timer starts when the last goes.
        self._fences[conversation] = _Fence(record.generation, math.inf)
        self._stop_lingering(conversation)
        self._push(expire_at, _RETENTION, record.name)
        result = PutResult(_snapshot(record), old_name or "")
        changes.append(RetentionChange(ChangeKind.PUT, result.retention, now))
        if request_id:
            answer = PutAnswer(fingerprint, record.name, now, expire_at, record.pin_expire_at, old_name or "")
            self._idempotency.put(key, answer, now)
        return result, changes

    def _holding_node(self, retention: Retention) -> Node:
        """The live node that holds `retention`'s blocks, and only if the retention is its own:
        its model and block size, and params that name it as registered."""
        node = self._nodes.get(retention.node)
        if node is None:
            raise FailedPrecondition(
                f"node {retention.node} is not registered",
                reason=ErrorReason.NODE_NOT_FOUND,
                metadata={"node": retention.node},
            )
        if node.spec.model != retention.model or node.spec.block_size != retention.block_size:
            raise FailedPrecondition(
                f"node {retention.node} serves model {node.spec.model!r} with block size "
                f"{node.spec.block_size}, not {retention.model!r} / {retention.block_size}",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"node": retention.node},
            )
        # KV is read only from nodes the registry knows: the params must send readers to this
        # node's engine and side channel as registered, never to a host of the caller's choosing.
        mismatch = Holder.mismatch(retention.holder, node.spec)
        if mismatch is not None:
            raise FailedPrecondition(
                f"retention.kv_transfer_params do not name node {retention.node} as registered "
                f"({mismatch.rsplit('.', 1)[-1]} differs)",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"node": retention.node, "field": mismatch},
            )
        return node

    @staticmethod
    def _first_put(retention: Retention, first: PutAnswer) -> PutResult:
        """The first response to a repeated put, rebuilt from the repeat (same fingerprint: the
        same retention) and what the first one set."""
        record = _snapshot(retention)
        record.name = first.name
        record.create_time = first.create_time
        record.expire_at = first.expire_at
        record.pin_expire_at = first.pin_expire_at
        record.claim = None
        return PutResult(record, first.replaced)

    def _retention(self, name: str) -> Retention:
        record = self._retentions.get(name)
        if record is None:
            raise NotFound(
                f"retention {name} not found",
                reason=ErrorReason.RETENTION_NOT_FOUND,
                metadata={"retention": name},
            )
        return record

    async def get_retention(self, name: str) -> Retention:
        return _snapshot(self._retention(name))

    async def get_conversation(self, name: str) -> Conversation:
        fence = self._fences.get(name)
        if fence is None:
            raise NotFound(
                f"conversation {name} has no retention and no fencing generation",
                reason=ErrorReason.CONVERSATION_NOT_FOUND,
                metadata={"conversation": name},
            )
        current = self._by_conversation.get(name)
        return Conversation(name, fence.generation, _snapshot(self._retentions[current]) if current else None)

    def _check_claimable(self, record: Retention, now: float) -> None:
        if record.claim is not None:
            raise Aborted(
                f"retention {record.name} is already claimed",
                reason=ErrorReason.RETENTION_ALREADY_CLAIMED,
                metadata={"retention": record.name},
            )
        if record.expire_at <= now:
            raise FailedPrecondition(
                f"retention {record.name} expired",
                reason=ErrorReason.RETENTION_EXPIRED,
                metadata={"retention": record.name},
            )

    async def renew_retention(
        self, name: str, ttl: float, max_ttl: float, now: float
    ) -> tuple[Retention, list[RetentionChange]]:
        record = self._retention(name)
        if record.claim is not None:
            raise FailedPrecondition(
                f"retention {name} is claimed; a claim is never renewed",
                reason=ErrorReason.RETENTION_CLAIMED,
                metadata={"retention": name},
            )
        self._check_claimable(record, now)
        expire_at = now + min(ttl, max_ttl)
        if record.pin_expire_at is not None:
            expire_at = min(expire_at, record.pin_expire_at)
        if expire_at > record.expire_at:
            record.expire_at = expire_at
            self._push(expire_at, _RETENTION, name)
        snapshot = _snapshot(record)
        return snapshot, [RetentionChange(ChangeKind.RENEWED, snapshot, now)]

    async def claim_retention(
        self, name: str, holder: str, claim_ttl: float, now: float, *, request_id: str
    ) -> tuple[Retention, list[RetentionChange]]:
        key = (_CLAIM, name, request_id)
        fingerprint = claim_fingerprint(holder) if request_id else b""
        if request_id:
            first = self._idempotency.get(key, now)
            if first is not None:
                if not isinstance(first, ClaimAnswer) or first.fingerprint != fingerprint:
                    raise request_id_reused()
                return self._first_claim(name, request_id, first), []
        record = self._retention(name)
        self._check_claimable(record, now)
        record.claim = Claim(uuid.uuid4().hex, holder, now, now + claim_ttl, lease_expire_at=record.expire_at)
        record.expire_at = record.claim.expire_at
        self._claimed += 1
        self._push(record.expire_at, _RETENTION, name)
        snapshot = _snapshot(record)
        if request_id:
            self._idempotency.put(key, ClaimAnswer(fingerprint, record.claim.claim_id), now)
        return snapshot, [RetentionChange(ChangeKind.CLAIMED, snapshot, now)]

    def _first_claim(self, name: str, request_id: str, first: ClaimAnswer) -> Retention:
        """The retention a repeated claim took, as it is now: a claim is never renewed or given
        back, so while the retention lives it is the first answer. Once it is gone (released,
        lapsed), the claim has ended: RETENTION_NOT_FOUND."""
        record = self._retentions.get(name)
        if record is None or record.claim is None or record.claim.claim_id != first.claim_id:
            raise NotFound(
                f"retention {name} is gone: the claim request {request_id} made has ended",
                reason=ErrorReason.RETENTION_NOT_FOUND,
                metadata={"retention": name},
            )
        return _snapshot(record)

    async def release_retention(
        self, name: str, claim_id: str, force: bool, now: float, *, keep: bool = False
    ) -> list[RetentionChange]:
        record = self._retention(name)
        if keep:
            return [self._unclaim(record, claim_id, now)]
        if record.claim is not None and not force and claim_id != record.claim.claim_id:
            raise FailedPrecondition(
                f"retention {name} is claimed by {record.claim.holder}",
                reason=ErrorReason.CLAIM_MISMATCH,
                metadata={"retention": name},
            )
        return [self._remove_retention(name, ChangeKind.RELEASED, now)]

    def _unclaim(self, record: Retention, claim_id: str, now: float) -> RetentionChange:
        """The claim given back unread: the retention's own lease again (EXPIRED when past)."""
        claim = record.claim
        if claim is None or claim.claim_id != claim_id:
            held = "is not claimed" if claim is None else f"is claimed by {claim.holder}"
            raise FailedPrecondition(
                f"retention {record.name} {held}: only its claim's holder gives the claim back",
                reason=ErrorReason.CLAIM_MISMATCH,
                metadata={"retention": record.name, "field": "claim_id"},
            )
        if claim.lease_expire_at <= now:
            return self._remove_retention(record.name, ChangeKind.EXPIRED, now)
        record.claim = None
        self._claimed -= 1
        record.expire_at = claim.lease_expire_at
        self._push(record.expire_at, _RETENTION, record.name)
        return RetentionChange(ChangeKind.UNCLAIMED, _snapshot(record), now)

    async def move_retention(
        self, move: Move, ttl: float, now: float, *, request_id: str
    ) -> tuple[Retention, list[RetentionChange]]:
        name = move.name
        key = (_MOVE, name, request_id)
        fingerprint = move_fingerprint(move) if request_id else b""
        if request_id:
            first = self._idempotency.get(key, now)
            if first is not None:
                if not isinstance(first, MoveAnswer) or first.fingerprint != fingerprint:
                    raise request_id_reused()
                return self._first_move(move, request_id, first), []
        record = self._retention(name)
        if record.claim is None or record.claim.claim_id != move.claim_id:
            held = "is not claimed" if record.claim is None else f"is claimed by {record.claim.holder}"
            raise FailedPrecondition(
                f"retention {name} {held}: only its claim's holder moves it",
                reason=ErrorReason.CLAIM_MISMATCH,
                metadata={"retention": name, "field": "claim_id"},
            )
        if record.expire_at <= now:
            raise FailedPrecondition(
                f"retention {name}'s claim lapsed",
                reason=ErrorReason.RETENTION_EXPIRED,
                metadata={"retention": name},
            )
        target = self._nodes.get(move.node)
        if target is None:
            raise NotFound(
                f"node {move.node} is not registered (or its lease lapsed)",
                reason=ErrorReason.NODE_NOT_FOUND,
                metadata={"node": move.node},
            )
        if target.spec.model != record.model or target.spec.block_size != record.block_size:
            raise FailedPrecondition(
                f"node {move.node} serves model {target.spec.model!r} with block size "
                f"{target.spec.block_size}, not {record.model!r} / {record.block_size}",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"node": move.node, "field": "node"},
            )
        mismatch = Holder.mismatch(move.holder, target.spec, "kv_transfer_params")
        if mismatch is not None:
            raise FailedPrecondition(
                f"kv_transfer_params do not name node {move.node} as registered "
                f"({mismatch.rsplit('.', 1)[-1]} differs)",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"node": move.node, "field": mismatch},
            )
        # Everything is checked: from here on nothing raises.
        previous = record.node
        source = self._nodes.get(previous)
        if source is not None:
            source.retained_bytes -= record.kv_bytes
            source.retention_count -= 1
        self._node_retentions[previous].discard(name)
        move.apply_to(record, now + ttl)
        self._claimed -= 1
        self._node_retentions[move.node].add(name)
        target.retained_bytes += record.kv_bytes
        target.retention_count += 1
        self._push(record.expire_at, _RETENTION, name)
        if request_id:
            self._idempotency.put(key, MoveAnswer(fingerprint, record.expire_at), now)
        snapshot = _snapshot(record)
        return snapshot, [RetentionChange(ChangeKind.MOVED, snapshot, now, previous_node=previous)]

    def _first_move(self, move: Move, request_id: str, first: MoveAnswer) -> Retention:
        """The first response to a repeated move, rebuilt from the live retention (its name,
        generation, chain and times never change) and the repeat (same fingerprint: the same
        move). Once the retention is gone, RETENTION_NOT_FOUND."""
        record = self._retentions.get(move.name)
        if record is None:
            raise NotFound(
                f"retention {move.name} is gone: the move request {request_id} made has ended",
                reason=ErrorReason.RETENTION_NOT_FOUND,
                metadata={"retention": move.name},
            )
        out = _snapshot(record)
        move.apply_to(out, first.expire_at)
        return out

    async def evict_retention(self, name: str, node: str, now: float) -> list[RetentionChange]:
        record = self._retention(name)
        if record.node != node:
            raise FailedPrecondition(
                f"retention {name} is held by {record.node}, not {node}",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"retention": name, "node": node, "field": "node"},
            )
        if record.claim is not None:
            raise FailedPrecondition(
                f"retention {name} is claimed by {record.claim.holder}: a reader may be reading it",
                reason=ErrorReason.RETENTION_ALREADY_CLAIMED,
                metadata={"retention": name},
            )
        return [self._remove_retention(name, ChangeKind.EVICTED, now)]

    async def list_retentions(
        self, *, tenant: str, conversation: str | None, node: str | None, after: str, limit: int
    ) -> list[Retention]:
        names = self._tenant_names.get(tenant, [])
        prefix = f"{conversation}/" if conversation else ""
        start = bisect.bisect_right(names, max(after, prefix))
        out: list[Retention] = []
        for name in names[start:]:
            if prefix and not name.startswith(prefix):
                break
            record = self._retentions[name]
            if node and record.node != node:
                continue
            out.append(_snapshot(record))
            if len(out) >= limit:
                break
        return out

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

    # ---- fences ----------------------------------------------------------------------------

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

    # ---- expiry ----------------------------------------------------------------------------

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
