"""The Redis store's node operations (kvshuttle.registry.store.redis.store)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import cast

from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec
from kvshuttle.registry.model import (
    Node,
    RetentionChange,
)
from kvshuttle.registry.store.errors import incarnation_mismatch, node_not_found, too_many
from kvshuttle.registry.store.redis.codec import (
    BATCH,
    as_str,
    load_json,
    node_of,
    pairs,
    reachable,
    spec_json,
    time_arg,
)
from kvshuttle.registry.store.redis.shared import RedisShared


class RedisNodes:
    """Node leases: register, heartbeat, deregister, read, list."""

    def __init__(self, shared: RedisShared) -> None:
        self._shared = shared
        self._redis = shared.client
        self._limits = shared.limits
        self._keys = shared.keys
        self._run = shared.run

    @reachable
    async def register_node(
        self, spec: NodeSpec, ttl: float, now: float
    ) -> tuple[Node, list[RetentionChange], bool]:
        expire_at = now + ttl
        reserved = await self._run(
            "reserve_node",
            [self._keys.nodes, self._keys.ndl, self._keys.nver],
            [spec.name, self._limits.max_nodes, time_arg(expire_at)],
        )
        if not reserved:
            raise too_many("max_nodes", f"at most {self._limits.max_nodes} nodes")
        self._shared.soon(expire_at)
        incarnation = int(
            await self._run("next_incarnation", [self._keys.meta], [self._shared.incarnation_base])
        )
        existed, changed, flat, lost = await self._run(
            "register_node",
            self._keys.node(spec.name),
            [
                spec_json(spec),
                spec.engine_id,
                incarnation,
                time_arg(now),
                time_arg(expire_at),
                load_json(NodeLoad()),
            ],
        )
        engine_changed = as_str(changed) == "1"
        changes = await self._shared.cascade(spec.name, lost, now) if engine_changed else []
        self._shared.account(changes, nodes=0 if as_str(existed) == "1" else 1)
        return node_of(pairs(flat)), changes, engine_changed

    @reachable
    async def heartbeat_node(
        self, name: str, incarnation: int, ttl: float, load: NodeLoad, now: float
    ) -> Node:
        keys = self._keys.node(name)[:2]
        out = await self._run("heartbeat_node", keys, [incarnation, time_arg(now + ttl), load_json(load)])
        if as_str(out[0]) == "err":
            if as_str(out[1]) == "NODE_NOT_FOUND":
                raise node_not_found(name)
            raise incarnation_mismatch(name, as_str(out[2]), incarnation)
        await self._shared.hint([self._keys.ndl, self._keys.nver], name, now + ttl)
        return node_of(pairs(out[1]))

    @reachable
    async def deregister_node(self, name: str, incarnation: int | None, now: float) -> list[RetentionChange]:
        version = as_str(
            await cast("Awaitable[bytes | None]", self._redis.hget(self._keys.nver, name)) or b""
        )
        out = await self._run(
            "remove_node",
            self._keys.node(name),
            ["" if incarnation is None else incarnation, time_arg(now), "deregister"],
        )
        if as_str(out[0]) == "err":
            if as_str(out[1]) == "NODE_NOT_FOUND":
                raise node_not_found(name)
            raise incarnation_mismatch(name, as_str(out[2]), cast(int, incarnation))
        changes = await self._shared.cascade(name, out[2], now)
        await self._run("unindex_node", [self._keys.nodes, self._keys.ndl, self._keys.nver], [name, version])
        self._shared.account(changes, nodes=-1)
        return changes

    @reachable
    async def get_node(self, name: str) -> Node:
        node = await self._shared.read_node(name)
        if node is None:
            raise node_not_found(name)
        return node

    @reachable
    async def list_nodes(
        self, *, role: NodeRole | None, model: str | None, after: str, limit: int
    ) -> list[Node]:
        out: list[Node] = []
        start = f"({after}" if after else "-"
        while len(out) < limit:
            names = [as_str(n) for n in await self._redis.zrangebylex(self._keys.nodes, start, "+", 0, BATCH)]
            if not names:
                break
            pipe = self._redis.pipeline(transaction=False)
            for name in names:
                base, held, _ = self._keys.node(name)
                pipe.hgetall(base)
                pipe.hlen(held)
            replies = await pipe.execute()
            for i in range(len(names)):
                raw, count = replies[2 * i], replies[2 * i + 1]
                if not raw:
                    continue
                h = {as_str(k): v for k, v in raw.items()}
                h["count"] = str(count).encode()
                node = node_of(h)
                if node.spec.role.serves(role) and (not model or node.spec.model == model):
                    out.append(node)
                    if len(out) >= limit:
                        break
            if len(names) < BATCH:
                break
            start = f"({names[-1]}"
        return out
