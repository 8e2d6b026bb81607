"""The Redis store's claim operations (kvshuttle.registry.store.redis.store): the single-use claim with
its pin, shared claims of a pool-held retention, release and giving a claim back, move to another
node, evict."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Sequence
from typing import Any, cast

from kvshuttle.core.errors import (
    FailedPrecondition,
    KvshuttleError,
)
from kvshuttle.core.fingerprint import request_id_reused
from kvshuttle.core.limits import MAX_SHARED_CLAIMS
from kvshuttle.core.nodes import NodeRole
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.idempotency import claim_fingerprint, move_fingerprint
from kvshuttle.registry.model import (
    ChangeKind,
    Holder,
    Move,
    Node,
    Retention,
    RetentionChange,
)
from kvshuttle.registry.store.errors import node_not_found, request_ended, retention_not_found
from kvshuttle.registry.store.redis.bounds import RedisBounds
from kvshuttle.registry.store.redis.codec import (
    as_str,
    claim_error,
    conversation_of,
    holder_json,
    pairs,
    reachable,
    retention_of,
    time_arg,
)
from kvshuttle.registry.store.redis.shared import RedisShared


class RedisClaims:
    """Claims and hand-overs: claim, release (or give back), move, evict."""

    def __init__(self, shared: RedisShared, bounds: RedisBounds) -> None:
        self._shared = shared
        self._redis = shared.client
        self._limits = shared.limits
        self._keys = shared.keys
        self._run = shared.run
        self._bounds = bounds

    @reachable
    async def claim_retention(
        self, name: str, holder: str, claim_ttl: float, now: float, *, request_id: str, shared: bool = False
    ) -> tuple[Retention, list[RetentionChange]]:
        conversation = conversation_of(name)
        key = self._keys.conversation(conversation)
        fingerprint = claim_fingerprint(holder, shared=shared).hex() if request_id else ""
        idem_key = self._keys.idempotency(conversation, "claim", name, request_id)
        claim_id = uuid.uuid4().hex
        node, pool = await self._pool_held(key) if shared else ("", False)
        out = await self._run(
            "claim",
            [key, idem_key],
            [
                name,
                time_arg(now),
                request_id,
                fingerprint,
                claim_id,
                holder,
                time_arg(now + claim_ttl),
                *self._shared.idem_args(now),
                "1" if shared else "",
                node,
                "1" if pool else "",
                MAX_SHARED_CLAIMS,
            ],
        )
        tag = as_str(out[0])
        if tag == "reused":
            raise request_id_reused()
        if tag == "repeat":
            return _claimed(retention_of(pairs(out[1])), as_str(out[2]), now), []
        if tag == "err":
            if as_str(out[1]) == "CLAIM_ENDED":
                raise request_ended(name, "claim", request_id)
            raise claim_error(name, out)
        record = _claimed(retention_of(pairs(out[1])), claim_id, now)
        changes = [RetentionChange(ChangeKind.CLAIMED, record, now)]
        if not shared:  # a shared claim leaves the deadline (the sweep keeps it) and the counts
            await self._redis.zadd(self._keys.claimed, {name: 0})
            await self._shared.hint(self._keys.retention_deadlines, name, record.expire_at)
            self._shared.account(changes)
        if request_id:
            await self._bounds.remember(idem_key, [fingerprint, claim_id], now)
        return record, changes

    async def _pool_held(self, key: str) -> tuple[str, bool]:
        """The node holding the conversation's retention ("" none) and whether it is a pool node.
        Another slot: the claim script checks the retention is still on that node."""
        raw = await cast("Awaitable[bytes | None]", self._redis.hget(key, "node"))
        if raw is None:
            return "", False
        node = await self._shared.read_node(as_str(raw))
        return as_str(raw), node is not None and node.spec.role is NodeRole.POOL

    @reachable
    async def release_retention(
        self, name: str, claim_id: str, force: bool, now: float, *, keep: bool = False
    ) -> list[RetentionChange]:
        out = await self._run(
            "release",
            [self._keys.conversation(conversation_of(name))],
            [
                name,
                claim_id,
                "1" if force else "",
                "1" if keep else "",
                time_arg(now),
                self._shared.forget_at(now),
            ],
        )
        tag = as_str(out[0])
        if tag == "err":
            reason = as_str(out[1])
            if reason == "RETENTION_NOT_FOUND":
                raise retention_not_found(name)
            held_by = as_str(out[2]) if len(out) > 2 else ""
            if reason == "CLAIM_MISMATCH_KEEP":
                held = f"is claimed by {held_by}" if held_by else "is not claimed"
                raise FailedPrecondition(
                    f"retention {name} {held}: only its claim's holder gives the claim back",
                    reason=ErrorReason.CLAIM_MISMATCH,
                    metadata={"retention": name, "field": "claim_id"},
                )
            raise FailedPrecondition(
                f"retention {name} is claimed by {held_by}",
                reason=ErrorReason.CLAIM_MISMATCH,
                metadata={"retention": name},
            )
        record = retention_of(pairs(out[1]))
        if tag == "unshared":  # one reader done: the deadline and the counts stay
            return [RetentionChange(ChangeKind.UNCLAIMED, record, now)]
        if tag == "unclaimed":
            await self._redis.zrem(self._keys.claimed, name)
            await self._shared.hint(self._keys.retention_deadlines, name, record.expire_at)
            changes = [RetentionChange(ChangeKind.UNCLAIMED, record, now)]
        else:
            await self._shared.retired(record, now)
            kind = ChangeKind.EXPIRED if tag == "expired" else ChangeKind.RELEASED
            changes = [RetentionChange(kind, record, now)]
        self._shared.account(changes)
        return changes

    @reachable
    async def move_retention(
        self, move: Move, ttl: float, now: float, *, request_id: str
    ) -> tuple[Retention, list[RetentionChange]]:
        name = move.name
        conversation = conversation_of(name)
        fingerprint = move_fingerprint(move).hex() if request_id else ""
        target = await self._shared.read_node(move.node)
        mismatch = "" if target is None else Holder.mismatch(move.holder, target.spec, "kv_transfer_params")
        expire_at = now + ttl
        attached = 0
        if target is not None and not mismatch:
            attached = await self._run(
                "attach", self._keys.node(move.node)[:2], [name, move.kv_bytes, target.spec.engine_id, ""]
            )
            if not attached:
                target = None
        idem_key = self._keys.idempotency(conversation, "move", name, request_id)
        out = await self._run(
            "move",
            [self._keys.conversation(conversation), idem_key],
            [
                name,
                move.claim_id,
                time_arg(now),
                request_id,
                fingerprint,
                "" if target is None else "1",
                "" if target is None else target.spec.model,
                "" if target is None else str(target.spec.block_size),
                mismatch or "",
                move.node,
                move.kv_transfer_params,
                str(move.kv_bytes),
                holder_json(move.holder),
                time_arg(expire_at),
                *self._shared.idem_args(now),
            ],
        )
        tag = as_str(out[0])
        if tag != "ok" and attached == 1:
            await self._run("detach", self._keys.node(move.node), [name])
        if tag == "reused":
            raise request_id_reused()
        if tag == "repeat":
            first = retention_of(pairs(out[1]))
            move.apply_to(first, float(out[2]))
            return first, []
        if tag == "err":
            raise self._move_error(move, out, target, request_id)
        previous = as_str(out[1])
        record = retention_of(pairs(out[3]))
        assert target is not None
        if previous != move.node:
            await self._run("detach", self._keys.node(previous), [name])
        if attached == 2:  # it was there already (a move onto its own node): its new bytes
            await self._run(
                "attach", self._keys.node(move.node)[:2], [name, move.kv_bytes, target.spec.engine_id, "1"]
            )
        await self._redis.zrem(self._keys.claimed, name)
        await self._shared.hint(self._keys.retention_deadlines, name, expire_at)
        if request_id:
            await self._bounds.remember(idem_key, [fingerprint, time_arg(expire_at)], now)
        changes = [RetentionChange(ChangeKind.MOVED, record, now, previous_node=previous)]
        changes += await self._shared.still_held(record, target, now)
        self._shared.account(changes)
        return record, changes

    @staticmethod
    def _move_error(move: Move, out: Sequence[Any], target: Node | None, request_id: str) -> KvshuttleError:
        name = move.name
        reason = as_str(out[1])
        if reason == "MOVE_ENDED":
            return request_ended(name, "move", request_id)
        if reason == "RETENTION_NOT_FOUND":
            return retention_not_found(name)
        if reason == "CLAIM_MISMATCH":
            held_by = as_str(out[2])
            held = f"is claimed by {held_by}" if held_by else "is not claimed"
            return FailedPrecondition(
                f"retention {name} {held}: only its claim's holder moves it",
                reason=ErrorReason.CLAIM_MISMATCH,
                metadata={"retention": name, "field": "claim_id"},
            )
        if reason == "RETENTION_EXPIRED":
            return FailedPrecondition(
                f"retention {name}'s claim lapsed",
                reason=ErrorReason.RETENTION_EXPIRED,
                metadata={"retention": name},
            )
        if reason == "NODE_NOT_FOUND" or target is None:
            return node_not_found(move.node)
        if reason == "NODE_MISMATCH":
            return FailedPrecondition(
                f"node {move.node} serves model {target.spec.model!r} with block size "
                f"{target.spec.block_size}, not {as_str(out[2])!r} / {as_str(out[3])}",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"node": move.node, "field": "node"},
            )
        field = as_str(out[2])
        return FailedPrecondition(
            f"kv_transfer_params do not name node {move.node} as registered "
            f"({field.rsplit('.', 1)[-1]} differs)",
            reason=ErrorReason.NODE_MISMATCH,
            metadata={"node": move.node, "field": field},
        )

    @reachable
    async def evict_retention(self, name: str, node: str, now: float) -> list[RetentionChange]:
        out = await self._run(
            "evict",
            [self._keys.conversation(conversation_of(name))],
            [name, node, self._shared.forget_at(now), time_arg(now)],
        )
        if as_str(out[0]) == "err":
            reason = as_str(out[1])
            if reason == "RETENTION_NOT_FOUND":
                raise retention_not_found(name)
            if reason == "NODE_MISMATCH":
                raise FailedPrecondition(
                    f"retention {name} is held by {as_str(out[2])}, not {node}",
                    reason=ErrorReason.NODE_MISMATCH,
                    metadata={"retention": name, "node": node, "field": "node"},
                )
            raise FailedPrecondition(
                f"retention {name} is claimed by {as_str(out[2])}: a reader may be reading it",
                reason=ErrorReason.RETENTION_ALREADY_CLAIMED,
                metadata={"retention": name},
            )
        record = retention_of(pairs(out[1]))
        await self._shared.retired(record, now)
        changes = [RetentionChange(ChangeKind.EVICTED, record, now)]
        self._shared.account(changes)
        return changes


def _claimed(record: Retention, claim_id: str, now: float) -> Retention:
    """`record` as a claim answers it: its live shared claims, and `claim` the one claimed
    (single-use or shared; the script found it live)."""
    record.shared = record.live_shared(now)
    record.claim = next(c for c in (record.claim, *record.shared) if c is not None and c.claim_id == claim_id)
    return record
