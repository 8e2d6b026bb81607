"""What the router needs from the registry and from the agents, as domain calls. The gRPC
adapters implement them over RegistryClient (grpc/registry_port.py) and AgentClient
(grpc/agent_port.py); tests implement them over the registry's domain object or fakes, no sockets.

Failures are domain errors (kvshuttle.core.errors) carrying the other service's reason.
"""

from __future__ import annotations

from typing import Any, Protocol

from kvshuttle.core.nodes import NodeRole
from kvshuttle.router.model import (
    ClaimInfo,
    FoundTranscript,
    Hashes,
    NewRetention,
    NodeInfo,
    Pooled,
    RetentionInfo,
)


class RegistryPort(Protocol):
    async def get_conversation(self, name: str) -> tuple[int, RetentionInfo | None]:
        """(fence generation, live retention); (0, None) for a conversation never seen."""
        ...

    async def list_nodes(self, model: str) -> list[NodeInfo]: ...

    async def find_by_chain(
        self, tenant: str, model: str, block_size: int, chain: Hashes
    ) -> RetentionInfo | None:
        """The tenant's live retention whose whole chain is the longest prefix of `chain`;
        None when none is."""
        ...

    async def find_transcript(self, tenant: str, model: str, lookup_key: bytes) -> FoundTranscript | None:
        """The tenant's transcript with `lookup_key` and its conversation; None when none."""
        ...

    async def lookup_blocks(self, chain: Hashes, model: str, role: NodeRole) -> dict[str, int]:
        """Node name -> leading blocks of `chain` it holds."""
        ...

    async def claim(
        self, name: str, *, holder: str, claim_ttl: float, request_id: str, shared: bool = False
    ) -> ClaimInfo:
        """Claim the retention for one reader, or (`shared`) as one of the readers of a
        pool-held one."""
        ...

    async def put_retention(self, new: NewRetention) -> RetentionInfo:
        """Store decode's retained KV; returns it as stored."""
        ...

    async def release(self, name: str, *, claim_id: str, keep: bool = False) -> None:
        """Remove a retention; a retention already gone is not an error. With `keep`, give the
        claim back instead (nothing was read: the holder still has every block)."""
        ...

    async def move_retention(
        self,
        name: str,
        *,
        claim_id: str,
        node: str,
        kv_transfer_params: dict[str, Any],
        kv_bytes: int,
        ttl: float,
        request_id: str,
    ) -> RetentionInfo:
        """Re-point a retention this caller claimed (`claim_id`) at `node` (a pool node) with
        `kv_transfer_params`, in one update: claim and pin cleared, expiring `ttl` from now."""
        ...


class AgentPort(Protocol):
    """The agents the shuttle asks to move a retention's blocks into their pools, each by its
    gRPC endpoint (NodeInfo.agent_endpoint). Both answer the pool node now holding the blocks
    and the params to read them there; neither touches the registry's record of the retention.

    Unavailable means the agent's answer is not known (it may have read, and so freed the
    holder's blocks); the other domain errors that it refused and read nothing."""

    async def park(
        self, endpoint: str, retention: str, *, source: dict[str, Any], ttl: float, request_id: str
    ) -> Pooled:
        """The agent of `source`'s engine reads its blocks into its own pool."""
        ...

    async def prefetch(
        self,
        endpoint: str,
        retention: str,
        target_node: str,
        *,
        source: dict[str, Any],
        ttl: float,
        request_id: str,
    ) -> Pooled:
        """The agent of `target_node` (an engine node) reads `source`'s blocks into its pool."""
        ...

    async def serving(self, endpoint: str, *, deadline_s: float) -> bool:
        """Whether the agent at `endpoint` answers within `deadline_s` and has a pool: asked
        before a plan sends prefill to read from its pool (vLLM 0.32's prefill never finishes a
        request whose READ failed on a peer that died after its handshake)."""
        ...

    async def close(self) -> None: ...
