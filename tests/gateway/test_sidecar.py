"""The decode-side sidecar (kvshuttle.sidecar) over HTTP, with a real registry and router
and stand-in engines: a turn the EPP planned (reuse, recompute, extend) run and committed; llm-d's
plain P->D; pass-through; the SSRF guard (IPv4, IPv6, unregistered hosts, KV sources); stale
and malformed plans; the router gone; streams passed on unchanged."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from structlog.testing import capture_logs
from tests.gateway.helpers import ANSWER, first_messages, register, standin
from tests.gateway.sidecar_helpers import (
    SidecarCluster,
    sse_events,
    start_sidecar_cluster,
    stop_sidecar_cluster,
)
from tests.router.helpers import MODEL
from tests.support.planning_epp import plan_headers

from kvshuttle.agent.engine import EnginePoller
from kvshuttle.client import KvshuttleRpcError
from kvshuttle.core.endpoints import endpoint_host_port
from kvshuttle.gateway.pd_headers import PLAN_HEADER, PREFILLER_HOST_PORT_HEADER, TURN_HEADER
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb
from kvshuttle.router.v1 import router_service_pb2 as pb
from kvshuttle.sidecar.proxy import PREFILL_PARAMS

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture
async def c(model_dir: Path, chat_tokenizer: ChatTokenizer) -> AsyncIterator[SidecarCluster]:
    cluster = await start_sidecar_cluster(model_dir, chat_tokenizer, provider=TracerProvider())
    try:
        yield cluster
    finally:
        await stop_sidecar_cluster(cluster)


def chat(messages: list[dict[str, Any]], conversation: str | None = "conv-s", **extra: Any) -> dict[str, Any]:
    named = {} if conversation is None else {"conversation_id": conversation}
    return {"model": MODEL, "messages": messages, "max_tokens": 64, **named, **extra}


async def planned(
    c: SidecarCluster, body: dict[str, Any]
) -> tuple[pb.PlanTurnResponse, dict[str, str], list[int]]:
    plan, ids = await c.epp.plan("chat", body)
    return plan, plan_headers(plan, ids), ids


async def planned_completion(
    c: SidecarCluster, prompt: list[int], conversation: str = "conv-c"
) -> tuple[pb.PlanTurnResponse, dict[str, Any], dict[str, str]]:
    """A completions turn the EPP planned: the stand-in engines serve plain requests only with
    token-id prompts, which is what a plan served plain sends them."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "conversation_id": conversation}
    plan, ids = await c.epp.plan("completions", body)
    return plan, body, plan_headers(plan, ids)


def text(raw: bytes) -> str:
    return str(json.loads(raw)["choices"][0]["text"])


def content(raw: bytes) -> str:
    return str(json.loads(raw)["choices"][0]["message"]["content"])


async def commit_refused(c: SidecarCluster, handle: str) -> grpc.StatusCode:
    """The code a CommitTurn of `handle` gets now (the turn was settled: aborted or committed)."""
    with pytest.raises(KvshuttleRpcError) as info:
        await c.router.client.commit_turn(handle, token_ids=[1, 2, 3])
    return info.value.code


async def two_turns(
    c: SidecarCluster, *, stream: bool = False, conversation: str | None = "conv-s"
) -> tuple[pb.PlanTurnResponse, bytes, dict[str, str]]:
    """Turn 1 (recompute), then turn 2 of the same conversation; turn 2's plan and answer."""
    messages = first_messages()
    body = chat(messages, conversation)
    _, headers, _ = await planned(c, body)
    status, raw, _ = await c.post(CHAT, body, headers)
    assert status == 200, raw
    messages = [
        *messages,
        {"role": "assistant", "content": content(raw)},
        {"role": "user", "content": "And then?"},
    ]
    body = chat(messages, conversation, stream=stream)
    plan, headers, _ = await planned(c, body)
    status, raw, response_headers = await c.post(CHAT, body, headers)
    assert status == 200, raw
    return plan, raw, response_headers


# ---- planned turns ---------------------------------------------------------------------------


async def test_a_first_turn_recomputes_p_to_d_and_is_committed_before_its_answer_ends(
    c: SidecarCluster,
) -> None:
    body = chat(first_messages())
    plan, headers, _ = await planned(c, body)
    assert plan.decision == pb.DECISION_RECOMPUTE

    async with c.http.post(c.url + CHAT, json=body, headers=headers) as response:
        raw, response_headers = await response.read(), response.headers
        # No settle(): the answer ended only once the commit had landed.
        retained = await c.retentions()

    assert response.status == 200 and content(raw) == ANSWER
    assert (response_headers["X-Kvshuttle-Decision"], response_headers["X-Kvshuttle-Reason"]) == (
        "recompute",
        "no_retention",
    )
    (prefill,) = c.prefill.transcript.requests
    assert prefill.body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert prefill.body["max_tokens"] == 1 and prefill.body["stream"] is False
    (decode,) = c.decode.transcript.requests
    assert decode.body["kv_transfer_params"] == c.prefill.transcript.answers[0]["kv_transfer_params"]
    assert decode.body["prompt"] == prefill.body["prompt"]
    assert [r.node for r in retained] == ["nodes/d0"]
    assert c.metric("kvshuttle_sidecar_requests_total", mode="kvshuttle") == 1


async def test_a_later_turn_reuses_decodes_kv_on_prefill_and_commits_again(c: SidecarCluster) -> None:
    plan, raw, headers = await two_turns(c)

    assert plan.decision == pb.DECISION_REUSE and plan.reusable_tokens > 2000
    assert headers["X-Kvshuttle-Decision"] == "reuse"
    assert int(headers["X-Kvshuttle-Reused-Tokens"]) == plan.reusable_tokens
    assert content(raw) == ANSWER
    prefill = c.prefill.transcript.requests[-1].body
    assert prefill["kv_transfer_params"]["remote_engine_id"] == "engine-d0"
    assert prefill["kv_transfer_params"]["remote_port"] == c.decode.side_channel_port
    # Prefill read the retained KV instead of computing it.
    assert c.prefill.transcript.answers[-1]["kv_transfer_params"]["remote_prefill_cached_tokens"] >= (
        plan.reusable_tokens
    )
    assert len(await c.retentions()) == 1  # turn 2's retention replaced turn 1's


@pytest.mark.parametrize("conversation", ["conv-s", None])
async def test_a_later_turn_reuses_through_the_previous_answer(
    c: SidecarCluster, conversation: str | None
) -> None:
    """With or without a conversation id, the picker and the sidecar both start turn 2's prompt
    with turn 1's transcript (decode's own ids), and the plan reuses through the answer."""
    plan, _, _ = await two_turns(c, conversation=conversation)
    first = c.prefill.transcript.requests[0].body["prompt"]
    answer = c.decode.transcript.answers[0]["token_ids"][:-1]  # EOS: not in the answer's text
    prompt = c.prefill.transcript.requests[-1].body["prompt"]
    assert prompt[: len(first) + len(answer)] == [*first, *answer]
    assert plan.decision == pb.DECISION_REUSE
    assert plan.reusable_tokens >= (len(first) + len(answer)) // 16 * 16
    if conversation is None:  # found, it forks a conversation of its own (its first turn)
        assert "/conversations/anon-" in plan.conversation and plan.generation == 1
    else:
        assert plan.generation == 2
    assert c.metric("kvshuttle_sidecar_plain_total", why="prompt_mismatch") in (None, 0)


async def test_a_streamed_reuse_turn_streams_the_answer_as_the_gateway_does(c: SidecarCluster) -> None:
    _, raw, headers = await two_turns(c, stream=True)

    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text == ANSWER
    assert headers["X-Kvshuttle-Decision"] == "reuse"
    assert c.decode.transcript.requests[-1].body["stream"] is True


async def test_an_extend_plan_runs_whole_on_this_decode_without_a_prefill_request(c: SidecarCluster) -> None:
    body = chat(first_messages())
    plan, _, ids = await planned(c, body)
    # The holder runs the turn: what the router's extend plan looks like (prefill = decode).
    plan.prefill.CopyFrom(plan.decode)
    plan.decision, plan.reason = pb.DECISION_EXTEND, pb.DECISION_REASON_EXTEND_CHEAPER
    plan.prefill_kv_transfer_params.Clear()
    headers = plan_headers(plan, ids)
    assert PREFILLER_HOST_PORT_HEADER not in headers

    status, raw, response_headers = await c.post(CHAT, body, headers)

    assert status == 200 and content(raw) == ANSWER
    assert response_headers["X-Kvshuttle-Decision"] == "extend"
    assert c.prefill.transcript.requests == []
    assert len(c.decode.transcript.requests) == 1
    assert [r.node for r in await c.retentions()] == ["nodes/d0"]


# ---- plans served plain ----------------------------------------------------------------------


async def test_a_plan_for_another_decode_is_stale_served_plain_and_its_turn_aborted(
    c: SidecarCluster,
) -> None:
    plan, body, _ = await planned_completion(c, list(range(100, 400)))
    plan.decode.node = "nodes/d9"

    with capture_logs() as logs:
        status, raw, response_headers = await c.post(COMPLETIONS, body, plan_headers(plan, body["prompt"]))

    assert status == 200 and text(raw) == ANSWER
    assert "X-Kvshuttle-Decision" not in response_headers  # served as llm-d serves it
    # llm-d's P->D on the header's prefill: the client's own request, prefill's params to decode.
    (prefill,) = c.prefill.transcript.requests
    assert prefill.body["kv_transfer_params"] == PREFILL_PARAMS and prefill.body["max_tokens"] == 1
    assert c.decode.transcript.requests[-1].body["kv_transfer_params"]["do_remote_prefill"] is True
    assert [e["why"] for e in logs if e["event"] == "sidecar.plan_refused"] == ["stale_plan"]
    assert c.metric("kvshuttle_sidecar_plain_total", why="stale_plan") == 1
    assert await commit_refused(c, plan.turn) == grpc.StatusCode.FAILED_PRECONDITION
    assert await c.retentions() == []


@pytest.mark.parametrize(
    ("mangle", "why"),
    [
        (lambda h: {**h, PLAN_HEADER: h[PLAN_HEADER] + "=="}, "bad_plan"),
        (lambda h: {**h, PLAN_HEADER: "AAAA" + h[PLAN_HEADER]}, "bad_plan"),
        (lambda h: {**h, TURN_HEADER: "turns/someone-else"}, "turn_mismatch"),
        (lambda h: {k: v for k, v in h.items() if k != TURN_HEADER}, "turn_mismatch"),
        (lambda h: {**h, PREFILLER_HOST_PORT_HEADER: "127.0.0.1:1"}, "prefiller_mismatch"),
        (lambda h: {**h, PREFILLER_HOST_PORT_HEADER: "http://127.0.0.1:1/x"}, "prefiller_mismatch"),
    ],
)
async def test_malformed_or_mismatched_headers_are_served_plain(
    c: SidecarCluster, mangle: Any, why: str
) -> None:
    _, body, headers = await planned_completion(c, list(range(100, 400)))

    status, raw, response_headers = await c.post(COMPLETIONS, body, mangle(headers))

    assert status == 200, raw
    assert text(raw) == ANSWER
    assert "X-Kvshuttle-Decision" not in response_headers
    assert c.metric("kvshuttle_sidecar_plain_total", why=why) == 1
    assert await c.retentions() == []


async def test_a_plan_whose_kv_source_is_not_registered_is_refused_never_forwarded(c: SidecarCluster) -> None:
    first = [100 + i % 900 for i in range(2500)]  # long enough that reading beats recomputing
    _, body, headers = await planned_completion(c, first)
    assert (await c.post(COMPLETIONS, body, headers))[0] == 200
    answer = c.decode.transcript.answers[-1]["token_ids"]
    plan, body, _ = await planned_completion(c, [*first, *answer, *range(500, 540)])
    assert plan.decision == pb.DECISION_REUSE
    plan.prefill_kv_transfer_params.remote_host = "169.254.169.254"
    requests_before = len(c.prefill.transcript.requests)

    status, raw, _ = await c.post(COMPLETIONS, body, plan_headers(plan, body["prompt"]))

    assert status == 200 and text(raw) == ANSWER
    assert c.metric("kvshuttle_sidecar_ssrf_refused_total", target="kv_source") == 1
    assert c.metric("kvshuttle_sidecar_plain_total", why="kv_source_refused") == 1
    sent = [r.body.get("kv_transfer_params") for r in c.prefill.transcript.requests[requests_before:]]
    assert sent == [PREFILL_PARAMS]  # plain P->D: no engine was handed the forged source
    assert await commit_refused(c, plan.turn) == grpc.StatusCode.FAILED_PRECONDITION


async def test_a_turn_that_fails_before_its_answer_is_served_locally_and_aborted(c: SidecarCluster) -> None:
    plan, body, headers = await planned_completion(c, list(range(100, 400)))
    c.prefill.script.fail_status = 500

    with capture_logs() as logs:
        status, raw, _ = await c.post(COMPLETIONS, body, headers)

    assert status == 200 and text(raw) == ANSWER
    assert c.metric("kvshuttle_sidecar_plain_total", why="turn_failed") == 1
    # Decode computed the prompt itself: the local request is the client's, as it came.
    assert c.decode.transcript.requests[-1].body == body
    done = [e for e in logs if e["event"] == "request.done"]
    assert [(d["outcome"], d["status"]) for d in done] == [("fell_back", 200)]
    assert await commit_refused(c, plan.turn) == grpc.StatusCode.FAILED_PRECONDITION


async def test_with_the_router_gone_a_planned_turn_is_still_answered(c: SidecarCluster) -> None:
    body = chat(first_messages())
    _, headers, _ = await planned(c, body)
    await c.router.server.stop()

    with capture_logs() as logs:
        status, raw, response_headers = await c.post(CHAT, body, headers)

    assert status == 200 and content(raw) == ANSWER
    assert response_headers["X-Kvshuttle-Decision"] == "recompute"
    assert [e["code"] for e in logs if e["event"] == "turn.commit_failed"] == ["UNAVAILABLE"]


# ---- llm-d's plain protocol and pass-through -------------------------------------------------


def completion(prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 64, **extra}


def prefiller(c: SidecarCluster) -> str:
    target = endpoint_host_port(c.prefill.url)
    assert target is not None
    return target


@pytest.mark.parametrize("stream", [False, True])
async def test_llmd_mode_prefills_with_do_remote_decode_then_decodes_and_passes_the_answer_on(
    c: SidecarCluster, stream: bool
) -> None:
    prompt = list(range(100, 400))
    body = (
        completion(prompt, stream=stream, stream_options={"include_usage": True})
        if stream
        else completion(prompt)
    )

    status, raw, headers = await c.post(COMPLETIONS, body, {PREFILLER_HOST_PORT_HEADER: prefiller(c)})

    assert status == 200, raw
    (prefill,) = c.prefill.transcript.requests
    assert prefill.body == {
        **completion(prompt),
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": PREFILL_PARAMS,
    }
    (decode,) = c.decode.transcript.requests
    assert decode.body == {
        **body,
        "kv_transfer_params": c.prefill.transcript.answers[0]["kv_transfer_params"],
    }
    prefill_headers = {k.lower(): v for k, v in prefill.headers.items()}
    decode_headers = {k.lower(): v for k, v in decode.headers.items()}
    assert prefill_headers["x-request-id"] == decode_headers["x-request-id"]
    assert PREFILLER_HOST_PORT_HEADER not in decode_headers
    # The decode engine's bytes, unchanged: its own answer as it would give it.
    if stream:
        assert headers["Content-Type"].startswith("text/event-stream")
        events = sse_events(raw)
        assert events[-1] == "[DONE]" and events[-2]["usage"]["prompt_tokens"] == len(prompt)
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == ANSWER
    else:
        assert json.loads(raw)["choices"][0]["text"] == ANSWER
    assert c.metric("kvshuttle_sidecar_requests_total", mode="llmd") == 1
    assert await c.retentions() == []  # llm-d's protocol commits nothing


async def test_without_headers_the_request_passes_through_to_decode_less_any_kv_transfer_params(
    c: SidecarCluster,
) -> None:
    forged = {"do_remote_prefill": True, "remote_host": "10.9.9.9", "remote_port": 5600}
    body = completion(list(range(50, 90)), kv_transfer_params=forged)

    status, raw, _ = await c.post(COMPLETIONS, body)

    assert status == 200 and json.loads(raw)["choices"][0]["text"] == ANSWER
    assert c.prefill.transcript.requests == []
    (decode,) = c.decode.transcript.requests
    assert decode.body == completion(list(range(50, 90)))
    assert c.metric("kvshuttle_sidecar_requests_total", mode="local") == 1


async def test_an_engine_error_passes_through_as_the_engine_sent_it(c: SidecarCluster) -> None:
    status, raw, _ = await c.post(COMPLETIONS, {"model": MODEL, "prompt": "text, not ids"})
    assert status == 400 and "token-id prompts" in json.loads(raw)["error"]["message"]


# ---- the SSRF guard --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target",
    [
        "127.0.0.1:1",  # an IPv4 address no node has
        "[::1]:8000",  # IPv6 loopback: not a registered node
        "169.254.169.254:80",  # cloud metadata
        "[::ffff:a9fe:a9fe]:80",  # the same, IPv4-mapped
        "localhost:8000",  # a name: nodes are registered by address
    ],
)
async def test_an_unregistered_prefill_target_is_never_called_and_the_request_served_locally(
    c: SidecarCluster, target: str
) -> None:
    body = completion(list(range(10, 60)))
    with capture_logs() as logs:
        status, raw, _ = await c.post(COMPLETIONS, body, {PREFILLER_HOST_PORT_HEADER: target})

    assert status == 200 and json.loads(raw)["choices"][0]["text"] == ANSWER
    assert c.prefill.transcript.requests == []
    assert c.decode.transcript.requests[-1].body == body
    assert c.metric("kvshuttle_sidecar_ssrf_refused_total", target="prefill") == 1
    assert [e["target"] for e in logs if e["event"] == "sidecar.ssrf_refused"] == ["prefill"]


@pytest.mark.parametrize("target", ["", "127.0.0.1", "::1:8000", "[127.0.0.1]:80", "a@127.0.0.1:80", "h:0"])
async def test_a_malformed_prefill_header_is_served_locally(c: SidecarCluster, target: str) -> None:
    status, _, _ = await c.post(COMPLETIONS, completion([5, 6, 7]), {PREFILLER_HOST_PORT_HEADER: target})
    assert status == 200
    assert c.prefill.transcript.requests == []


async def test_a_prefill_registered_by_ipv6_address_is_allowed_in_any_spelling(
    c: SidecarCluster, model_dir: Path
) -> None:
    # A second prefill registered by an IPv6 address (IPv4-mapped: it listens on 127.0.0.1).
    engine = standin("prefill", model_dir)
    engine.config = dataclasses.replace(engine.config, engine_id="engine-p1")
    await engine.start()
    try:
        port = engine.url.rsplit(":", 1)[1]
        engine.url = f"http://[::ffff:127.0.0.1]:{port}"
        await register(c.registry, "nodes/p1", reg_pb.NODE_ROLE_PREFILL, engine)
        body = completion(list(range(10, 60)))

        status, raw, _ = await c.post(
            COMPLETIONS, body, {PREFILLER_HOST_PORT_HEADER: f"[::ffff:7f00:1]:{port}"}
        )

        assert status == 200, raw
        assert len(engine.transcript.requests) == 1
        assert c.decode.transcript.requests[-1].body["kv_transfer_params"]["do_remote_prefill"] is True
        assert c.metric("kvshuttle_sidecar_ssrf_refused_total", target="prefill") == 0
    finally:
        await engine.stop()


async def test_a_registered_prefill_that_fails_leaves_decode_to_compute(c: SidecarCluster) -> None:
    c.prefill.script.fail_status = 503
    body = completion(list(range(10, 60)))

    status, raw, _ = await c.post(COMPLETIONS, body, {PREFILLER_HOST_PORT_HEADER: prefiller(c)})

    assert status == 200 and json.loads(raw)["choices"][0]["text"] == ANSWER
    assert c.decode.transcript.requests[-1].body == body
    assert c.metric("kvshuttle_sidecar_prefill_failures_total") == 1


async def test_a_prefill_that_refuses_the_request_answers_the_client_with_its_refusal(
    c: SidecarCluster,
) -> None:
    c.prefill.script.fail_status = 400

    status, raw, _ = await c.post(
        COMPLETIONS, completion([1, 2, 3]), {PREFILLER_HOST_PORT_HEADER: prefiller(c)}
    )

    assert status == 400 and "error" in json.loads(raw)
    assert c.decode.transcript.requests == []


async def test_a_plan_without_a_turn_handle_is_served_plain_p_to_d(c: SidecarCluster) -> None:
    # The EPP's own degrade path (the router out of reach): a plan with no handle, nothing to commit.
    plan, body, _ = await planned_completion(c, list(range(100, 400)))
    plan.turn = ""
    headers = {k: v for k, v in plan_headers(plan, body["prompt"]).items() if k != TURN_HEADER}

    status, raw, _ = await c.post(COMPLETIONS, body, headers)

    assert status == 200 and text(raw) == ANSWER
    assert c.prefill.transcript.requests[-1].body["kv_transfer_params"] == PREFILL_PARAMS
    assert c.metric("kvshuttle_sidecar_plain_total", why="unplanned") == 1


async def test_a_plan_made_for_a_longer_prompt_is_never_run_on_this_one(c: SidecarCluster) -> None:
    # The EPP tokenized differently (another template, another model): its plan is not this prompt's.
    plan, _, headers = await planned_completion(c, list(range(100, 400)))
    body = {"model": MODEL, "prompt": list(range(100, 200)), "max_tokens": 64, "conversation_id": "conv-c"}

    status, raw, _ = await c.post(COMPLETIONS, body, headers)

    assert status == 200 and text(raw) == ANSWER
    assert c.prefill.transcript.requests == []
    assert c.decode.transcript.requests[-1].body == body
    # Its ids are not the planned ones (x-kvshuttle-prompt): served plain before anything runs.
    assert c.metric("kvshuttle_sidecar_plain_total", why="prompt_mismatch") == 1
    assert await commit_refused(c, plan.turn) == grpc.StatusCode.FAILED_PRECONDITION


async def test_other_paths_pass_through_to_decode(c: SidecarCluster) -> None:
    async with c.http.get(c.url + "/v1/models?x=1") as response:
        assert response.status == 200
        assert [m["id"] for m in (await response.json())["data"]] == [MODEL]
    async with c.http.get(c.url + "/health") as response:
        assert response.status == 200  # decode's
    await c.decode.stop()
    async with c.http.get(c.url + "/health") as response:
        assert response.status == 502  # the pod is not ready without its engine


async def test_the_agents_polls_of_the_sidecar_read_decodes_own_health_and_load(c: SidecarCluster) -> None:
    """With the sidecar in front (deploy/kubernetes/overlays/inference-pool), the decode agent
    registers the sidecar's address and polls /health and /metrics there: the agent's own
    poller reads decode's health and load through it exactly as from decode itself, and sees
    the node unhealthy while the sidecar drains and when decode is gone."""
    status, raw, _ = await c.post(
        COMPLETIONS, {"model": MODEL, "prompt": list(range(1, 200)), "max_tokens": 8}
    )
    assert status == 200, raw  # decode's prefix cache now holds blocks: a load that is not all zeros
    through = EnginePoller(c.url, interval=1.0, timeout=5.0)
    direct = EnginePoller(c.decode.url, interval=1.0, timeout=5.0)
    async with aiohttp.ClientSession() as session:
        await through.poll_once(session)
        await direct.poll_once(session)
        assert through.state.healthy and through.state.last_error == ""
        assert through.state.missing_metrics == 0
        assert through.load() == direct.load() and direct.load().kv_cache_usage > 0
        c.server.sidecar.draining = True  # as SidecarServer.stop sets it
        await through.poll_once(session)
        assert not through.state.healthy and "/health answered 503" in through.state.last_error
        c.server.sidecar.draining = False
        await c.decode.stop()
        await through.poll_once(session)
        assert not through.state.healthy
