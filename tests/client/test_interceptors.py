"""Extra client interceptors (OpenTelemetry's) wrap every attempt; errors still parse."""

from __future__ import annotations

import grpc
import pytest
from opentelemetry.instrumentation.grpc import aio_client_interceptors
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tests.client.fake_registry import FakeRegistry

from kvshuttle.client import ChannelOptions, KvshuttleRpcError, RegistryClient


async def test_opentelemetry_interceptors_see_each_attempt(fake: FakeRegistry) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    interceptors = aio_client_interceptors(tracer_provider=provider)  # type: ignore[no-untyped-call]
    options = ChannelOptions(fake.address, initial_backoff=0.001, interceptors=interceptors)
    fake.add_node("nodes/d0")
    fake.fail("GetNode", grpc.StatusCode.UNAVAILABLE)
    async with RegistryClient.connect(options) as client:
        assert (await client.get_node("nodes/d0")).node.name == "nodes/d0"
        with pytest.raises(KvshuttleRpcError) as caught:
            await client.get_node("nodes/missing")
    assert caught.value.reason == "NODE_NOT_FOUND"
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["/kvshuttle.registry.v1.RegistryService/GetNode"] * 3
    provider.shutdown()
