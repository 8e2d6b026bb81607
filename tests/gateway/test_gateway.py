"""The gateway end to end: a real registry and router in process over gRPC, two stand-in engines
speaking vLLM's HTTP protocol, and the gateway in front, called over HTTP as a client would.

What a user and the lead's benchmark rely on: the engines get exactly what vLLM needs
(prefill: a token-id prompt, max_tokens 1, stream false, the plan's params; decode: P's
params unchanged), the client gets valid OpenAI objects, a committed turn leaves a retention
that the next turn reuses, and whatever ends a turn early releases what it held."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import re
from collections.abc import AsyncIterator, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from structlog.testing import capture_logs
from tests.gateway.helpers import (
    ANSWER,
    CHAT,
    Cluster,
    chat,
    cluster_fixture,
    conversation_text,
    first_messages,
    reference_ids,
)
from tests.router.helpers import BS, MODEL

from kvshuttle.core.digest import log_digest, log_name
from kvshuttle.core.hashing import cache_salt_digest, chain_hashes, salted_root
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.registry.v1 import registry_service_pb2 as reg_pb

FIRST_TURN_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


def assert_openai_error(body: dict[str, Any], code: str | None = None) -> dict[str, Any]:
    assert set(body) == {"error"}
    error: dict[str, Any] = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error


def request_lines(logs: Sequence[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [entry for entry in logs if entry.get("event") == "request.done"]


async def wait_for(predicate: Any) -> None:
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


# ---- the turn -----------------------------------------------------------------------------


async def test_chat_turn_sends_the_engines_what_vllm_needs_and_commits_the_sequence(
    c: Cluster, model_dir: Path
) -> None:
    messages = first_messages()
    with capture_logs() as logs:
        status, body = await c.post(
            CHAT,
            chat(messages, conversation_id="conv-1", max_tokens=64, temperature=0.0, seed=7, top_p=0.9),
        )
    assert status == 200, body
    prompt = reference_ids(model_dir, messages)

    # Prefill: the token-id prompt, one token, not streamed, the plan's (first-turn) params.
    (p,) = c.prefill.transcript.requests
    assert p.body["prompt"] == prompt
    assert (p.body["max_tokens"], p.body["stream"]) == (1, False)
    assert p.body["kv_transfer_params"] == FIRST_TURN_PARAMS
    assert p.body["model"] == MODEL
    assert (p.body["temperature"], p.body["seed"], p.body["top_p"]) == (0.0, 7, 0.9)
    assert "conversation_id" not in p.body and "messages" not in p.body
    # Decode: the same prompt, P's params exactly as P returned them, the client's sampling.
    (d,) = c.decode.transcript.requests
    assert d.body["prompt"] == prompt
    assert d.body["kv_transfer_params"] == c.prefill.transcript.answers[0]["kv_transfer_params"]
    assert (d.body["return_token_ids"], d.body["stream"], d.body["max_tokens"]) == (True, False, 64)
    assert (d.body["temperature"], d.body["seed"], d.body["top_p"]) == (0.0, 7, 0.9)
    assert "conversation_id" not in d.body

    # The client's chat.completion.
    assert set(body) >= {"id", "object", "created", "model", "choices", "usage"}
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == MODEL and isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "stop"
    assert choice["message"] == {"role": "assistant", "content": c.decode.script.answer}
    output = c.decode.transcript.answers[0]["token_ids"]
    assert body["usage"]["completion_tokens"] == len(output)
    assert "kv_transfer_params" not in json.dumps(body) and "token_ids" not in choice

    # The commit: a retention of prompt + output, as decode holds it (its last token has no KV).
    (retention,) = await c.retentions()
    sequence = prompt + output
    held = c.decode.transcript.answers[0]["kv_transfer_params"]
    assert retention.name == "tenants/default/conversations/conv-1/retentions/1"
    assert retention.node == "nodes/d0"
    assert retention.num_tokens == len(sequence) - 1 == held["remote_num_tokens"]
    # kvshuttle's chain of the sequence, from the root of the tenant's cache salt (both engines
    # got the same one).
    assert p.body["cache_salt"] == d.body["cache_salt"]
    root = salted_root(cache_salt_digest(p.body["cache_salt"]))
    assert list(retention.block_hashes) == chain_hashes(sequence[: retention.num_tokens], BS, parent=root)
    assert list(retention.kv_transfer_params.remote_block_ids[0].block_ids) == held["remote_block_ids"][0]

    (line,) = request_lines(logs)
    assert line["decision"] == "recompute" and line["reason"] == "no_retention"
    assert line["status"] == 200 and line["outcome"] == "ok"
    assert line["prompt_tokens"] == len(prompt) and line["output_tokens"] == len(output)
    assert line["conversation"] != "conv-1" and re.fullmatch(r"[0-9a-f]{16}", line["conversation"])
    for key in ("tokenize_ms", "plan_ms", "prefill_ms", "decode_ms", "ttft_ms", "added_ms"):
        assert line[key] >= 0, key
    assert "wait_ms" not in line  # no earlier turn of this conversation was committing
    (committed,) = [e for e in logs if e["event"] == "turn.committed"]
    # The retention's name with the conversation id as its digest: ids never reach a log.
    assert committed["retention"] == log_name(retention.name) and committed["commit_ms"] >= 0
    assert "conv-1" not in committed["retention"]
    assert committed["request_id"] == line["request_id"]
    assert line["added_ms"] <= line["total_ms"] - line["prefill_ms"] - line["decode_ms"] + 0.01


async def test_the_next_turn_reads_the_retained_kv_truncated_to_the_verified_prefix(
    c: Cluster, model_dir: Path
) -> None:
    messages = first_messages()
    status, events = await c.stream(CHAT, chat(messages, conversation_id="conv-2"))
    assert status == 200
    answer = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    first_prompt = reference_ids(model_dir, messages)
    first = first_prompt + c.decode.transcript.answers[0]["token_ids"]
    held = c.decode.transcript.answers[0]["kv_transfer_params"]

    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And after that?"}]
    with capture_logs() as logs:
        status, body = await c.post(CHAT, chat(messages), **{"X-Conversation-ID": "conv-2"})
    assert status == 200, body
    prompt = reference_ids(model_dir, messages)
    p = c.prefill.transcript.requests[1].body
    assert p["prompt"] == prompt
    params = p["kv_transfer_params"]
    assert (params["do_remote_decode"], params["do_remote_prefill"]) == (True, False)
    assert params["remote_engine_id"] == "engine-d0"
    assert params["remote_request_id"] == held["remote_request_id"]
    reused = params["remote_num_tokens"]
    assert 0 < reused < len(prompt)
    # The tokens that match token for token (the router's hint knows the partly filled last
    # block's), and the block list cut to the blocks that hold them.
    assert params["remote_block_ids"] == [held["remote_block_ids"][0][: -(-reused // BS)]]
    assert prompt[:reused] == first[:reused]
    common = next(i for i, (a, b) in enumerate(zip(prompt, first, strict=False)) if a != b)
    assert reused == min(common, held["remote_num_tokens"])
    # Decode gets what prefill answered on this turn, unchanged.
    assert (
        c.decode.transcript.requests[1].body["kv_transfer_params"]
        == c.prefill.transcript.answers[1]["kv_transfer_params"]
    )

    (line,) = request_lines(logs)
    assert (line["decision"], line["reason"], line["generation"]) == ("reuse", "reuse_cheaper", 2)
    assert line["reused_tokens"] == reused == line["remote_cached_tokens"]
    (retention,) = await c.retentions()  # turn 2's replaced turn 1's (claimed and consumed)
    assert retention.generation == 2


async def test_the_answer_does_not_wait_for_the_commit_but_the_next_turn_does(
    c: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    router = c.gateway.gateway.router
    commit_turn = router.commit_turn
    release = asyncio.Event()

    async def held_commit(*args: Any, **kwargs: Any) -> Any:
        await release.wait()
        return await commit_turn(*args, **kwargs)

    monkeypatch.setattr(router, "commit_turn", held_commit)
    messages = first_messages()
    async with c.http.post(c.url + CHAT, json=chat(messages, conversation_id="conv-bg")) as response:
        assert response.status == 200
        body = await response.json()
    assert await c.retentions() == []  # answered while its commit is still held

    messages += [body["choices"][0]["message"], {"role": "user", "content": "go on"}]
    with capture_logs() as logs:
        turn2 = asyncio.create_task(c.post(CHAT, chat(messages, conversation_id="conv-bg")))
        await asyncio.sleep(0.2)
        assert not turn2.done() and len(c.prefill.transcript.requests) == 1  # waiting for turn 1's commit
        release.set()
        status, _ = await turn2
    assert status == 200
    (line,) = request_lines(logs)
    # It planned after the commit landed, so it read turn 1's retention.
    assert (line["decision"], line["generation"]) == ("reuse", 2)
    assert line["wait_ms"] >= 150
    # Another conversation's turn does not wait for this one's commit.
    release.clear()
    async with c.http.post(c.url + CHAT, json=chat(messages, conversation_id="conv-bg")) as response:
        assert response.status == 200
    async with c.http.post(c.url + CHAT, json=chat(first_messages(), conversation_id="conv-x")) as response:
        assert response.status == 200
    assert [r.generation for r in await c.retentions()] == [2]  # both commits still held
    release.set()
    await c.gateway.gateway.settle()
    assert sorted(r.generation for r in await c.retentions()) == [1, 3]


async def test_a_streamed_chat_is_valid_openai_and_the_final_chunk_params_are_committed(c: Cluster) -> None:
    status, events = await c.stream(
        CHAT, chat(first_messages(), conversation_id="conv-3", stream_options={"include_usage": True})
    )
    assert status == 200
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    ids = {e["id"] for e in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == MODEL for e in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in chunks if e["choices"])
    assert text == c.decode.script.answer
    finals = [e for e in chunks if e["choices"] and e["choices"][0]["finish_reason"]]
    assert [e["choices"][0]["finish_reason"] for e in finals] == ["stop"]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(
        c.decode.transcript.answers[0]["token_ids"]
    )
    assert all("kv_transfer_params" not in e and "token_ids" not in json.dumps(e) for e in chunks)

    d = c.decode.transcript.requests[0].body
    assert (d["stream"], d["stream_options"], d["return_token_ids"]) == (True, {"include_usage": True}, True)
    assert c.prefill.transcript.requests[0].body["stream"] is False
    (retention,) = await c.retentions()
    held = c.decode.transcript.answers[0]["kv_transfer_params"]
    assert retention.num_tokens == held["remote_num_tokens"]


async def test_a_stream_without_final_params_commits_nothing_to_reuse(c: Cluster) -> None:
    c.decode.script.stream_params = False  # vLLM 0.32 without the kvshuttle plugin
    with capture_logs() as logs:
        status, events = await c.stream(CHAT, chat(first_messages(), conversation_id="conv-4"))
    assert status == 200 and events[-1] == "[DONE]"
    assert await c.retentions() == []
    (line,) = request_lines(logs)
    assert line["outcome"] == "ok" and "retention" not in line


async def test_return_token_ids_reaches_the_client_only_when_asked(c: Cluster, model_dir: Path) -> None:
    messages = first_messages()
    status, body = await c.post(CHAT, chat(messages, return_token_ids=True))
    assert status == 200
    assert body["prompt_token_ids"] == reference_ids(model_dir, messages)
    assert body["choices"][0]["token_ids"] == c.decode.transcript.answers[0]["token_ids"]
    status, events = await c.stream(CHAT, chat(messages, return_token_ids=True))
    streamed = [t for e in events[:-1] for t in e["choices"][0].get("token_ids", [])]
    assert streamed == c.decode.transcript.answers[1]["token_ids"]
    assert events[0]["prompt_token_ids"] == reference_ids(model_dir, messages)


async def test_without_a_conversation_the_next_turn_finds_its_history_by_what_it_holds(c: Cluster) -> None:
    """The OpenAI SDK's requests as sent, no conversation id: the router starts a conversation
    for the first turn and keeps its transcript, and the next request, its whole history as
    text, is found by it and reuses through the previous answer, spliced from decode's ids."""
    messages = first_messages()
    with capture_logs() as logs:
        status, body = await c.post(CHAT, chat(messages))
    assert status == 200 and body["choices"][0]["message"]["content"] == c.decode.script.answer
    assert c.prefill.transcript.requests[0].body["kv_transfer_params"] == FIRST_TURN_PARAMS
    (retention,) = await c.retentions()
    assert "/conversations/anon-" in retention.name
    (line,) = request_lines(logs)
    assert (line["decision"], line["reason"]) == ("recompute", "no_retention")
    first_prompt = c.prefill.transcript.requests[0].body["prompt"]
    # Decode's ids but its last, EOS, which the answer's text lacks.
    answer_ids = c.decode.transcript.answers[0]["token_ids"][:-1]

    following = [*messages, body["choices"][0]["message"], {"role": "user", "content": "And then?"}]
    with capture_logs() as logs:
        status, _ = await c.post(CHAT, chat(following))
    assert status == 200
    (line,) = request_lines(logs)
    # Found, it forks a conversation of its own from the first (kvshuttle.router.fork_reads).
    first = retention.name.rsplit("/", 2)[0]
    assert line["decision"] == "reuse" and line["conversation"] != log_digest(first)
    prompt = c.prefill.transcript.requests[1].body["prompt"]
    assert prompt[: len(first_prompt) + len(answer_ids)] == [*first_prompt, *answer_ids]
    assert line["reused_tokens"] >= (len(first_prompt) + len(answer_ids)) // 16 * 16
    # The first retention was read from decode (no pool to park it in): consumed, released.
    (retention,) = await c.retentions()
    assert retention.generation == 1 and line["conversation"] == log_digest(retention.name.rsplit("/", 2)[0])


async def test_without_finding_a_request_of_no_conversation_is_plain_and_retains_nothing(
    model_dir: Path, chat_tokenizer: ChatTokenizer
) -> None:
    async for c in cluster_fixture(model_dir, chat_tokenizer, find_conversations=False):
        with capture_logs() as logs:
            status, body = await c.post(CHAT, chat(first_messages()))
        assert status == 200 and body["choices"][0]["message"]["content"] == c.decode.script.answer
        assert c.prefill.transcript.requests[0].body["kv_transfer_params"] == FIRST_TURN_PARAMS
        assert (
            c.decode.transcript.requests[0].body["kv_transfer_params"]
            == c.prefill.transcript.answers[0]["kv_transfer_params"]
        )
        assert await c.retentions() == []
        (line,) = request_lines(logs)
        assert (line["decision"], line["reason"]) == ("recompute", "no_conversation")
        assert "conversation" not in line and "retention" not in line


async def test_prefill_without_params_sends_decode_none_rather_than_made_up_ones(c: Cluster) -> None:
    c.prefill.script.kv_connector = False  # P runs without the NIXL connector
    status, body = await c.post(CHAT, chat(first_messages(), conversation_id="conv-np"))
    assert status == 200 and body["choices"][0]["message"]["content"] == c.decode.script.answer
    # A hand-made dict would make decode hold its blocks forever: decode gets nothing.
    assert "kv_transfer_params" not in c.decode.transcript.requests[0].body
    assert await c.retentions() == []


async def test_a_reused_client_request_id_does_not_replay_an_earlier_plan(c: Cluster) -> None:
    messages = await commit_first_turn(c, "conv-rid")
    with capture_logs() as logs:
        for _ in range(2):
            status, _ = await c.post(
                CHAT, chat(messages, conversation_id="conv-rid"), **{"X-Request-Id": "same"}
            )
            assert status == 200
    lines = request_lines(logs)
    assert [line["generation"] for line in lines] == [2, 3]
    assert {line["client_request_id"] for line in lines} == {"same"}
    assert len({line["request_id"] for line in lines}) == 2


async def test_requests_are_counted(c: Cluster) -> None:
    await c.post(CHAT, chat(first_messages()))
    await c.post(CHAT, {"model": "nope", "messages": []})
    count = c.metrics.get_sample_value
    assert count("kvshuttle_gateway_requests_total", {"endpoint": "chat", "status": "200"}) == 1
    assert count("kvshuttle_gateway_requests_total", {"endpoint": "chat", "status": "404"}) == 1
    assert count("kvshuttle_gateway_turns_total", {"decision": "recompute", "reason": "no_retention"}) == 1
    assert count("kvshuttle_gateway_added_seconds_count") == 1


async def test_concurrent_conversations_each_keep_their_own_retention(c: Cluster) -> None:
    async def conversation(i: int) -> None:
        messages = first_messages(seed=100 + i)
        status, body = await c.post(CHAT, chat(messages, conversation_id=f"many-{i}"))
        assert status == 200
        messages += [body["choices"][0]["message"], {"role": "user", "content": "more"}]
        status, events = await c.stream(CHAT, chat(messages, conversation_id=f"many-{i}"))
        assert status == 200 and events[-1] == "[DONE]"

    with capture_logs() as logs:
        await asyncio.gather(*(conversation(i) for i in range(8)))
    retained = await c.retentions()
    assert sorted(r.name for r in retained) == sorted(
        f"tenants/default/conversations/many-{i}/retentions/2" for i in range(8)
    )
    # Every second turn found its conversation's retention (whether reading it paid off is the
    # router's cost model: after a few instant fake prefills it learns that recompute is cheap).
    reasons = sorted(line["reason"] for line in request_lines(logs) if line["generation"] == 2)
    assert len(reasons) == 8 and "no_retention" not in reasons


# ---- the completions endpoint -------------------------------------------------------------


async def test_completions_take_text_or_token_ids_and_answer_as_completions(
    c: Cluster, chat_tokenizer: ChatTokenizer
) -> None:
    text = conversation_text(random.Random(5), 300)
    status, body = await c.post("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 5})
    assert status == 200, body
    expected = chat_tokenizer.tokenizer.encode(text).ids  # the tokenizer's default: with <s>
    assert expected[0] == chat_tokenizer.tokenizer.token_to_id("<s>")
    assert c.prefill.transcript.requests[0].body["prompt"] == expected
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == MODEL
    assert body["choices"][0]["finish_reason"] == "length"
    assert "kv_transfer_params" not in body and "token_ids" not in body["choices"][0]

    status, events = await c.stream("/v1/completions", {"model": MODEL, "prompt": [[5, 6, 7, 8]]})
    assert status == 200 and events[-1] == "[DONE]"
    assert c.prefill.transcript.requests[1].body["prompt"] == [5, 6, 7, 8]
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == c.decode.script.answer
    assert all(e["object"] == "text_completion" and "token_ids" not in json.dumps(e) for e in events[:-1])


# ---- what the gateway refuses -------------------------------------------------------------


@pytest.mark.parametrize("prompt", [[1, True], [1, -1], [1, 2**32], [1, 2.0], [1, "2"], [], [[1], [2]]])
async def test_a_token_id_prompt_must_be_uint32_ids(c: Cluster, prompt: list[Any]) -> None:
    status, body = await c.post("/v1/completions", {"model": MODEL, "prompt": prompt})
    assert status == 400
    assert assert_openai_error(body)["param"] == "prompt"
    assert c.prefill.transcript.requests == []


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"conversation_id": "bad/id"}, "conversation_id"),
        ({"conversation_id": "x" * 129}, "conversation_id"),
        ({"conversation_id": "-starts-with-dash"}, "conversation_id"),
        ({"n": 2}, "n"),
        # tool_choice "auto" (the default with tools) needs the model's tool_call_parser.
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ],
)
async def test_bad_requests_are_400_and_reach_no_engine(
    c: Cluster, extra: dict[str, Any], param: str
) -> None:
    status, body = await c.post(CHAT, {**chat(first_messages()), **extra})
    assert status == 400
    assert assert_openai_error(body)["param"] == param
    assert body["error"]["type"] == "invalid_request_error"
    assert c.prefill.transcript.requests == [] and c.decode.transcript.requests == []


async def test_header_and_body_conversation_ids_must_agree(c: Cluster) -> None:
    status, body = await c.post(
        CHAT, chat(first_messages(), conversation_id="a"), **{"X-Conversation-ID": "b"}
    )
    assert status == 400 and assert_openai_error(body)["param"] == "conversation_id"


async def test_an_unknown_model_is_404_and_a_bad_body_400(c: Cluster) -> None:
    status, body = await c.post(CHAT, {"model": "nope", "messages": first_messages()})
    assert status == 404 and assert_openai_error(body, "model_not_found")["param"] == "model"
    # Not JSON, and what only a lenient parser takes: NaN, a lone surrogate.
    for raw in (b"{not json", b'{"model": "m", "prompt": [1], "temperature": NaN}',
                b'{"model": "m", "prompt": "\\ud800"}'):  # fmt: skip
        async with c.http.post(c.url + CHAT, data=raw) as response:
            assert response.status == 400
            assert "not valid JSON" in assert_openai_error(await response.json())["message"]
    assert c.prefill.transcript.requests == []
    async with c.http.get(c.url + "/v1/nothing") as response:
        assert response.status == 404
        assert_openai_error(await response.json(), "not_found")


async def test_a_chat_template_refusal_is_400(c: Cluster) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    status, body = await c.post(CHAT, chat(messages))
    assert status == 400
    error = assert_openai_error(body, "chat_template_error")
    assert "the system message must come first" in error["message"]


async def test_health_and_models(c: Cluster) -> None:
    async with c.http.get(c.url + "/health") as response:
        assert response.status == 200
    async with c.http.get(c.url + "/v1/models") as response:
        listing = await response.json()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == [MODEL]
    assert listing["data"][0]["object"] == "model"


# ---- tenants --------------------------------------------------------------------------------


@pytest.fixture
async def keyed(model_dir: Path, chat_tokenizer: ChatTokenizer) -> AsyncIterator[Cluster]:
    keys = json.dumps({"sk-acme-0123456789": "acme", "sk-globex-0123456789": "globex"})
    async for cluster in cluster_fixture(model_dir, chat_tokenizer, api_keys=keys):
        yield cluster


async def test_api_keys_authenticate_and_scope_conversations_by_tenant(keyed: Cluster) -> None:
    body = chat(first_messages(), conversation_id="shared-id")
    status, error = await keyed.post(CHAT, body)
    assert status == 401 and assert_openai_error(error, "invalid_api_key")["type"] == "authentication_error"
    status, error = await keyed.post(CHAT, body, Authorization="Bearer sk-wrong-0123456789")
    assert status == 401 and assert_openai_error(error, "invalid_api_key")
    async with keyed.http.get(keyed.url + "/v1/models") as response:
        assert response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
    assert keyed.prefill.transcript.requests == []

    status, _ = await keyed.post(CHAT, body, Authorization="Bearer sk-acme-0123456789")
    assert status == 200
    (retention,) = await keyed.retentions("acme")
    assert retention.name == "tenants/acme/conversations/shared-id/retentions/1"
    assert await keyed.retentions("globex") == []
    # The same conversation id under another tenant is another conversation: no reuse.
    with capture_logs() as logs:
        status, _ = await keyed.post(CHAT, body, Authorization="Bearer sk-globex-0123456789")
    assert status == 200
    assert request_lines(logs)[0]["reason"] == "no_retention"


# ---- failures -------------------------------------------------------------------------------


async def commit_first_turn(c: Cluster, conversation: str = "conv-f") -> list[dict[str, Any]]:
    messages = first_messages()
    status, body = await c.post(CHAT, chat(messages, conversation_id=conversation))
    assert status == 200
    assert len(await c.retentions()) == 1
    return [*messages, body["choices"][0]["message"], {"role": "user", "content": "next question"}]


async def test_a_failing_prefill_is_a_502_and_the_claimed_retention_is_released(c: Cluster) -> None:
    messages = await commit_first_turn(c)
    c.prefill.script.fail_status = 500
    with capture_logs() as logs:
        status, body = await c.post(CHAT, chat(messages, conversation_id="conv-f"))
    assert status == 502
    error = assert_openai_error(body, "engine_error")
    assert error["type"] == "server_error" and "prefill" in error["message"]
    assert len(c.decode.transcript.requests) == 1  # decode never saw the failed turn
    (line,) = request_lines(logs)
    assert (line["decision"], line["outcome"], line["status"]) == ("reuse", "engine_error", 502)
    # Aborted: the claim is released, and with it the retention (its blocks were handed out).
    assert await c.retentions() == []
    c.prefill.script.fail_status = None
    with capture_logs() as logs:
        status, _ = await c.post(CHAT, chat(messages, conversation_id="conv-f"))
    assert status == 200 and request_lines(logs)[0]["reason"] == "no_retention"


async def test_a_failing_decode_is_a_502_and_the_turn_is_aborted(c: Cluster) -> None:
    messages = await commit_first_turn(c)
    c.decode.script.fail_status = 503
    status, body = await c.post(CHAT, chat(messages, conversation_id="conv-f"))
    assert status == 502 and assert_openai_error(body, "engine_error")
    assert await c.retentions() == []
    # An engine that refuses the client's parameters is the client's error.
    c.decode.script.fail_status = 400
    status, body = await c.post(CHAT, chat(messages, conversation_id="conv-f"))
    assert status == 400 and assert_openai_error(body, "engine_rejected")


async def test_decode_failing_mid_stream_ends_the_stream_with_an_error_and_aborts(c: Cluster) -> None:
    messages = await commit_first_turn(c)
    c.decode.script.fail_after_tokens = 3
    with capture_logs() as logs:
        status, events = await c.stream(CHAT, chat(messages, conversation_id="conv-f"))
    assert status == 200  # the status line went out with the first chunk
    assert events[-1] == "[DONE]"
    assert_openai_error(events[-2], "engine_error")
    assert await c.retentions() == []
    (line,) = request_lines(logs)
    assert line["outcome"] == "engine_error" and line["status"] == 502


async def test_a_refused_commit_still_answers_the_client_and_releases_the_claim(c: Cluster) -> None:
    messages = await commit_first_turn(c)
    # decode's params name another engine than the plan's
    c.decode.config = dataclasses.replace(c.decode.config, engine_id="engine-elsewhere")
    with capture_logs() as logs:
        status, body = await c.post(CHAT, chat(messages, conversation_id="conv-f"))
    assert status == 200 and body["choices"][0]["message"]["content"] == c.decode.script.answer
    (line,) = request_lines(logs)
    assert line["status"] == 200 and "error" not in line
    (failed,) = [e for e in logs if e.get("log_level") == "warning"]
    assert (failed["event"], failed["code"], failed["reason"]) == (
        "turn.commit_failed",
        "FAILED_PRECONDITION",
        "NODE_MISMATCH",
    )
    assert failed["request_id"] == line["request_id"]
    assert not [e for e in logs if e["event"] == "turn.committed"]
    assert await c.retentions() == []  # turn 1's claimed retention was released by the abort


async def test_an_unreachable_engine_is_a_502(c: Cluster) -> None:
    await c.decode.stop()
    status, body = await c.post(CHAT, chat(first_messages(), conversation_id="conv-x"))
    assert status == 502 and "decode" in assert_openai_error(body, "engine_error")["message"]
    assert await c.retentions() == []


async def test_no_live_engine_is_a_503(model_dir: Path, chat_tokenizer: ChatTokenizer) -> None:
    # A long deadline: the client retries UNAVAILABLE, and a busy test machine must not turn
    # the router's answer into the gateway's own timeout (504).
    async for c in cluster_fixture(model_dir, chat_tokenizer, nodes=False, router_timeout=30.0):
        status, body = await c.post(CHAT, chat(first_messages()))
        assert status == 503
        assert assert_openai_error(body)["type"] == "server_error"


async def test_a_client_disconnect_mid_stream_cancels_decode_and_aborts_the_turn(
    c: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    messages = await commit_first_turn(c)
    c.decode.script.token_delay = 0.2
    with capture_logs() as logs:
        async with aiohttp.ClientSession() as client:
            response = await client.post(
                c.url + CHAT, json=chat(messages, conversation_id="conv-f", stream=True)
            )
            assert response.status == 200
            first = await response.content.readuntil(b"\n\n")
            assert first.startswith(b"data: ")
            response.close()  # the client goes away mid-answer
        await asyncio.wait_for(c.decode.transcript.cancelled.wait(), 5)
        await wait_for(lambda: bool(request_lines(logs)))
        await wait_for(lambda: not c.gateway.gateway._background)
    (line,) = request_lines(logs)
    assert (line["outcome"], line["status"], line["decision"]) == ("client_disconnected", 499, "reuse")
    assert c.decode.transcript.finished_streams == 0  # the stream was cut, not finished
    # Aborted: turn 1's retention (claimed by this turn) is released, and nothing is committed.
    assert await c.retentions() == []
    assert not [e for e in logs if e.get("log_level") in ("error", "critical", "exception")]
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


@pytest.fixture
async def quick_stop(model_dir: Path, chat_tokenizer: ChatTokenizer) -> AsyncIterator[Cluster]:
    async for cluster in cluster_fixture(model_dir, chat_tokenizer, grace_seconds=0.3):
        yield cluster


async def test_shutdown_drains_then_cancels_in_flight_turns_and_aborts_them(quick_stop: Cluster) -> None:
    c = quick_stop
    messages = await commit_first_turn(c)
    c.decode.script.token_delay = 0.2  # an answer that outlasts the grace period
    with capture_logs() as logs:
        async with aiohttp.ClientSession() as client:
            response = await client.post(
                c.url + CHAT, json=chat(messages, conversation_id="conv-f", stream=True)
            )
            await response.content.readuntil(b"\n\n")
            stopping = asyncio.create_task(c.gateway.stop())
            await wait_for(lambda: c.gateway.gateway.draining)
            health = await c.gateway.gateway.health(None)  # type: ignore[arg-type]
            assert health.status == 503
            with contextlib.suppress(aiohttp.ClientError):
                await response.read()  # cut when the grace period ends
            await stopping
    assert await c.retentions() == []  # the turn was aborted: its claim released
    (line,) = request_lines(logs)
    assert line["outcome"] == "client_disconnected"
    await asyncio.wait_for(c.decode.transcript.cancelled.wait(), 5)


async def test_a_client_leaving_during_prefill_closes_it_and_aborts_the_turn(
    c: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    messages = await commit_first_turn(c)
    c.prefill.script.delay = 1.0
    with capture_logs() as logs:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.3)) as client:
            with pytest.raises(asyncio.TimeoutError):
                await client.post(c.url + CHAT, json=chat(messages, conversation_id="conv-f"))
        await wait_for(lambda: bool(request_lines(logs)))
        await wait_for(lambda: not c.gateway.gateway._background)
    (line,) = request_lines(logs)
    assert (line["outcome"], line["status"]) == ("client_disconnected", 499)
    assert len(c.decode.transcript.requests) == 1  # turn 2 never reached decode
    assert await c.retentions() == []  # aborted: the claim released
    await asyncio.wait_for(c.prefill.transcript.cancelled.wait(), 5)  # prefill's connection was closed
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


# ---- text stop strings --------------------------------------------------------------------


async def test_a_text_stop_string_passes_to_decode_only_and_costs_the_retention(c: Cluster) -> None:
    with capture_logs() as logs:
        status, body = await c.post(CHAT, chat(first_messages(), conversation_id="conv-s", stop=["moves"]))
    assert status == 200
    assert body["choices"][0]["message"]["content"] == ANSWER.split("moves")[0]
    assert c.decode.transcript.requests[0].body["stop"] == ["moves"]
    assert "stop" not in c.prefill.transcript.requests[0].body
    # vLLM aborts a request on a stop string: decode keeps nothing for the next turn.
    assert await c.retentions() == []
    assert request_lines(logs)[0]["stop_strings"] is True


# ---- tracing --------------------------------------------------------------------------------


async def test_one_trace_per_turn_spans_the_gateway_the_router_and_the_engines(c: Cluster) -> None:
    with capture_logs() as logs:
        status, _ = await c.post(CHAT, chat(first_messages(), conversation_id="conv-t"))
    assert status == 200
    trace_id = request_lines(logs)[0]["trace_id"]
    spans: list[ReadableSpan] = [
        s
        for s in c.exporter.get_finished_spans()
        if s.context and format(s.context.trace_id, "032x") == trace_id
    ]
    by_name = {s.name: s for s in spans}
    turn = by_name["turn"]
    assert turn.parent is None
    assert turn.context is not None
    for child in ("prefill", "decode"):
        parent = by_name[child].parent
        assert parent is not None and parent.span_id == turn.context.span_id
    assert {"plan", "commit"} <= set(by_name)  # the router's spans joined over gRPC metadata
    assert turn.attributes is not None
    assert turn.attributes["kvshuttle.decision"] == "recompute"
    assert isinstance(turn.attributes["kvshuttle.ttft.ms"], float)
    assert turn.attributes["kvshuttle.conversation"] == request_lines(logs)[0]["conversation"]
    # The engines got the trace too.
    for engine, name in ((c.prefill, "prefill"), (c.decode, "decode")):
        traceparent = engine.transcript.requests[0].headers["traceparent"]
        span = by_name[name]
        assert span.context is not None
        version, tid, parent_id, flags = traceparent.split("-")
        assert (version, tid, parent_id) == ("00", trace_id, f"{span.context.span_id:016x}")
        assert int(flags, 16) & 1  # sampled


async def test_a_callers_trace_context_is_continued(c: Cluster) -> None:
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    with capture_logs() as logs:
        await c.post(CHAT, chat(first_messages()), traceparent=f"00-{trace_id}-00f067aa0ba902b7-01")
    assert request_lines(logs)[0]["trace_id"] == trace_id


async def test_the_log_line_is_structured_json_in_production(c: Cluster) -> None:
    # One line per request, machine-readable: the lead's benchmark parses added_ms from it.
    with capture_logs() as logs:
        await c.post(CHAT, chat(first_messages(), conversation_id="conv-j"))
    (line,) = request_lines(logs)
    json.dumps(line)  # plain values only
    assert isinstance(line["added_ms"], float)


async def test_registry_state_is_untouched_by_rejected_requests(c: Cluster) -> None:
    before = await c.retentions()
    await c.post(CHAT, chat(first_messages(), conversation_id="bad id"))
    await c.post(CHAT, {"model": MODEL, "messages": "nope", "conversation_id": "ok"})
    assert await c.retentions() == before
    nodes = await c.registry.stub.ListNodes(reg_pb.ListNodesRequest(page_size=10))
    assert len(nodes.nodes) == 2


async def test_usage_reports_the_prompt_tokens_prefill_did_not_compute(c: Cluster) -> None:
    """usage.prompt_tokens_details.cached_tokens, as agent SDKs read it: 0 on a first turn, the
    tokens prefill read from decode's retained KV on the next, streamed and not, chat and
    completions alike."""
    messages = first_messages()
    status, body = await c.post(CHAT, chat(messages, conversation_id="conv-u"))
    assert status == 200
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    messages += [
        {"role": "assistant", "content": body["choices"][0]["message"]["content"]},
        {"role": "user", "content": "And after that?"},
    ]
    status, events = await c.stream(
        CHAT, chat(messages, conversation_id="conv-u", stream_options={"include_usage": True})
    )
    assert status == 200
    read = c.prefill.transcript.answers[1]["kv_transfer_params"]["remote_prefill_cached_tokens"]
    assert read > 0
    (usage,) = [e["usage"] for e in events[:-1] if e.get("usage")]
    assert usage["prompt_tokens_details"]["cached_tokens"] == read
    assert usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]

    prompt = (
        c.prefill.transcript.requests[1].body["prompt"]
        + c.decode.transcript.answers[1]["token_ids"]
        + [5, 6, 7]
    )
    status, body = await c.post("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                     "conversation_id": "conv-u"})  # fmt: skip
    assert status == 200, body
    assert (
        body["usage"]["prompt_tokens_details"]["cached_tokens"]
        == (c.prefill.transcript.answers[2]["kv_transfer_params"]["remote_prefill_cached_tokens"])
        > 0
    )


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf", "86401"])
async def test_a_bad_think_time_header_is_400_naming_it(c: Cluster, value: str) -> None:
    status, body = await c.post(
        CHAT, chat(first_messages(), conversation_id="t"), **{"X-Kvshuttle-Expected-Think-Time": value}
    )
    assert status == 400
    assert assert_openai_error(body)["param"] == "X-Kvshuttle-Expected-Think-Time"
    assert c.prefill.transcript.requests == [] and c.decode.transcript.requests == []


async def test_a_think_time_header_is_accepted(c: Cluster) -> None:
    status, _ = await c.post(
        CHAT, chat(first_messages(), conversation_id="t2"), **{"X-Kvshuttle-Expected-Think-Time": "2.5"}
    )
    assert status == 200
