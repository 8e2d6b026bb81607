"""What the agent-loop tests on real vLLM share (tests/e2e/test_tools.py through the gateway,
tests/e2e/test_llmd_sidecar.py through the endpoint picker and the sidecar): the tools, and how a
client reads a tool-calling answer."""

from __future__ import annotations

import json
from typing import Any

from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer

__all__ = ["TOOLS", "calls", "no_free_whitespace", "streamed_message"]

# Strict, with small argument spaces (enums, booleans): vLLM then holds the arguments to the
# schema, and a random-weight model ends its call quickly instead of filling a free string up
# to max_tokens.
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "strict": True,
            "description": "Read one file of the repository — UTF-8, ≤ 1 MiB.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {
                        "type": "string",
                        "enum": ["src/cache.py", "src/router.py", "tests/test_cache.py"],
                    },
                    "whole": {"type": "boolean"},
                },
                "required": ["path", "whole"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run_tests",
            "strict": True,
            "description": "Run the test suite.",
            "parameters": {
                "type": "object",
                "properties": {"suite": {"type": "string", "enum": ["unit", "e2e"]}},
                "required": ["suite"],
                "additionalProperties": False,
            },
        },
    },
]


def calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in message.get("tool_calls") or ()
    ]


def streamed_message(events: list[dict[str, Any]]) -> tuple[dict[str, Any], str | None]:
    """The message a client assembles from chat.completion.chunk deltas."""
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for event in events:
        for choice in event.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                content.append(delta["content"])
            for tc in delta.get("tool_calls") or ():
                call = calls.setdefault(tc["index"], {"id": None, "function": {"name": "", "arguments": ""}})
                call["id"] = tc.get("id") or call["id"]
                function = tc.get("function") or {}
                call["function"]["name"] += function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    message = {
        "role": "assistant",
        "content": "".join(content),
        "tool_calls": [calls[i] for i in sorted(calls)],
    }
    return message, finish


def no_free_whitespace(tok: ChatTokenizer) -> dict[str, float]:
    """logit_bias against the whitespace-only tokens: JSON allows whitespace anywhere, and a
    random-weight model left free to choose fills its call with it up to max_tokens. Where the
    call format needs a newline or a space, the constraint still forces it."""
    vocab = tok.tokenizer.get_vocab_size()
    blank = [i for i in range(vocab) if (text := tok.tokenizer.decode([i])) and not text.strip()]
    assert blank, "the tokenizer has no whitespace tokens?"
    return {str(i): -100.0 for i in blank}
