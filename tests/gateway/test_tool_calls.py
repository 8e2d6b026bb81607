"""Tool calls and reasoning through the gateway, with stand-in engines: what decode is sent (the
forced-call JSON schema; prefill never), and how decode's text comes back (tool_calls, content,
reasoning, finish_reason), streamed and not. The parsers' conformance with vLLM's own is in
tests/gateway/parsing; real vLLM in tests/e2e/test_tools.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from bench.emulator.http.tokenizer import make_tokenizer
from tests.gateway.helpers import Cluster, cluster_fixture
from tests.router.helpers import MODEL

from kvshuttle.gateway.config import ModelSettings
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "run_tests", "parameters": {"type": "object", "properties": {}}},
    },
]
MESSAGES = [{"role": "user", "content": "read the cache module"}]
HERMES_ANSWER = (
    'Let me look.<tool_call>\n{"name": "read_file", "arguments": {"path": "src/cache.py"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok-think"), added_tokens=["<think>", "</think>"])


@pytest.fixture
async def cluster(model_dir: Path, chat_tokenizer: ChatTokenizer) -> AsyncIterator[Cluster]:
    async for c in cluster_fixture(model_dir, chat_tokenizer, tool_call_parser="hermes"):
        yield c


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 512, **extra}


def _assembled(events: list[Any]) -> tuple[str, list[dict[str, Any]], str | None]:
    """(content, tool calls, finish_reason) as a client assembles them from the deltas."""
    content, finish = "", None
    calls: dict[int, dict[str, str]] = {}
    for event in events:
        if event == "[DONE]":
            continue
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls") or ():
                call = calls.setdefault(tc["index"], {"id": "", "type": "", "name": "", "arguments": ""})
                call["id"] = tc.get("id") or call["id"]
                call["type"] = tc.get("type") or call["type"]
                call["name"] += (tc.get("function") or {}).get("name") or ""
                call["arguments"] += (tc.get("function") or {}).get("arguments") or ""
            finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


async def test_auto_tool_choice_parses_decodes_hermes_call(cluster: Cluster) -> None:
    cluster.decode.script.answer = HERMES_ANSWER
    status, body = await cluster.post("/v1/chat/completions", _chat(tool_choice="auto"))
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Let me look."
    (call,) = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "read_file"
    assert json.loads(call["function"]["arguments"]) == {"path": "src/cache.py"}
    # Auto: decode is not constrained, and prefill never gets a sampling constraint.
    assert "structured_outputs" not in cluster.decode.transcript.requests[-1].body
    assert "structured_outputs" not in cluster.prefill.transcript.requests[-1].body


async def test_streamed_auto_tool_call_assembles_to_the_same_call(cluster: Cluster) -> None:
    cluster.decode.script.answer = HERMES_ANSWER
    status, events = await cluster.stream("/v1/chat/completions", _chat())
    assert status == 200, events
    content, calls, finish = _assembled(events)
    assert content == "Let me look."
    (call,) = calls
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["name"] == "read_file"
    assert json.loads(call["arguments"]) == {"path": "src/cache.py"}
    assert finish == "tool_calls"
    assert events[-1] == "[DONE]"


async def test_a_named_tool_choice_constrains_decode_to_a_call_of_it(cluster: Cluster) -> None:
    cluster.decode.script.answer = HERMES_ANSWER.removeprefix("Let me look.")
    choice = {"type": "function", "function": {"name": "read_file"}}
    status, body = await cluster.post(
        "/v1/chat/completions", _chat(tool_choice=choice, response_format={"type": "json_object"})
    )
    assert status == 200, body
    sent = cluster.decode.transcript.requests[-1].body
    # vLLM 0.32's strict tool calling: a structural tag of the parser's own call format, with
    # the named function's parameters as the arguments' schema.
    tag = json.loads(sent["structured_outputs"]["structural_tag"])
    (begin, *_) = [t["begin"] for t in tag["format"]["tags"]]
    assert begin == '<tool_call>\n{"name": "read_file", "arguments": '
    # Without `strict`, any JSON object is a valid argument (vLLM's choice); with it, the schema.
    assert {t["content"]["json_schema"] for t in tag["format"]["tags"]} == {True}
    assert sent["skip_special_tokens"] is False
    assert "response_format" not in sent  # replaced by the call's schema, as vLLM does
    assert "structured_outputs" not in cluster.prefill.transcript.requests[-1].body
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "read_file"
    assert json.loads(call["function"]["arguments"]) == {"path": "src/cache.py"}
    assert body["choices"][0]["finish_reason"] == "stop"  # vLLM: "stop" for a named function


async def test_a_strict_tools_schema_constrains_the_arguments(cluster: Cluster) -> None:
    cluster.decode.script.answer = HERMES_ANSWER.removeprefix("Let me look.")
    strict = [{**t, "function": {**t["function"], "strict": True}} for t in TOOLS]
    status, body = await cluster.post("/v1/chat/completions", _chat(tools=strict, tool_choice="required"))
    assert status == 200, body
    tag = json.loads(cluster.decode.transcript.requests[-1].body["structured_outputs"]["structural_tag"])
    schemas = [t["content"]["json_schema"] for t in tag["format"]["tags"]]
    assert TOOLS[0]["function"]["parameters"] in schemas


async def test_required_tool_choice_constrains_decode_to_a_call_of_one_tool(cluster: Cluster) -> None:
    cluster.decode.script.answer = '<tool_call>\n{"name": "run_tests", "arguments": {}}\n</tool_call>'
    status, body = await cluster.post("/v1/chat/completions", _chat(tool_choice="required"))
    assert status == 200, body
    tag = json.loads(cluster.decode.transcript.requests[-1].body["structured_outputs"]["structural_tag"])
    assert "run_tests" in json.dumps(tag) and "read_file" in json.dumps(tag)
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "run_tests"
    assert json.loads(call["function"]["arguments"]) == {}
    assert body["choices"][0]["finish_reason"] == "tool_calls"


async def test_tool_choice_none_answers_content(cluster: Cluster) -> None:
    cluster.decode.script.answer = HERMES_ANSWER
    status, body = await cluster.post("/v1/chat/completions", _chat(tool_choice="none"))
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert message["content"] == HERMES_ANSWER
    assert not message.get("tool_calls")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": "read_file"}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ],
)
async def test_bad_tools_are_a_400_naming_the_field(
    cluster: Cluster, extra: dict[str, Any], param: str
) -> None:
    status, body = await cluster.post("/v1/chat/completions", _chat(**extra))
    assert status == 400, body
    assert body["error"]["param"] == param, body
    assert not cluster.decode.transcript.requests


async def test_auto_without_a_tool_parser_is_refused(model_dir: Path, chat_tokenizer: ChatTokenizer) -> None:
    async for c in cluster_fixture(model_dir, chat_tokenizer):
        status, body = await c.post("/v1/chat/completions", _chat(tool_choice="auto"))
        assert status == 400, body
        assert "tool-call-parser" in body["error"]["message"]
        assert not c.decode.transcript.requests


async def test_reasoning_is_split_out_as_reasoning_content(thinking_dir: Path) -> None:
    tok = ChatTokenizer.load(MODEL, ModelSettings(tokenizer=thinking_dir))
    async for c in cluster_fixture(thinking_dir, tok, reasoning_parser="deepseek_r1"):
        c.decode.script.answer = "the block moved</think>It is in decode."
        status, body = await c.post("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES})
        assert status == 200, body
        message = body["choices"][0]["message"]
        assert message["reasoning_content"] == message["reasoning"] == "the block moved"
        assert message["content"] == "It is in decode."
        status, events = await c.stream("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES})
        assert status == 200
        reasoning = "".join(
            (ch["delta"].get("reasoning_content") or "")
            for e in events
            if e != "[DONE]"
            for ch in e["choices"]
        )
        content = "".join(
            (ch["delta"].get("content") or "") for e in events if e != "[DONE]" for ch in e["choices"]
        )
        assert (reasoning, content) == ("the block moved", "It is in decode.")


def test_a_reasoning_parser_whose_tokens_the_model_lacks_fails_at_start(model_dir: Path) -> None:
    from kvshuttle.gateway.parsing import check_parsers  # noqa: PLC0415

    tok = ChatTokenizer.load(MODEL, ModelSettings(tokenizer=model_dir))
    with pytest.raises(ValueError, match="think"):
        check_parsers(None, "deepseek_r1", tok.tokenizer.token_to_id)


async def test_a_history_without_its_reasoning_still_reuses_the_prompt_before_it(thinking_dir: Path) -> None:
    tok = ChatTokenizer.load(MODEL, ModelSettings(tokenizer=thinking_dir))
    async for c in cluster_fixture(thinking_dir, tok, reasoning_parser="deepseek_r1"):
        c.decode.script.answer = "the block moved</think>It is in decode."
        # Long enough that reading it back beats computing it (the router's min_reuse_tokens).
        question = [{"role": "user", "content": "where is the cache block of the request " * 150}]
        body = {"model": MODEL, "messages": question, "conversation_id": "think-1"}
        status, first = await c.post("/v1/chat/completions", body)
        assert status == 200, first
        first_prompt = c.prefill.transcript.requests[0].body["prompt"]
        # Agent SDKs send the answer back without its reasoning: the text decode generated is
        # not in the history any more, the prompt before it is.
        messages = [
            *question,
            {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
            {"role": "user", "content": "and then?"},
        ]
        status, second = await c.post("/v1/chat/completions", {**body, "messages": messages})
        assert status == 200, second
        params = c.prefill.transcript.requests[1].body["kv_transfer_params"]
        assert params["do_remote_decode"] is True
        prompt = c.prefill.transcript.requests[1].body["prompt"]
        reused = params["remote_num_tokens"]
        assert prompt[:reused] == first_prompt[:reused]
        # Every token of the first prompt the new one repeats (its last may merge with the
        # answer's first characters when re-tokenized).
        common = next(
            (i for i, (a, b) in enumerate(zip(prompt, first_prompt, strict=False)) if a != b),
            len(first_prompt),
        )
        assert reused == common >= len(first_prompt) - 2
