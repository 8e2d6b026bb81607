"""Protobuf <-> registry domain records. Pure translation: bounds are the domain's job, except
where a value cannot even be represented (an unknown enum, a malformed nested message, a
Timestamp outside protobuf's range) and what only the wire format shows (the bounds on
kv_transfer_params' pass-through `extra`). The holder a retention's params name is read here and
handed to the domain as plain values (model.Holder): the domain keeps the params opaque."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from kvshuttle.client.registry_convert import ROLE_FROM_PB, load_to_pb, spec_from_pb, spec_to_pb
from kvshuttle.core import kv_events as ev
from kvshuttle.core.errors import InvalidArgument
from kvshuttle.core.hashing import SALT_DIGEST_BYTES
from kvshuttle.core.nodes import NodeRole, NodeSpec
from kvshuttle.core.prototime import from_timestamp, timestamp_seconds, to_timestamp
from kvshuttle.registry.model import (
    ChangeKind,
    Claim,
    Holder,
    Move,
    Node,
    Retention,
    RetentionChange,
    Transcript,
)
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.vllm.kv_transfer_params import check_extra
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

_UINT64_MAX = 2**64 - 1
_UINT32_MAX = 2**32 - 1

CHANGE_TO_PB = {
    ChangeKind.PUT: pb.RETENTION_CHANGE_PUT,
    ChangeKind.RENEWED: pb.RETENTION_CHANGE_RENEWED,
    ChangeKind.CLAIMED: pb.RETENTION_CHANGE_CLAIMED,
    ChangeKind.RELEASED: pb.RETENTION_CHANGE_RELEASED,
    ChangeKind.EXPIRED: pb.RETENTION_CHANGE_EXPIRED,
    ChangeKind.REPLACED: pb.RETENTION_CHANGE_REPLACED,
    ChangeKind.NODE_LOST: pb.RETENTION_CHANGE_NODE_LOST,
    ChangeKind.MOVED: pb.RETENTION_CHANGE_MOVED,
    ChangeKind.EVICTED: pb.RETENTION_CHANGE_EVICTED,
    ChangeKind.UNCLAIMED: pb.RETENTION_CHANGE_UNCLAIMED,
}
CHANGE_FROM_PB = {v: k for k, v in CHANGE_TO_PB.items()}


def role_from_pb(role: int, field: str, *, required: bool) -> NodeRole | None:
    if role == pb.NODE_ROLE_UNSPECIFIED and not required:
        return None
    found = ROLE_FROM_PB.get(role)
    if found is None:
        raise InvalidArgument(
            field, "must be NODE_ROLE_PREFILL, NODE_ROLE_DECODE, NODE_ROLE_BOTH or NODE_ROLE_POOL"
        )
    return found


def node_spec_from_pb(node: pb.Node) -> NodeSpec:
    """The spec of a node a caller sent: INVALID_ARGUMENT (node.role) for a role the API lacks."""
    role = role_from_pb(node.role, "node.role", required=True)
    assert role is not None
    return spec_from_pb(node, role)


def node_to_pb(node: Node, indexed_blocks: int = 0) -> pb.Node:
    """A live node: its spec and the registry's output-only fields."""
    out = spec_to_pb(node.spec)
    out.load.CopyFrom(load_to_pb(node.load))
    out.incarnation = node.incarnation
    out.register_time.CopyFrom(to_timestamp(node.register_time))
    out.expire_time.CopyFrom(to_timestamp(node.expire_at))
    # Sums over the node's retentions: each is bounded, so these fit; saturated all the same, so
    # that no configuration of the bounds can make a node unlistable.
    out.retained_bytes = min(node.retained_bytes, _UINT64_MAX)
    out.retention_count = min(node.retention_count, _UINT32_MAX)
    out.indexed_blocks = indexed_blocks
    return out


def holder_from_pb(params: KvTransferParams) -> Holder:
    """Who decode's params send readers to; an unset field is "" or 0 (names no node). Interned:
    a node's many retentions share one engine id and host string."""
    return Holder(
        engine_id=sys.intern(params.remote_engine_id),
        side_channel_host=sys.intern(params.remote_host),
        side_channel_port=params.remote_port,
    )


def retention_from_pb(r: pb.Retention) -> Retention:
    """The input fields of a retention; the name is set by the domain from the parent."""
    params = r.kv_transfer_params if r.HasField("kv_transfer_params") else None
    if params is not None:
        check_extra(params, "retention.kv_transfer_params")
    pin = (
        timestamp_seconds(r.pin_expire_time, "retention.pin_expire_time")
        if r.HasField("pin_expire_time")
        else None
    )
    return Retention(
        name="",
        node=r.node,
        generation=r.generation,
        model=r.model,
        block_size=r.block_size,
        num_tokens=r.num_tokens,
        block_hashes=array("Q", r.block_hashes),
        kv_transfer_params=params.SerializeToString(deterministic=True) if params is not None else b"",
        kv_bytes=r.kv_bytes,
        pin_expire_at=pin,
        holder=holder_from_pb(params) if params is not None else None,
        transcript=transcript_from_pb(r.transcript) if r.HasField("transcript") else None,
        prompt_blocks=r.prompt_blocks,
    )


def transcript_from_pb(t: pb.Transcript) -> Transcript:
    return Transcript(
        lookup_key=t.lookup_key,
        token_ids=array("I", t.token_ids),
        answer_sha256=t.answer_sha256,
        answer_chars=t.answer_chars,
    )


def move_from_pb(request: pb.MoveRetentionRequest) -> Move:
    """What MoveRetention hands over: the new holder and its params (read for their holder, as a
    put's are); the lease is the servicer's."""
    params = request.kv_transfer_params if request.HasField("kv_transfer_params") else None
    if params is not None:
        check_extra(params, "kv_transfer_params")
    return Move(
        name=request.name,
        claim_id=request.claim_id,
        node=request.node,
        kv_transfer_params=params.SerializeToString(deterministic=True) if params is not None else b"",
        kv_bytes=request.kv_bytes,
        holder=holder_from_pb(params) if params is not None else None,
    )


def retention_to_pb(r: Retention, *, transcript: bool = False) -> pb.Retention:
    """The retention; with its transcript only when `transcript` (reads of one retention)."""
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
        state=pb.RETENTION_STATE_CLAIMED if r.claim is not None or r.shared else pb.RETENTION_STATE_ACTIVE,
        prompt_blocks=r.prompt_blocks,
        shared_claims=len(r.shared),
        create_time=to_timestamp(r.create_time),
        expire_time=to_timestamp(r.expire_at),
    )
    if r.pin_expire_at is not None:
        out.pin_expire_time.CopyFrom(to_timestamp(r.pin_expire_at))
    if r.claim is not None:
        out.claim.CopyFrom(
            pb.Claim(
                claim_id=r.claim.claim_id,
                holder=r.claim.holder,
                claim_time=to_timestamp(r.claim.claim_time),
                expire_time=to_timestamp(r.claim.expire_at),
            )
        )
    if transcript and r.transcript is not None:
        t = r.transcript
        out.transcript.CopyFrom(
            pb.Transcript(
                lookup_key=t.lookup_key,
                token_ids=t.token_ids,
                answer_sha256=t.answer_sha256,
                answer_chars=t.answer_chars,
            )
        )
    return out


def change_to_pb(change: RetentionChange) -> pb.WatchRetentionsResponse:
    return pb.WatchRetentionsResponse(
        change=CHANGE_TO_PB[change.kind],
        retention=retention_to_pb(change.retention),
        change_time=to_timestamp(change.at),
        previous_node=change.previous_node,
        resume_token=change.token,
    )


def change_from_pb(out: pb.WatchRetentionsResponse, token: str) -> RetentionChange:
    """The inverse of change_to_pb, for a change that went through the Redis change feed (which
    stores what change_to_pb writes): every field a watcher is sent comes back (a claim's
    `lease_expire_at`, never sent, is 0)."""
    r = out.retention
    params = r.kv_transfer_params
    claim = None
    if r.HasField("claim"):
        claim = Claim(
            claim_id=r.claim.claim_id,
            holder=r.claim.holder,
            claim_time=from_timestamp(r.claim.claim_time),
            expire_at=from_timestamp(r.claim.expire_time),
        )
    retention = Retention(
        name=r.name,
        node=r.node,
        generation=r.generation,
        model=r.model,
        block_size=r.block_size,
        num_tokens=r.num_tokens,
        block_hashes=array("Q", r.block_hashes),
        kv_transfer_params=params.SerializeToString(deterministic=True),
        kv_bytes=r.kv_bytes,
        pin_expire_at=from_timestamp(r.pin_expire_time) if r.HasField("pin_expire_time") else None,
        create_time=from_timestamp(r.create_time),
        expire_at=from_timestamp(r.expire_time),
        claim=claim,
        holder=holder_from_pb(params),
    )
    return RetentionChange(
        kind=CHANGE_FROM_PB[out.change],
        retention=retention,
        at=from_timestamp(out.change_time),
        previous_node=out.previous_node,
        token=token,
    )


def _salt_digest(digest: bytes, batch: int, event: int) -> bytes:
    if len(digest) not in (0, SALT_DIGEST_BYTES):
        raise InvalidArgument(
            f"batches[{batch}].events[{event}].cache_salt_sha256",
            f"must be {SALT_DIGEST_BYTES} bytes (SHA-256 of the cache salt) or empty",
        )
    return digest


def event_batches_from_pb(batches: Sequence[pb.BlockEventBatch]) -> list[ev.EventBatch]:
    out: list[ev.EventBatch] = []
    for i, batch in enumerate(batches):
        events: list[ev.BlockStored | ev.BlockRemoved | ev.AllBlocksCleared] = []
        for j, event in enumerate(batch.events):
            kind = event.WhichOneof("event")
            if kind == "stored":
                s = event.stored
                events.append(
                    ev.BlockStored(
                        block_hashes=tuple(s.block_hashes),
                        parent_block_hash=s.parent_block_hash if s.HasField("parent_block_hash") else None,
                        token_ids=tuple(s.token_ids),
                        block_size=s.block_size,
                        lora_id=s.lora_id if s.HasField("lora_id") else None,
                        medium=s.medium,
                        cache_salt_sha256=_salt_digest(s.cache_salt_sha256, i, j),
                    )
                )
            elif kind == "removed":
                events.append(
                    ev.BlockRemoved(
                        block_hashes=tuple(event.removed.block_hashes), medium=event.removed.medium
                    )
                )
            elif kind == "cleared":
                events.append(ev.AllBlocksCleared())
            else:
                raise InvalidArgument(f"batches[{i}].events[{j}]", "must set stored, removed or cleared")
        out.append(ev.EventBatch(seq=batch.seq, engine_time=batch.engine_time, events=tuple(events)))
    return out
