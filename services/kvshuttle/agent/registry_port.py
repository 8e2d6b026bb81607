"""RegistryPort over the registry's gRPC API (RegistryClient, which retries what is safe).

Error mapping (KvshuttleRpcError code -> what the agent's loops see):

* NOT_FOUND, FAILED_PRECONDITION, RESOURCE_EXHAUSTED -> NotFound, FailedPrecondition,
  ResourceExhausted with the registry's reason (NODE_NOT_FOUND, NODE_INCARNATION_MISMATCH,
  CAPACITY_EXCEEDED).
* UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED -> Unavailable(reason="REGISTRY_UNAVAILABLE").
* anything else (INVALID_ARGUMENT: a misconfigured node or a batch over the registry's limits;
  PERMISSION_DENIED, UNAUTHENTICATED, INTERNAL) -> CallRefused, kept with its details for
  the log.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Sequence
from typing import TypeVar

from kvshuttle.client.errors import KvshuttleRpcError, domain_error
from kvshuttle.client.registry import RegistryClient
from kvshuttle.registry import block_index as bi
from kvshuttle.registry.model import NodeLoad, NodeRole, NodeSpec
from kvshuttle.registry.v1 import registry_service_pb2 as pb

__all__ = ["GrpcRegistryPort", "batch_to_pb", "spec_to_pb"]

T = TypeVar("T")

ROLE_TO_PB: dict[NodeRole, pb.NodeRole.ValueType] = {
    NodeRole.PREFILL: pb.NODE_ROLE_PREFILL,
    NodeRole.DECODE: pb.NODE_ROLE_DECODE,
    NodeRole.BOTH: pb.NODE_ROLE_BOTH,
}


def spec_to_pb(spec: NodeSpec) -> pb.Node:
    return pb.Node(
        name=spec.name,
        role=ROLE_TO_PB[spec.role],
        engine_id=spec.engine_id,
        http_endpoint=spec.http_endpoint,
        side_channel_host=spec.side_channel_host,
        side_channel_port=spec.side_channel_port,
        agent_endpoint=spec.agent_endpoint,
        model=spec.model,
        block_size=spec.block_size,
        kv_bytes_per_token=spec.kv_bytes_per_token,
        labels=spec.labels,
    )


def _event_to_pb(event: bi.BlockEvent) -> pb.BlockEvent:
    if isinstance(event, bi.BlockStored):
        stored = pb.BlockStored(
            block_hashes=event.block_hashes,
            token_ids=event.token_ids,
            block_size=event.block_size,
            medium=event.medium,
        )
        if event.parent_block_hash is not None:
            stored.parent_block_hash = event.parent_block_hash
        if event.lora_id is not None:
            stored.lora_id = event.lora_id
        return pb.BlockEvent(stored=stored)
    if isinstance(event, bi.BlockRemoved):
        return pb.BlockEvent(removed=pb.BlockRemoved(block_hashes=event.block_hashes, medium=event.medium))
    return pb.BlockEvent(cleared=pb.AllBlocksCleared())


def batch_to_pb(batch: bi.EventBatch) -> pb.BlockEventBatch:
    return pb.BlockEventBatch(
        seq=batch.seq, engine_time=batch.engine_time, events=[_event_to_pb(e) for e in batch.events]
    )


def _batches_to_pb(batches: Iterable[bi.EventBatch]) -> list[pb.BlockEventBatch]:
    return [batch_to_pb(b) for b in batches]


class GrpcRegistryPort:
    """The agent's RegistryPort over a RegistryClient."""

    def __init__(self, client: RegistryClient) -> None:
        self._client = client

    @staticmethod
    async def _call(call: Awaitable[T]) -> T:
        try:
            return await call
        except KvshuttleRpcError as err:
            raise domain_error(err, "registry") from err

    async def register_node(self, spec: NodeSpec, ttl: float) -> int:
        response = await self._call(self._client.register_node(spec_to_pb(spec), ttl=ttl))
        return int(response.node.incarnation)

    async def heartbeat_node(self, name: str, incarnation: int, ttl: float, load: NodeLoad) -> None:
        await self._call(
            self._client.heartbeat_node(
                name,
                incarnation,
                ttl=ttl,
                load=pb.NodeLoad(
                    running_requests=load.running_requests,
                    waiting_requests=load.waiting_requests,
                    kv_cache_usage=load.kv_cache_usage,
                    engine_healthy=load.engine_healthy,
                ),
            )
        )

    async def deregister_node(self, name: str, incarnation: int, *, deadline_s: float) -> None:
        await self._call(self._client.deregister_node(name, incarnation=incarnation, timeout=deadline_s))

    async def report_block_events(
        self, node: str, incarnation: int, batches: Sequence[bi.EventBatch]
    ) -> bi.ApplyResult:
        response = await self._call(
            self._client.report_block_events(node, incarnation, _batches_to_pb(batches))
        )
        return bi.ApplyResult(
            applied_batches=response.applied_batches,
            next_seq=response.next_seq,
            gap_detected=response.gap_detected,
            engine_restarted=response.engine_restarted,
        )
