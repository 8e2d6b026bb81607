from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from tests.client.fake_registry import FakeRegistry, serve

from kvshuttle.client import ChannelOptions, RegistryClient
from kvshuttle.registry.v1 import registry_service_pb2_grpc as pb_grpc


@pytest.fixture
async def fake() -> AsyncIterator[FakeRegistry]:
    """A FakeRegistry served on 127.0.0.1; its address is in `fake_address`."""
    registry = FakeRegistry()
    async with serve((pb_grpc.add_RegistryServiceServicer_to_server, registry)) as address:
        registry.address = address
        yield registry


@pytest.fixture
def fake_address(fake: FakeRegistry) -> str:
    return fake.address


@pytest.fixture
async def client(fake_address: str) -> AsyncIterator[RegistryClient]:
    """A RegistryClient on the fake with millisecond backoff, so retry tests stay fast."""
    options = ChannelOptions(fake_address, initial_backoff=0.001, max_backoff=0.005)
    async with RegistryClient.connect(options) as c:
        yield c
