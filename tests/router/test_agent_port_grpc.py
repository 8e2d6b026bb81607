"""GrpcAgentPort over a real gRPC server (127.0.0.1 port 0) speaking AgentService: requests and
answers translated, the agent's errors as domain errors, channels bounded."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry

from kvshuttle.agent.v1 import agent_service_pb2 as pb
from kvshuttle.agent.v1 import agent_service_pb2_grpc
from kvshuttle.core.errors import FailedPrecondition, ResourceExhausted, Unavailable
from kvshuttle.core.prototime import duration_seconds
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.router.config import AgentConnection
from kvshuttle.router.grpc.agent_port import GrpcAgentPort
from kvshuttle.serving.server import GrpcServer
from kvshuttle.serving.settings import ServerSettings, TelemetrySettings
from kvshuttle.vllm.kv_transfer_params import from_vllm, to_vllm

SOURCE: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": "engine-d",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "remote_block_ids": [[1, 2, 3]],
    "remote_num_tokens": 40,
    "tp_size": 1,
}
POOLED: dict[str, Any] = SOURCE | {"remote_engine_id": "pool-d", "remote_block_ids": [[7, 8, 9]]}


class FakeAgent(agent_service_pb2_grpc.AgentServiceServicer):
    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.error: Exception | None = None
        self.pool_bytes = 2**20

    async def ParkRetention(self, request: pb.ParkRetentionRequest, context: Any) -> pb.ParkRetentionResponse:
        self.requests.append(request)
        if self.error is not None:
            raise self.error
        return pb.ParkRetentionResponse(
            retention=request.retention, pooled=from_vllm(POOLED), node="nodes/d-pool"
        )

    async def GetStatus(self, request: pb.GetStatusRequest, context: Any) -> pb.GetStatusResponse:
        return pb.GetStatusResponse(pool=pb.PoolStatus(capacity_bytes=self.pool_bytes))

    async def PullBlocks(self, request: pb.PullBlocksRequest, context: Any) -> pb.PullBlocksResponse:
        raise NotImplementedError

    async def Prefetch(self, request: pb.PrefetchRequest, context: Any) -> pb.PrefetchResponse:
        self.requests.append(request)
        return pb.PrefetchResponse(retention=request.retention, pooled=from_vllm(POOLED), node="nodes/p-pool")


@pytest.fixture
async def agent() -> Any:
    fake = FakeAgent()

    def register(server: grpc.aio.Server) -> None:
        agent_service_pb2_grpc.add_AgentServiceServicer_to_server(fake, server)

    server = GrpcServer(
        ServerSettings(listen="127.0.0.1:0", grace_seconds=0),
        TelemetrySettings(),
        service_name="fake-agent",
        domain="agent.kvshuttle",
        register=register,
        service_names=["kvshuttle.agent.v1.AgentService"],
        registry=CollectorRegistry(),
    )
    port = await server.start()
    yield fake, f"127.0.0.1:{port}"
    await server.stop()


async def test_park_and_prefetch_send_the_source_and_answer_the_pool(agent: Any) -> None:
    fake, endpoint = agent
    port = GrpcAgentPort(AgentConnection(timeout=5))
    try:
        name = "tenants/t/conversations/c/retentions/1"
        pooled = await port.park(endpoint, name, source=SOURCE, ttl=120.0, request_id="park-1")
        assert pooled.node == "nodes/d-pool" and pooled.kv_transfer_params == to_vllm(from_vllm(POOLED))
        [request] = fake.requests
        assert (request.request_id, request.retention) == ("park-1", name)
        assert to_vllm(request.source) == to_vllm(from_vllm(SOURCE))
        assert duration_seconds(request.ttl, "ttl") == 120.0

        pooled = await port.prefetch(endpoint, name, "nodes/p", source=SOURCE, ttl=60.0, request_id="pf-1")
        assert pooled.node == "nodes/p-pool"
        assert fake.requests[1].target_node == "nodes/p"
        assert len(port) == 1  # one channel per endpoint
    finally:
        await port.close()


async def test_the_agents_errors_are_domain_errors(agent: Any) -> None:
    fake, endpoint = agent
    port = GrpcAgentPort(AgentConnection(timeout=5, max_attempts=1))
    try:
        fake.error = ResourceExhausted("pool full", reason=ErrorReason.RESOURCE_EXHAUSTED)
        with pytest.raises(ResourceExhausted):
            await port.park(
                endpoint, "tenants/t/conversations/c/retentions/1", source=SOURCE, ttl=9, request_id="a"
            )
        fake.error = FailedPrecondition("not my engine", reason=ErrorReason.NODE_MISMATCH)
        with pytest.raises(FailedPrecondition) as refused:
            await port.park(
                endpoint, "tenants/t/conversations/c/retentions/1", source=SOURCE, ttl=9, request_id="b"
            )
        assert refused.value.reason == ErrorReason.NODE_MISMATCH
        # Nobody listens there: the answer is unknown.
        with pytest.raises(Unavailable):
            await port.park(
                "127.0.0.1:1", "tenants/t/conversations/c/retentions/1", source=SOURCE, ttl=9, request_id="c"
            )
    finally:
        await port.close()


async def test_channels_are_bounded(agent: Any) -> None:
    _, endpoint = agent
    port = GrpcAgentPort(AgentConnection(timeout=5, max_channels=2))
    try:
        for other in ("127.0.0.1:2", "127.0.0.1:3", endpoint):
            port._client(other)
        assert len(port) == 2
        await port.park(
            endpoint, "tenants/t/conversations/c/retentions/1", source=SOURCE, ttl=9, request_id="d"
        )
    finally:
        await port.close()


async def test_serving_is_an_answering_agent_with_a_pool(agent: Any) -> None:
    fake, endpoint = agent
    port = GrpcAgentPort(AgentConnection(timeout=5, max_attempts=1))
    try:
        assert await port.serving(endpoint, deadline_s=2)
        fake.pool_bytes = 0  # restarted without a pool: its old pool is gone
        assert not await port.serving(endpoint, deadline_s=2)
        assert not await port.serving("127.0.0.1:1", deadline_s=0.5)  # nobody listens there
    finally:
        await port.close()
