"""Every RouterService and AgentService RPC with near-valid and hostile requests against real
servers: never INTERNAL or UNKNOWN, the servers stay up, and a rejected request leaves the
registry's state and the router's memory (plans, hints, chains) as they were."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from google.protobuf.duration_pb2 import Duration
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from tests.fuzz.harness import FUZZ, NAME, NANOS, SECONDS, TEXT, UINT32, UINT64, LoopThread, outcome, state_of
from tests.fuzz.served import Served, build
from tests.router.helpers import PROFILES

from kvshuttle.agent.agent import Agent
from kvshuttle.agent.main import build_server as build_agent_server
from kvshuttle.agent.main import connect_registry as agent_registry
from kvshuttle.agent.registry_port import GrpcRegistryPort as AgentPort
from kvshuttle.agent.v1 import agent_service_pb2 as apb
from kvshuttle.client import RegistryClient
from kvshuttle.client.settings import ServiceConnection
from kvshuttle.registry.v1 import registry_service_pb2 as rpb
from kvshuttle.router.config import RouterSettings
from kvshuttle.router.grpc.registry_port import GrpcRegistryPort
from kvshuttle.router.main import build_router, build_server
from kvshuttle.router.policy import RouterPolicy
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.router.v1 import router_service_pb2_grpc as pb_grpc
from kvshuttle.serving.settings import ServerSettings
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import BlockIdList, KvTransferParams

MODEL = "Qwen/Qwen3-32B"  # the profile's model (deploy/profiles/qwen3-32b-h200.toml)
CONV = "tenants/acme/conversations/c1"


class RouterServed:
    """A router over the registry of `Served` (its node is the decode node; a prefill joins)."""

    def __init__(self, registry: Served) -> None:
        self.registry = registry
        self.thread = registry.thread
        address = registry.channel._channel.target().decode()  # type: ignore[attr-defined]
        config = RouterSettings(
            server=ServerSettings(listen="127.0.0.1:0", grace_seconds=1),
            registry=ServiceConnection(address=address),
            profiles_file=PROFILES,
            turn_signing_key=SecretStr("fuzz-turn-key-" * 3),
            policy=RouterPolicy(node_max_age_s=0.0),
        )

        async def start() -> Any:
            self.client = RegistryClient.connect(config.registry.channel_options())
            self.router = build_router(
                config, GrpcRegistryPort(self.client), registry.registry.clock, CollectorRegistry()
            )
            self.server = build_server(config, self.router, CollectorRegistry())
            return await self.server.start()

        port = self.thread.run(start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.stub = pb_grpc.RouterServiceStub(self.channel)
        for name, role, side_port in (
            ("nodes/p1", rpb.NODE_ROLE_PREFILL, 5602),
            ("nodes/d1", rpb.NODE_ROLE_DECODE, 5603),
        ):
            node = rpb.Node(
                name=name,
                role=role,
                engine_id=f"engine-{name[6:]}",
                http_endpoint="http://127.0.0.1:8002",
                side_channel_host="127.0.0.1",
                side_channel_port=side_port,
                model=MODEL,
                block_size=16,
                kv_bytes_per_token=1024,
            )
            stub = registry.stub
            live = stub.RegisterNode(rpb.RegisterNodeRequest(node=node, ttl=Duration(seconds=300)))
            load = rpb.NodeLoad(engine_healthy=True)
            stub.HeartbeatNode(
                rpb.HeartbeatNodeRequest(
                    name=name, incarnation=live.node.incarnation, ttl=Duration(seconds=300), load=load
                )
            )

    def state(self) -> Any:
        return (self.registry.state(), self.thread.call(lambda: state_of(self.router._planner._parts.memory)))

    def close(self) -> None:
        self.channel.close()
        self.thread.run(self.server.stop())
        self.thread.run(self.client.close())


@pytest.fixture(scope="module")
def served() -> Iterator[RouterServed]:
    registry = Served()
    router = RouterServed(registry)
    yield router
    router.close()
    registry.close()


def checked(served: RouterServed, call: Any) -> grpc.StatusCode:
    before = served.state()
    code = outcome(call)
    if code != grpc.StatusCode.OK:
        assert served.state() == before, f"a rejected call ({code.name}) changed the state"
    served.stub.AbortTurn  # noqa: B018  # the stub outlives the call: the channel is still up
    served.registry.alive()
    return code


tokens = st.lists(UINT32, max_size=300)
durations = st.builds(lambda s, n: build(lambda: Duration(seconds=s, nanos=n)), SECONDS, NANOS)
# hints.decode_endpoints entries: the decode node's (as host:port, bare host, IPv6 forms), others,
# malformed ones and text.
DECODE_ENDPOINT = (
    st.sampled_from(
        ["127.0.0.1:8002", "127.0.0.1", "[::1]:8002", "::1", "10.0.0.9:1", "", " ", "http://127.0.0.1:8002"]
    )
    | st.sampled_from(["127.0.0.1:0", "127.0.0.1:65536", "[127.0.0.1]:80", "a" * 301])
    | TEXT
)


@FUZZ
@given(
    conversation=st.sampled_from([CONV, ""]) | NAME,
    model=st.sampled_from([MODEL, ""]) | TEXT,
    prompt=tokens,
    parent=st.sampled_from(["", CONV, "tenants/other/conversations/c"]) | NAME,
    think=durations,
    salt=st.sampled_from([b"", b"\x02" * 32, b"odd"]),
    request_id=st.sampled_from(["", "p1", "p1", "x" * 300]),
    decode_endpoints=st.lists(DECODE_ENDPOINT, max_size=4),
)
def test_plan_turn(
    served: RouterServed,
    conversation: str,
    model: str,
    prompt: list[int],
    parent: str,
    think: Duration,
    salt: bytes,
    request_id: str,
    decode_endpoints: list[str],
) -> None:
    request = build(
        lambda: pb.PlanTurnRequest(
            conversation=conversation,
            model=model,
            prompt_token_ids=prompt,
            request_id=request_id,
            cache_salt_sha256=salt,
            hints=pb.PlanHints(
                parent_conversation=parent, expected_think_time=think, decode_endpoints=decode_endpoints
            ),
        )
    )
    checked(served, lambda: served.stub.PlanTurn(request))


@FUZZ
@given(model=st.sampled_from([MODEL, ""]) | TEXT)
def test_list_ready_decodes(served: RouterServed, model: str) -> None:
    code = checked(served, lambda: served.stub.ListReadyDecodes(pb.ListReadyDecodesRequest(model=model)))
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT)


@st.composite
def decode_params(draw: st.DrawFn) -> KvTransferParams:
    return build(
        lambda: KvTransferParams(
            do_remote_decode=draw(st.booleans()),
            remote_engine_id=draw(st.sampled_from(["engine-d1", "x", ""])),
            remote_host=draw(st.sampled_from(["127.0.0.1", "6.6.6.6"])),
            remote_port=draw(st.sampled_from([5603, 9])),
            remote_block_ids=[
                BlockIdList(block_ids=g) for g in draw(st.lists(st.lists(UINT32, max_size=30), max_size=2))
            ],
            remote_num_tokens=draw(UINT32),
        )
    )


@FUZZ
@given(
    use_plan=st.booleans(),
    handle=TEXT,
    extra=tokens,
    params=decode_params(),
    ttft=durations,
    transfer_bytes=UINT64,
    reason=TEXT,
)
def test_commit_and_abort(
    served: RouterServed,
    use_plan: bool,
    handle: str,
    extra: list[int],
    params: KvTransferParams,
    ttft: Duration,
    transfer_bytes: int,
    reason: str,
) -> None:
    prompt = list(range(1, 65))
    if use_plan:  # a real handle: the commit's own fields get checked
        handle = served.stub.PlanTurn(
            pb.PlanTurnRequest(conversation=CONV, model=MODEL, prompt_token_ids=prompt)
        ).turn
    timings = build(lambda: pb.TurnTimings(ttft=ttft, transfer_bytes=transfer_bytes))
    commit = pb.CommitTurnRequest(
        turn=handle, token_ids=prompt + extra, decode_kv_transfer_params=params, timings=timings
    )
    checked(served, lambda: served.stub.CommitTurn(commit))
    checked(served, lambda: served.stub.AbortTurn(pb.AbortTurnRequest(turn=handle, reason=reason)))


ROUTER_METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["RouterService"].methods]


@FUZZ
@given(method=st.sampled_from(ROUTER_METHODS), body=st.binary(max_size=200))
def test_router_any_bytes(served: RouterServed, method: str, body: bytes) -> None:
    rpc: Any = served.channel.unary_unary(f"/kvshuttle.router.v1.RouterService/{method}")
    checked(served, lambda: rpc(body, timeout=5))


@pytest.fixture(scope="module")
def agent() -> Iterator[tuple[LoopThread, grpc.Channel]]:
    from tests.agent.helpers import agent_settings  # noqa: PLC0415  # the agent's own test kit

    thread = LoopThread()
    settings = agent_settings("127.0.0.1:1", "http://127.0.0.1:1")

    async def start() -> Any:
        port = AgentPort(agent_registry(settings))
        server = build_agent_server(settings, Agent(settings, port), CollectorRegistry())
        return server, await server.start()

    server, port = thread.run(start())
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield thread, channel
    channel.close()
    thread.run(server.stop())
    thread.close()


AGENT_METHODS = [m.name for m in apb.DESCRIPTOR.services_by_name["AgentService"].methods]


@FUZZ
@given(method=st.sampled_from(AGENT_METHODS), body=st.binary(max_size=200))
def test_agent_any_bytes(agent: tuple[LoopThread, grpc.Channel], method: str, body: bytes) -> None:
    _, channel = agent
    rpc: Any = channel.unary_unary(f"/kvshuttle.agent.v1.AgentService/{method}")
    code = outcome(lambda: rpc(body, timeout=5))
    # FAILED_PRECONDITION: a move asked of this agent, which has no pool.
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    status: Any = channel.unary_unary("/kvshuttle.agent.v1.AgentService/GetStatus")
    status(b"", timeout=5)  # still up
