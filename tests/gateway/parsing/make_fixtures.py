"""Write the conformance fixtures by driving vLLM 0.32's own parsers.

Run with the vLLM venv (it imports vllm, which the gateway's venv lacks):

    .venv-vllm/bin/python tests/gateway/parsing/make_fixtures.py

It feeds vLLM's composed `Parser` (`ParserManager.get_parser`, the object the serving layer
holds per request) with model outputs tokenized by `.run/models/tiny`, non-streamed (`parse`)
and streamed in several splits (`parse_delta`), and assembles the message / deltas and the
finish_reason with the branches of `entrypoints/openai/chat_completion/serving.py` (copied:
`OpenAIServingChat` needs an engine). Request validation and `adjust_request` run on vLLM's
`ChatCompletionRequest`. Ids are random in vLLM; the tests compare them by prefix.
"""

from __future__ import annotations

import json
import logging
import random
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError
from vllm.entrypoints.generate.base.protocol import DeltaMessage, ToolCall  # type: ignore[import-not-found,unused-ignore]
from vllm.entrypoints.openai.chat_completion.protocol import (  # type: ignore[import-not-found,unused-ignore]
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionRequest,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatMessage,
)
from vllm.entrypoints.serve.utils.tool_calls_utils import maybe_filter_parallel_tool_calls  # type: ignore[import-not-found,unused-ignore]
from vllm.exceptions import VLLMValidationError  # type: ignore[import-not-found,unused-ignore]
from vllm.parser import ParserManager  # type: ignore[import-not-found,unused-ignore]
from vllm.renderers.chat_utils import make_tool_call_id  # type: ignore[import-not-found,unused-ignore]
from vllm.tokenizers import get_tokenizer  # type: ignore[import-not-found,unused-ignore]

logging.disable(logging.CRITICAL)

ROOT = Path(__file__).resolve().parents[3]
OUT = Path(__file__).resolve().parent / "fixtures"
MODEL = ROOT / ".run/models/tiny"

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "noop"}},
    {
        "type": "function",
        "function": {
            "name": "book",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"when": {"$ref": "#/$defs/slot"}},
                "$defs": {"slot": {"type": "string"}},
            },
        },
    },
]

W = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
NESTED = (
    '{"name": "book", "arguments": {"when": {"day": "mon", "slots": [1, 2, {"x": null}]}, '
    '"note": "a \\"quoted\\" }"}}'
)
HERMES_OUTPUTS: dict[str, str] = {
    "content_only": "The weather is nice today.",
    "empty": "",
    "one_call": f"<tool_call>\n{W}\n</tool_call>",
    "one_call_compact": f"<tool_call>{W}</tool_call>",
    "two_calls": f"<tool_call>\n{W}\n</tool_call>\n"
    '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>',
    "content_then_call": f"Let me check.\n<tool_call>\n{W}\n</tool_call>",
    "call_then_text": f"<tool_call>\n{W}\n</tool_call>\nDone.",
    "malformed_json": '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
    "cut_off": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
    "cut_off_after_json": f"<tool_call>\n{W}\n",
    "unicode": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich ☃ 東京"}}\n</tool_call>',
    "unicode_content": "Grüße aus 東京 ☃ — ok",
    "nested": f"<tool_call>\n{NESTED}\n</tool_call>",
    "no_arguments": '<tool_call>\n{"name": "noop"}\n</tool_call>',
    "partial_tag_text": "a <tool_ that is not a tag <tool",
    "reasoning_then_call": f"<think>\nI should call.\n</think>\n\n<tool_call>\n{W}\n</tool_call>",
    "reasoning_then_content": "<think>Hmm, sunny?</think>It is sunny.",
    "reasoning_no_start": "thinking without start</think>answer",
    "reasoning_unclosed": "<think>still thinking about Zürich",
    "reasoning_empty_content": "<think>x</think>",
    "reasoning_call_inside": f"<think>maybe <tool_call>\n{W}\n</tool_call>",
    "reasoning_empty": "<think></think>answer",
    "text_before_think": "pre<think>r</think>c",
    "two_think_ends": "<think>a</think>b</think>c",
    "reasoning_unicode_split": "<think>東京</think>☃",
}
LLAMA_OUTPUTS: dict[str, str] = {
    "content_only": "The weather is nice today.",
    "one_call": W,
    "python_tag": "<|python_tag|>" + W,
    "parameters_key": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
    "two_calls": W + '; {"name": "noop", "arguments": {}}',
    "content_then_call": "Sure: " + W,
    "nested": NESTED,
    "unicode": '{"name": "get_weather", "arguments": {"city": "Zürich ☃ 東京"}}',
    "missing_name": '{"arguments": {"city": "Paris"}}',
    "malformed": '{"name": "get_weather", "arguments": {"city": }}',
    "cut_off": '{"name": "get_weather", "arguments": {"city": "Par',
    "reasoning_then_call": "<think>call it</think>" + W,
}

NAMED = {"type": "function", "function": {"name": "get_weather"}}


def tool_choices(tool_parser: str | None) -> list[tuple[str, Any, bool]]:
    """(label, tool_choice, parallel_tool_calls) to run for a configuration."""
    if tool_parser is None:
        return [("none", "none", True)]
    return [
        ("auto", "auto", True),
        ("auto_single", "auto", False),
        ("required", "required", True),
        ("named", NAMED, True),
        ("none", "none", True),
    ]


class _LlamaVocab:
    """The tiny tokenizer with `<|python_tag|>` in its vocabulary, which llama3_json needs
    to be constructed at all (the tiny model lacks it; vLLM refuses the pair at start-up)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def get_vocab(self) -> dict[str, int]:
        return {**self._tokenizer.get_vocab(), "<|python_tag|>": 4096}


def detokenize(tokenizer: Any, ids: list[int]) -> list[str]:
    """Per-token delta texts as vLLM's incremental detokenizer yields them: a token that ends
    in an incomplete UTF-8 sequence yields "" until the character completes."""
    out: list[str] = []
    sent = ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[: i + 1])
        if text.endswith("\ufffd"):
            out.append("")
            continue
        out.append(text[len(sent) :])
        sent = text
    return out


def splits(tokenizer: Any, text: str, with_chars: bool) -> dict[str, list[dict[str, Any]]]:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = detokenize(tokenizer, ids)
    assert "".join(pieces) == text, (text, pieces)
    result: dict[str, list[dict[str, Any]]] = {
        "per_token": [{"text": p, "ids": [i]} for p, i in zip(pieces, ids, strict=True)]
    }
    for seed in range(3):
        rng = random.Random(seed)
        chunks: list[dict[str, Any]] = []
        k = 0
        while k < len(ids):
            n = rng.randint(1, 6)
            chunks.append({"text": "".join(pieces[k : k + n]), "ids": ids[k : k + n]})
            k += n
        result[f"random_{seed}"] = chunks
    if with_chars:
        # Token ids ride with the chunk where the token's text ends (tool parsers are
        # text-based; reasoning parsers need whole tokens, so no per-char split for them).
        chunks = []
        ends: dict[int, list[int]] = {}
        pos = 0
        for p, i in zip(pieces, ids, strict=True):
            pos += len(p)
            ends.setdefault(pos, []).append(i)
        for c, ch in enumerate(text):
            chunks.append({"text": ch, "ids": ends.get(c + 1, [])})
        result["per_char"] = chunks
    if not ids:
        result = {"per_token": [{"text": "", "ids": []}]}
    return result


def make_request(tool_parser: str | None, choice: Any, parallel: bool, include_reasoning: bool) -> Any:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "include_reasoning": include_reasoning,
        "parallel_tool_calls": parallel,
    }
    if tool_parser is not None:
        body["tools"] = json.loads(json.dumps(TOOLS))
        body["tool_choice"] = choice
    return ChatCompletionRequest.model_validate(body)


def full_message(
    parser: Any, request: Any, text: str, ids: list[int], finish: str, auto: bool
) -> dict[str, Any]:
    """chat_completion_full_generator's message and finish_reason (serving.py)."""
    reasoning, content, tool_calls = parser.parse(
        text, request, enable_auto_tools=True, model_output_token_ids=ids
    )
    if not request.include_reasoning:
        reasoning = None
    named = type(request.tool_choice) is ChatCompletionNamedToolChoiceParam
    required = request.tool_choice == "required"
    auto_tools_called = False
    role = "assistant"
    if not auto and not named and not required:
        message = ChatMessage(role=role, reasoning=reasoning, content=content)
    elif named or required:
        message = ChatMessage(
            role=role,
            reasoning=reasoning,
            content=content or "",
            tool_calls=[ToolCall(id=tc.id or make_tool_call_id(), function=tc) for tc in tool_calls or []],
        )
    elif not request.tool_choice or request.tool_choice == "none":
        message = ChatMessage(role=role, reasoning=reasoning, content=content)
    else:
        auto_tools_called = tool_calls is not None and len(tool_calls) > 0
        message = ChatMessage(
            role=role,
            reasoning=reasoning,
            content=content,
            tool_calls=[ToolCall(id=tc.id or make_tool_call_id(), function=tc) for tc in tool_calls or []],
        )
    tool_calls_reason = auto_tools_called or (required and finish == "stop")
    choice = ChatCompletionResponseChoice(
        index=0, message=message, finish_reason="tool_calls" if tool_calls_reason else finish
    )
    choice = maybe_filter_parallel_tool_calls(choice, request)
    return {"message": choice.message.model_dump(), "finish_reason": choice.finish_reason}


def stream(parser: Any, request: Any, chunks: list[dict[str, Any]], finish: str) -> list[Any]:
    """chat_completion_stream_generator's per-chunk output: [delta, finish_reason] or None."""
    named = type(request.tool_choice) is ChatCompletionNamedToolChoiceParam
    tools_streamed = False
    out: list[Any] = []
    for n, chunk in enumerate(chunks):
        last = n == len(chunks) - 1
        delta = parser.parse_delta(
            delta_text=chunk["text"],
            delta_token_ids=list(chunk["ids"]),
            request=request,
            prompt_token_ids=[3, 306, 4],
            finished=last,
        )
        if delta is not None and delta.tool_calls:
            tools_streamed = True
        if delta is None:
            if not last:
                out.append(None)
                continue
            delta = DeltaMessage()
        reason = None
        if last:
            reason = "tool_calls" if tools_streamed and not named and finish == "stop" else finish
        sc = ChatCompletionResponseStreamChoice(index=0, delta=delta, finish_reason=reason)
        sc = maybe_filter_parallel_tool_calls(sc, request)
        out.append([sc.delta.model_dump(exclude_unset=True), reason])
    return out


def conformance(tokenizer: Any) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    configs = [
        ("hermes", None, HERMES_OUTPUTS),
        ("hermes", "deepseek_r1", HERMES_OUTPUTS),
        ("hermes", "qwen3", HERMES_OUTPUTS),
        (None, "deepseek_r1", HERMES_OUTPUTS),
        (None, "qwen3", HERMES_OUTPUTS),
        ("llama3_json", None, LLAMA_OUTPUTS),
        ("llama3_json", "deepseek_r1", LLAMA_OUTPUTS),
    ]
    for tool_parser, reasoning_parser, outputs in configs:
        tok = _LlamaVocab(tokenizer) if tool_parser == "llama3_json" else tokenizer
        parser_cls = ParserManager.get_parser(
            tool_parser_name=tool_parser,
            reasoning_parser_name=reasoning_parser,
            enable_auto_tools=tool_parser is not None,
            tokenizer=tok,
        )
        assert parser_cls is not None
        auto_enabled = parser_cls.tool_parser_cls is not None
        for label, choice, parallel in tool_choices(tool_parser):
            for include_reasoning in (True, False) if reasoning_parser else (True,):
                if not include_reasoning and label != "auto":
                    continue
                for name, text in outputs.items():
                    request = make_request(tool_parser, choice, parallel, include_reasoning)
                    ids = tokenizer.encode(text, add_special_tokens=False)
                    messages = {
                        finish: full_message(
                            parser_cls(tok, request.tools), request, text, ids, finish, auto_enabled
                        )
                        for finish in ("stop", "length")
                    }
                    streams = {}
                    for split, chunks in splits(tokenizer, text, reasoning_parser is None).items():
                        if label != "auto" and split not in ("per_token", "random_0"):
                            continue  # the other choices differ from auto in assembly only
                        streams[split] = {
                            "chunks": chunks,
                            **{
                                finish: stream(parser_cls(tok, request.tools), request, chunks, finish)
                                for finish in (("stop", "length") if label == "auto" else ("stop",))
                            },
                        }
                    cases.append(
                        {
                            "tool_parser": tool_parser,
                            "reasoning_parser": reasoning_parser,
                            "tool_choice": choice if tool_parser else None,
                            "parallel_tool_calls": parallel,
                            "include_reasoning": include_reasoning,
                            "name": name,
                            "text": text,
                            "token_ids": ids,
                            "messages": messages,
                            "streams": streams,
                        }
                    )
    return cases


def request_cases(tokenizer: Any) -> list[dict[str, Any]]:
    """Validation and adjust_request of ChatCompletionRequest bodies."""
    base = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    bodies: dict[str, dict[str, Any]] = {
        "no_tools": {},
        "tools_default_choice": {"tools": TOOLS},
        "auto": {"tools": TOOLS, "tool_choice": "auto"},
        "auto_single": {"tools": TOOLS, "tool_choice": "auto", "parallel_tool_calls": False},
        "auto_strict_tool": {"tools": TOOLS[2:], "tool_choice": "auto"},
        "required": {"tools": TOOLS, "tool_choice": "required"},
        "required_single": {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False},
        "named": {"tools": TOOLS, "tool_choice": NAMED},
        "named_noparams": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "noop"}}},
        "none": {"tools": TOOLS, "tool_choice": "none"},
        "none_without_tools": {"tool_choice": "none"},
        "null_choice": {"tools": TOOLS, "tool_choice": None},
        "empty_tools": {"tools": []},
        "required_without_tools": {"tool_choice": "required"},
        "named_without_tools": {"tool_choice": NAMED},
        "bad_choice_string": {"tools": TOOLS, "tool_choice": "always"},
        "named_unknown": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        "named_no_function": {"tools": TOOLS, "tool_choice": {"type": "function"}},
        "named_no_name": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
        "named_empty_name": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": ""}}},
        "tool_without_name": {"tools": [*TOOLS, {"type": "function", "function": {}}]},
        "tool_bad_type": {"tools": [{"type": "retrieval", "function": {"name": "x"}}]},
        "tool_no_function": {"tools": [{"type": "function"}]},
        "tool_params_not_object": {
            "tools": [{"type": "function", "function": {"name": "x", "parameters": 3}}]
        },
        "tool_extra_fields": {
            "tools": [{"type": "function", "x": 1, "function": {"name": "x", "y": 2, "strict": False}}]
        },
        "tools_not_list": {"tools": {"type": "function"}},
        "parallel_null": {"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": None},
    }
    out = []
    for name, extra in bodies.items():
        body = json.loads(json.dumps({**base, **extra}))
        case: dict[str, Any] = {"name": name, "body": extra}
        try:
            request = ChatCompletionRequest.model_validate(body)
        except VLLMValidationError as e:
            case["error"] = {"message": e.args[0], "parameter": e.parameter}
            out.append(case)
            continue
        except ValidationError as e:
            case["error"] = {"message": None, "loc": list(e.errors()[0]["loc"])}
            out.append(case)
            continue
        case["tool_choice"] = (
            request.tool_choice.model_dump()
            if isinstance(request.tool_choice, ChatCompletionNamedToolChoiceParam)
            else request.tool_choice
        )
        case["template_tools"] = [t.model_dump() for t in request.tools] if request.tools else None
        adjusted = {}
        for tool_parser in ("hermes", "llama3_json"):
            tok = _LlamaVocab(tokenizer) if tool_parser == "llama3_json" else tokenizer
            parser_cls = ParserManager.get_parser(
                tool_parser_name=tool_parser, enable_auto_tools=True, tokenizer=tok
            )
            assert parser_cls is not None
            req = ChatCompletionRequest.model_validate(json.loads(json.dumps(body)))
            req.skip_special_tokens = True
            if req.tool_choice != "none":  # online_renderer: adjust only then (no reasoning parser)
                req = parser_cls(tok, req.tools).adjust_request(req)
            so = req.structured_outputs
            adjusted[tool_parser] = {
                "skip_special_tokens": req.skip_special_tokens,
                "structured_outputs": None
                if so is None
                else {
                    k: v
                    for k, v in {"json": so.json, "structural_tag": so.structural_tag}.items()
                    if v is not None
                },
            }
        case["adjusted"] = adjusted
        out.append(case)
    return out


def parser_checks(tokenizer: Any) -> list[dict[str, Any]]:
    out = []
    for tool_parser in (None, "hermes", "llama3_json"):
        for reasoning_parser in (None, "deepseek_r1", "qwen3"):
            if tool_parser is None and reasoning_parser is None:
                continue
            try:
                ParserManager.get_parser(
                    tool_parser_name=tool_parser,
                    reasoning_parser_name=reasoning_parser,
                    enable_auto_tools=True,
                    tokenizer=tokenizer,
                )
                ok = True
            except Exception:
                ok = False
            out.append({"tool_parser": tool_parser, "reasoning_parser": reasoning_parser, "ok": ok})
    return out


def main() -> None:
    tokenizer = get_tokenizer(str(MODEL))
    OUT.mkdir(exist_ok=True)
    vocab = {t: tokenizer.get_vocab()[t] for t in ("<tool_call>", "</tool_call>", "<think>", "</think>")}
    files = {
        "conformance.json": {
            "tools": TOOLS,
            "vocab": {**vocab, "<|python_tag|>": 4096},
            "cases": conformance(tokenizer),
        },
        "requests.json": request_cases(tokenizer),
        "parser_checks.json": parser_checks(tokenizer),
    }
    for file, data in files.items():
        (OUT / file).write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n")
        print(file, len(data), file=sys.stderr)


if __name__ == "__main__":
    main()
