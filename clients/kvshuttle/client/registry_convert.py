"""kvshuttle's shared domain values <-> the registry API's messages: node roles, specs and
loads (kvshuttle.core.nodes), KV-event batches and their outcome (kvshuttle.core.kv_events).

One translation for every side that speaks them: the agent (registering its worker,
forwarding its events), the router (reading nodes) and the registry's own servicer.
"""

from __future__ import annotations

from kvshuttle.core.kv_events import (
    AllBlocksCleared,
    ApplyResult,
    BlockEvent,
    BlockRemoved,
    BlockStored,
    EventBatch,
)
from kvshuttle.core.nodes import NodeLoad, NodeRole, NodeSpec
from kvshuttle.registry.v1 import registry_service_pb2 as pb

__all__ = [
    "ROLE_FROM_PB",
    "ROLE_TO_PB",
    "apply_result_from_pb",
    "batch_to_pb",
    "load_from_pb",
    "load_to_pb",
    "spec_from_pb",
    "spec_to_pb",
]

ROLE_TO_PB: dict[NodeRole, pb.NodeRole.ValueType] = {
    NodeRole.PREFILL: pb.NODE_ROLE_PREFILL,
    NodeRole.DECODE: pb.NODE_ROLE_DECODE,
    NodeRole.BOTH: pb.NODE_ROLE_BOTH,
    NodeRole.POOL: pb.NODE_ROLE_POOL,
}
ROLE_FROM_PB: dict[int, NodeRole] = {v: k for k, v in ROLE_TO_PB.items()}


def spec_to_pb(spec: NodeSpec) -> pb.Node:
    """A node's descriptive fields (what RegisterNode takes)."""
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


def spec_from_pb(node: pb.Node, role: NodeRole) -> NodeSpec:
    """A node's descriptive fields, of the role the caller resolved from node.role (ROLE_FROM_PB:
    the registry refuses a role it does not know, the router skips the node)."""
    return NodeSpec(
        name=node.name,
        role=role,
        engine_id=node.engine_id,
        http_endpoint=node.http_endpoint,
        side_channel_host=node.side_channel_host,
        side_channel_port=node.side_channel_port,
        agent_endpoint=node.agent_endpoint,
        model=node.model,
        block_size=node.block_size,
        kv_bytes_per_token=node.kv_bytes_per_token,
        labels=dict(node.labels),
    )


def load_from_pb(load: pb.NodeLoad) -> NodeLoad:
    return NodeLoad(
        running_requests=load.running_requests,
        waiting_requests=load.waiting_requests,
        kv_cache_usage=load.kv_cache_usage,
        engine_healthy=load.engine_healthy,
    )


def load_to_pb(load: NodeLoad) -> pb.NodeLoad:
    return pb.NodeLoad(
        running_requests=load.running_requests,
        waiting_requests=load.waiting_requests,
        kv_cache_usage=load.kv_cache_usage,
        engine_healthy=load.engine_healthy,
    )


def _event_to_pb(event: BlockEvent) -> pb.BlockEvent:
    if isinstance(event, BlockStored):
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
        if event.cache_salt_sha256:
            stored.cache_salt_sha256 = event.cache_salt_sha256
        return pb.BlockEvent(stored=stored)
    if isinstance(event, BlockRemoved):
        return pb.BlockEvent(removed=pb.BlockRemoved(block_hashes=event.block_hashes, medium=event.medium))
    assert isinstance(event, AllBlocksCleared)
    return pb.BlockEvent(cleared=pb.AllBlocksCleared())


def batch_to_pb(batch: EventBatch) -> pb.BlockEventBatch:
    return pb.BlockEventBatch(
        seq=batch.seq, engine_time=batch.engine_time, events=[_event_to_pb(e) for e in batch.events]
    )


def apply_result_from_pb(response: pb.ReportBlockEventsResponse) -> ApplyResult:
    return ApplyResult(
        applied_batches=response.applied_batches,
        next_seq=response.next_seq,
        gap_detected=response.gap_detected,
        engine_restarted=response.engine_restarted,
    )
