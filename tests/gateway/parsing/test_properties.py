"""Streaming agrees with the non-streamed message for any chunking of decode's text."""

from __future__ import annotations

import itertools
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from kvshuttle.gateway.parsing import OutputParser, parse_tool_request

VOCAB = {"<tool_call>": 2048, "</tool_call>": 2049, "<think>": 2050, "</think>": 2051}
TOOLS = [{"type": "function", "function": {"name": n}} for n in ("get_weather", "noop", "book")]

text = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=30)
# A call whose JSON spells a tag is cut there, by vLLM's hermes parser as by this port (it finds
# calls by their tags, not by parsing JSON): no property holds for it. Hypothesis draws the
# module's own string constants, VOCAB's tags among them, so they are kept out explicitly.
arg_text = text.filter(lambda t: not any(tag in t for tag in VOCAB))
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | arg_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(arg_text, inner, max_size=3),
    max_leaves=8,
)
calls = st.lists(
    st.tuples(
        st.sampled_from(["get_weather", "noop", "book"]), st.dictionaries(arg_text, json_values, max_size=4)
    ),
    min_size=1,
    max_size=3,
)


def _parser(tool_parser: str | None, reasoning_parser: str | None = None) -> OutputParser:
    body: dict[str, Any] = {"tools": TOOLS} if tool_parser else {}
    return OutputParser(
        tool_request=parse_tool_request(body, tool_parser=tool_parser),
        tool_parser=tool_parser,
        reasoning_parser=reasoning_parser,
        vocab=VOCAB.get,
    )


def _chunks(output: str, cuts: list[int]) -> list[str]:
    points = sorted({min(c, len(output)) for c in cuts} | {0, len(output)})
    return [output[a:b] for a, b in itertools.pairwise(points)] or [""]


def _stream(parser: OutputParser, pieces: list[str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for n, piece in enumerate(pieces):
        deltas, _ = parser.delta(piece, [], "stop" if n == len(pieces) - 1 else None)
        out.extend(deltas)
    return out


def _arguments(deltas: list[dict[str, Any]]) -> dict[int, str]:
    args: dict[int, str] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            args[tc["index"]] = args.get(tc["index"], "") + tc.get("function", {}).get("arguments", "")
    return args


@settings(max_examples=200, deadline=None)
@given(
    prefix=text.filter(lambda t: "<" not in t), calls=calls, cuts=st.lists(st.integers(0, 400), max_size=20)
)
def test_hermes_streamed_arguments_equal_the_message(prefix: str, calls: list[Any], cuts: list[int]) -> None:
    bodies = [f'{{"name": "{n}", "arguments": {json.dumps(a, ensure_ascii=False)}}}' for n, a in calls]
    output = prefix + "".join(f"<tool_call>\n{body}\n</tool_call>" for body in bodies)
    message, reason = _parser("hermes").message(output, [], "stop")
    deltas = _stream(_parser("hermes"), _chunks(output, cuts))
    assert [tc["function"]["arguments"] for tc in message["tool_calls"]] == list(_arguments(deltas).values())
    names = [tc["function"]["name"] for d in deltas for tc in d.get("tool_calls", []) if "id" in tc]
    assert names == [tc["function"]["name"] for tc in message["tool_calls"]]
    streamed = "".join(d.get("content") or "" for d in deltas)
    # vLLM drops whitespace-only content beside tool calls from the message, not from the stream.
    assert streamed == message["content"] or (message["content"] is None and not streamed.strip())
    assert reason == "tool_calls"


@settings(max_examples=200, deadline=None)
@given(calls=calls.filter(lambda cs: all(a for _, a in cs)), sizes=st.lists(st.integers(1, 3), min_size=1))
def test_llama3_json_streamed_arguments_equal_the_message(calls: list[Any], sizes: list[int]) -> None:
    """As in vLLM, only for small chunks and non-empty arguments: its llama3_json stream sends
    nothing for a call that arrives in one chunk, and never sends `{}` arguments."""
    output = "; ".join(json.dumps({"name": n, "arguments": a}, ensure_ascii=False) for n, a in calls)
    message, _ = _parser("llama3_json").message(output, [], "stop")
    pieces: list[str] = []
    pos = 0
    while pos < len(output):
        size = sizes[len(pieces) % len(sizes)]
        pieces.append(output[pos : pos + size])
        pos += size
    deltas = _stream(_parser("llama3_json"), pieces)
    assert [tc["function"]["arguments"] for tc in message["tool_calls"]] == list(_arguments(deltas).values())


@settings(max_examples=300, deadline=None)
@given(
    output=text, cuts=st.lists(st.integers(0, 40), max_size=10), tool_parser=st.sampled_from([None, "hermes"])
)
def test_content_is_never_lost_or_duplicated(output: str, cuts: list[int], tool_parser: str | None) -> None:
    output = output.replace("<tool_call>", "")
    deltas = _stream(_parser(tool_parser), _chunks(output, cuts))
    assert "".join(d.get("content") or "" for d in deltas) == output


@settings(max_examples=300, deadline=None)
@given(
    reasoning=text.filter(lambda t: "<" not in t),
    content=text.filter(lambda t: "<" not in t),
    cuts=st.lists(st.integers(0, 80), max_size=10),
    reasoning_parser=st.sampled_from(["deepseek_r1", "qwen3"]),
)
def test_reasoning_and_content_split_alike_streamed(
    reasoning: str, content: str, cuts: list[int], reasoning_parser: str
) -> None:
    """Chunks cut on token boundaries: the think markers are single tokens."""
    pieces: list[tuple[str, list[int]]] = [("<think>", [2050])]
    pieces += [(p, [1]) for p in _chunks(reasoning, cuts) if p]
    pieces += [("</think>", [2051])] + [(p, [1]) for p in _chunks(content, cuts) if p]
    parser = _parser(None, reasoning_parser)
    deltas: list[dict[str, Any]] = []
    for n, (piece, ids) in enumerate(pieces):
        deltas.extend(parser.delta(piece, ids, "stop" if n == len(pieces) - 1 else None)[0])
    message, _ = _parser(None, reasoning_parser).message("".join(p for p, _ in pieces), [], "stop")
    assert "".join(d.get("reasoning") or "" for d in deltas) == (message["reasoning"] or "")
    assert "".join(d.get("content") or "" for d in deltas) == (message["content"] or "")
    assert all(d.get("reasoning_content") == d.get("reasoning") for d in deltas)
