"""What the agent needs from the registry and from the engine's replay endpoint, as domain
calls. The gRPC and ZMQ adapters implement them; tests may implement them over anything.

Registry failures are domain errors (kvshuttle.core.errors) carrying the registry's reason:
NotFound (NODE_NOT_FOUND: the lease lapsed, register again), FailedPrecondition
(NODE_INCARNATION_MISMATCH: a newer registration replaced this one), Unavailable (the
registry could not be reached in time; try again later). A call the registry refused outright
(INVALID_ARGUMENT, PERMISSION_DENIED...: a bug or a misconfiguration, never retried) raises
RegistryRefused with the registry's reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvshuttle.core.kv_events import ApplyResult, EventBatch
from kvshuttle.core.nodes import NodeLoad, NodeSpec

__all__ = ["RegistryPort", "RegistryRefused", "ReplayPort"]


class RegistryRefused(Exception):
    """The registry refused a call as built: `reason` is its ErrorInfo reason (or status code)."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class RegistryPort(Protocol):
    async def register_node(self, spec: NodeSpec, ttl: float) -> int:
        """Start a new lease; returns its incarnation."""
        ...

    async def heartbeat_node(self, name: str, incarnation: int, ttl: float, load: NodeLoad) -> None: ...

    async def deregister_node(self, name: str, incarnation: int, *, deadline_s: float) -> None:
        """End the lease now; `deadline_s` bounds the call."""
        ...

    async def report_block_events(
        self, node: str, incarnation: int, batches: Sequence[EventBatch]
    ) -> ApplyResult:
        """Apply batches in order. With no batches it changes nothing and answers the seq the
        registry expects next from the node (0: it holds nothing of the node's sequence)."""
        ...

    async def evict_retention(self, name: str, node: str) -> None:
        """Drop retention `name` from `node` (this agent's pool node) so its pool slots may be
        reused. NotFound (RETENTION_NOT_FOUND): gone already, as good as evicted;
        FailedPrecondition (NODE_MISMATCH: not held by `node`, e.g. not moved there yet;
        RETENTION_ALREADY_CLAIMED: a reader claimed it): keep the slots."""
        ...


class ReplayPort(Protocol):
    async def fetch(self, start: int, end: int) -> list[EventBatch]:
        """The engine's buffered batches with start <= seq < end, in order; fewer (or none)
        when the engine no longer has them or does not answer in time. Never raises for that."""
        ...
