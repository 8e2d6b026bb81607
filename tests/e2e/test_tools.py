"""Tool calling through the gateway on real vLLM (CPU build, tiny model with a Hermes-style
template): the gateway's prompt ids for chats with tools equal vLLM's own /tokenize, and an agent
loop of tool call -> tool result turns reuses decode's KV every turn while each answer equals the
same request on one vLLM server started with its tool parser (`--tool-call-parser hermes`).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from deploy.local.launch import VllmPair
from deploy.local.stack import KvshuttleStack
from prometheus_client.parser import text_string_to_metric_families
from tests.e2e.agent_loop import TOOLS, calls, no_free_whitespace, streamed_message
from tests.e2e.stacks import running_stack

from kvshuttle.gateway.config import ModelSettings
from kvshuttle.gateway.openai.prompt import prompt_ids
from kvshuttle.gateway.openai.protocol import parse_request
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.gateway.turns.background import BackgroundTasks

pytestmark = pytest.mark.vllm
CALL = {
    "id": "call-1",
    "type": "function",
    "function": {"name": "read_file", "arguments": '{"path": "src/cache.py", "whole": true}'},
}


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=180) as response:
            return json.loads(response.read()), {k.lower(): v for k, v in response.headers.items()}
    except urllib.error.HTTPError as err:
        raise AssertionError(f"{url}: {err.code} {err.read()[:800]!r}") from None


def post_sse(url: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, str]]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    events: list[dict[str, Any]] = []
    with urllib.request.urlopen(req, timeout=180) as response:
        headers = {k.lower(): v for k, v in response.headers.items()}
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events, headers


# ---- conformance: the gateway's ids are vLLM's ----------------------------------------------

CHATS: dict[str, dict[str, Any]] = {
    "tools_and_system": {
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Find the bug in the cache — and fix it."},
        ],
        "tools": TOOLS,
    },
    "tools_without_system": {
        "messages": [{"role": "user", "content": "run the tests"}],
        "tools": TOOLS[1:],
    },
    "call_and_result": {
        "messages": [
            {"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": "Read the cache module."},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call-1", "content": "def get(key):\n    return None\n"},
        ],
        "tools": TOOLS,
    },
    "content_then_parallel_calls_and_results": {
        "messages": [
            {"role": "user", "content": "Look at both."},
            {
                "role": "assistant",
                "content": "Reading both files.",
                "tool_calls": [
                    CALL,
                    {
                        "id": "call-2",
                        "type": "function",
                        "function": {
                            "name": "read_file",
                            "arguments": '{"path": "src/router.py", "whole": false}',
                        },
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call-1", "content": "x = 1"},
            {"role": "tool", "tool_call_id": "call-2", "content": "y = «2»"},
            {"role": "assistant", "content": "Both read."},
            {"role": "user", "content": "Now run the unit tests."},
        ],
        "tools": TOOLS,
    },
    "nested_arguments": {
        "messages": [
            {"role": "user", "content": "go"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {
                            "name": "run_tests",
                            "arguments": json.dumps({"suite": "unit", "env": {"A": [1, 2.5, None, "ü"]}}),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": "3 passed"},
        ],
        "tools": TOOLS,
    },
    "history_with_calls_but_no_tools": {
        "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call-1", "content": "ok"},
        ],
    },
}


@pytest.fixture(scope="module")
def tokenizer(vllm_model: Path) -> ChatTokenizer:
    return ChatTokenizer.load("m", ModelSettings(tokenizer=vllm_model), verify_fraction=0.0)


def gateway_ids(tok: ChatTokenizer, chat: dict[str, Any]) -> list[int]:
    body = {"model": "m", **chat}
    treq = parse_request(
        "chat",
        body,
        models={"m"},
        default_max_tokens=None,
        content_format={"m": "string"},
        tool_parsers={"m": "hermes"},
    )
    return asyncio.run(prompt_ids(tok, treq, max_tokens=100_000, background=BackgroundTasks())).ids


@pytest.mark.parametrize("case", sorted(CHATS))
def test_prompt_ids_of_chats_with_tools_equal_vllm_tokenize(
    case: str, tokenizer: ChatTokenizer, vllm_pair: VllmPair
) -> None:
    chat = CHATS[case]
    body = {"model": "m", "add_generation_prompt": True, **chat}
    vllm, _ = post(f"{vllm_pair.decode.url}/tokenize", body)
    ids = gateway_ids(tokenizer, chat)
    assert ids == vllm["tokens"]
    # Twice: the second time the earlier messages' pieces come from the segment cache.
    assert gateway_ids(tokenizer, chat) == vllm["tokens"]


# ---- the agent loop ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(vllm_pair: VllmPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KvshuttleStack]:
    with running_stack(vllm_pair, tmp_path_factory.mktemp("kvshuttle-tools")) as s:
        yield s


def test_an_agent_loop_reuses_decodes_kv_and_answers_as_vllm_does(
    stack: KvshuttleStack, vllm_pair: VllmPair, tokenizer: ChatTokenizer
) -> None:
    conversation = f"agent-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent. Call one tool at a time."},
        {"role": "user", "content": "The cache tests fail after the block-size change; find out why."},
    ]
    choices: list[Any] = [
        {"type": "function", "function": {"name": "read_file"}},
        "required",
        {"type": "function", "function": {"name": "run_tests"}},
        "required",
        {"type": "function", "function": {"name": "read_file"}},
    ]
    no_whitespace = no_free_whitespace(tokenizer)
    previous_prompt = 0
    before = _router_turn_ends(stack)  # the module's stack: other tests' turns counted already
    for turn, tool_choice in enumerate(choices, start=1):
        body = {
            "model": "m",
            "messages": messages,
            "tools": TOOLS,
            "tool_choice": tool_choice,
            "parallel_tool_calls": False,
            "max_tokens": 96,
            "temperature": 0,
            "logit_bias": no_whitespace,
        }
        # The reference: one server from scratch (a fresh cache salt) answering as vLLM does with
        # its tool parser; a streamed turn against a streamed reference.
        ref_body = {**body, "cache_salt": uuid.uuid4().hex}
        shuttle_body = {**body, "conversation_id": conversation}
        chat = "/v1/chat/completions"
        if turn % 2 == 0:
            ref_events, _ = post_sse(vllm_pair.decode.url + chat, {**ref_body, "stream": True})
            ref_message, ref_finish = streamed_message(ref_events)
            events, headers = post_sse(stack.gateway_url + chat, {**shuttle_body, "stream": True})
            message, finish = streamed_message(events)
        else:
            ref = post(vllm_pair.decode.url + chat, ref_body)[0]["choices"][0]
            ref_message, ref_finish = ref["message"], ref["finish_reason"]
            answer, headers = post(stack.gateway_url + chat, shuttle_body)
            message, finish = answer["choices"][0]["message"], answer["choices"][0]["finish_reason"]
        assert calls(message) == calls(ref_message), (turn, message, ref_message)
        assert len(calls(message)) == 1, (turn, message)
        assert (message.get("content") or "") == (ref_message.get("content") or ""), turn
        assert finish == ref_finish, turn
        for call in message["tool_calls"]:
            assert call["id"], call
        prompt = int(headers["x-kvshuttle-prompt-tokens"])
        reused = int(headers["x-kvshuttle-reused-tokens"])
        if turn > 1:
            # The history verifies against decode's KV up to where the previous answer's
            # re-rendered call departs from decode's text, past the previous prompt's end.
            assert headers["x-kvshuttle-decision"] == "reuse", (turn, headers)
            assert reused >= previous_prompt - 1, (turn, reused, previous_prompt)
        previous_prompt = prompt
        call = message["tool_calls"][0]
        messages.append(
            {
                "role": "assistant",
                "content": message.get("content") or None,
                "tool_calls": [{"id": call["id"], "type": "function", "function": call["function"]}],
            }
        )
        messages.append(
            {"role": "tool", "tool_call_id": call["id"], "content": f"result {turn}: " + "ok " * 40}
        )
    # Every answer was a tool call (vLLM's tool parser says so above), though a named tool_choice
    # finishes "stop" as vLLM tells the client: each commit told the router "tool_call", from the
    # gateway's own parse of decode's text. Commits land in the background: wait for the last.
    deadline = time.monotonic() + 30
    while True:
        now = _router_turn_ends(stack)
        ends = {end: n - before.get(end, 0) for end, n in now.items() if n > before.get(end, 0)}
        if sum(ends.values()) >= len(choices) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert ends == {"tool_call": len(choices)}, ends


def _router_turn_ends(stack: KvshuttleStack) -> dict[str, float]:
    """kvshuttle_router_turn_ends_total by `end`, from the router's /metrics."""
    url = f"http://127.0.0.1:{stack.metrics_ports['router']}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        s.labels["end"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvshuttle_router_turn_ends_total"
    }


# ---- reasoning ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def thinking_stack(
    vllm_pair: VllmPair, vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KvshuttleStack]:
    """The gateway with the deepseek_r1 reasoning parser (the tiny model has <think> tokens)."""
    model = {"tokenizer": str(vllm_model), "tool_call_parser": "hermes", "reasoning_parser": "deepseek_r1"}
    models = {"gateway": {"MODELS": json.dumps({"m": model})}}
    with running_stack(vllm_pair, tmp_path_factory.mktemp("kvshuttle-thinking"), extra_env=models) as s:
        yield s


def test_reasoning_is_split_out_and_a_history_without_it_still_reuses(
    thinking_stack: KvshuttleStack, vllm_pair: VllmPair
) -> None:
    conversation = f"think-{uuid.uuid4().hex[:8]}"
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Why did the cache tests fail after the block-size change? " * 12}
    ]
    previous_prompt = 0
    for turn in (1, 2):
        body = {"model": "m", "messages": messages, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
        ref = post(f"{vllm_pair.decode.url}/v1/chat/completions", {**body, "cache_salt": uuid.uuid4().hex})[0]
        answer, headers = post(
            f"{thinking_stack.gateway_url}/v1/chat/completions", {**body, "conversation_id": conversation}
        )
        message = answer["choices"][0]["message"]
        # deepseek_r1: everything before </think> is reasoning (the model may not open <think>).
        text = ref["choices"][0]["message"]["content"]
        thought, end, rest = text.partition("</think>")
        assert message["reasoning_content"] == message["reasoning"] == thought.removeprefix("<think>")
        assert (message["content"] or "") == (rest if end else "")
        if turn == 2:
            # The history left the reasoning out: reuse still covers the whole first prompt
            # but the last token or two, where the re-tokenized answer departs.
            assert headers["x-kvshuttle-decision"] == "reuse", headers
            assert int(headers["x-kvshuttle-reused-tokens"]) >= previous_prompt - 2, headers
        previous_prompt = int(headers["x-kvshuttle-prompt-tokens"])
        messages += [
            {"role": "assistant", "content": message["content"] or "(no answer)"},
            {"role": "user", "content": "And the fix? " * 20},
        ]
