"""A traced client: one CLIENT span per attempt, its context sent to the server, failures marked."""

from __future__ import annotations

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from tests.client.fake_registry import FakeRegistry

from kvshuttle.client import ChannelOptions, KvshuttleRpcError, RegistryClient

GET_NODE = "/kvshuttle.registry.v1.RegistryService/GetNode"


@pytest.fixture
def traced() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


async def test_each_attempt_is_a_client_span_and_its_context_reaches_the_server(
    fake: FakeRegistry, traced: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = traced
    options = ChannelOptions(fake.address, initial_backoff=0.001, tracer_provider=provider)
    fake.add_node("nodes/d0")
    fake.fail("GetNode", grpc.StatusCode.UNAVAILABLE)  # the first attempt fails, the retry answers
    async with RegistryClient.connect(options) as client:
        assert (await client.get_node("nodes/d0")).node.name == "nodes/d0"
        with pytest.raises(KvshuttleRpcError) as caught:
            await client.get_node("nodes/missing")
    assert caught.value.reason == "NODE_NOT_FOUND"

    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == [GET_NODE] * 3
    assert all(s.kind == SpanKind.CLIENT for s in spans)
    codes = [(s.attributes or {})["rpc.grpc.status_code"] for s in spans]
    assert codes == [grpc.StatusCode.UNAVAILABLE.value[0], 0, grpc.StatusCode.NOT_FOUND.value[0]]
    assert [s.status.status_code for s in spans] == [StatusCode.ERROR, StatusCode.UNSET, StatusCode.ERROR]
    attributes = spans[1].attributes or {}
    assert (attributes["rpc.system"], attributes["rpc.service"], attributes["rpc.method"]) == (
        "grpc",
        "kvshuttle.registry.v1.RegistryService",
        "GetNode",
    )
    # Each attempt sent its own span's context as W3C trace context.
    sent = [dict(m).get("traceparent") for m in fake.received_metadata["GetNode"]]
    assert sent == [
        f"00-{s.context.trace_id:032x}-{s.context.span_id:016x}-{s.context.trace_flags:02x}" for s in spans
    ]


async def test_an_untraced_client_sends_no_trace_context(fake: FakeRegistry) -> None:
    fake.add_node("nodes/d0")
    async with RegistryClient.connect(fake.address) as client:
        await client.get_node("nodes/d0")
    assert all("traceparent" not in dict(m) for m in fake.received_metadata["GetNode"])
