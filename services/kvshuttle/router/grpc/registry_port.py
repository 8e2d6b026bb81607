"""RegistryPort over the registry's gRPC API: protobuf to the router's domain types, and the
registry's errors to domain errors carrying the registry's reason.

Error mapping (KvshuttleRpcError code -> what the router sees):

* NOT_FOUND, FAILED_PRECONDITION, ABORTED, RESOURCE_EXHAUSTED -> NotFound, FailedPrecondition,
  Aborted, ResourceExhausted with the same reason (RETENTION_NOT_FOUND, RETENTION_EXPIRED,
  RETENTION_ALREADY_CLAIMED, FENCING_GENERATION_STALE, CAPACITY_EXCEEDED, ...). The domain
  decides what they mean for a turn (a lost claim plans a recompute, and so on).
* UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED -> Unavailable (REGISTRY_UNAVAILABLE): the
  registry could not answer in time; the caller may retry the turn.
* anything else, INVALID_ARGUMENT included -> CallRefused, which is not a domain error:
  the router built the request, so a registry refusing it is a router bug (or a
  misconfiguration such as a TLS or auth failure), and the router's client sees INTERNAL while
  the log keeps the details. The router bounds client input itself before calling.

A claim answered with another retention than the one claimed (scoped claim ids rule that out)
is Aborted (REGISTRY_ANSWER_MISMATCH): the plan recomputes and hands out no KV. A put or claim
whose request id the registry saw with another body (INVALID_ARGUMENT, REQUEST_ID_REUSED) is
Aborted with that reason: the first request won (a commit of the turn stored something else, a
plan of another prompt claimed the retention).
"""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import structlog

from kvshuttle.client.errors import KvshuttleRpcError, as_domain, domain_error
from kvshuttle.client.registry import RegistryClient
from kvshuttle.client.registry_convert import ROLE_FROM_PB, ROLE_TO_PB, load_from_pb, spec_from_pb
from kvshuttle.core.errors import Aborted
from kvshuttle.core.nodes import NodeRole
from kvshuttle.core.prototime import from_timestamp, to_timestamp
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.router.model import (
    ClaimInfo,
    FoundTranscript,
    Hashes,
    NewRetention,
    NodeInfo,
    RetentionInfo,
    TranscriptInfo,
)
from kvshuttle.vllm.kv_transfer_params import from_vllm, to_vllm

__all__ = ["GrpcRegistryPort"]

log = structlog.get_logger("kvshuttle.router")

# Pages of ListNodes; a deployment has tens of nodes, so one page almost always.
_PAGE_SIZE = 500


def node_info(node: pb.Node) -> NodeInfo | None:
    """The router's view of a node; None for a role it cannot place on (a newer registry's)."""
    role = ROLE_FROM_PB.get(node.role)
    if role is None:
        return None
    return NodeInfo.of(
        spec_from_pb(node, role),
        load_from_pb(node.load),
        retained_bytes=node.retained_bytes,
        indexed_blocks=node.indexed_blocks,
    )


def retention_info(r: pb.Retention) -> RetentionInfo:
    return RetentionInfo(
        name=r.name,
        node=r.node,
        generation=r.generation,
        model=r.model,
        block_size=r.block_size,
        num_tokens=r.num_tokens,
        block_hashes=np.asarray(r.block_hashes, dtype=np.uint64),
        kv_transfer_params=to_vllm(r.kv_transfer_params),
        expire_at=from_timestamp(r.expire_time),
        claimed=r.state == pb.RETENTION_STATE_CLAIMED,
        shared_claims=r.shared_claims,
        claim_holder=r.claim.holder if r.HasField("claim") else "",
    )


def _refused(err: KvshuttleRpcError) -> Exception:
    """The domain error of a failed put or claim: a reused request id is Aborted (the first
    request with that id won), the rest as domain_error."""
    if err.code == grpc.StatusCode.INVALID_ARGUMENT and err.reason == ErrorReason.REQUEST_ID_REUSED:
        return Aborted(err.message, reason=ErrorReason.REQUEST_ID_REUSED, metadata=err.metadata)
    return domain_error(err, "registry")


def _check_tenant(name: str, tenant: str) -> None:
    """Never hand a tenant another's retention, whatever the registry answered."""
    if not name.startswith(f"tenants/{tenant}/"):
        raise Aborted(
            f"the registry answered a lookup of tenant {tenant} with another tenant's retention",
            reason=ErrorReason.REGISTRY_ANSWER_MISMATCH,
        )


class GrpcRegistryPort:
    """The router's RegistryPort over a RegistryClient (which retries what is safe to retry)."""

    def __init__(self, client: RegistryClient) -> None:
        self._client = client

    async def get_conversation(self, name: str) -> tuple[int, RetentionInfo | None]:
        try:
            response = await self._client.get_conversation(name)
        except KvshuttleRpcError as err:
            if err.code == grpc.StatusCode.NOT_FOUND and err.reason == ErrorReason.CONVERSATION_NOT_FOUND:
                return 0, None
            raise domain_error(err, "registry") from err
        conversation = response.conversation
        retention = retention_info(conversation.retention) if conversation.HasField("retention") else None
        return conversation.fence_generation, retention

    async def find_by_chain(
        self, tenant: str, model: str, block_size: int, chain: Hashes
    ) -> RetentionInfo | None:
        try:
            response = await self._client.find_retention(
                f"tenants/{tenant}",
                model=model,
                block_size=block_size,
                block_hashes=np.asarray(chain, dtype=np.uint64).tolist(),
            )
        except KvshuttleRpcError as err:
            if err.code == grpc.StatusCode.NOT_FOUND:
                return None
            raise domain_error(err, "registry") from err
        retention = retention_info(response.retention)
        _check_tenant(retention.name, tenant)
        return retention

    async def find_transcript(self, tenant: str, model: str, lookup_key: bytes) -> FoundTranscript | None:
        try:
            response = await self._client.find_retention(
                f"tenants/{tenant}", model=model, transcript_key=lookup_key
            )
        except KvshuttleRpcError as err:
            if err.code == grpc.StatusCode.NOT_FOUND:
                return None
            raise domain_error(err, "registry") from err
        r = response.retention
        _check_tenant(r.name, tenant)
        if not r.HasField("transcript") or r.transcript.lookup_key != lookup_key:
            return None
        t = r.transcript
        return FoundTranscript(
            conversation=r.name.rsplit("/", 2)[0],
            transcript=TranscriptInfo(
                lookup_key=t.lookup_key,
                token_ids=np.asarray(t.token_ids, dtype=np.uint32),
                answer_sha256=t.answer_sha256,
                answer_chars=t.answer_chars,
            ),
        )

    async def list_nodes(self, model: str) -> list[NodeInfo]:
        nodes: list[NodeInfo] = []
        token = ""
        while True:
            page = await as_domain(
                self._client.list_nodes(model=model, page_size=_PAGE_SIZE, page_token=token), "registry"
            )
            for node in page.nodes:
                info = node_info(node)
                if info is None:
                    log.warning("registry.unknown_node_role", node=node.name, role=int(node.role))
                else:
                    nodes.append(info)
            token = page.next_page_token
            if not token:
                return nodes

    async def lookup_blocks(self, chain: Hashes, model: str, role: NodeRole) -> dict[str, int]:
        if not len(chain):
            return {}
        hashes = np.asarray(chain, dtype=np.uint64).tolist()
        response = await as_domain(
            self._client.lookup_blocks(hashes, model=model, role=ROLE_TO_PB[role]), "registry"
        )
        return {m.node: m.matched_blocks for m in response.matches}

    async def claim(
        self, name: str, *, holder: str, claim_ttl: float, request_id: str, shared: bool = False
    ) -> ClaimInfo:
        try:
            response = await self._client.claim_retention(
                name, holder, claim_ttl, request_id=request_id, shared=shared
            )
        except KvshuttleRpcError as err:
            raise _refused(err) from err
        r = response.retention
        if r.name != name:  # cannot happen with scoped ids; never hand out another's KV if it does
            raise Aborted(
                f"the registry answered a claim of {name} with {r.name}",
                reason=ErrorReason.REGISTRY_ANSWER_MISMATCH,
            )
        return ClaimInfo(
            retention=retention_info(r),
            claim_id=r.claim.claim_id,
            expire_at=from_timestamp(r.claim.expire_time),
        )

    async def put_retention(self, new: NewRetention) -> RetentionInfo:
        retention = pb.Retention(
            node=new.node,
            generation=new.generation,
            model=new.model,
            block_size=new.block_size,
            num_tokens=new.num_tokens,
            block_hashes=np.asarray(new.block_hashes, dtype=np.uint64).tolist(),
            kv_transfer_params=from_vllm(new.kv_transfer_params, "decode_kv_transfer_params"),
            kv_bytes=new.kv_bytes,
            pin_expire_time=to_timestamp(new.pin_expire_at),
            prompt_blocks=new.prompt_blocks,
        )
        if new.transcript is not None:
            t = new.transcript
            retention.transcript.CopyFrom(
                pb.Transcript(
                    lookup_key=t.lookup_key,
                    token_ids=t.token_ids,
                    answer_sha256=t.answer_sha256,
                    answer_chars=t.answer_chars,
                )
            )
        try:
            response = await self._client.put_retention(
                new.conversation, retention, ttl=max(new.ttl, 0.0), request_id=new.request_id
            )
        except KvshuttleRpcError as err:
            raise _refused(err) from err
        return retention_info(response.retention)

    async def release(self, name: str, *, claim_id: str, keep: bool = False) -> None:
        try:
            await self._client.release_retention(name, claim_id=claim_id, keep=keep)
        except KvshuttleRpcError as err:
            if err.code == grpc.StatusCode.NOT_FOUND:
                return  # already consumed, replaced or lapsed: what releasing wanted
            raise domain_error(err, "registry") from err

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
        try:
            response = await self._client.move_retention(
                name,
                claim_id=claim_id,
                node=node,
                kv_transfer_params=from_vllm(kv_transfer_params, "kv_transfer_params"),
                kv_bytes=kv_bytes,
                ttl=max(ttl, 0.0),
                request_id=request_id,
            )
        except KvshuttleRpcError as err:
            raise _refused(err) from err
        return retention_info(response.retention)
