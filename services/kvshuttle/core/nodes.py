"""A vLLM worker as kvshuttle knows it: its role, what its registrant says about it, its load.

Shared by the agent (which registers its worker), the registry (which leases nodes) and the
router (which places turns on them). The registry's lease record (`registry.model.Node`) and
the router's view (`router.model.NodeInfo`) are built from these.

An agent with a block pool registers the pool as a node of its own, `pool_node_name(node)`, of
role POOL: parked and prefetched retentions are held by it, and read over the pool's own NIXL
side channel, so readers still go only to nodes as registered. A pool node is never placed as
prefill or decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.limits import MAX_ID_LENGTH
from kvshuttle.core.names import check_id, parse_node

__all__ = [
    "POOL_CAPACITY_LABEL",
    "POOL_NODE_SUFFIX",
    "POOL_OF_LABEL",
    "NodeLoad",
    "NodeRole",
    "NodeSpec",
    "is_pool_node_name",
    "pool_node_name",
    "pool_owner",
]

# Labels of a pool node: the node whose agent owns the pool, and the pool's size in bytes.
POOL_OF_LABEL: Final = "kvshuttle.io/pool-of"
POOL_CAPACITY_LABEL: Final = "kvshuttle.io/pool-capacity-bytes"
# `nodes/{node}` -> `nodes/{node}-pool`.
POOL_NODE_SUFFIX: Final = "-pool"


class NodeRole(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"
    # An agent's block pool (pool_node_name): holds retentions, serves reads, runs no requests.
    POOL = "pool"

    def serves(self, wanted: NodeRole | None) -> bool:
        """Whether a node of this role can serve `wanted` (None: any role). A pool node serves
        only POOL; a BOTH node serves PREFILL, DECODE and BOTH."""
        if wanted is None or self is wanted:
            return True
        return self is NodeRole.BOTH and wanted is not NodeRole.POOL


def pool_node_name(node: str, field: str = "node", *, max_length: int = MAX_ID_LENGTH) -> str:
    """The name of the pool node of `node`'s agent: "nodes/x" -> "nodes/x-pool". InvalidArgument
    when `node` is not a node name, is itself a pool node's, or is too long to take the suffix
    (its id must leave len(POOL_NODE_SUFFIX) characters of `max_length`)."""
    node_id = parse_node(node, field, max_length=max_length)
    if is_pool_node_name(node):
        raise InvalidArgument(field, f"{node} is a pool node's name already")
    if len(node_id) + len(POOL_NODE_SUFFIX) > max_length:
        raise InvalidArgument(
            field,
            f"node id longer than {max_length - len(POOL_NODE_SUFFIX)} characters leaves no room "
            f"for its pool node's name (+{POOL_NODE_SUFFIX!r})",
        )
    return f"nodes/{check_id(node_id + POOL_NODE_SUFFIX, field, max_length=max_length)}"


def is_pool_node_name(node: str) -> bool:
    """Whether `node` has the shape of a pool node's name (no validation of the rest)."""
    return node.endswith(POOL_NODE_SUFFIX)


def pool_owner(pool_node: str) -> str:
    """The node a pool node's name belongs to: "nodes/x-pool" -> "nodes/x" ("" when `pool_node`
    has no pool node's shape)."""
    if not is_pool_node_name(pool_node) or pool_node == f"nodes/{POOL_NODE_SUFFIX}":
        return ""
    return pool_node.removesuffix(POOL_NODE_SUFFIX)


@dataclass(slots=True)
class NodeLoad:
    running_requests: int = 0
    waiting_requests: int = 0
    kv_cache_usage: float = 0.0
    engine_healthy: bool = False


@dataclass(slots=True)
class NodeSpec:
    """What a registrant says about its worker."""

    name: str  # nodes/{node}
    role: NodeRole
    engine_id: str
    http_endpoint: str
    side_channel_host: str
    side_channel_port: int
    agent_endpoint: str
    model: str
    block_size: int
    kv_bytes_per_token: int
    labels: dict[str, str] = field(default_factory=dict)
