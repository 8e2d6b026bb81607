"""The nodes an agent registers: its engine's (from the settings), and its served pool's."""

from __future__ import annotations

from kvshuttle.agent.config import AgentSettings
from kvshuttle.core.nodes import POOL_CAPACITY_LABEL, POOL_OF_LABEL, NodeRole, NodeSpec, pool_node_name

__all__ = ["node_spec", "pool_node_spec"]


def node_spec(settings: AgentSettings, agent_endpoint: str = "", engine_id: str | None = None) -> NodeSpec:
    """The node to register; `engine_id` replaces node.engine_id (one read from the id file)."""
    node = settings.node
    return NodeSpec(
        name=node.name,
        role=NodeRole(node.role),
        engine_id=engine_id or node.engine_id or "",
        http_endpoint=node.http_endpoint,
        side_channel_host=node.side_channel_host,
        side_channel_port=node.side_channel_port,
        agent_endpoint=agent_endpoint,
        model=node.model,
        block_size=node.block_size,
        kv_bytes_per_token=node.kv_bytes_per_token,
        labels=dict(node.labels),
    )


def pool_node_spec(
    engine: NodeSpec, *, engine_id: str, host: str, port: int, capacity_bytes: int
) -> NodeSpec:
    """The node an agent's served pool registers as: named after the engine's node, role POOL,
    the pool server's engine id and side channel, the engine's model and block geometry."""
    return NodeSpec(
        name=pool_node_name(engine.name),
        role=NodeRole.POOL,
        engine_id=engine_id,
        http_endpoint=engine.http_endpoint,
        side_channel_host=host,
        side_channel_port=port,
        agent_endpoint=engine.agent_endpoint,
        model=engine.model,
        block_size=engine.block_size,
        kv_bytes_per_token=engine.kv_bytes_per_token,
        labels={POOL_OF_LABEL: engine.name, POOL_CAPACITY_LABEL: str(capacity_bytes)},
    )
