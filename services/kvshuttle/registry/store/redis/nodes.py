"""The Redis store's node operations (kvshuttle.registry.store.redis.store)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import cast

from kvshuttle.core.errors import (
    ResourceExhausted,
)
from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.model import (
    Node,
    RetentionChange,
)
from kvshuttle.registry.store.redis.bounds import RedisBounds
from kvshuttle.registry.store.redis.codec import (
    _BATCH,
    _incarnation_mismatch,
    _load_json,
    _node_not_found,
    _node_of,
    _pairs,
    _reachable,
    _s,
    _spec_json,
    _t,
)


class RedisNodes(RedisBounds):
    """Node leases: register, heartbeat, deregister, read, list."""

    async def _read_node(self, name: str) -> Node | None:
        base, held, _ = self._node_keys(name)
        pipe = self._redis.pipeline(transaction=False)
        pipe.hgetall(base)
        pipe.hlen(held)
        raw, count = await pipe.execute()
        if not raw:
            return None
        h = {_s(k): v for k, v in raw.items()}
        h["count"] = str(count).encode()
        return _node_of(h)

    @_reachable
    async def register_node(
        self, spec: NodeSpec, ttl: float, now: float
    ) -> tuple[Node, list[RetentionChange], bool]:
        expire_at = now + ttl
        reserved = await self._run(
            "reserve_node",
            [self._k_nodes, self._k_ndl, self._k_nver],
            [spec.name, self._limits.max_nodes, _t(expire_at)],
        )
        if not reserved:
            raise ResourceExhausted(
                f"at most {self._limits.max_nodes} nodes",
                reason=ErrorReason.CAPACITY_EXCEEDED,
                metadata={"limit": "max_nodes"},
            )
        self._soon(expire_at)
        incarnation = int(await self._run("next_incarnation", [self._k_meta], [self._incarnation_base]))
        existed, changed, flat, lost = await self._run(
            "register_node",
            self._node_keys(spec.name),
            [_spec_json(spec), spec.engine_id, incarnation, _t(now), _t(expire_at), _load_json(NodeLoad())],
        )
        engine_changed = _s(changed) == "1"
        changes = await self._cascade(spec.name, lost, now) if engine_changed else []
        self._account(changes, nodes=0 if _s(existed) == "1" else 1)
        return _node_of(_pairs(flat)), changes, engine_changed

    @_reachable
    async def heartbeat_node(
        self, name: str, incarnation: int, ttl: float, load: NodeLoad, now: float
    ) -> Node:
        keys = self._node_keys(name)[:2]
        out = await self._run("heartbeat_node", keys, [incarnation, _t(now + ttl), _load_json(load)])
        if _s(out[0]) == "err":
            if _s(out[1]) == "NODE_NOT_FOUND":
                raise _node_not_found(name)
            raise _incarnation_mismatch(name, _s(out[2]), incarnation)
        await self._hint([self._k_ndl, self._k_nver], name, now + ttl)
        return _node_of(_pairs(out[1]))

    @_reachable
    async def deregister_node(self, name: str, incarnation: int | None, now: float) -> list[RetentionChange]:
        version = _s(await cast("Awaitable[bytes | None]", self._redis.hget(self._k_nver, name)) or b"")
        out = await self._run(
            "remove_node",
            self._node_keys(name),
            ["" if incarnation is None else incarnation, _t(now), "deregister"],
        )
        if _s(out[0]) == "err":
            if _s(out[1]) == "NODE_NOT_FOUND":
                raise _node_not_found(name)
            raise _incarnation_mismatch(name, _s(out[2]), cast(int, incarnation))
        changes = await self._cascade(name, out[2], now)
        await self._run("unindex_node", [self._k_nodes, self._k_ndl, self._k_nver], [name, version])
        self._account(changes, nodes=-1)
        return changes

    @_reachable
    async def get_node(self, name: str) -> Node:
        node = await self._read_node(name)
        if node is None:
            raise _node_not_found(name)
        return node

    @_reachable
    async def list_nodes(
        self, *, role: NodeRole | None, model: str | None, after: str, limit: int
    ) -> list[Node]:
        out: list[Node] = []
        start = f"({after}" if after else "-"
        while len(out) < limit:
            names = [_s(n) for n in await self._redis.zrangebylex(self._k_nodes, start, "+", 0, _BATCH)]
            if not names:
                break
            pipe = self._redis.pipeline(transaction=False)
            for name in names:
                base, held, _ = self._node_keys(name)
                pipe.hgetall(base)
                pipe.hlen(held)
            replies = await pipe.execute()
            for i in range(len(names)):
                raw, count = replies[2 * i], replies[2 * i + 1]
                if not raw:
                    continue
                h = {_s(k): v for k, v in raw.items()}
                h["count"] = str(count).encode()
                node = _node_of(h)
                if node.spec.role.serves(role) and (not model or node.spec.model == model):
                    out.append(node)
                    if len(out) >= limit:
                        break
            if len(names) < _BATCH:
                break
            start = f"({names[-1]}"
        return out
