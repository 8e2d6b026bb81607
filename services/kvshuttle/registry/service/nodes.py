"""The Registry's node operations (kvshuttle.registry.service.registry): each checks the whole request
(a node spec: endpoints, model, block geometry, labels, and a pool node's name and labels), then
applies it to the store; an engine change or a removal also drops the node's blocks through the
index feed."""

from __future__ import annotations

import math

import structlog

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.limits import MAX_KV_BYTES_PER_TOKEN
from kvshuttle.core.nodes import (
    POOL_CAPACITY_LABEL,
    POOL_OF_LABEL,
    NodeLoad,
    NodeRole,
    NodeSpec,
    is_pool_node_name,
    pool_node_name,
    pool_owner,
)
from kvshuttle.registry.model import Node
from kvshuttle.registry.service.shared import RegistryShared

log = structlog.get_logger("kvshuttle.registry")


class RegistryNodes:
    """Node leases: register, heartbeat, deregister, read, list."""

    def __init__(self, shared: RegistryShared) -> None:
        self._shared = shared
        self._store = shared.store
        self._clock = shared.clock
        self._index_feed = shared.index_feed
        self._limits = shared.limits
        self._check = shared.checks
        self._wake = shared.wake

    def _check_spec(self, spec: NodeSpec) -> None:
        self._check.node_name(spec.name, "node.name")
        self._check.id(spec.engine_id, "node.engine_id")
        self._check.bounded(spec.http_endpoint, "node.http_endpoint")
        if not spec.http_endpoint.startswith(("http://", "https://")):
            raise InvalidArgument("node.http_endpoint", "must be an http:// or https:// URL")
        self._check.bounded(spec.side_channel_host, "node.side_channel_host")
        if not 0 < spec.side_channel_port < 65536:
            raise InvalidArgument("node.side_channel_port", "must be 1..65535")
        self._check.bounded(spec.agent_endpoint, "node.agent_endpoint", required=False)
        self._check.bounded(spec.model, "node.model")
        if not 0 < spec.block_size <= self._limits.max_block_size:
            raise InvalidArgument("node.block_size", f"must be 1..{self._limits.max_block_size}")
        if not 0 < spec.kv_bytes_per_token <= MAX_KV_BYTES_PER_TOKEN:
            raise InvalidArgument("node.kv_bytes_per_token", f"must be 1..{MAX_KV_BYTES_PER_TOKEN}")
        if len(spec.labels) > self._limits.max_labels:
            raise InvalidArgument("node.labels", f"at most {self._limits.max_labels} labels")
        for key, value in spec.labels.items():
            if (
                not key
                or len(key) > self._limits.max_label_length
                or len(value) > self._limits.max_label_length
            ):
                raise InvalidArgument(
                    "node.labels",
                    f"keys must be 1..{self._limits.max_label_length} "
                    f"characters, values at most {self._limits.max_label_length}",
                )
        self._check_pool(spec)

    def _check_pool(self, spec: NodeSpec) -> None:
        """A pool node is `pool_node_name(owner)`, labelled with its owner (and, if at all, a
        byte capacity); no other node takes a pool node's name, so an agent's scope over its
        pool node (kvshuttle.core.auth) never reaches an engine's node."""
        if spec.role is not NodeRole.POOL:
            if is_pool_node_name(spec.name):
                raise InvalidArgument("node.name", "names ending in -pool are reserved for NODE_ROLE_POOL")
            return
        owner = pool_owner(spec.name)
        if not owner:
            raise InvalidArgument("node.name", "a pool node is named nodes/{node}-pool")
        pool_node_name(owner, "node.name", max_length=self._limits.max_id_length)  # a valid owner
        if spec.labels.get(POOL_OF_LABEL) != owner:
            raise InvalidArgument("node.labels", f"a pool node's {POOL_OF_LABEL} label must be {owner}")
        capacity = spec.labels.get(POOL_CAPACITY_LABEL)
        if capacity is not None and not (capacity.isascii() and capacity.isdigit() and len(capacity) <= 20):
            raise InvalidArgument("node.labels", f"{POOL_CAPACITY_LABEL} must be a number of bytes")

    async def register_node(self, spec: NodeSpec, ttl: float | None) -> Node:
        self._check_spec(spec)
        lease = self._limits.node_ttl.pick(ttl, "ttl")
        node, changes, engine_changed = await self._store.register_node(spec, lease, self._clock.now())
        if engine_changed:  # the old engine's reports are refused from here on
            await self._index_feed.drop(spec.name, node.incarnation, self._clock.now())
        await self._shared.publish(changes)
        self._wake.set()
        log.info(
            "node.registered", node=spec.name, incarnation=node.incarnation, engine_changed=engine_changed
        )
        return node

    async def heartbeat_node(self, name: str, incarnation: int, ttl: float | None, load: NodeLoad) -> Node:
        self._check.node_name(name, "name")
        if incarnation <= 0:
            raise InvalidArgument("incarnation", "required")
        lease = self._limits.node_ttl.pick(ttl, "ttl")
        if not (math.isfinite(load.kv_cache_usage) and 0.0 <= load.kv_cache_usage <= 1.0):
            raise InvalidArgument("load.kv_cache_usage", "must be within 0..1")
        # Renewals only push deadlines later, so the expiry timer need not wake.
        return await self._store.heartbeat_node(name, incarnation, lease, load, self._clock.now())

    async def deregister_node(self, name: str, incarnation: int) -> int:
        self._check.node_name(name, "name")
        # The incarnation removed, so that its reports in flight are refused after the removal.
        removed = incarnation or (await self._store.get_node(name)).incarnation
        changes = await self._store.deregister_node(name, incarnation or None, self._clock.now())
        await self._index_feed.drop(name, removed + 1, self._clock.now())
        await self._shared.publish(changes)
        return len(changes)

    async def get_node(self, name: str) -> Node:
        return await self._store.get_node(self._check.node_name(name, "name"))

    async def list_nodes(
        self, *, role: NodeRole | None, model: str, page_size: int, page_token: str
    ) -> tuple[list[Node], str]:
        self._check.bounded(model, "model", required=False)
        size, after = self._check.page(page_size, page_token, "nodes")
        nodes = await self._store.list_nodes(role=role, model=model or None, after=after, limit=size)
        return nodes, self._check.next_token("nodes", [n.name for n in nodes], size)
