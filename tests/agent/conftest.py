"""The agent tests' stand-ins for the engine an agent sits beside: its HTTP (/health, /metrics)
and its KV-event publisher (ZMQ PUB + replay), each started and stopped per test."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import zmq.asyncio
from tests.agent.engine_fakes import FakeEngineHttp, FakePublisher


@pytest.fixture
async def zmq_context() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
async def engine() -> AsyncIterator[FakeEngineHttp]:
    server = FakeEngineHttp()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def publisher(zmq_context: zmq.asyncio.Context) -> AsyncIterator[FakePublisher]:
    pub = FakePublisher(zmq_context)
    yield pub
    await pub.close()
