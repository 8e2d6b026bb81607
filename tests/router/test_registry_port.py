"""GrpcRegistryPort's translation, over a stub RegistryClient: no sockets."""

from __future__ import annotations

from typing import Any, cast

import pytest

from kvshuttle.client.registry import RegistryClient
from kvshuttle.core.errors import Aborted
from kvshuttle.core.nodes import NodeRole
from kvshuttle.core.prototime import to_timestamp
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.router.grpc.registry_port import GrpcRegistryPort, node_info
from kvshuttle.router.model import NewRetention
from kvshuttle.vllm.kv_transfer_params import from_vllm

NAME = "tenants/t/conversations/c/retentions/1"
PARAMS: dict[str, object] = {"do_remote_decode": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "e"}


class StubClient:
    """Answers each call with `answer`, keeping what it was asked."""

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.asked: list[tuple[Any, ...]] = []

    async def claim_retention(
        self, name: str, holder: str, claim_ttl: float, *, request_id: str, shared: bool = False
    ) -> Any:
        self.asked.append((name, holder, claim_ttl, request_id))
        return self.answer

    async def put_retention(
        self, conversation: str, retention: pb.Retention, *, ttl: float, request_id: str
    ) -> Any:
        self.asked.append((conversation, retention, ttl, request_id))
        return self.answer


def port(client: StubClient) -> GrpcRegistryPort:
    return GrpcRegistryPort(cast(RegistryClient, client))


def stored(name: str) -> pb.Retention:
    return pb.Retention(
        name=name,
        node="nodes/d0",
        generation=1,
        model="m",
        block_size=16,
        num_tokens=32,
        block_hashes=[1, 2],
        kv_transfer_params=from_vllm(PARAMS),
        expire_time=to_timestamp(1_800_000_100.25),
        state=pb.RETENTION_STATE_CLAIMED,
        claim=pb.Claim(claim_id="k", expire_time=to_timestamp(1_800_000_030.5)),
    )


async def test_a_claim_answered_with_another_retention_is_refused() -> None:
    other = pb.ClaimRetentionResponse(retention=stored(NAME.replace("/1", "/2")))
    with pytest.raises(Aborted) as err:
        await port(StubClient(other)).claim(NAME, holder="router:r", claim_ttl=30.0, request_id="")
    assert err.value.reason == "REGISTRY_ANSWER_MISMATCH"


async def test_a_claim_reads_the_retention_and_its_claim() -> None:
    claim = await port(StubClient(pb.ClaimRetentionResponse(retention=stored(NAME)))).claim(
        NAME, holder="router:r", claim_ttl=30.0, request_id="x"
    )
    assert claim.claim_id == "k"
    assert claim.expire_at == pytest.approx(1_800_000_030.5, abs=1e-6)
    r = claim.retention
    assert (r.name, r.claimed, list(r.block_hashes)) == (NAME, True, [1, 2])
    assert r.expire_at == pytest.approx(1_800_000_100.25, abs=1e-6)
    assert r.kv_transfer_params == PARAMS | {"do_remote_prefill": False}


async def test_a_new_retention_goes_out_as_one_put() -> None:
    client = StubClient(pb.PutRetentionResponse(retention=stored(NAME)))
    new = NewRetention(
        request_id="t-commit",
        conversation="tenants/t/conversations/c",
        node="nodes/d0",
        generation=1,
        model="m",
        block_size=16,
        num_tokens=32,
        block_hashes=[1, 2],
        kv_transfer_params=PARAMS,
        kv_bytes=1024,
        ttl=-1.0,
        pin_expire_at=1_800_000_450.0,
    )
    await port(client).put_retention(new)
    ((conversation, retention, ttl, request_id),) = client.asked
    assert (conversation, ttl, request_id) == ("tenants/t/conversations/c", 0.0, "t-commit")
    assert (retention.node, retention.generation, retention.num_tokens, list(retention.block_hashes)) == (
        "nodes/d0",
        1,
        32,
        [1, 2],
    )
    assert (retention.kv_bytes, retention.pin_expire_time.seconds) == (1024, 1_800_000_450)


def test_roles_map_to_the_core_roles_and_an_unknown_one_is_skipped() -> None:
    for role, expected in [
        (pb.NODE_ROLE_PREFILL, NodeRole.PREFILL),
        (pb.NODE_ROLE_DECODE, NodeRole.DECODE),
        (pb.NODE_ROLE_BOTH, NodeRole.BOTH),
    ]:
        info = node_info(pb.Node(name="nodes/n", role=role))
        assert info is not None and info.role is expected
    assert node_info(pb.Node(name="nodes/n", role=cast(Any, 99))) is None
