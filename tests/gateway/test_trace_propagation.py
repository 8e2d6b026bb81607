"""The trace context the gateway sends the engines when its process exports nothing (no OTLP
endpoint: the services' spans carry ids only, kvshuttle.serving.tracing): every prefill and
decode request still carries a `traceparent` of the turn's trace, real ids and the sampler's
flag, so an engine that exports (vLLM with --otlp-traces-endpoint) joins the turn's trace and
honours its sampling decision. The exporting case: tests/gateway/test_gateway.py and
tests/deploy/test_turn_trace_standin.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import structlog
from structlog.testing import capture_logs
from tests.gateway.helpers import CHAT, Cluster, chat, cluster_fixture, first_messages

from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer

NO_SPAN = "0" * 16


@pytest.fixture
async def quiet(model_dir: Path, chat_tokenizer: ChatTokenizer) -> AsyncIterator[Cluster]:
    async for cluster in cluster_fixture(model_dir, chat_tokenizer, export=False):
        yield cluster


def sent(c: Cluster) -> list[tuple[str, str, str, str]]:
    """The (version, trace id, parent span id, flags) of each engine request's traceparent."""
    requests = [*c.prefill.transcript.requests, *c.decode.transcript.requests]
    return [tuple(r.headers["traceparent"].split("-")) for r in requests]  # type: ignore[misc]


async def test_without_an_exporter_the_engines_still_get_the_turns_sampled_trace(quiet: Cluster) -> None:
    # merge_contextvars: the servers bind each RPC's trace id there, as in production.
    with capture_logs(processors=[structlog.contextvars.merge_contextvars]) as logs:
        status, _ = await quiet.post(CHAT, chat(first_messages(), conversation_id="conv-q"))
    assert status == 200
    assert quiet.exporter.get_finished_spans() == ()  # nothing recorded, nothing exported
    (done,) = [e for e in logs if e.get("event") == "request.done"]
    (prefill, decode) = sent(quiet)
    for version, trace_id, parent, flags in (prefill, decode):
        assert (version, trace_id, flags) == ("00", done["trace_id"], "01")
        assert parent != NO_SPAN
    assert prefill[2] != decode[2]  # each request under its own span (prefill's, decode's)
    # The router's calls are in the same trace: its log lines carry the turn's trace id.
    rpcs = [e for e in logs if e.get("event") == "rpc.done" and e.get("method") in ("PlanTurn", "CommitTurn")]
    assert {e["method"] for e in rpcs} == {"PlanTurn", "CommitTurn"}
    assert {e["trace_id"] for e in rpcs} == {done["trace_id"]}


async def test_an_unsampled_callers_trace_reaches_the_engines_unsampled(quiet: Cluster) -> None:
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    status, _ = await quiet.post(
        CHAT,
        chat(first_messages(), conversation_id="conv-u"),
        traceparent=f"00-{trace_id}-b7ad6b7169203331-00",
        tracestate="vendor=opaque-1",
    )
    assert status == 200
    # An engine that exports records nothing of it: the caller's decision holds end to end.
    assert [(t, f) for _, t, _, f in sent(quiet)] == [(trace_id, "00"), (trace_id, "00")]
    # The caller's tracestate travels with it.
    requests = [*quiet.prefill.transcript.requests, *quiet.decode.transcript.requests]
    assert [r.headers.get("tracestate") for r in requests] == ["vendor=opaque-1"] * 2


async def test_the_configured_sampler_decides_the_flag_the_engines_get(
    model_dir: Path, chat_tokenizer: ChatTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # OTEL_TRACES_SAMPLER, read by the SDK when the provider is made: sample nothing.
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    async for c in cluster_fixture(model_dir, chat_tokenizer, export=False):
        with capture_logs() as logs:
            status, _ = await c.post(CHAT, chat(first_messages(), conversation_id="conv-s"))
        assert status == 200
        (done,) = [e for e in logs if e.get("event") == "request.done"]
        # Still sent, with real ids: the engines' logs and the next hop keep the trace id.
        assert [(t, f) for _, t, _, f in sent(c)] == [(done["trace_id"], "00")] * 2
