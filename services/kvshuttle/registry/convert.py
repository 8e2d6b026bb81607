"""Protobuf <-> registry domain records. Pure translation: bounds are the domain's job, except
where a value cannot even be represented (an unknown enum, a malformed nested message)."""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp

from kvshuttle.core.errors import InvalidArgument
from kvshuttle.registry import block_index as bi
from kvshuttle.registry.model import (
    ChangeKind,
    Node,
    NodeLoad,
    NodeRole,
    NodeSpec,
    Retention,
    RetentionChange,
)
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

ROLE_TO_PB = {
    NodeRole.PREFILL: pb.NODE_ROLE_PREFILL,
    NodeRole.DECODE: pb.NODE_ROLE_DECODE,
    NodeRole.BOTH: pb.NODE_ROLE_BOTH,
}
ROLE_FROM_PB = {v: k for k, v in ROLE_TO_PB.items()}
CHANGE_TO_PB = {
    ChangeKind.PUT: pb.RETENTION_CHANGE_PUT,
    ChangeKind.RENEWED: pb.RETENTION_CHANGE_RENEWED,
    ChangeKind.CLAIMED: pb.RETENTION_CHANGE_CLAIMED,
    ChangeKind.RELEASED: pb.RETENTION_CHANGE_RELEASED,
    ChangeKind.EXPIRED: pb.RETENTION_CHANGE_EXPIRED,
    ChangeKind.REPLACED: pb.RETENTION_CHANGE_REPLACED,
    ChangeKind.NODE_LOST: pb.RETENTION_CHANGE_NODE_LOST,
}


def timestamp(seconds: float) -> Timestamp:
    ts = Timestamp()
    ts.FromNanoseconds(round(seconds * 1e9))
    return ts


def seconds(ts: Timestamp) -> float:
    return ts.ToNanoseconds() / 1e9


def duration_seconds(d: Duration, field: str) -> float | None:
    """None when unset (the domain picks its default); negative durations are rejected."""
    if d.seconds == 0 and d.nanos == 0:
        return None
    value = d.ToNanoseconds() / 1e9
    if value < 0:
        raise InvalidArgument(field, "must not be negative")
    return value


def role_from_pb(role: int, field: str, *, required: bool) -> NodeRole | None:
    if role == pb.NODE_ROLE_UNSPECIFIED and not required:
        return None
    found: NodeRole | None = ROLE_FROM_PB.get(role)  # type: ignore[call-overload]
    if found is None:
        raise InvalidArgument(field, "must be NODE_ROLE_PREFILL, NODE_ROLE_DECODE or NODE_ROLE_BOTH")
    return found


def node_spec_from_pb(node: pb.Node) -> NodeSpec:
    role = role_from_pb(node.role, "node.role", required=True)
    assert role is not None
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


def node_to_pb(node: Node, indexed_blocks: int = 0) -> pb.Node:
    """A live node: its spec and the registry's output-only fields."""
    out = spec_to_pb(node.spec)
    load = node.load
    out.load.running_requests = load.running_requests
    out.load.waiting_requests = load.waiting_requests
    out.load.kv_cache_usage = load.kv_cache_usage
    out.load.engine_healthy = load.engine_healthy
    out.incarnation = node.incarnation
    out.register_time.CopyFrom(timestamp(node.register_time))
    out.expire_time.CopyFrom(timestamp(node.expire_at))
    out.retained_bytes = node.retained_bytes
    out.retention_count = node.retention_count
    out.indexed_blocks = indexed_blocks
    return out


def retention_from_pb(r: pb.Retention) -> Retention:
    """The input fields of a retention; the name is set by the domain from the parent."""
    return Retention(
        name="",
        node=r.node,
        generation=r.generation,
        model=r.model,
        block_size=r.block_size,
        num_tokens=r.num_tokens,
        block_hashes=array("Q", r.block_hashes),
        kv_transfer_params=r.kv_transfer_params.SerializeToString(deterministic=True)
        if r.HasField("kv_transfer_params")
        else b"",
        kv_bytes=r.kv_bytes,
        pin_expire_at=seconds(r.pin_expire_time) if r.HasField("pin_expire_time") else None,
    )


def retention_to_pb(r: Retention) -> pb.Retention:
    out = pb.Retention(
        name=r.name,
        node=r.node,
        generation=r.generation,
        model=r.model,
        block_size=r.block_size,
        num_tokens=r.num_tokens,
        block_hashes=r.block_hashes,
        kv_transfer_params=KvTransferParams.FromString(r.kv_transfer_params),
        kv_bytes=r.kv_bytes,
        state=pb.RETENTION_STATE_CLAIMED if r.claim is not None else pb.RETENTION_STATE_ACTIVE,
        create_time=timestamp(r.create_time),
        expire_time=timestamp(r.expire_at),
    )
    if r.pin_expire_at is not None:
        out.pin_expire_time.CopyFrom(timestamp(r.pin_expire_at))
    if r.claim is not None:
        out.claim.CopyFrom(
            pb.Claim(
                claim_id=r.claim.claim_id,
                holder=r.claim.holder,
                claim_time=timestamp(r.claim.claim_time),
                expire_time=timestamp(r.claim.expire_at),
            )
        )
    return out


def change_to_pb(change: RetentionChange) -> pb.WatchRetentionsResponse:
    return pb.WatchRetentionsResponse(
        change=CHANGE_TO_PB[change.kind],
        retention=retention_to_pb(change.retention),
        change_time=timestamp(change.at),
    )


def event_batches_from_pb(batches: Sequence[pb.BlockEventBatch]) -> list[bi.EventBatch]:
    out: list[bi.EventBatch] = []
    for i, batch in enumerate(batches):
        events: list[bi.BlockStored | bi.BlockRemoved | bi.AllBlocksCleared] = []
        for j, event in enumerate(batch.events):
            kind = event.WhichOneof("event")
            if kind == "stored":
                s = event.stored
                events.append(
                    bi.BlockStored(
                        block_hashes=tuple(s.block_hashes),
                        parent_block_hash=s.parent_block_hash if s.HasField("parent_block_hash") else None,
                        token_ids=tuple(s.token_ids),
                        block_size=s.block_size,
                        lora_id=s.lora_id if s.HasField("lora_id") else None,
                        medium=s.medium,
                    )
                )
            elif kind == "removed":
                events.append(
                    bi.BlockRemoved(
                        block_hashes=tuple(event.removed.block_hashes), medium=event.removed.medium
                    )
                )
            elif kind == "cleared":
                events.append(bi.AllBlocksCleared())
            else:
                raise InvalidArgument(f"batches[{i}].events[{j}]", "must set stored, removed or cleared")
        out.append(bi.EventBatch(seq=batch.seq, engine_time=batch.engine_time, events=tuple(events)))
    return out
