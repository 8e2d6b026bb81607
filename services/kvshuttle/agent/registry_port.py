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

from collections.abc import Iterable, Sequence

from kvshuttle.client.errors import as_domain
from kvshuttle.client.registry import RegistryClient
from kvshuttle.registry import block_index as bi
from kvshuttle.registry.convert import spec_to_pb
from kvshuttle.registry.model import NodeLoad, NodeSpec
from kvshuttle.registry.v1 import registry_service_pb2 as pb

__all__ = ["GrpcRegistryPort", "batch_to_pb"]


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

    async def register_node(self, spec: NodeSpec, ttl: float) -> int:
        response = await as_domain(self._client.register_node(spec_to_pb(spec), ttl=ttl), "registry")
        return int(response.node.incarnation)

    async def heartbeat_node(self, name: str, incarnation: int, ttl: float, load: NodeLoad) -> None:
        await as_domain(
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
            ),
            "registry",
        )

    async def deregister_node(self, name: str, incarnation: int, *, deadline_s: float) -> None:
        await as_domain(
            self._client.deregister_node(name, incarnation=incarnation, timeout=deadline_s), "registry"
        )

    async def report_block_events(
        self, node: str, incarnation: int, batches: Sequence[bi.EventBatch]
    ) -> bi.ApplyResult:
        response = await as_domain(
            self._client.report_block_events(node, incarnation, _batches_to_pb(batches)), "registry"
        )
        return bi.ApplyResult(
            applied_batches=response.applied_batches,
            next_seq=response.next_seq,
            gap_detected=response.gap_detected,
            engine_restarted=response.engine_restarted,
        )
