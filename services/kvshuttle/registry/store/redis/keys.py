"""The Redis store's keys and shared steps (kvshuttle.registry.store.redis.store): the key layout, scripts,
this replica's counts view, and the NODE_LOST cascade and retirement of a removed retention."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Awaitable, Sequence
from typing import Any, ClassVar, cast

from redis.commands.core import AsyncScript

from kvshuttle.registry.model import (
    ChangeKind,
    Retention,
    RetentionChange,
    StoreCounts,
)
from kvshuttle.registry.store.contract import FENCE_OVERHEAD, StoreLimits
from kvshuttle.registry.store.redis.codec import (
    _REMOVED_KINDS,
    RedisClient,
    _conversation_of,
    _pairs,
    _retention_of,
    _s,
    _scripting,
    _t,
)
from kvshuttle.registry.store.redis.scripts import SCRIPTS


class RedisStoreBase:
    """The store's keys, its accounting and the node-removal cascade every part uses (see
    kvshuttle.registry.store.redis.store). `client` must be created with decode_responses=False."""

    # The Lua scripts by name (a subclass adds the ones of its steps).
    _SCRIPTS: ClassVar[dict[str, str]] = SCRIPTS

    def __init__(
        self,
        client: RedisClient,
        limits: StoreLimits | None = None,
        *,
        prefix: str = "kvshuttle",
        incarnation_base: int = 0,
    ) -> None:
        if not prefix or any(c in prefix for c in "{}"):
            raise ValueError("the key prefix must be non-empty and without braces")
        self._redis = client
        self._limits = limits or StoreLimits()
        self._p = prefix
        self._incarnation_base = incarnation_base
        self._scripts: dict[str, AsyncScript] = {
            name: _scripting(client).register_script(body) for name, body in self._SCRIPTS.items()
        }
        g = f"{{{prefix}}}"
        self._k_nodes = f"{g}:nodes"
        self._k_ndl, self._k_nver = f"{g}:ndl", f"{g}:nver"
        self._k_rdl, self._k_rver = f"{g}:rdl", f"{g}:rver"
        # The retention deadline set with its versions, per-tenant member counts and members
        # reserved past a limit: the keys of every script that adds or removes one of its members
        # (kvshuttle.registry.store.redis.bounds).
        self._rdl = [self._k_rdl, self._k_rver, f"{g}:rcount", f"{g}:rover"]
        self._k_idem, self._k_isz = f"{g}:idem", f"{g}:isz"
        self._k_fdl, self._k_fsz = f"{g}:fdl", f"{g}:fsz"
        self._k_claimed, self._k_meta = f"{g}:claimed", f"{g}:meta"
        self._counts = StoreCounts(0, 0, 0, 0)
        self._deadline: float | None = None

    # ---- keys and plumbing -----------------------------------------------------------------

    def _conv_key(self, conversation: str) -> str:
        return f"{self._p}:{{{conversation}}}"

    def _idem_key(self, conversation: str, op: str, target: str, request_id: str) -> str:
        return f"{self._p}:{{{conversation}}}:i:{op}:{target}:{request_id}"

    def _node_keys(self, node: str) -> list[str]:
        base = f"{self._p}:{{{node}}}"
        return [base, f"{base}:held", f"{base}:lost"]

    def _tenant_key(self, tenant: str) -> str:
        return f"{self._p}:{{tenants/{tenant}}}:names"

    async def _run(self, script: str, keys: list[str], args: list[Any]) -> Any:
        return await self._scripts[script](keys=keys, args=args)

    async def _hgetall(self, key: str) -> dict[bytes, bytes]:
        return await cast("Awaitable[dict[bytes, bytes]]", self._redis.hgetall(key))

    def _forget_at(self, now: float) -> str:
        return _t(now + self._limits.fence_ttl)

    def _idem_args(self, now: float) -> list[str]:
        ttl = self._limits.idempotency_ttl
        return [_t(now + ttl), str(max(1, math.ceil(ttl * 1000)))]

    def _soon(self, deadline: float) -> None:
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline

    def _account(self, changes: Sequence[RetentionChange], nodes: int = 0) -> None:
        c = self._counts
        retentions, claimed = c.retentions, c.claimed
        for change in changes:
            if change.kind is ChangeKind.PUT:
                retentions += 1
            elif change.kind in _REMOVED_KINDS:
                retentions -= 1
                claimed -= change.retention.claim is not None
            elif change.kind is ChangeKind.CLAIMED:
                claimed += 1
            elif change.kind in (ChangeKind.UNCLAIMED, ChangeKind.MOVED):
                claimed -= 1
        self._counts = dataclasses.replace(
            c, nodes=max(0, c.nodes + nodes), retentions=max(0, retentions), claimed=max(0, claimed)
        )

    async def _hint(self, keys: list[str], member: str, deadline: float) -> None:
        await self._run("hint", keys, [member, _t(deadline)])
        self._soon(deadline)

    async def _cascade(self, node: str, lost: Sequence[Any], now: float) -> list[RetentionChange]:
        """Drop a removed node's retentions (NODE_LOST), each only if still that retention there."""
        changes: list[RetentionChange] = []
        keys = self._node_keys(node)
        for name in sorted(_s(n) for n in _pairs(lost)):
            flat = await self._run(
                "drop_if", [self._conv_key(_conversation_of(name))], [name, node, self._forget_at(now)]
            )
            if flat:
                record = _retention_of(_pairs(flat))
                await self._retired(record, now, detach=False)
                changes.append(RetentionChange(ChangeKind.NODE_LOST, record, now))
            await self._run("detach", keys, [name])
        return changes

    async def _retired(
        self, record: Retention, now: float, *, detach: bool = True, linger: bool = True
    ) -> None:
        """The index steps after a retention's record was removed (each idempotent)."""
        if detach:
            await self._run("detach", self._node_keys(record.node), [record.name])
        await self._redis.zrem(self._tenant_key(record.tenant), record.name)
        if record.claim is not None:
            await self._redis.zrem(self._k_claimed, record.name)
        await self._run("drop", self._rdl, [record.name])
        if linger:
            await self._linger(record.conversation, now)

    async def _linger(self, conversation: str, now: float) -> None:
        limits = self._limits
        forget_at = now + limits.fence_ttl
        evicted = await self._run(
            "linger",
            [self._k_fdl, self._k_fsz, self._k_meta],
            [
                conversation,
                _t(forget_at),
                FENCE_OVERHEAD + len(conversation),
                limits.max_lingering_fences,
                limits.lingering_fence_max_bytes,
            ],
        )
        self._soon(forget_at)
        for raw in evicted:
            conv = _s(raw)
            out = await self._run("forget_fence", [self._conv_key(conv)], [_t(now), "1"])
            if _s(out[0]) == "forgotten":
                await cast("Awaitable[int]", self._redis.hincrby(self._k_meta, "early", 1))
