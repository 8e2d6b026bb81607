"""The Redis store's retention operations (kvshuttle.registry.store.redis.store): put-and-replace under
the conversation's fence, read, renew, list."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvshuttle.core.errors import (
    FailedPrecondition,
    KvshuttleError,
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
    Transcript,
)
from kvshuttle.registry.store.errors import (
    conversation_not_found,
    generation_stale,
    node_not_registered,
    pin_expired,
    retention_not_found,
    too_many,
)
from kvshuttle.registry.store.redis.bounds import RedisBounds
from kvshuttle.registry.store.redis.codec import (
    BATCH,
    as_str,
    claim_error,
    conversation_of,
    copy_retention,
    holder_json,
    pairs,
    reachable,
    retention_of,
    time_arg,
    transcript_bytes,
)
from kvshuttle.registry.store.redis.shared import RedisShared


@dataclass(slots=True)
class _PutSteps:
    """What a put's index steps before its commit did (RedisRetentions._index_first)."""

    attached: bool = False  # this put attached the name to its node
    reserved: bool = False  # this put added the name's deadline member, which got `version`
    version: int = 0
    capacity: str = ""  # the limit a new retention would pass ("" none)
    kept: Transcript | None = None  # the transcript, if its bytes fit


class RedisRetentions:
    """Retentions: put under the fence, read, renew, list."""

    def __init__(self, shared: RedisShared, bounds: RedisBounds) -> None:
        self._shared = shared
        self._redis = shared.client
        self._limits = shared.limits
        self._keys = shared.keys
        self._run = shared.run
        self._bounds = bounds

    async def _holding_node(self, retention: Retention) -> tuple[Node | None, KvshuttleError | None]:
        node = await self._shared.read_node(retention.node)
        if node is None:
            return None, node_not_registered(retention.node)
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

    @reachable
    async def put_retention(
        self, retention: Retention, ttl: float, now: float, *, request_id: str
    ) -> tuple[PutResult, list[RetentionChange]]:
        conversation = retention.conversation
        name = retention.name
        fingerprint = put_fingerprint(retention).hex() if request_id else ""
        node, node_error = await self._holding_node(retention)
        expire_at = now + ttl
        if retention.pin_expire_at is not None and retention.pin_expire_at > now:
            expire_at = min(expire_at, retention.pin_expire_at)
        steps, node_error = await self._index_first(retention, node, node_error, expire_at)
        idem_key = self._keys.idempotency(conversation, "put", conversation, request_id)
        idem_until = self._shared.idem_args(now)
        out = await self._run(
            "put",
            [self._keys.conversation(conversation), idem_key],
            [
                time_arg(now),
                request_id,
                fingerprint,
                str(retention.generation),
                time_arg(expire_at),
                "" if retention.pin_expire_at is None else time_arg(retention.pin_expire_at),
                "" if node_error is None else "NODE",
                steps.capacity,
                *idem_until,
                name,
                retention.node,
                retention.model,
                str(retention.block_size),
                str(retention.num_tokens),
                retention.block_hashes.tobytes(),
                retention.kv_transfer_params,
                str(retention.kv_bytes),
                holder_json(retention.holder),
                transcript_bytes(steps.kept),
                str(retention.prompt_blocks),
            ],
        )
        tag = as_str(out[0])
        if tag != "ok":
            dead, held, out = as_str(out[1]) == "1", as_str(out[3]) == "1", out[2]
            tag = as_str(out[0])
            if not held:
                await self._take_back(retention, node, steps, dead)
            if tag == "reused":
                raise request_id_reused()
            if tag == "repeat":
                return self._first_put(retention, out), []
            raise self._put_error(out, retention, node_error)
        old_name, old_flat = as_str(out[1]), out[2]
        changes: list[RetentionChange] = []
        if old_name:
            old = retention_of(pairs(old_flat))
            await self._shared.retired(old, now, linger=False)
            changes.append(RetentionChange(ChangeKind.REPLACED, old, now))
        await self._run("unlinger", [self._keys.fdl, self._keys.fsz, self._keys.meta], [conversation, ""])
        if request_id:
            await self._bounds.remember(idem_key, [fingerprint, name, old_name, *idem_until], now)
        record = copy_retention(retention)
        record.create_time = now
        record.expire_at = expire_at
        record.claim = None
        record.transcript = steps.kept
        await self._shared.index(record)
        result = PutResult(record, old_name)
        changes.append(RetentionChange(ChangeKind.PUT, copy_retention(record), now))
        assert node is not None
        changes += await self._shared.still_held(record, node, now)
        self._shared.account(changes)
        return result, changes

    async def _index_first(
        self, retention: Retention, node: Node | None, node_error: KvshuttleError | None, expire_at: float
    ) -> tuple[_PutSteps, KvshuttleError | None]:
        """A put's index steps before its commit: a replica dying right after the commit still
        leaves the deadline that expires it, and a replacement's detach always comes after this
        attach. The deadline is the put's reservation too: the commit refuses a new retention past
        the limit its count gave (kvshuttle.registry.store.redis.bounds). Its transcript's bytes
        are reserved with its place; past the transcript bounds it is kept without them."""
        steps = _PutSteps()
        if node_error is None:
            assert node is not None
            attached, node_error = await self._attach_for_put(retention, node.spec)
            steps.attached = attached == 1
        if node_error is None:
            size = 0 if retention.transcript is None else retention.transcript.nbytes
            steps.reserved, steps.version, steps.capacity, fits = await self._bounds.reserve_put(
                retention.name, expire_at, size
            )
            steps.kept = retention.transcript if fits else None
            await self._redis.zadd(self._keys.tenant(retention.tenant), {retention.name: 0})
        return steps, node_error

    async def _take_back(self, retention: Retention, node: Node | None, steps: _PutSteps, dead: bool) -> None:
        """A refused put's index steps and place, given back. Not called for a name another put
        of it committed meanwhile (a replay racing its first answer): that commit owns them."""
        name = retention.name
        reserved, version = steps.reserved, steps.version
        if steps.attached:  # the name was not live: take its index steps back
            await self._run("detach", self._keys.node(retention.node), [name])
            # ... unless a put of the name that attached before this one committed since (its
            # node check may have run before this detach): then it is attached again. Were its
            # node gone meanwhile, the retention stays until its expiry; plans check the node.
            if node is not None:
                await self._shared.attached_while_held(retention, node)
        # The place this put reserved: back when its name can no longer be committed, or when
        # this put added it and no other put of the name wrote it since (that one takes it back,
        # or holds it; both refused: the sweeper drops it when it is due).
        if (dead or reserved) and await self._bounds.unreserve(name, None if dead else version):
            await self._redis.zrem(self._keys.tenant(retention.tenant), name)

    async def _attach_for_put(
        self, retention: Retention, spec: NodeSpec
    ) -> tuple[int, KvshuttleError | None]:
        attached = int(
            await self._run(
                "attach",
                self._keys.node(retention.node)[:2],
                [retention.name, retention.kv_bytes, spec.engine_id, ""],
            )
        )
        if attached:
            return attached, None
        # The node went away since it was read.
        return 0, node_not_registered(retention.node)

    @staticmethod
    def _first_put(retention: Retention, out: Sequence[Any]) -> PutResult:
        """The first response to a repeated put, rebuilt from the repeat and what the first set."""
        record = copy_retention(retention)
        record.name = as_str(out[1])
        record.create_time = float(out[2])
        record.expire_at = float(out[3])
        record.pin_expire_at = float(out[4]) if out[4] else None
        record.claim = None
        return PutResult(record, as_str(out[5]))

    def _put_error(
        self, out: Sequence[Any], retention: Retention, node_error: KvshuttleError | None
    ) -> KvshuttleError:
        reason = as_str(out[1])
        if reason == "NODE" and node_error is not None:
            return node_error
        if reason == "FENCING_GENERATION_STALE":
            fence = as_str(out[2])
            return generation_stale(retention.generation, fence, retention.conversation)
        if reason == "PIN_EXPIRED":
            return pin_expired()
        limit = as_str(out[2])
        if limit == "max_retentions":
            return too_many("max_retentions", f"at most {self._limits.max_retentions} retentions")
        return too_many(
            "max_retentions_per_tenant",
            f"tenant {retention.tenant} holds {self._limits.max_retentions_per_tenant} retentions",
        )

    @reachable
    async def get_retention(self, name: str) -> Retention:
        record = await self._shared.read_retention(name)
        if record is None:
            raise retention_not_found(name)
        return record

    @reachable
    async def get_conversation(self, name: str) -> Conversation:
        raw = await self._shared.hgetall(self._keys.conversation(name))
        h = {as_str(k): v for k, v in raw.items()}
        if "fence" not in h:
            raise conversation_not_found(name)
        return Conversation(name, int(h["fence"]), retention_of(h) if "name" in h else None)

    @reachable
    async def renew_retention(
        self, name: str, ttl: float, max_ttl: float, now: float
    ) -> tuple[Retention, list[RetentionChange]]:
        out = await self._run(
            "renew",
            [self._keys.conversation(conversation_of(name))],
            [name, time_arg(now), time_arg(now + min(ttl, max_ttl))],
        )
        if as_str(out[0]) == "err":
            raise claim_error(name, out)
        record = retention_of(pairs(out[1]))
        # Only ever later: the deadline set may keep the earlier one (the sweep reschedules it).
        return record, [RetentionChange(ChangeKind.RENEWED, record, now)]

    @reachable
    async def list_retentions(
        self, *, tenant: str, conversation: str | None, node: str | None, after: str, limit: int
    ) -> list[Retention]:
        prefix = f"{conversation}/" if conversation else ""
        begin = max(after, prefix)
        start = f"({begin}" if begin else "-"
        key = self._keys.tenant(tenant)
        out: list[Retention] = []
        while len(out) < limit:
            names = [as_str(n) for n in await self._redis.zrangebylex(key, start, "+", 0, BATCH)]
            if not names:
                break
            pipe = self._redis.pipeline(transaction=False)
            for name in names:
                pipe.hgetall(self._keys.conversation(conversation_of(name)))
            replies = await pipe.execute()
            for name, raw in zip(names, replies, strict=True):
                if prefix and not name.startswith(prefix):
                    return out
                h = {as_str(k): v for k, v in raw.items()}
                if as_str(h.get("name", b"")) != name:
                    continue
                record = retention_of(h)
                if node and record.node != node:
                    continue
                out.append(record)
                if len(out) >= limit:
                    return out
            if len(names) < BATCH:
                break
            start = f"({names[-1]}"
        return out
