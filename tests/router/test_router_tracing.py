"""One trace per turn: the test plays the gateway, opens the turn's root span and calls the
router through a traced channel; the router's server span, its domain spans (plan, claim,
commit) and its registry calls must all land in that trace."""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import pytest
from opentelemetry import context, trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tests.router.helpers import MODEL, RouterEnv, Tokens, add_node, seconds, start_router
from tests.support.registry_env import RegistryEnv, start_registry

from kvshuttle.client import RouterClient
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.serving.settings import TelemetrySettings
from kvshuttle.serving.tracing import configure_tracing, shutdown_tracing

CONVERSATION_ID = "conv-4f1c-private"
CONV = f"tenants/acme/conversations/{CONVERSATION_ID}"


@dataclass
class Traced:
    registry: RegistryEnv
    router: RouterEnv
    provider: TracerProvider
    exporter: InMemorySpanExporter
    tokens: Tokens

    @property
    def gateway(self) -> trace.Tracer:
        return self.provider.get_tracer("gateway")

    def spans(self, trace_id: int) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.context and s.context.trace_id == trace_id]

    def named(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if s.name == name]


@pytest.fixture
async def traced() -> AsyncIterator[Traced]:
    # One provider per test, with its own exporter: the router gets it explicitly (the global
    # provider belongs to whichever test configured tracing first).
    exporter = InMemorySpanExporter()
    provider = configure_tracing(TelemetrySettings(), "kvshuttle-router-test", exporter=exporter)
    registry = await start_registry()
    router = await start_router(registry, tracer_provider=provider, client_tracing=provider)
    await add_node(registry, "nodes/p0", reg_pb.NODE_ROLE_PREFILL)
    await add_node(registry, "nodes/d0", reg_pb.NODE_ROLE_DECODE)
    yield Traced(registry, router, provider, exporter, Tokens())
    await router.close()
    await registry.channel.close()
    registry.registry.close()
    await registry.server.stop()
    shutdown_tracing(provider)


async def run_turn(
    t: Traced, prompt: list[int], output: int = 70, *, timings: pb.TurnTimings | None = None
) -> tuple[int, pb.PlanTurnResponse, list[int]]:
    """One turn inside the gateway's root span; returns its trace id."""
    with t.gateway.start_as_current_span("turn") as root:
        plan = await t.router.client.plan_turn(MODEL, prompt, conversation=CONV)
        sequence = prompt + t.tokens(output)
        await t.router.client.commit_turn(
            plan.turn,
            token_ids=sequence,
            decode_kv_transfer_params=t.tokens.decode_params(plan, len(sequence)),
            timings=timings,
        )
    return root.get_span_context().trace_id, plan, sequence


def one(spans: Sequence[ReadableSpan], name: str) -> ReadableSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, [s.name for s in spans]
    return found[0]


async def test_a_turn_is_one_trace_with_plan_claim_and_commit(traced: Traced) -> None:
    first_trace, _, sequence = await run_turn(traced, traced.tokens(4000))
    timings = pb.TurnTimings(
        ttft=seconds(0.120), prefill=seconds(0.100), transfer=seconds(0.030), transfer_bytes=123_456_789
    )
    second_trace, second, _ = await run_turn(traced, sequence + traced.tokens(100), timings=timings)
    assert second.decision == pb.DECISION_REUSE
    assert first_trace != second_trace

    spans = traced.spans(second_trace)
    names = [s.name for s in spans]
    for name in (
        "turn",
        "plan",
        "claim",
        "commit",
        "/kvshuttle.router.v1.RouterService/PlanTurn",  # client and server spans
        "/kvshuttle.router.v1.RouterService/CommitTurn",
        "/kvshuttle.registry.v1.RegistryService/ClaimRetention",
        "/kvshuttle.registry.v1.RegistryService/PutRetention",
    ):
        assert name in names, (name, names)
    # The router that committed turn 1 planned turn 2 from its hint: no registry read.
    assert "/kvshuttle.registry.v1.RegistryService/GetConversation" not in names
    # Nothing of the turn escaped into another trace.
    stray = [
        s.name
        for s in traced.exporter.get_finished_spans()
        if s.context.trace_id not in (first_trace, second_trace)
    ]
    assert stray == []

    plan, claim, commit = one(spans, "plan"), one(spans, "claim"), one(spans, "commit")
    assert claim.parent is not None and claim.parent.span_id == plan.context.span_id
    registry_claim = one(spans, "/kvshuttle.registry.v1.RegistryService/ClaimRetention")
    assert registry_claim.parent is not None and registry_claim.parent.span_id == claim.context.span_id

    digest = hashlib.sha256(CONV.encode()).hexdigest()[:16]
    a = plan.attributes or {}
    assert a["kvshuttle.tenant"] == "acme"
    assert a["kvshuttle.conversation"] == digest
    assert a["kvshuttle.turn_index"] == 2
    assert (a["kvshuttle.decision"], a["kvshuttle.decision.reason"]) == ("reuse", "reuse_cheaper")
    assert a["kvshuttle.reused_tokens"] == second.reusable_tokens
    assert a["kvshuttle.recomputed_tokens"] == second.tokens_to_compute
    assert (claim.attributes or {})["kvshuttle.claim"] == "won"
    assert a["kvshuttle.retention_hint"] == "confirmed"

    c = commit.attributes or {}
    assert (c["kvshuttle.turn_index"], c["kvshuttle.decision"]) == (2, "reuse")
    assert c["kvshuttle.reused_tokens"] == second.reusable_tokens
    assert c["kvshuttle.ttft.ms"] == pytest.approx(120.0)
    assert c["kvshuttle.transfer.ms"] == pytest.approx(30.0)
    assert c["kvshuttle.transfer.bytes"] == 123_456_789
    # The retention's name with the conversation id replaced by the same digest.
    assert c["kvshuttle.retention"] == f"tenants/acme/conversations/{digest}/retentions/2"

    # Turn 1 recomputed: no claim, and its commit carries no timings it was not given.
    first_spans = traced.spans(first_trace)
    assert "claim" not in [s.name for s in first_spans]
    first_commit = one(first_spans, "commit").attributes or {}
    assert "kvshuttle.ttft.ms" not in first_commit and "kvshuttle.transfer.bytes" not in first_commit
    assert (one(first_spans, "plan").attributes or {})["kvshuttle.decision.reason"] == "no_retention"


async def test_the_raw_conversation_id_is_in_no_span(traced: Traced) -> None:
    await run_turn(traced, traced.tokens(200))
    for span in traced.exporter.get_finished_spans():
        for key, value in (span.attributes or {}).items():
            if key == "kvshuttle.retention":
                continue  # a resource name the gateway already knows, like the RPC's own fields
            assert CONVERSATION_ID not in str(value), (span.name, key)


async def test_a_commit_sent_without_trace_context_joins_the_plans_trace(traced: Traced) -> None:
    with traced.gateway.start_as_current_span("turn") as root:
        prompt = traced.tokens(300)
        plan = await traced.router.client.plan_turn(MODEL, prompt, conversation=CONV)
    # A gateway that does not propagate context: a plain channel, no current span.
    address = traced.router.client.options.target
    async with RouterClient.connect(address) as plain:
        sequence = prompt + traced.tokens(20)
        await plain.commit_turn(
            plan.turn,
            token_ids=sequence,
            decode_kv_transfer_params=traced.tokens.decode_params(plan, len(sequence)),
        )

    trace_id = root.get_span_context().trace_id
    plan_span = one(traced.spans(trace_id), "plan")
    commit = one(traced.spans(trace_id), "commit")
    assert commit.parent is not None and commit.parent.span_id == plan_span.context.span_id
    # The server span of that CommitTurn started a trace of its own (nothing came with it).
    server = one(
        traced.named("/kvshuttle.router.v1.RouterService/CommitTurn"),
        "/kvshuttle.router.v1.RouterService/CommitTurn",
    )
    assert server.context.trace_id != trace_id


async def test_a_commit_without_trace_context_keeps_an_unsampled_plans_decision(traced: Traced) -> None:
    # The gateway's turn was not sampled (flags 00): neither the plan nor its commit is recorded,
    # even when the commit comes without trace context and joins the plan's trace.
    unsampled = trace.SpanContext(0x5B8AA5A2D2C872E8321CF37308D69DF2, 0x051581BF3CB55C13, is_remote=True)
    token = context.attach(trace.set_span_in_context(trace.NonRecordingSpan(unsampled)))
    try:
        prompt = traced.tokens(300)
        plan = await traced.router.client.plan_turn(MODEL, prompt, conversation=CONV)
    finally:
        context.detach(token)
    async with RouterClient.connect(traced.router.client.options.target) as plain:
        sequence = prompt + traced.tokens(20)
        await plain.commit_turn(
            plan.turn,
            token_ids=sequence,
            decode_kv_transfer_params=traced.tokens.decode_params(plan, len(sequence)),
        )
    assert traced.named("/kvshuttle.router.v1.RouterService/CommitTurn")  # the commit was traced...
    assert traced.spans(unsampled.trace_id) == []  # ...but nothing of the unsampled trace recorded
