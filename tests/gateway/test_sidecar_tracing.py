"""The trace context the decode-side sidecar sends the engines: every prefill and decode request,
in each of its modes, carries a `traceparent` of the request's trace, naming the sidecar's own
CLIENT span of that engine request (so vLLM's `llm_request` span joins the trace): llm-d's plain
P->D and local serving under a `request` SERVER span (a child of the caller's context, its
tracestate kept), a planned turn under the gateway's `turn` span."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tests.gateway.helpers import first_messages
from tests.gateway.sidecar_helpers import SidecarCluster, start_sidecar_cluster, stop_sidecar_cluster
from tests.router.helpers import MODEL
from tests.support.planning_epp import plan_headers

from kvshuttle.core.endpoints import endpoint_host_port
from kvshuttle.gateway.pd_headers import PREFILLER_HOST_PORT_HEADER
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.serving.settings import TelemetrySettings
from kvshuttle.serving.tracing import configure_tracing, shutdown_tracing

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
CALLER = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01", "tracestate": "vendor=opaque-1"}


@pytest.fixture
async def traced(
    model_dir: Path, chat_tokenizer: ChatTokenizer
) -> AsyncIterator[tuple[SidecarCluster, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = configure_tracing(TelemetrySettings(), "kvshuttle-sidecar-test", exporter=exporter)
    cluster = await start_sidecar_cluster(model_dir, chat_tokenizer, provider=provider)
    try:
        yield cluster, exporter
    finally:
        await stop_sidecar_cluster(cluster)
        shutdown_tracing(provider)


def completion(prompt: list[int]) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 16}


def parent_of(headers: dict[str, str]) -> tuple[str, str, str]:
    """(trace id, parent span id, tracestate) of an engine request's headers."""
    lowered = {k.lower(): v for k, v in headers.items()}
    _, trace_id, span_id, _ = lowered["traceparent"].split("-")
    return trace_id, span_id, lowered.get("tracestate", "")


def one(spans: tuple[ReadableSpan, ...], name: str) -> ReadableSpan:
    (span,) = [s for s in spans if s.name == name]
    return span


def hexes(span: ReadableSpan) -> tuple[str, str]:
    assert span.context is not None
    return format(span.context.trace_id, "032x"), format(span.context.span_id, "016x")


async def test_llmd_mode_sends_each_engine_its_own_spans_context_in_the_callers_trace(
    traced: tuple[SidecarCluster, InMemorySpanExporter],
) -> None:
    c, exporter = traced
    prefiller = endpoint_host_port(c.prefill.url)
    assert prefiller is not None
    status, raw, _ = await c.post(
        "/v1/completions",
        completion(list(range(100, 300))),
        {PREFILLER_HOST_PORT_HEADER: prefiller, **CALLER},
    )
    assert status == 200, raw
    spans = exporter.get_finished_spans()
    served = one(spans, "request")
    assert served.parent is not None and format(served.parent.span_id, "016x") == CALLER_SPAN
    assert (served.attributes or {})["kvshuttle.sidecar.mode"] == "llmd"
    for engine, role in ((c.prefill, "prefill"), (c.decode, "decode")):
        call = one(spans, role)
        assert (
            call.parent is not None
            and format(call.parent.span_id, "016x") == hexes(served)[1]
            and hexes(call)[0] == CALLER_TRACE
        )
        (request,) = engine.transcript.requests
        assert parent_of(request.headers) == (CALLER_TRACE, hexes(call)[1], "vendor=opaque-1")


async def test_local_mode_without_a_callers_context_starts_the_requests_trace(
    traced: tuple[SidecarCluster, InMemorySpanExporter],
) -> None:
    c, exporter = traced
    status, raw, _ = await c.post("/v1/completions", completion(list(range(50, 90))))
    assert status == 200, raw
    spans = exporter.get_finished_spans()
    served, call = one(spans, "request"), one(spans, "decode")
    assert served.parent is None and (served.attributes or {})["kvshuttle.sidecar.mode"] == "local"
    (request,) = c.decode.transcript.requests
    assert parent_of(request.headers)[:2] == hexes(call) and hexes(call)[0] == hexes(served)[0]


async def test_a_planned_turns_engine_requests_are_in_the_turns_trace(
    traced: tuple[SidecarCluster, InMemorySpanExporter],
) -> None:
    c, exporter = traced
    body = {"model": MODEL, "messages": first_messages(), "max_tokens": 16, "conversation_id": "conv-t"}
    plan, ids = await c.epp.plan("chat", body)
    status, raw, _ = await c.post("/v1/chat/completions", body, {**plan_headers(plan, ids), **CALLER})
    assert status == 200, raw
    spans = exporter.get_finished_spans()
    turn = one(spans, "turn")
    assert hexes(turn)[0] == CALLER_TRACE
    for engine, role in ((c.prefill, "prefill"), (c.decode, "decode")):
        (request,) = engine.transcript.requests
        assert parent_of(request.headers)[:2] == hexes(one(spans, role))
