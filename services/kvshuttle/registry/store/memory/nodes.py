"""The in-memory store's node operations (kvshuttle.registry.store.memory.store)."""

from __future__ import annotations

import copy

from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec
from kvshuttle.registry.model import ChangeKind, Node, RetentionChange
from kvshuttle.registry.store.errors import incarnation_mismatch, node_not_found, too_many
from kvshuttle.registry.store.memory.state import NODE, MemoryState, snapshot_node


class MemoryNodes:
    """Node leases: register, heartbeat, deregister, read, list."""

    def __init__(self, state: MemoryState) -> None:
        self._state = state

    async def register_node(
        self, spec: NodeSpec, ttl: float, now: float
    ) -> tuple[Node, list[RetentionChange], bool]:
        existing = self._state.nodes.get(spec.name)
        if existing is None and len(self._state.nodes) >= self._state.limits.max_nodes:
            raise too_many("max_nodes", f"at most {self._state.limits.max_nodes} nodes")
        changes: list[RetentionChange] = []
        engine_changed = existing is not None and existing.spec.engine_id != spec.engine_id
        if engine_changed:
            changes = self._state.drop_node_retentions(spec.name, ChangeKind.NODE_LOST, now)
        node = Node(
            spec=copy.deepcopy(spec),
            incarnation=self._state.next_incarnation,
            register_time=now,
            expire_at=now + ttl,
            load=NodeLoad(),
        )
        self._state.next_incarnation += 1
        if existing is not None and not engine_changed:
            node.retained_bytes = existing.retained_bytes
            node.retention_count = existing.retention_count
        self._state.nodes[spec.name] = node
        self._state.node_retentions.setdefault(spec.name, set())
        self._state.push(node.expire_at, NODE, spec.name)
        return snapshot_node(node), changes, engine_changed

    def _live_node(self, name: str, incarnation: int | None) -> Node:
        node = self._state.nodes.get(name)
        if node is None:
            raise node_not_found(name)
        if incarnation is not None and node.incarnation != incarnation:
            raise incarnation_mismatch(name, str(node.incarnation), incarnation)
        return node

    async def heartbeat_node(
        self, name: str, incarnation: int, ttl: float, load: NodeLoad, now: float
    ) -> Node:
        node = self._live_node(name, incarnation)
        node.expire_at = now + ttl
        node.load = copy.copy(load)
        self._state.push(node.expire_at, NODE, name)
        return snapshot_node(node)

    async def deregister_node(self, name: str, incarnation: int | None, now: float) -> list[RetentionChange]:
        self._live_node(name, incarnation)
        return self._state.remove_node(name, now)

    async def get_node(self, name: str) -> Node:
        return snapshot_node(self._live_node(name, None))

    async def list_nodes(
        self, *, role: NodeRole | None, model: str | None, after: str, limit: int
    ) -> list[Node]:
        names = sorted(n for n in self._state.nodes if n > after)
        out: list[Node] = []
        for name in names:
            node = self._state.nodes[name]
            if node.spec.role.serves(role) and (not model or node.spec.model == model):
                out.append(snapshot_node(node))
                if len(out) >= limit:
                    break
        return out
