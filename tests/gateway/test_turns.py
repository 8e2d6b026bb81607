"""The turn runner on its own: a fake router and fake engines in memory (no sockets, no HTTP
server, no gRPC), driven as the gateway's HTTP layer drives it.

What it owes the gateway: the engines get what vLLM needs (prefill: max_tokens 1, the plan's
params; decode: P's params unchanged), CommitTurn gets the sequence, decode's final params and
the runner's own timings, whatever fails after planning aborts the turn, and a conversation's
next turn plans only after its previous commit has landed."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry import trace
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs

from kvshuttle.core.prototime import to_duration
from kvshuttle.gateway.errors import GatewayError, RouterFailure, engine_error
from kvshuttle.gateway.http.app import turn_headers
from kvshuttle.gateway.metrics import GatewayMetrics
from kvshuttle.gateway.turns.background import BackgroundTasks
from kvshuttle.gateway.turns.record import DecodeOutput, Turn
from kvshuttle.gateway.turns.request_log import RequestLog
from kvshuttle.gateway.turns.runner import ClientGone, TurnRunner
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.vllm.kv_transfer_params import from_vllm, to_vllm
from kvshuttle.vllm.v1.kv_transfer_params_pb2 import KvTransferParams

PROMPT = list(range(100, 164))
OUTPUT = [7, 8, 9, 2]
FIRST_TURN_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
CONVERSATION = "tenants/t/conversations/c"
REUSE_TIMEOUT_S = 0.2


def p_params(cached: int = 0) -> dict[str, Any]:
    """Prefill's answer params, as vLLM's NixlConnector sends them."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1, 2, 3, 4]],
        "remote_engine_id": "engine-p0",
        "remote_request_id": "cmpl-p-0",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_num_tokens": len(PROMPT),
        "remote_prefill_cached_tokens": cached,
    }


def d_params() -> dict[str, Any]:
    """Decode's final params: the blocks it keeps for the next turn."""
    return {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_block_ids": [[11, 12, 13, 14]],
        "remote_engine_id": "engine-d0",
        "remote_request_id": "cmpl-d-0",
        "remote_host": "127.0.0.1",
        "remote_port": 5601,
        "remote_num_tokens": len(PROMPT) + len(OUTPUT) - 1,
    }


def make_plan(
    n: int, *, reuse: bool = False, conversation: bool = True, params: dict[str, Any] | None = None
) -> pb.PlanTurnResponse:
    reason = pb.DECISION_REASON_NO_RETENTION if conversation else pb.DECISION_REASON_NO_CONVERSATION
    plan = pb.PlanTurnResponse(
        turn=f"turns/{n}",
        generation=n,
        prefill=pb.Placement(node="nodes/p0", http_endpoint="http://p0"),
        decode=pb.Placement(node="nodes/d0", http_endpoint="http://d0"),
        decision=pb.DECISION_REUSE if reuse else pb.DECISION_RECOMPUTE,
        reason=pb.DECISION_REASON_REUSE_CHEAPER if reuse else reason,
        reusable_tokens=32 if reuse else 0,
    )
    plan.prefill_kv_transfer_params.CopyFrom(from_vllm(params or FIRST_TURN_PARAMS))
    return plan


@dataclass
class Commit:
    turn: str
    conversation: str  # what routes it to the replica that planned the turn
    token_ids: list[int]
    params: KvTransferParams | None
    timings: pb.TurnTimings
    turn_end: int = pb.TURN_END_UNSPECIFIED


@dataclass
class FakeRouter:
    """RouterPort in memory; `log` records every call in order, across the fakes."""

    log: list[str]
    # Request id -> the plan it gets.
    plans: dict[str, pb.PlanTurnResponse] = field(default_factory=dict)
    commits: list[Commit] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)
    abort_conversations: list[str] = field(default_factory=list)
    # Set: CommitTurn waits for it. A failure: CommitTurn raises it.
    commit_gate: asyncio.Event | None = None
    commit_failure: RouterFailure | None = None
    plan_failure: RouterFailure | None = None
    # Request id -> the think-time hint its PlanTurn carried.
    think_times: dict[str, float | None] = field(default_factory=dict)

    async def plan_turn(
        self,
        model: str,
        prompt_token_ids: Iterable[int],
        *,
        conversation: str,
        request_id: str,
        cache_salt_sha256: bytes,
        expected_think_time_s: float | None = None,
        decode_endpoints: Sequence[str] = (),
        tenant: str = "",
    ) -> pb.PlanTurnResponse:
        self.log.append(f"plan {request_id}")
        self.think_times[request_id] = expected_think_time_s
        if self.plan_failure is not None:
            raise self.plan_failure
        return self.plans[request_id]

    async def commit_turn(
        self,
        turn: str,
        *,
        conversation: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int],
        decode_kv_transfer_params: KvTransferParams | None,
        timings: pb.TurnTimings,
        turn_end: pb.TurnEnd.ValueType = pb.TURN_END_UNSPECIFIED,
        transcript: pb.TranscriptSpec | None = None,
    ) -> pb.CommitTurnResponse:
        if self.commit_gate is not None:
            await self.commit_gate.wait()
        self.log.append(f"commit {turn}")
        if self.commit_failure is not None:
            raise self.commit_failure
        sequence = [*prompt_token_ids, *output_token_ids]
        self.commits.append(
            Commit(turn, conversation, sequence, decode_kv_transfer_params, timings, turn_end)
        )
        retained = decode_kv_transfer_params is not None
        return pb.CommitTurnResponse(retention=f"{CONVERSATION}/retentions/1" if retained else "")

    async def abort_turn(self, turn: str, *, conversation: str, reason: str) -> None:
        self.log.append(f"abort {turn}")
        self.aborts.append((turn, reason))
        self.abort_conversations.append(conversation)


@dataclass
class FakeEngines:
    """EnginePort in memory: prefill answers P's params, decode the output and D's params,
    whole or as a stream of one chunk per token (the last one with finish_reason and params)."""

    log: list[str]
    cached: int = 0
    requests: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: {"prefill": [], "decode": []})
    # (role, endpoint) of every call, in order.
    endpoints: list[tuple[str, str]] = field(default_factory=list)
    failures: dict[str, GatewayError] = field(default_factory=dict)
    # Seconds each call takes: the runner's measurements must see them.
    delay: float = 0.002
    # A prefill reading retained KV (its params name remote_block_ids) hangs, as vLLM 0.32's does
    # when the KV holder died ("KV fetch in progress" forever), or fails with this error.
    reuse_prefill_hangs: bool = False
    reuse_prefill_failure: GatewayError | None = None
    # Extra seconds every prefill takes.
    prefill_delay: float = 0.0
    # X-Request-Id of every call, and of every call cancelled before it answered.
    request_ids: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    def _record(self, role: str, body: bytes) -> None:
        self.log.append(role)
        self.requests[role].append(json.loads(body))
        if role in self.failures:
            raise self.failures[role]

    async def complete(
        self, role: str, endpoint: str, body: bytes, headers: Mapping[str, str], *, timeout_s: float
    ) -> dict[str, Any]:
        self.request_ids.append(headers["X-Request-Id"])
        reuse = role == "prefill" and "remote_block_ids" in json.loads(body).get("kv_transfer_params", {})
        try:
            await asyncio.sleep(self.delay + (self.prefill_delay if role == "prefill" else 0.0))
            if reuse and self.reuse_prefill_hangs:
                self.endpoints.append((role, endpoint))
                self._record(role, body)
                await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.append(headers["X-Request-Id"])
            raise
        self.endpoints.append((role, endpoint))
        self._record(role, body)
        if reuse and self.reuse_prefill_failure is not None:
            raise self.reuse_prefill_failure
        if role == "prefill":
            choice = {"index": 0, "text": "x", "token_ids": OUTPUT[:1], "finish_reason": "length"}
            return {"choices": [choice], "kv_transfer_params": p_params(self.cached)}
        choice = {"index": 0, "text": "abcd", "token_ids": OUTPUT, "finish_reason": "stop"}
        return {"id": "cmpl-d", "choices": [choice], "kv_transfer_params": d_params()}

    @asynccontextmanager
    async def stream(
        self, role: str, endpoint: str, body: bytes, headers: Mapping[str, str]
    ) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        await asyncio.sleep(self.delay)
        self.endpoints.append((role, endpoint))
        self._record(role, body)

        async def chunks() -> AsyncIterator[dict[str, Any]]:
            for i, token in enumerate(OUTPUT):
                last = i == len(OUTPUT) - 1
                choice = {
                    "index": 0,
                    "text": "t",
                    "token_ids": [token],
                    "finish_reason": "stop" if last else None,
                }
                yield {"choices": [choice], **({"kv_transfer_params": d_params()} if last else {})}

        yield chunks()


@dataclass
class FakeSink:
    """DecodeSink: keeps what the client would get; `gone_after` chunks, the client leaves."""

    opened: bool = False
    chunks: list[dict[str, Any]] = field(default_factory=list)
    gone_after: int | None = None

    async def open(self) -> None:
        self.opened = True

    async def send(self, chunk: dict[str, Any]) -> bool:
        if self.gone_after is not None and len(self.chunks) == self.gone_after:
            raise ClientGone
        chunk.pop("kv_transfer_params", None)  # as the HTTP layer's translation does
        self.chunks.append(chunk)
        return True


@dataclass
class Env:
    runner: TurnRunner
    router: FakeRouter
    engines: FakeEngines
    background: BackgroundTasks
    metrics: CollectorRegistry
    log: list[str]

    def commits(self, outcome: str) -> float | None:
        return self.metrics.get_sample_value("kvshuttle_gateway_commits_total", {"outcome": outcome})

    def fallbacks(self, why: str) -> float | None:
        return self.metrics.get_sample_value("kvshuttle_gateway_reuse_fallbacks_total", {"why": why})


@pytest.fixture
def env() -> Env:
    log: list[str] = []
    router, engines, background = FakeRouter(log), FakeEngines(log), BackgroundTasks()
    registry = CollectorRegistry()
    runner = TurnRunner(
        router,
        engines,
        tracer=trace.NoOpTracer(),
        metrics=GatewayMetrics(registry),
        background=background,
        prefill_timeout_s=5.0,
        reuse_prefill_timeout_s=REUSE_TIMEOUT_S,
        decode_timeout_s=5.0,
        commit_wait_s=5.0,
    )
    return Env(runner, router, engines, background, registry, log)


def make_turn(request_id: str = "r1", conversation: str = CONVERSATION) -> Turn:
    return Turn(
        request_id=request_id,
        model="m",
        conversation=conversation,
        prompt_ids=list(PROMPT),
        prefill_params={"temperature": 0.0},
        decode_params={"temperature": 0.0, "max_tokens": 16},
        arrived=time.perf_counter(),
    )


async def test_a_plain_turn_prefills_decodes_and_commits_the_sequence_with_its_own_timings(env: Env) -> None:
    env.router.plans["r1"] = make_plan(1, conversation=False)
    turn = make_turn(conversation="")
    answer = await env.runner.complete(turn)
    await env.background.settle()

    assert answer["choices"][0]["text"] == "abcd"
    (prefill,) = env.engines.requests["prefill"]
    assert prefill["prompt"] == PROMPT
    assert (prefill["max_tokens"], prefill["stream"], prefill["model"]) == (1, False, "m")
    assert prefill["kv_transfer_params"] == FIRST_TURN_PARAMS
    assert prefill["temperature"] == 0.0
    (decode,) = env.engines.requests["decode"]
    assert decode["prompt"] == PROMPT
    assert decode["kv_transfer_params"] == p_params()  # P's, unchanged
    assert (decode["return_token_ids"], decode["stream"], decode["max_tokens"]) == (True, False, 16)

    (commit,) = env.router.commits
    assert commit.turn == "turns/1"
    assert commit.token_ids == PROMPT + OUTPUT
    assert commit.params is not None and to_vllm(commit.params) == d_params()
    assert commit.turn_end == pb.TURN_END_STOP  # decode's finish_reason "stop"
    # The timings are what the runner measured (each engine call took at least `delay`).
    assert turn.prefill_s is not None and turn.decode_s is not None and turn.ttft_s is not None
    assert min(turn.prefill_s, turn.decode_s) >= env.engines.delay
    assert commit.timings.prefill == to_duration(turn.prefill_s)
    assert commit.timings.decode == to_duration(turn.decode_s)
    assert commit.timings.ttft == to_duration(turn.ttft_s)
    assert turn.ttft_s >= turn.prefill_s + turn.decode_s
    # Prefill said it read nothing: a fact the router learns from, unlike an unset field.
    assert commit.timings.HasField("remote_cached_tokens") and commit.timings.remote_cached_tokens == 0
    assert (turn.decision, turn.reason, turn.generation) == ("recompute", "no_conversation", 1)
    assert turn.output_tokens == len(OUTPUT) and turn.settled and not turn.outcome
    assert env.router.aborts == []
    assert env.log == ["plan r1", "prefill", "decode", "commit turns/1"]
    assert env.commits("stored") == 1


async def test_the_commit_says_how_the_answer_ended_as_the_client_is_told(env: Env) -> None:
    """A chat answer whose parsed tool call makes its finish_reason "tool_calls" commits as a
    tool call, though decode itself said "stop"; one the reader cannot place is unspecified."""
    for n, told, end in ((1, "tool_calls", pb.TURN_END_TOOL_CALL), (2, "length", pb.TURN_END_LENGTH),
                         (3, "abort", pb.TURN_END_UNSPECIFIED)):  # fmt: skip
        env.router.plans[f"r{n}"] = make_plan(n)
        turn = make_turn(f"r{n}")
        seen: list[str | None] = []

        def finish(out: DecodeOutput, told: str = told, seen: list[str | None] = seen) -> str:
            seen.append(out.finish_reason)
            return told

        turn.finish_reason = finish
        await env.runner.complete(turn)
        await env.background.settle()
        assert env.router.commits[-1].turn_end == end
        assert seen == ["stop"]  # read from decode's whole answer


async def test_the_turns_think_time_hint_reaches_the_plan(env: Env) -> None:
    env.router.plans["r1"] = make_plan(1)
    env.router.plans["r2"] = make_plan(2)
    hinted = make_turn("r1")
    hinted.expected_think_time_s = 7.5
    await env.runner.complete(hinted)
    await env.background.settle()
    await env.runner.complete(make_turn("r2"))
    await env.background.settle()
    assert env.router.think_times == {"r1": 7.5, "r2": None}


async def test_a_reuse_turn_hands_prefill_the_plans_params_and_streams_decode(env: Env) -> None:
    retained = {**d_params(), "remote_num_tokens": 32, "remote_block_ids": [[11, 12]]}
    env.router.plans["r1"] = make_plan(2, reuse=True, params=retained)
    env.engines.cached = 32
    turn, sink = make_turn(), FakeSink()
    await env.runner.stream(turn, sink)
    await env.background.settle()

    (prefill,) = env.engines.requests["prefill"]
    assert prefill["kv_transfer_params"] == retained  # exactly the plan's: decode's retained KV
    (decode,) = env.engines.requests["decode"]
    assert decode["kv_transfer_params"] == p_params(cached=32)
    assert (decode["stream"], decode["stream_options"]) == (True, {"include_usage": True})
    assert sink.opened and len(sink.chunks) == len(OUTPUT)
    assert all("kv_transfer_params" not in c for c in sink.chunks)

    (commit,) = env.router.commits
    assert commit.conversation == turn.conversation
    assert commit.token_ids == PROMPT + OUTPUT
    assert commit.params is not None and to_vllm(commit.params) == d_params()  # from the final chunk
    assert commit.timings.remote_cached_tokens == 32 == turn.remote_cached_tokens
    assert turn.decode_ttfb_s is not None and turn.decode_s is not None
    assert commit.timings.decode == to_duration(turn.decode_s)
    assert (turn.decision, turn.reason, turn.reused_tokens) == ("reuse", "reuse_cheaper", 32)
    assert env.metrics.get_sample_value("kvshuttle_gateway_reused_tokens_total") == 32


@pytest.mark.parametrize("stream", [True, False])
async def test_an_extend_turn_runs_whole_on_the_holder_without_a_prefill_request(
    env: Env, stream: bool
) -> None:
    holder = pb.Placement(node="nodes/d0", http_endpoint="http://d0")
    plan = make_plan(2, params={"do_remote_decode": False, "do_remote_prefill": False})
    plan.prefill.CopyFrom(holder)
    plan.decision, plan.reason = pb.DECISION_EXTEND, pb.DECISION_REASON_EXTEND_CHEAPER
    plan.reusable_tokens = 32
    env.router.plans["r1"] = plan
    turn = make_turn()
    if stream:
        await env.runner.stream(turn, FakeSink())
    else:
        await env.runner.complete(turn)
    await env.background.settle()

    assert env.engines.requests["prefill"] == []  # the holder's prefix cache is the history
    assert env.engines.log == ["plan r1", "decode", "commit turns/2"]
    (decode,) = env.engines.requests["decode"]
    # The plan's params: nothing remote to read, and the holder keeps the turn's KV.
    assert decode["kv_transfer_params"] == {"do_remote_decode": False, "do_remote_prefill": False}
    assert decode["prompt"] == PROMPT
    (commit,) = env.router.commits
    assert commit.params is not None and to_vllm(commit.params) == d_params()
    assert not commit.timings.HasField("prefill") and turn.prefill_s is None
    assert (turn.decision, turn.reason, turn.reused_tokens) == ("extend", "extend_cheaper", 32)


async def test_a_failing_prefill_aborts_the_turn_and_reaches_no_decode(env: Env) -> None:
    env.router.plans["r1"] = make_plan(3)
    env.engines.failures["prefill"] = engine_error("prefill", 500, "EngineCore died")
    turn = make_turn()
    with pytest.raises(GatewayError) as raised:
        await env.runner.complete(turn)
    await env.background.settle()

    assert raised.value.status == 502 and raised.value.code == "engine_error"
    assert env.router.aborts == [("turns/3", raised.value.message)]
    assert env.router.abort_conversations == [turn.conversation]  # to the replica that planned it
    assert env.engines.requests["decode"] == [] and env.router.commits == []
    assert (turn.outcome, turn.settled) == ("engine_error", True)
    assert turn.prefill_s is not None and turn.decode_s is None
    assert env.log == ["plan r1", "prefill", "abort turns/3"]


async def test_a_client_leaving_mid_stream_aborts_the_turn_and_commits_nothing(env: Env) -> None:
    env.router.plans["r1"] = make_plan(4)
    with pytest.raises(ClientGone):
        await env.runner.stream(make_turn(), FakeSink(gone_after=2))
    await env.background.settle()
    assert env.router.aborts == [("turns/4", "client disconnected")]
    assert env.router.commits == []


async def test_the_next_turn_of_a_conversation_plans_after_the_previous_commit(env: Env) -> None:
    env.router.plans.update(r1=make_plan(1), r2=make_plan(2, reuse=True), r9=make_plan(9))
    gate = env.router.commit_gate = asyncio.Event()
    await env.runner.complete(make_turn("r1"))  # answered while its commit is held

    second = make_turn("r2")
    turn2 = asyncio.create_task(env.runner.complete(second))
    await asyncio.sleep(0.05)
    assert not turn2.done() and env.log.count("plan r2") == 0  # waiting for turn 1's commit
    # Another conversation's turn does not wait for it.
    other = await asyncio.wait_for(env.runner.complete(make_turn("r9", "tenants/t/conversations/x")), 1)
    assert other["choices"]

    gate.set()
    await turn2
    await env.background.settle()
    assert env.log.index("commit turns/1") < env.log.index("plan r2")
    assert second.wait_s is not None and second.wait_s >= 0.04
    assert sorted(c.turn for c in env.router.commits) == ["turns/1", "turns/2", "turns/9"]


async def test_a_failed_commit_aborts_the_turn_after_the_answer(env: Env) -> None:
    env.router.plans["r1"] = make_plan(5, reuse=True)
    env.router.commit_failure = RouterFailure(
        "INVALID_ARGUMENT", "engine id mismatch", reason="INVALID_ARGUMENT"
    )
    turn = make_turn()
    with capture_logs() as logs:
        answer = await env.runner.complete(turn)
        await env.background.settle()

    assert answer["choices"][0]["text"] == "abcd"  # the client's answer did not depend on it
    assert env.router.aborts == [("turns/5", "commit failed")]
    assert env.log[-2:] == ["commit turns/5", "abort turns/5"]
    (failed,) = [e for e in logs if e["event"] == "turn.commit_failed"]
    assert (failed["code"], failed["request_id"]) == ("INVALID_ARGUMENT", "r1")
    assert failed["commit_ms"] >= 0
    assert env.commits("failed") == 1 and env.commits("stored") is None


async def test_a_failed_plan_is_the_routers_error_and_aborts_nothing(env: Env) -> None:
    env.router.plan_failure = RouterFailure("UNAVAILABLE", "no live engine", reason="NO_LIVE_NODE")
    turn = make_turn()
    with pytest.raises(GatewayError) as raised:
        await env.runner.complete(turn)
    assert (raised.value.status, raised.value.code) == (503, "no_live_node")
    assert turn.outcome == "router_error" and turn.plan_s is not None
    assert env.router.aborts == [] and env.log == ["plan r1"]


def test_the_turn_runner_and_its_domain_modules_import_no_transport() -> None:
    modules = [
        "turns.background",
        "errors",
        "metrics",
        "turns.ports",
        "turns.request_log",
        "openai.responses",
        "openai.protocol",
        "turns.runner",
    ]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module('kvshuttle.gateway.' + m)\n"
        "print(sorted({n.split('.')[0] for n in sys.modules} & {'grpc', 'aiohttp'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- the router out of reach --------------------------------------------------------------


def unreachable(code: str = "UNAVAILABLE") -> RouterFailure:
    """What GrpcRouterPort raises when the router cannot be reached (no ErrorInfo)."""
    return RouterFailure(code, "failed to connect to all addresses")


async def placed_once(env: Env) -> None:
    """One turn planned by the router: the gateway learns where model "m" runs."""
    plan = make_plan(1)
    plan.prefill.http_endpoint, plan.decode.http_endpoint = "http://p-last", "http://d-last"
    env.router.plans["r0"] = plan
    await env.runner.complete(make_turn("r0"))
    await env.background.settle()
    env.log.clear()
    env.router.commits.clear()
    env.engines.endpoints.clear()
    env.engines.requests = {"prefill": [], "decode": []}


@pytest.mark.parametrize("code", ["UNAVAILABLE", "DEADLINE_EXCEEDED"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_router_out_of_reach_serves_plain_pd_on_the_models_last_placement(
    env: Env, code: str, stream: bool
) -> None:
    await placed_once(env)
    env.router.plan_failure = unreachable(code)
    turn = make_turn("r1")
    with capture_logs() as logs:
        if stream:
            sink = FakeSink()
            await env.runner.stream(turn, sink)
            assert sink.opened and len(sink.chunks) == len(OUTPUT)
        else:
            answer = await env.runner.complete(turn)
            assert answer["choices"][0]["text"] == "abcd"
        await env.background.settle()

    assert env.engines.endpoints == [("prefill", "http://p-last"), ("decode", "http://d-last")]
    (prefill,) = env.engines.requests["prefill"]
    assert prefill["kv_transfer_params"] == FIRST_TURN_PARAMS  # decode still reads P's KV
    (decode,) = env.engines.requests["decode"]
    assert decode["kv_transfer_params"] == p_params()
    assert (turn.decision, turn.reason, turn.reused_tokens) == ("recompute", "router_unavailable", 0)
    assert turn.settled and not turn.outcome
    # Nothing to commit or abort: no turn handle.
    assert env.log == ["plan r1", "prefill", "decode"]
    assert env.router.commits == [] and env.router.aborts == []
    (warned,) = [e for e in logs if e["event"] == "turn.router_unavailable"]
    assert (warned["code"], warned["prefill"], warned["decode"]) == (code, "nodes/p0", "nodes/d0")
    labels = {"decision": "recompute", "reason": "router_unavailable"}
    assert env.metrics.get_sample_value("kvshuttle_gateway_turns_total", labels) == 1


async def test_an_extend_plan_is_not_the_placement_a_router_out_of_reach_falls_back_on(env: Env) -> None:
    await placed_once(env)
    holder = pb.Placement(node="nodes/d1", http_endpoint="http://d1")
    extend = make_plan(2, params={"do_remote_decode": False, "do_remote_prefill": False})
    extend.prefill.CopyFrom(holder)
    extend.decode.CopyFrom(holder)
    extend.decision, extend.reason = pb.DECISION_EXTEND, pb.DECISION_REASON_EXTEND_CHEAPER
    env.router.plans["r1"] = extend
    await env.runner.complete(make_turn("r1"))
    await env.background.settle()
    env.engines.endpoints.clear()
    env.router.plan_failure = unreachable()
    await env.runner.complete(make_turn("r2"))
    # Plain P->D on the last prefill-and-decode pair, not the holder named twice.
    assert env.engines.endpoints == [("prefill", "http://p-last"), ("decode", "http://d-last")]


@pytest.mark.parametrize(
    ("router_reason", "reason"),
    [("NO_PREFILL_NODE", "no_prefill_node"), ("NO_DECODE_NODE", "no_decode_node")],
)
async def test_a_router_with_no_node_of_a_role_serves_plain_pd_under_its_own_reason(
    env: Env, router_reason: str, reason: str
) -> None:
    """A router that answers but finds no healthy node of a role (an agent's lease lapsed, an
    engine restarting) is not a router out of reach: the turn runs plain P->D on the model's last
    placement, as then, under a reason of its own."""
    await placed_once(env)
    env.router.plan_failure = RouterFailure("UNAVAILABLE", "no decode node", reason=router_reason)
    turn = make_turn("r1")
    with capture_logs() as logs:
        answer = await env.runner.complete(turn)
        await env.background.settle()

    assert answer["choices"][0]["text"] == "abcd"
    assert env.engines.endpoints == [("prefill", "http://p-last"), ("decode", "http://d-last")]
    assert (turn.decision, turn.reason, turn.reused_tokens) == ("recompute", reason, 0)
    assert env.router.commits == [] and env.router.aborts == []
    (warned,) = [e for e in logs if e["event"] == "turn.no_node"]
    assert (warned["code"], warned["reason"]) == ("UNAVAILABLE", router_reason)
    assert not [e for e in logs if e["event"] == "turn.router_unavailable"]
    labels = {"decision": "recompute", "reason": reason}
    assert env.metrics.get_sample_value("kvshuttle_gateway_turns_total", labels) == 1


async def test_an_engine_failing_a_turn_run_without_the_router_aborts_nothing(env: Env) -> None:
    await placed_once(env)
    env.router.plan_failure = unreachable()
    env.engines.failures["decode"] = engine_error("decode", 500, "EngineCore died")
    turn = make_turn("r1")
    with pytest.raises(GatewayError) as raised:
        await env.runner.complete(turn)
    await env.background.settle()
    assert raised.value.status == 502 and turn.outcome == "engine_error"
    assert env.router.aborts == [] and env.log == ["plan r1", "prefill", "decode"]


async def test_without_a_placement_for_the_model_an_unreachable_router_is_503(env: Env) -> None:
    env.router.plan_failure = unreachable()
    with pytest.raises(GatewayError) as raised:
        await env.runner.complete(make_turn("r1"))
    assert raised.value.status == 503
    # A placement is the model's own: another model's does not serve it.
    env.router.plan_failure = None
    await placed_once(env)
    env.router.plan_failure = unreachable()
    other = make_turn("r2")
    other.model = "m2"
    with pytest.raises(GatewayError) as raised:
        await env.runner.complete(other)
    assert raised.value.status == 503 and env.engines.requests["prefill"] == []


async def test_a_router_that_answers_with_an_error_is_not_routed_around(env: Env) -> None:
    await placed_once(env)
    env.router.plan_failure = RouterFailure("INVALID_ARGUMENT", "bad ids", reason="INVALID_ARGUMENT")
    with pytest.raises(GatewayError) as raised:
        await env.runner.complete(make_turn("r1"))
    assert raised.value.status == 400 and env.engines.requests["prefill"] == []


async def test_the_router_back_plans_again_and_commits(env: Env) -> None:
    await placed_once(env)
    env.router.plan_failure = unreachable()
    await env.runner.complete(make_turn("r1"))
    env.router.plan_failure = None
    env.router.plans["r2"] = make_plan(2, reuse=True)
    turn = make_turn("r2")
    await env.runner.complete(turn)
    await env.background.settle()
    assert (turn.decision, turn.reason) == ("reuse", "reuse_cheaper")
    assert [c.turn for c in env.router.commits] == ["turns/2"]


# ---- a reuse turn whose prefill hangs or fails --------------------------------------------


def retained_params() -> dict[str, Any]:
    """A reuse plan's prefill params: decode's retained KV, on the node holding it."""
    return {**d_params(), "remote_num_tokens": 32, "remote_block_ids": [[11, 12]]}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("how", "why"), [("hangs", "reuse_prefill_timeout"), ("fails", "reuse_prefill_failed")]
)
async def test_a_reuse_prefill_that_hangs_or_fails_is_run_again_as_a_recompute(
    env: Env, stream: bool, how: str, why: str
) -> None:
    env.router.plans["r1"] = make_plan(2, reuse=True, params=retained_params())
    if how == "hangs":
        env.engines.reuse_prefill_hangs = True
    else:
        env.engines.reuse_prefill_failure = engine_error("prefill", 500, "NIXL_ERR_REMOTE_DISCONNECT")
    turn = make_turn()
    started = time.perf_counter()
    with capture_logs() as logs:
        if stream:
            sink = FakeSink()
            await asyncio.wait_for(env.runner.stream(turn, sink), 3)
            assert sink.opened and len(sink.chunks) == len(OUTPUT)
        else:
            answer = await asyncio.wait_for(env.runner.complete(turn), 3)
            assert answer["choices"][0]["text"] == "abcd"  # decode's
        await env.background.settle()
    elapsed = time.perf_counter() - started

    first, retry = env.engines.requests["prefill"]
    assert first["kv_transfer_params"] == retained_params()
    assert retry["kv_transfer_params"] == FIRST_TURN_PARAMS  # turn 1's: a plain recompute
    assert (retry["prompt"], retry["max_tokens"]) == (PROMPT, 1)
    # The same prefill node, a request id of its own; the hung call was cancelled (closed).
    assert [r for r in env.engines.request_ids if r.startswith("r1-p")] == ["r1-p", "r1-pr"]
    assert env.engines.cancelled == (["r1-p"] if how == "hangs" else [])
    assert [e for e in env.engines.endpoints if e[0] == "prefill"] == [("prefill", "http://p0")] * 2
    (decode,) = env.engines.requests["decode"]
    assert decode["kv_transfer_params"] == p_params()  # the retry's params
    if how == "hangs":
        assert REUSE_TIMEOUT_S <= elapsed < 2
        assert turn.prefill_s is not None and turn.prefill_s >= REUSE_TIMEOUT_S  # both calls

    assert (turn.decision, turn.reason) == ("reuse", "reuse_cheaper")  # the router's
    assert (turn.fallback, turn.reused_tokens, turn.outcome) == (why, 0, "")
    headers = turn_headers(turn)
    assert (headers["X-Kvshuttle-Decision"], headers["X-Kvshuttle-Reused-Tokens"]) == ("recompute", "0")
    assert headers["X-Kvshuttle-Reason"] == "reuse_cheaper"
    line = RequestLog(endpoint="completions", request_id="r1")
    line.add_turn(turn)
    assert (line.fields()["fallback"], line.fields()["decision"], line.reused_tokens) == (why, "reuse", 0)
    assert env.fallbacks(why) == 1
    (warned,) = [e for e in logs if e["event"] == "prefill.reuse_fallback"]
    assert (warned["node"], warned["why"], warned["log_level"]) == ("nodes/p0", why, "warning")
    assert warned["waited_ms"] >= (REUSE_TIMEOUT_S * 1e3 if how == "hangs" else 0)
    # Committed as usual (the commit releases the plan's claim); nothing aborted.
    assert env.log == ["plan r1", "prefill", "prefill", "decode", "commit turns/2"]
    (commit,) = env.router.commits
    assert commit.token_ids == PROMPT + OUTPUT and env.router.aborts == []


async def test_a_slow_recompute_prefill_is_not_cut_by_the_reuse_deadline(env: Env) -> None:
    env.router.plans["r1"] = make_plan(1)
    env.engines.prefill_delay = REUSE_TIMEOUT_S * 2
    turn = make_turn()
    with capture_logs() as logs:
        answer = await env.runner.complete(turn)
        await env.background.settle()
    assert answer["choices"][0]["text"] == "abcd"
    assert len(env.engines.requests["prefill"]) == 1 and env.engines.cancelled == []
    assert turn.fallback == "" and turn.prefill_s is not None and turn.prefill_s >= REUSE_TIMEOUT_S * 2
    assert not [e for e in logs if e["event"] == "prefill.reuse_fallback"]
    assert env.fallbacks("reuse_prefill_timeout") is None
    assert turn_headers(turn)["X-Kvshuttle-Decision"] == "recompute"


async def test_a_reuse_prefill_answering_within_its_deadline_is_not_retried(env: Env) -> None:
    env.router.plans["r1"] = make_plan(2, reuse=True, params=retained_params())
    env.engines.prefill_delay = REUSE_TIMEOUT_S / 4
    turn = make_turn()
    await env.runner.complete(turn)
    await env.background.settle()
    assert len(env.engines.requests["prefill"]) == 1 and turn.fallback == ""
    headers = turn_headers(turn)
    assert (headers["X-Kvshuttle-Decision"], headers["X-Kvshuttle-Reused-Tokens"]) == ("reuse", "32")


async def test_a_reuse_prefill_whose_retry_fails_too_is_the_engine_error(env: Env) -> None:
    env.router.plans["r1"] = make_plan(3, reuse=True, params=retained_params())
    env.engines.failures["prefill"] = engine_error("prefill", 500, "EngineCore died")
    turn = make_turn()
    with pytest.raises(GatewayError) as raised:
        await env.runner.complete(turn)
    await env.background.settle()

    assert raised.value.status == 502 and raised.value.code == "engine_error"
    first, retry = env.engines.requests["prefill"]
    assert (first["kv_transfer_params"], retry["kv_transfer_params"]) == (
        retained_params(),
        FIRST_TURN_PARAMS,
    )
    assert env.router.aborts == [("turns/3", raised.value.message)]
    assert env.router.abort_conversations == [turn.conversation]  # to the replica that planned it
    assert env.engines.requests["decode"] == [] and env.router.commits == []
    assert (turn.outcome, turn.fallback) == ("engine_error", "reuse_prefill_failed")
    assert env.log == ["plan r1", "prefill", "prefill", "abort turns/3"]
    assert env.fallbacks("reuse_prefill_failed") == 1


async def test_a_reuse_prefill_the_engine_rejects_is_not_retried(env: Env) -> None:
    env.router.plans["r1"] = make_plan(3, reuse=True, params=retained_params())
    env.engines.reuse_prefill_failure = engine_error("prefill", 400, "max_tokens too large")
    with pytest.raises(GatewayError) as raised:
        await env.runner.complete(make_turn())
    await env.background.settle()
    assert raised.value.status == 400 and len(env.engines.requests["prefill"]) == 1
    assert env.router.aborts and env.fallbacks("reuse_prefill_failed") is None
