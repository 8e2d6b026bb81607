"""RegistryPort over the registry's gRPC API (RegistryClient, which retries what is safe).

Error mapping (KvshuttleRpcError code -> what the agent's loops see):

* NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED -> NotFound, FailedPrecondition,
  ResourceExhausted with the registry's reason (NODE_NOT_FOUND, NODE_INCARNATION_MISMATCH,
  CAPACITY_EXCEEDED).
* UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED -> Unavailable (REGISTRY_UNAVAILABLE).
* anything else (INVALID_ARGUMENT: a misconfigured node or a batch over the registry's limits;
  PERMISSION_DENIED, UNAUTHENTICATED, INTERNAL) -> RegistryRefused with the registry's reason
  (or the status code), its details in the message for the log.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import TypeVar

from kvshuttle.agent.ports import RegistryRefused
from kvshuttle.client.errors import CallRefused, as_domain
from kvshuttle.client.registry import RegistryClient
from kvshuttle.client.registry_convert import apply_result_from_pb, batch_to_pb, load_to_pb, spec_to_pb
from kvshuttle.core.kv_events import ApplyResult, EventBatch
from kvshuttle.core.nodes import NodeLoad, NodeSpec

__all__ = ["GrpcRegistryPort"]

T = TypeVar("T")


async def _registry(call: Awaitable[T]) -> T:
    try:
        return await as_domain(call, "registry")
    except CallRefused as err:
        raise RegistryRefused(str(err), reason=err.error.reason or err.error.code_name) from err


class GrpcRegistryPort:
    """The agent's RegistryPort over a RegistryClient."""

    def __init__(self, client: RegistryClient) -> None:
        self._client = client

    async def register_node(self, spec: NodeSpec, ttl: float) -> int:
        response = await _registry(self._client.register_node(spec_to_pb(spec), ttl=ttl))
        return int(response.node.incarnation)

    async def heartbeat_node(self, name: str, incarnation: int, ttl: float, load: NodeLoad) -> None:
        await _registry(
            self._client.heartbeat_node(
                name,
                incarnation,
                ttl=ttl,
                load=load_to_pb(load),
            )
        )

    async def deregister_node(self, name: str, incarnation: int, *, deadline_s: float) -> None:
        await _registry(self._client.deregister_node(name, incarnation=incarnation, timeout=deadline_s))

    async def report_block_events(
        self, node: str, incarnation: int, batches: Sequence[EventBatch]
    ) -> ApplyResult:
        response = await _registry(
            self._client.report_block_events(node, incarnation, [batch_to_pb(b) for b in batches])
        )
        return apply_result_from_pb(response)

    async def evict_retention(self, name: str, node: str) -> None:
        await _registry(self._client.evict_retention(name, node=node))
