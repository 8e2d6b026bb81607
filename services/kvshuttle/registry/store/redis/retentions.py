"""The Redis store's retention operations (kvshuttle.registry.store.redis.store): put-and-replace under
the conversation's fence, read, renew, list."""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import Any, cast

from kvshuttle.core.errors import (
    Aborted,
    FailedPrecondition,
    KvshuttleError,
    NotFound,
    ResourceExhausted,
)
from kvshuttle.core.fingerprint import request_id_reused
from kvshuttle.core.nodes import NodeSpec
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.idempotency import put_fingerprint
from kvshuttle.registry.model import (
    ChangeKind,
    Conversation,
    Holder,
    Node,
    PutResult,
    Retention,
    RetentionChange,
)
from kvshuttle.registry.store.redis.codec import (
    _BATCH,
    _conversation_of,
    _holder_json,
    _not_found,
    _pairs,
    _reachable,
    _retention_of,
    _s,
    _t,
    copy_retention,
)
from kvshuttle.registry.store.redis.nodes import RedisNodes


class RedisRetentions(RedisNodes):
    """Retentions: put under the fence, read, renew, list."""

    async def _holding_node(self, retention: Retention) -> tuple[Node | None, KvshuttleError | None]:
        node = await self._read_node(retention.node)
        if node is None:
            return None, FailedPrecondition(
                f"node {retention.node} is not registered",
                reason=ErrorReason.NODE_NOT_FOUND,
                metadata={"node": retention.node},
            )
        spec = node.spec
        if spec.model != retention.model or spec.block_size != retention.block_size:
            return node, FailedPrecondition(
                f"node {retention.node} serves model {spec.model!r} with block size "
                f"{spec.block_size}, not {retention.model!r} / {retention.block_size}",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"node": retention.node},
            )
        mismatch = Holder.mismatch(retention.holder, spec)
        if mismatch is not None:
            return node, FailedPrecondition(
                f"retention.kv_transfer_params do not name node {retention.node} as registered "
                f"({mismatch.rsplit('.', 1)[-1]} differs)",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"node": retention.node, "field": mismatch},
            )
        return node, None

    @_reachable
    async def put_retention(
        self, retention: Retention, ttl: float, now: float, *, request_id: str
    ) -> tuple[PutResult, list[RetentionChange]]:
        conversation = retention.conversation
        tenant = retention.tenant
        name = retention.name
        fingerprint = put_fingerprint(retention).hex() if request_id else ""
        node, node_error = await self._holding_node(retention)
        expire_at = now + ttl
        if retention.pin_expire_at is not None and retention.pin_expire_at > now:
            expire_at = min(expire_at, retention.pin_expire_at)
        # Index steps first: a replica dying right after the commit still leaves the deadline
        # that expires it, and a replacement's detach always comes after this attach. The
        # deadline is the put's reservation too: the commit refuses a new retention past the
        # limit its count gave (kvshuttle.registry.store.redis.bounds).
        attached = version = 0
        reserved = False
        capacity = ""
        if node_error is None:
            assert node is not None
            attached, node_error = await self._attach_for_put(retention, node.spec)
        if node_error is None:
            reserved, version, capacity = await self._reserve(name, expire_at)
            await self._redis.zadd(self._tenant_key(tenant), {name: 0})
        idem_key = self._idem_key(conversation, "put", conversation, request_id)
        idem_until = self._idem_args(now)
        out = await self._run(
            "put",
            [self._conv_key(conversation), idem_key],
            [
                _t(now),
                request_id,
                fingerprint,
                str(retention.generation),
                _t(expire_at),
                "" if retention.pin_expire_at is None else _t(retention.pin_expire_at),
                "" if node_error is None else "NODE",
                capacity,
                *idem_until,
                name,
                retention.node,
                retention.model,
                str(retention.block_size),
                str(retention.num_tokens),
                retention.block_hashes.tobytes(),
                retention.kv_transfer_params,
                str(retention.kv_bytes),
                _holder_json(retention.holder),
            ],
        )
        tag = _s(out[0])
        if tag != "ok":
            dead, held, out = _s(out[1]) == "1", _s(out[3]) == "1", out[2]
            tag = _s(out[0])
            if not held:
                await self._take_back(retention, node, attached == 1, dead, reserved, version)
            if tag == "reused":
                raise request_id_reused()
            if tag == "repeat":
                return self._first_put(retention, out), []
            raise self._put_error(out, retention, node_error)
        old_name, old_flat = _s(out[1]), out[2]
        changes: list[RetentionChange] = []
        if old_name:
            old = _retention_of(_pairs(old_flat))
            await self._retired(old, now, linger=False)
            changes.append(RetentionChange(ChangeKind.REPLACED, old, now))
        await self._run("unlinger", [self._k_fdl, self._k_fsz, self._k_meta], [conversation, ""])
        if request_id:
            await self._remember(idem_key, [fingerprint, name, old_name, *idem_until], now)
        record = copy_retention(retention)
        record.create_time = now
        record.expire_at = expire_at
        record.claim = None
        result = PutResult(record, old_name)
        changes.append(RetentionChange(ChangeKind.PUT, copy_retention(record), now))
        assert node is not None
        changes += await self._still_held(record, node, now)
        self._account(changes)
        return result, changes

    async def _attach_for_put(
        self, retention: Retention, spec: NodeSpec
    ) -> tuple[int, KvshuttleError | None]:
        attached = int(
            await self._run(
                "attach",
                self._node_keys(retention.node)[:2],
                [retention.name, retention.kv_bytes, spec.engine_id, ""],
            )
        )
        if attached:
            return attached, None
        # The node went away since it was read.
        return 0, FailedPrecondition(
            f"node {retention.node} is not registered",
            reason=ErrorReason.NODE_NOT_FOUND,
            metadata={"node": retention.node},
        )

    @staticmethod
    def _first_put(retention: Retention, out: Sequence[Any]) -> PutResult:
        """The first response to a repeated put, rebuilt from the repeat and what the first set."""
        record = copy_retention(retention)
        record.name = _s(out[1])
        record.create_time = float(out[2])
        record.expire_at = float(out[3])
        record.pin_expire_at = float(out[4]) if out[4] else None
        record.claim = None
        return PutResult(record, _s(out[5]))

    async def _take_back(
        self,
        retention: Retention,
        node: Node | None,
        attached: bool,
        dead: bool,
        reserved: bool,
        version: int,
    ) -> None:
        """A refused put's index steps and place, given back. Not called for a name another put
        of it committed meanwhile (a replay racing its first answer): that commit owns them."""
        name = retention.name
        if attached:  # the name was not live: take its index steps back
            await self._run("detach", self._node_keys(retention.node), [name])
            # ... unless a put of the name that attached before this one committed since (its
            # node check may have run before this detach): then it is attached again. Were its
            # node gone meanwhile, the retention stays until its expiry; plans check the node.
            if node is not None:
                await self._attached_while_held(retention, node)
        # The place this put reserved: back when its name can no longer be committed, or when
        # this put added it and no other put of the name wrote it since (that one takes it back,
        # or holds it; both refused: the sweeper drops it when it is due).
        if (dead or reserved) and await self._unreserve(name, None if dead else version):
            await self._redis.zrem(self._tenant_key(retention.tenant), name)

    async def _committed_on(self, record: Retention) -> bool:
        """Whether the conversation holds this retention's name on its node now."""
        held = await cast(
            "Awaitable[list[bytes | None]]",
            self._redis.hmget(self._conv_key(record.conversation), ["name", "node"]),
        )
        return [None if v is None else _s(v) for v in held] == [record.name, record.node]

    async def _attached_while_held(self, record: Retention, node: Node) -> bool:
        """Attach a committed retention's name to its node again, where a refused put of the same
        name took it back. The conversation and the node are in different slots, so: check it is
        held, attach, check again; replaced in between, its retirement may have detached it
        before this attach, so detach it again. False when it is not held, or the node (that
        engine, that incarnation) went away."""
        if not await self._committed_on(record):
            return False
        args = [record.name, node.spec.engine_id, str(node.incarnation), record.kv_bytes]
        if not await self._run("hold", self._node_keys(record.node)[:2], args):
            return False
        if await self._committed_on(record):
            return True
        await self._run("detach", self._node_keys(record.node), [record.name])
        return False

    async def _still_held(self, record: Retention, node: Node, now: float) -> list[RetentionChange]:
        """After a commit onto a node: if the node went away meanwhile (its cascade may have
        run before the commit), the retention goes as NODE_LOST now."""
        holds = [record.name, node.spec.engine_id]
        if await self._run("holds", self._node_keys(record.node)[:2], holds):
            return []
        if await self._attached_while_held(record, node):
            return []
        lost = await self._run(
            "drop_if",
            [self._conv_key(record.conversation)],
            [record.name, record.node, self._forget_at(now)],
        )
        if not lost:  # replaced, moved or dropped meanwhile: not this step's to emit
            return []
        gone = _retention_of(_pairs(lost))
        await self._retired(gone, now)
        return [RetentionChange(ChangeKind.NODE_LOST, gone, now)]

    def _put_error(
        self, out: Sequence[Any], retention: Retention, node_error: KvshuttleError | None
    ) -> KvshuttleError:
        reason = _s(out[1])
        if reason == "NODE" and node_error is not None:
            return node_error
        if reason == "FENCING_GENERATION_STALE":
            fence = _s(out[2])
            return Aborted(
                f"generation {retention.generation} is not newer than {fence} for {retention.conversation}",
                reason=ErrorReason.FENCING_GENERATION_STALE,
                metadata={"fence_generation": fence},
            )
        if reason == "PIN_EXPIRED":
            return FailedPrecondition(
                "pin_expire_time has already passed: the blocks are gone", reason=ErrorReason.PIN_EXPIRED
            )
        limit = _s(out[2])
        if limit == "max_retentions":
            return ResourceExhausted(
                f"at most {self._limits.max_retentions} retentions",
                reason=ErrorReason.CAPACITY_EXCEEDED,
                metadata={"limit": "max_retentions"},
            )
        return ResourceExhausted(
            f"tenant {retention.tenant} holds {self._limits.max_retentions_per_tenant} retentions",
            reason=ErrorReason.CAPACITY_EXCEEDED,
            metadata={"limit": "max_retentions_per_tenant"},
        )

    async def _read_retention(self, name: str) -> Retention | None:
        raw = await self._hgetall(self._conv_key(_conversation_of(name)))
        h = {_s(k): v for k, v in raw.items()}
        if _s(h.get("name", b"")) != name:
            return None
        return _retention_of(h)

    @_reachable
    async def get_retention(self, name: str) -> Retention:
        record = await self._read_retention(name)
        if record is None:
            raise _not_found(name)
        return record

    @_reachable
    async def get_conversation(self, name: str) -> Conversation:
        raw = await self._hgetall(self._conv_key(name))
        h = {_s(k): v for k, v in raw.items()}
        if "fence" not in h:
            raise NotFound(
                f"conversation {name} has no retention and no fencing generation",
                reason=ErrorReason.CONVERSATION_NOT_FOUND,
                metadata={"conversation": name},
            )
        return Conversation(name, int(h["fence"]), _retention_of(h) if "name" in h else None)

    @staticmethod
    def _claim_error(name: str, out: Sequence[Any]) -> KvshuttleError:
        reason = _s(out[1])
        if reason == "RETENTION_NOT_FOUND":
            return _not_found(name)
        if reason == "RETENTION_CLAIMED":
            return FailedPrecondition(
                f"retention {name} is claimed; a claim is never renewed",
                reason=ErrorReason.RETENTION_CLAIMED,
                metadata={"retention": name},
            )
        if reason == "RETENTION_ALREADY_CLAIMED":
            return Aborted(
                f"retention {name} is already claimed",
                reason=ErrorReason.RETENTION_ALREADY_CLAIMED,
                metadata={"retention": name},
            )
        return FailedPrecondition(
            f"retention {name} expired",
            reason=ErrorReason.RETENTION_EXPIRED,
            metadata={"retention": name},
        )

    @_reachable
    async def renew_retention(
        self, name: str, ttl: float, max_ttl: float, now: float
    ) -> tuple[Retention, list[RetentionChange]]:
        out = await self._run(
            "renew", [self._conv_key(_conversation_of(name))], [name, _t(now), _t(now + min(ttl, max_ttl))]
        )
        if _s(out[0]) == "err":
            raise self._claim_error(name, out)
        record = _retention_of(_pairs(out[1]))
        # Only ever later: the deadline set may keep the earlier one (the sweep reschedules it).
        return record, [RetentionChange(ChangeKind.RENEWED, record, now)]

    @_reachable
    async def list_retentions(
        self, *, tenant: str, conversation: str | None, node: str | None, after: str, limit: int
    ) -> list[Retention]:
        prefix = f"{conversation}/" if conversation else ""
        begin = max(after, prefix)
        start = f"({begin}" if begin else "-"
        key = self._tenant_key(tenant)
        out: list[Retention] = []
        while len(out) < limit:
            names = [_s(n) for n in await self._redis.zrangebylex(key, start, "+", 0, _BATCH)]
            if not names:
                break
            pipe = self._redis.pipeline(transaction=False)
            for name in names:
                pipe.hgetall(self._conv_key(_conversation_of(name)))
            replies = await pipe.execute()
            for name, raw in zip(names, replies, strict=True):
                if prefix and not name.startswith(prefix):
                    return out
                h = {_s(k): v for k, v in raw.items()}
                if _s(h.get("name", b"")) != name:
                    continue
                record = _retention_of(h)
                if node and record.node != node:
                    continue
                out.append(record)
                if len(out) >= limit:
                    return out
            if len(names) < _BATCH:
                break
            start = f"({names[-1]}"
        return out
