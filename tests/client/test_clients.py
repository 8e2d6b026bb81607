"""The typed clients against real grpc.aio servers: requests as sent, pages followed, streams."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from datetime import timedelta
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf.message import Message
from tests.client.fake_registry import Context, FakeRegistry, abort, names, serve

from kvshuttle.agent.v1 import agent_service_pb2 as agent_pb
from kvshuttle.agent.v1 import agent_service_pb2_grpc as agent_grpc
from kvshuttle.client import AgentClient, ChannelOptions, KvshuttleRpcError, RegistryClient, RouterClient
from kvshuttle.core.prototime import to_duration
from kvshuttle.registry.v1 import registry_service_pb2 as pb
from kvshuttle.router.v1 import router_service_pb2 as router_pb
from kvshuttle.router.v1 import router_service_pb2_grpc as router_grpc
from kvshuttle.vllm.kv_transfer_params import from_vllm
from kvshuttle.vllm.v1 import kv_transfer_params_pb2 as vllm_pb

CONVERSATION = "tenants/a/conversations/b"


async def test_connect_is_an_async_context_manager(fake: FakeRegistry) -> None:
    fake.add_node("nodes/d0")
    async with RegistryClient.connect(fake.address) as client:
        assert (await client.get_node("nodes/d0")).node.engine_id == "engine-d0"
    assert client.options.target == fake.address


async def test_a_client_over_a_shared_channel_leaves_it_open(fake: FakeRegistry) -> None:
    fake.add_node("nodes/d0")
    async with grpc.aio.insecure_channel(fake.address) as channel:
        async with RegistryClient(channel, ChannelOptions(fake.address)) as client:
            await client.get_node("nodes/d0")
        async with RegistryClient(channel) as again:  # the channel is still usable
            await again.get_node("nodes/d0")


async def test_register_then_heartbeat(fake: FakeRegistry, client: RegistryClient) -> None:
    registered = await client.register_node(
        pb.Node(name="nodes/d0", role=pb.NODE_ROLE_DECODE, model="m"), ttl=timedelta(seconds=7)
    )
    assert registered.node.incarnation == 1
    sent = fake.requests["RegisterNode"][0]
    assert isinstance(sent, pb.RegisterNodeRequest)
    assert sent.ttl == to_duration(7)
    load = pb.NodeLoad(running_requests=2, kv_cache_usage=0.5, engine_healthy=True)
    beat = await client.heartbeat_node("nodes/d0", registered.node.incarnation, ttl=3.5, load=load)
    assert beat.expire_time.seconds > 0
    assert fake.nodes["nodes/d0"].load == load
    with pytest.raises(KvshuttleRpcError) as caught:
        await client.heartbeat_node("nodes/d0", 99)
    assert caught.value.reason == "NODE_INCARNATION_MISMATCH"


async def test_iter_nodes_follows_page_tokens(fake: FakeRegistry, client: RegistryClient) -> None:
    for i in range(5):
        fake.add_node(f"nodes/n{i}")
    found = [n async for n in client.iter_nodes(page_size=2)]
    assert names(found) == [f"nodes/n{i}" for i in range(5)]
    tokens = [r.page_token for r in fake.requests["ListNodes"]]  # type: ignore[attr-defined]
    assert tokens == ["", "2", "4"]


async def test_iter_retentions_follows_server_capped_pages(
    fake: FakeRegistry, client: RegistryClient
) -> None:
    fake.max_page_size = 2
    fake.add_node("nodes/d0")
    fake.add_node("nodes/d1")
    for i in range(5):
        fake.add_retention(f"tenants/a/conversations/c{i}", 1, "nodes/d0" if i % 2 else "nodes/d1")
    fake.add_retention("tenants/other/conversations/c", 1, "nodes/d0")
    everything = [r async for r in client.iter_retentions("tenants/a")]
    assert len(everything) == 5
    on_d0 = [r async for r in client.iter_retentions("tenants/a", node="nodes/d0")]
    assert {r.node for r in on_d0} == {"nodes/d0"}
    assert len(on_d0) == 2


async def test_retention_lifecycle(fake: FakeRegistry, client: RegistryClient) -> None:
    fake.add_node("nodes/d0")
    params = from_vllm({"do_remote_decode": True, "remote_block_ids": [[1, 2]]})
    put = await client.put_retention(
        CONVERSATION,
        pb.Retention(node="nodes/d0", generation=1, num_tokens=32, kv_transfer_params=params),
        ttl=30,
    )
    name = put.retention.name
    assert (await client.get_retention(name)).retention.num_tokens == 32
    assert (await client.get_conversation(CONVERSATION)).conversation.fence_generation == 1
    with pytest.raises(KvshuttleRpcError) as stale:
        await client.put_retention(CONVERSATION, pb.Retention(node="nodes/d0", generation=1))
    assert (stale.value.code, stale.value.reason) == (grpc.StatusCode.ABORTED, "FENCING_GENERATION_STALE")
    claimed = await client.claim_retention(name, "turns/t1", timedelta(seconds=2))
    with pytest.raises(KvshuttleRpcError) as taken:
        await client.claim_retention(name, "turns/t2")
    assert taken.value.reason == "RETENTION_ALREADY_CLAIMED"
    await client.release_retention(name, claim_id=claimed.retention.claim.claim_id)
    with pytest.raises(KvshuttleRpcError) as gone:
        await client.get_retention(name)
    assert gone.value.reason == "RETENTION_NOT_FOUND"


async def test_move_and_evict_send_their_fields_and_retry(fake: FakeRegistry, client: RegistryClient) -> None:
    fake.add_node("nodes/d0")
    fake.add_node("nodes/d0-pool", role=pb.NODE_ROLE_POOL)
    name = fake.add_retention(CONVERSATION, 1, "nodes/d0").name
    claim_id = (await client.claim_retention(name, "router/park")).retention.claim.claim_id
    pooled = from_vllm(
        {"do_remote_decode": True, "remote_engine_id": "engine-d0-pool", "remote_block_ids": [[7]]}
    )
    fake.failures["MoveRetention"] = [grpc.StatusCode.UNAVAILABLE]
    moved = await client.move_retention(
        name, claim_id=claim_id, node="nodes/d0-pool", kv_transfer_params=pooled, kv_bytes=2048, ttl=45
    )
    assert moved.retention.node == "nodes/d0-pool"
    sent = fake.requests["MoveRetention"]
    assert len(sent) == 2  # retried once under the request_id it filled in
    assert isinstance(sent[0], pb.MoveRetentionRequest) and sent[0].request_id
    assert sent[0] == sent[1]
    assert (sent[0].claim_id, sent[0].kv_bytes, sent[0].ttl) == (claim_id, 2048, to_duration(45))
    assert sent[0].kv_transfer_params == pooled
    fake.failures["EvictRetention"] = [grpc.StatusCode.UNAVAILABLE]
    await client.evict_retention(name, node="nodes/d0-pool")
    assert fake.calls["EvictRetention"] == 2
    assert name not in fake.retentions


async def test_watch_yields_changes_and_cancels_on_close(fake: FakeRegistry, client: RegistryClient) -> None:
    fake.hold_watch_open = True
    fake.watch_events = [
        pb.WatchRetentionsResponse(
            change=pb.RETENTION_CHANGE_PUT, retention=pb.Retention(name=f"{CONVERSATION}/retentions/{g}")
        )
        for g in (1, 2)
    ]
    async with aclosing(client.watch_retentions(parent="tenants/a")) as events:
        seen = [await anext(events), await anext(events)]
    assert [e.retention.name for e in seen] == [
        f"{CONVERSATION}/retentions/1",
        f"{CONVERSATION}/retentions/2",
    ]


async def test_watch_errors_are_kvshuttle_errors(fake: FakeRegistry, client: RegistryClient) -> None:
    fake.fail("WatchRetentions", grpc.StatusCode.INVALID_ARGUMENT)
    with pytest.raises(KvshuttleRpcError) as caught:
        async for _ in client.watch_retentions():
            pass
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert fake.calls["WatchRetentions"] == 1


async def test_block_index_calls(fake: FakeRegistry, client: RegistryClient) -> None:
    fake.block_index = {"nodes/p0": [11, 12, 13], "nodes/p1": [11, 99]}
    found = await client.lookup_blocks([11, 12, 13, 14], model="m", role=pb.NODE_ROLE_PREFILL)
    assert [(m.node, m.matched_blocks) for m in found.matches] == [("nodes/p0", 3), ("nodes/p1", 1)]
    batches = [pb.BlockEventBatch(seq=s) for s in (4, 5)]
    report = await client.report_block_events("nodes/p0", 1, batches)
    assert (report.applied_batches, report.next_seq) == (2, 6)


# Router and agent: the clients only need to be right against the protos.


class _Recorder:
    """Records requests; answers with canned responses or an ErrorInfo abort."""

    def __init__(self, responses: dict[str, Message]) -> None:
        self.responses = responses
        self.requests: dict[str, list[Any]] = {}
        self.unavailable: dict[str, int] = {}

    async def answer(self, method: str, request: Message, context: Context) -> Any:
        self.requests.setdefault(method, []).append(request)
        if self.unavailable.get(method, 0) > 0:
            self.unavailable[method] -= 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "busy")
        if method not in self.responses:
            await abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                "TURN_NOT_FOUND",
                "no such turn",
                domain="router.kvshuttle",
            )
        return self.responses[method]


class _Router(router_grpc.RouterServiceServicer):
    def __init__(self, recorder: _Recorder) -> None:
        self.r = recorder

    async def PlanTurn(self, request: router_pb.PlanTurnRequest, context: Context) -> Any:
        return await self.r.answer("PlanTurn", request, context)

    async def CommitTurn(self, request: router_pb.CommitTurnRequest, context: Context) -> Any:
        return await self.r.answer("CommitTurn", request, context)

    async def AbortTurn(self, request: router_pb.AbortTurnRequest, context: Context) -> Any:
        return await self.r.answer("AbortTurn", request, context)

    async def ListReadyDecodes(self, request: router_pb.ListReadyDecodesRequest, context: Context) -> Any:
        return await self.r.answer("ListReadyDecodes", request, context)

    async def FindTranscript(self, request: router_pb.FindTranscriptRequest, context: Context) -> Any:
        return await self.r.answer("FindTranscript", request, context)


class _Agent(agent_grpc.AgentServiceServicer):
    def __init__(self, recorder: _Recorder) -> None:
        self.r = recorder

    async def GetStatus(self, request: agent_pb.GetStatusRequest, context: Context) -> Any:
        return await self.r.answer("GetStatus", request, context)

    async def PullBlocks(self, request: agent_pb.PullBlocksRequest, context: Context) -> Any:
        return await self.r.answer("PullBlocks", request, context)

    async def ParkRetention(self, request: agent_pb.ParkRetentionRequest, context: Context) -> Any:
        return await self.r.answer("ParkRetention", request, context)

    async def Prefetch(self, request: agent_pb.PrefetchRequest, context: Context) -> Any:
        return await self.r.answer("Prefetch", request, context)


@pytest.fixture
async def router() -> AsyncIterator[tuple[_Recorder, RouterClient]]:
    recorder = _Recorder(
        {
            "PlanTurn": router_pb.PlanTurnResponse(turn="turns/t1", decision=router_pb.DECISION_REUSE),
            "CommitTurn": router_pb.CommitTurnResponse(retention=f"{CONVERSATION}/retentions/2"),
        }
    )
    servicer = (router_grpc.add_RouterServiceServicer_to_server, _Router(recorder))
    async with (
        serve(servicer) as address,
        RouterClient.connect(address, initial_backoff=0.001, max_backoff=0.002) as client,
    ):
        yield recorder, client


async def test_router_client(router: tuple[_Recorder, RouterClient]) -> None:
    recorder, client = router
    recorder.unavailable["PlanTurn"] = 1
    plan = await client.plan_turn("m", [1, 2, 3], conversation=CONVERSATION)
    assert (plan.turn, plan.decision) == ("turns/t1", router_pb.DECISION_REUSE)
    first, second = recorder.requests["PlanTurn"]
    assert first.request_id and first.request_id == second.request_id
    assert list(first.prompt_token_ids) == [1, 2, 3]
    params = vllm_pb.KvTransferParams(do_remote_decode=True, remote_num_tokens=3)
    commit = await client.commit_turn(
        "turns/t1", token_ids=[1, 2, 3, 4], decode_kv_transfer_params=params, request_id="c-1"
    )
    assert commit.retention.endswith("/retentions/2")
    sent = recorder.requests["CommitTurn"][0]
    assert (sent.request_id, sent.decode_kv_transfer_params) == ("c-1", params)
    recorder.unavailable["AbortTurn"] = 1
    with pytest.raises(KvshuttleRpcError) as caught:
        await client.abort_turn("turns/t1", reason="client gave up")
    assert caught.value.code == grpc.StatusCode.UNAVAILABLE
    assert len(recorder.requests["AbortTurn"]) == 1  # never retried
    with pytest.raises(KvshuttleRpcError) as missing:
        await client.abort_turn("turns/t1")
    assert (missing.value.reason, missing.value.domain) == ("TURN_NOT_FOUND", "router.kvshuttle")


async def test_agent_client() -> None:
    recorder = _Recorder(
        {
            "GetStatus": agent_pb.GetStatusResponse(node="nodes/d0", registered=True),
            "PullBlocks": agent_pb.PullBlocksResponse(bytes=4096),
            "ParkRetention": agent_pb.ParkRetentionResponse(retention="r", bytes=1),
            "Prefetch": agent_pb.PrefetchResponse(retention="r", bytes=2),
        }
    )
    async with (
        serve((agent_grpc.add_AgentServiceServicer_to_server, _Agent(recorder))) as address,
        AgentClient.connect(address, initial_backoff=0.001, max_backoff=0.002) as client,
    ):
        recorder.unavailable["GetStatus"] = 2
        assert (await client.get_status()).registered
        source = vllm_pb.KvTransferParams(remote_engine_id="e1", remote_num_tokens=16)
        recorder.unavailable["PullBlocks"] = 1
        assert (await client.pull_blocks(source, ttl=30, notify_holder=True)).bytes == 4096
        await client.park_retention("r", source=source, ttl=60, request_id="p-1")
        await client.prefetch("r", "nodes/p0", source=source, ttl=45)
    assert len(recorder.requests["GetStatus"]) == 3
    pulls = recorder.requests["PullBlocks"]
    assert len(pulls) == 2 and pulls[0].request_id == pulls[1].request_id
    assert pulls[0].source == source and pulls[0].notify_holder and pulls[0].ttl.seconds == 30
    park = recorder.requests["ParkRetention"][0]
    assert (park.request_id, park.ttl.seconds, park.source) == ("p-1", 60, source)
    prefetch = recorder.requests["Prefetch"][0]
    assert (prefetch.target_node, prefetch.ttl.seconds, prefetch.source) == ("nodes/p0", 45, source)


# Conversions


def test_to_duration() -> None:
    assert to_duration(1.5) == to_duration(timedelta(milliseconds=1500))
    assert (to_duration(2).seconds, to_duration(0.25).nanos) == (2, 250_000_000)
    with pytest.raises(ValueError):
        to_duration(-1)
