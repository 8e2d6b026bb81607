"""What the router needs from the registry, as domain calls. The gRPC adapter implements it
over RegistryClient; tests implement it over the registry's domain object, no sockets.

Failures are domain errors (kvshuttle.core.errors) carrying the registry's reason.
"""

from __future__ import annotations

from typing import Protocol

from kvshuttle.core.nodes import NodeRole
from kvshuttle.router.model import ClaimInfo, Hashes, NewRetention, NodeInfo, RetentionInfo


class RegistryPort(Protocol):
    async def get_conversation(self, name: str) -> tuple[int, RetentionInfo | None]:
        """(fence generation, live retention); (0, None) for a conversation never seen."""
        ...

    async def list_nodes(self, model: str) -> list[NodeInfo]: ...

    async def lookup_blocks(self, chain: Hashes, model: str, role: NodeRole) -> dict[str, int]:
        """Node name -> leading blocks of `chain` it holds."""
        ...

    async def claim(self, name: str, *, holder: str, claim_ttl: float, request_id: str) -> ClaimInfo: ...

    async def put_retention(self, new: NewRetention) -> RetentionInfo:
        """Store decode's retained KV; returns it as stored."""
        ...

    async def release(self, name: str, *, claim_id: str) -> None:
        """Remove a retention; a retention already gone is not an error."""
        ...
