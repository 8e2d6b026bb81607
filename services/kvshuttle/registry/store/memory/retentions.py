"""The in-memory store's retention operations (kvshuttle.registry.store.memory.store): put-and-replace
under the conversation's fence, read, renew, list."""

from __future__ import annotations

import bisect
import math
from array import array

from kvshuttle.core.errors import FailedPrecondition
from kvshuttle.core.fingerprint import request_id_reused
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.idempotency import PutAnswer, put_fingerprint
from kvshuttle.registry.model import (
    ChangeKind,
    Conversation,
    Found,
    Holder,
    Node,
    PutResult,
    Retention,
    RetentionChange,
)
from kvshuttle.registry.store.errors import (
    conversation_not_found,
    generation_stale,
    node_not_registered,
    pin_expired,
    retention_claimed,
    retention_expired,
    retention_not_found,
    too_many,
)
from kvshuttle.registry.store.memory.state import RETENTION, Fence, MemoryState, snapshot_retention

_PUT = "put"


class MemoryRetentions:
    """Retentions: put (with its remembered first answer), read, renew, list."""

    def __init__(self, state: MemoryState) -> None:
        self._state = state

    async def put_retention(
        self, retention: Retention, ttl: float, now: float, *, request_id: str
    ) -> tuple[PutResult, list[RetentionChange]]:
        # Scoped by the target, the request's parent: another conversation (or tenant) reusing an
        # id gets its own answer; another generation under the same id is another body.
        key = (_PUT, retention.conversation, request_id)
        fingerprint = put_fingerprint(retention) if request_id else b""
        if request_id:
            first = self._state.idempotency.get(key, now)
            if first is not None:
                if not isinstance(first, PutAnswer) or first.fingerprint != fingerprint:
                    raise request_id_reused()
                return self._first_put(retention, first), []
        node = self._holding_node(retention)
        conversation = retention.conversation
        fence = self._state.fences.get(conversation)
        if fence is not None and retention.generation <= fence.generation:
            raise generation_stale(retention.generation, str(fence.generation), conversation)
        expire_at = now + ttl
        if retention.pin_expire_at is not None:
            if retention.pin_expire_at <= now:
                raise pin_expired()
            expire_at = min(expire_at, retention.pin_expire_at)
        old_name = self._state.by_conversation.get(conversation)
        tenant = retention.tenant
        if old_name is None:
            if len(self._state.retentions) >= self._state.limits.max_retentions:
                raise too_many("max_retentions", f"at most {self._state.limits.max_retentions} retentions")
            if len(self._state.tenant_names.get(tenant, ())) >= self._state.limits.max_retentions_per_tenant:
                raise too_many(
                    "max_retentions_per_tenant",
                    f"tenant {tenant} holds {self._state.limits.max_retentions_per_tenant} retentions",
                )
        # Everything is checked: from here on nothing raises.
        changes: list[RetentionChange] = []
        if old_name is not None:
            changes.append(self._state.remove_retention(old_name, ChangeKind.REPLACED, now))
        record = snapshot_retention(retention)
        record.create_time = now
        record.expire_at = expire_at
        record.claim, record.shared = None, ()
        if record.transcript is not None and not self._state.transcript_fits(tenant, record.transcript):
            record.transcript = None  # past the transcript bounds: the retention is kept without
        self._state.retentions[record.name] = record
        self._state.index(record)
        self._state.by_conversation[conversation] = record.name
        self._state.node_retentions[record.node].add(record.name)
        node.retained_bytes += record.kv_bytes
        node.retention_count += 1
        bisect.insort(self._state.tenant_names.setdefault(tenant, []), record.name)
        # The fence lives as long as a retention does; its own timer starts when the last goes.
        self._state.fences[conversation] = Fence(record.generation, math.inf)
        self._state.stop_lingering(conversation)
        self._state.push(expire_at, RETENTION, record.name)
        result = PutResult(snapshot_retention(record), old_name or "")
        changes.append(RetentionChange(ChangeKind.PUT, result.retention, now))
        if request_id:
            answer = PutAnswer(fingerprint, record.name, now, expire_at, record.pin_expire_at, old_name or "")
            self._state.idempotency.put(key, answer, now)
        return result, changes

    def _holding_node(self, retention: Retention) -> Node:
        """The live node that holds `retention`'s blocks, and only if the retention is its own:
        its model and block size, and params that name it as registered."""
        node = self._state.nodes.get(retention.node)
        if node is None:
            raise node_not_registered(retention.node)
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
        record = snapshot_retention(retention)
        record.name = first.name
        record.create_time = first.create_time
        record.expire_at = first.expire_at
        record.pin_expire_at = first.pin_expire_at
        record.claim, record.shared = None, ()
        return PutResult(record, first.replaced)

    async def get_retention(self, name: str) -> Retention:
        return snapshot_retention(self._state.retention(name))

    async def get_conversation(self, name: str) -> Conversation:
        fence = self._state.fences.get(name)
        if fence is None:
            raise conversation_not_found(name)
        current = self._state.by_conversation.get(name)
        return Conversation(
            name, fence.generation, snapshot_retention(self._state.retentions[current]) if current else None
        )

    async def renew_retention(
        self, name: str, ttl: float, max_ttl: float, now: float
    ) -> tuple[Retention, list[RetentionChange]]:
        record = self._state.retention(name)
        if record.claim is not None:
            raise retention_claimed(name)
        if record.expire_at <= now:  # shared readers do not keep it from a renewal
            raise retention_expired(name)
        expire_at = now + min(ttl, max_ttl)
        if record.pin_expire_at is not None:
            expire_at = min(expire_at, record.pin_expire_at)
        if expire_at > record.expire_at:
            record.expire_at = expire_at
            self._state.push(expire_at, RETENTION, name)
        snapshot = snapshot_retention(record)
        return snapshot, [RetentionChange(ChangeKind.RENEWED, snapshot, now)]

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
        state = self._state
        if chain is not None:
            ends = state.chain_ends.get(tenant, {})
            for i in range(len(chain) - 1, -1, -1):
                name = ends.get((model, block_size, chain[i]))
                if name is None:
                    continue
                record = state.retentions[name]
                if record.expire_at > now and record.block_hashes[: i + 1] == chain[: i + 1]:
                    return Found(snapshot_retention(record), i + 1)
        elif transcript_key is not None:
            name = state.transcript_keys.get(tenant, {}).get((model, transcript_key))
            if name is not None and state.retentions[name].expire_at > now:
                return Found(snapshot_retention(state.retentions[name]))
        raise retention_not_found(f"tenants/{tenant}")

    async def list_retentions(
        self, *, tenant: str, conversation: str | None, node: str | None, after: str, limit: int
    ) -> list[Retention]:
        names = self._state.tenant_names.get(tenant, [])
        prefix = f"{conversation}/" if conversation else ""
        start = bisect.bisect_right(names, max(after, prefix))
        out: list[Retention] = []
        for name in names[start:]:
            if prefix and not name.startswith(prefix):
                break
            record = self._state.retentions[name]
            if node and record.node != node:
                continue
            out.append(snapshot_retention(record))
            if len(out) >= limit:
                break
        return out
