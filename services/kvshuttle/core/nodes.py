"""A vLLM worker as kvshuttle knows it: its role, what its registrant says about it, its load.

Shared by the agent (which registers its worker), the registry (which leases nodes) and the
router (which places turns on them). The registry's lease record (`registry.model.Node`) and
the router's view (`router.model.NodeInfo`) are built from these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

__all__ = ["NodeLoad", "NodeRole", "NodeSpec"]


class NodeRole(StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"

    def serves(self, wanted: NodeRole | None) -> bool:
        """Whether a node of this role can serve `wanted` (None: any role)."""
        return wanted is None or self is wanted or self is NodeRole.BOTH


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
