"""RegistryPort over the registry's domain object, in process: the router domain tests and the fleet
simulator (bench/fleet) run the real router over the real registry with no sockets."""

from __future__ import annotations

from array import array
from typing import Any

import numpy as np

from kvshuttle.core.errors import NotFound
from kvshuttle.core.nodes import NodeRole
from kvshuttle.registry import model as reg
from kvshuttle.registry.api.convert import holder_from_pb
from kvshuttle.registry.service.registry import Registry
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
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams


def retention_info(r: reg.Retention) -> RetentionInfo:
    return RetentionInfo(
        name=r.name,
        node=r.node,
        generation=r.generation,
        model=r.model,
        block_size=r.block_size,
        num_tokens=r.num_tokens,
        block_hashes=np.frombuffer(r.block_hashes.tobytes(), dtype=np.uint64),
        kv_transfer_params=to_vllm(KvTransferParams.FromString(r.kv_transfer_params)),
        expire_at=r.expire_at,
        claimed=r.claim is not None or bool(r.shared),
        shared_claims=len(r.shared),
        claim_holder=r.claim.holder if r.claim is not None else "",
    )


class InProcessPort:
    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.calls: dict[str, int] = {}

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    async def get_conversation(self, name: str) -> tuple[int, RetentionInfo | None]:
        self._count("get_conversation")
        try:
            conv = await self.registry.get_conversation(name)
        except NotFound:
            return 0, None
        return conv.fence_generation, retention_info(conv.retention) if conv.retention else None

    async def find_by_chain(
        self, tenant: str, model: str, block_size: int, chain: Hashes
    ) -> RetentionInfo | None:
        self._count("find_by_chain")
        try:
            found = await self.registry.find_retention(
                parent=f"tenants/{tenant}",
                model=model,
                block_size=block_size,
                block_hashes=array("Q", np.asarray(chain, dtype=np.uint64).tobytes()),
                transcript_key=b"",
            )
        except NotFound:
            return None
        return retention_info(found.retention)

    async def find_transcript(self, tenant: str, model: str, lookup_key: bytes) -> FoundTranscript | None:
        self._count("find_transcript")
        try:
            found = await self.registry.find_retention(
                parent=f"tenants/{tenant}",
                model=model,
                block_size=0,
                block_hashes=array("Q"),
                transcript_key=lookup_key,
            )
        except NotFound:
            return None
        t = found.retention.transcript
        if t is None:
            return None
        ids = np.frombuffer(t.token_ids.tobytes(), dtype=np.uint32)
        return FoundTranscript(
            found.retention.conversation, TranscriptInfo(t.lookup_key, ids, t.answer_sha256, t.answer_chars)
        )

    async def list_nodes(self, model: str) -> list[NodeInfo]:
        self._count("list_nodes")
        nodes, _ = await self.registry.list_nodes(role=None, model=model, page_size=1000, page_token="")
        return [
            NodeInfo.of(
                n.spec,
                n.load,
                retained_bytes=n.retained_bytes,
                indexed_blocks=self.registry.indexed_blocks(n.spec.name),
            )
            for n in nodes
        ]

    async def lookup_blocks(self, chain: Hashes, model: str, role: NodeRole) -> dict[str, int]:
        self._count("lookup_blocks")
        found = await self.registry.lookup_blocks(
            np.asarray(chain, dtype=np.uint64).tolist(), model=model, role=role
        )
        return dict(found)

    async def claim(
        self, name: str, *, holder: str, claim_ttl: float, request_id: str, shared: bool = False
    ) -> ClaimInfo:
        self._count("claim")
        r = await self.registry.claim_retention(
            request_id=request_id, name=name, holder=holder, claim_ttl=claim_ttl, shared=shared
        )
        assert r.claim is not None
        return ClaimInfo(retention_info(r), r.claim.claim_id, r.claim.expire_at)

    async def put_retention(self, new: NewRetention) -> RetentionInfo:
        self._count("put_retention")
        params = from_vllm(dict(new.kv_transfer_params))
        result = await self.registry.put_retention(
            request_id=new.request_id,
            parent=new.conversation,
            ttl=new.ttl,
            retention=reg.Retention(
                name="",
                node=new.node,
                generation=new.generation,
                model=new.model,
                block_size=new.block_size,
                num_tokens=new.num_tokens,
                block_hashes=array("Q", np.asarray(new.block_hashes, dtype=np.uint64).tobytes()),
                kv_transfer_params=params.SerializeToString(),
                kv_bytes=new.kv_bytes,
                pin_expire_at=new.pin_expire_at,
                holder=holder_from_pb(params),
                prompt_blocks=new.prompt_blocks,
                transcript=None
                if new.transcript is None
                else reg.Transcript(
                    new.transcript.lookup_key,
                    array("I", np.asarray(new.transcript.token_ids, dtype=np.uint32).tobytes()),
                    new.transcript.answer_sha256,
                    new.transcript.answer_chars,
                ),
            ),
        )
        return retention_info(result.retention)

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
        self._count("move_retention")
        params = from_vllm(dict(kv_transfer_params))
        moved = await self.registry.move_retention(
            request_id=request_id,
            move=reg.Move(
                name=name,
                claim_id=claim_id,
                node=node,
                kv_transfer_params=params.SerializeToString(),
                kv_bytes=kv_bytes,
                holder=holder_from_pb(params),
            ),
            ttl=ttl,
        )
        return retention_info(moved)

    async def release(self, name: str, *, claim_id: str, keep: bool = False) -> None:
        self._count("release")
        try:
            await self.registry.release_retention(name, claim_id=claim_id, force=False, keep=keep)
        except NotFound:
            return
