"""Several replicas behind one target: round robin over those up, failover when one goes.

Real gRPC servers on 127.0.0.1 (port 0), each a fake registry that counts its calls."""

from __future__ import annotations

import contextlib

import pytest
from tests.client.fake_registry import FakeRegistry, serve

from kvshuttle.client import RegistryClient
from kvshuttle.client.channel import ChannelOptions, grpc_target
from kvshuttle.client.settings import ServiceConnection
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc


def test_a_list_of_replicas_is_a_grpc_address_list_and_host_names_are_refused() -> None:
    assert grpc_target("127.0.0.1:1") == "127.0.0.1:1"
    assert grpc_target("dns:///registry.kvshuttle:50051") == "dns:///registry.kvshuttle:50051"
    assert grpc_target("10.0.0.5:50051, 10.0.0.6:50051") == "ipv4:10.0.0.5:50051,10.0.0.6:50051"
    assert grpc_target("[::1]:1,[::2]:2") == "ipv6:[::1]:1,[::2]:2"
    for bad in ("registry-0:50051,registry-1:50051", "10.0.0.5:50051,[::1]:2", "10.0.0.5,10.0.0.6:1"):
        with pytest.raises(ValueError, match="dns:///"):
            ChannelOptions(bad)
        with pytest.raises(ValueError, match="dns:///"):
            ServiceConnection(address=bad)


async def test_calls_go_round_robin_and_fail_over_when_a_replica_stops() -> None:
    first, second = FakeRegistry(), FakeRegistry()
    for fake in (first, second):
        fake.add_node("nodes/d0")
    async with contextlib.AsyncExitStack() as stack:
        add = pb_grpc.add_RegistryServiceServicer_to_server
        a = await stack.enter_async_context(serve((add, first)))
        replica_b = contextlib.AsyncExitStack()
        b = await replica_b.enter_async_context(serve((add, second)))
        client = await stack.enter_async_context(
            RegistryClient.connect(f"{a},{b}", initial_backoff=0.001, max_backoff=0.01)
        )
        for _ in range(20):
            await client.get_node("nodes/d0")
        assert first.calls["GetNode"] > 0 and second.calls["GetNode"] > 0  # both serve
        assert first.calls["GetNode"] + second.calls["GetNode"] == 20
        await replica_b.aclose()  # the second replica stops under the open channel
        served_by_b, before = second.calls["GetNode"], first.calls["GetNode"]
        for _ in range(10):  # every call answered: retried on the first when it hit the dead one
            await client.get_node("nodes/d0")
        assert first.calls["GetNode"] - before == 10 and second.calls["GetNode"] == served_by_b
