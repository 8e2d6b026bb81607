"""The package against vLLM 0.32 itself: fixtures written by make_fixtures.py from vLLM's own
parsers (ids compared by prefix: vLLM's are random)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvshuttle.gateway.errors import GatewayError
from kvshuttle.gateway.parsing import OutputParser, check_parsers, parse_tool_request

FIXTURES = Path(__file__).parent / "fixtures"
CONFORMANCE = json.loads((FIXTURES / "conformance.json").read_text())
REQUESTS = json.loads((FIXTURES / "requests.json").read_text())
CHECKS = json.loads((FIXTURES / "parser_checks.json").read_text())
VOCAB: dict[str, int] = CONFORMANCE["vocab"]
TINY_VOCAB = {k: v for k, v in VOCAB.items() if k != "<|python_tag|>"}


def _case_id(case: dict[str, Any]) -> str:
    choice = case["tool_choice"]
    choice = "named" if isinstance(choice, dict) else choice
    single = "" if case["parallel_tool_calls"] else "-single"
    hidden = "" if case["include_reasoning"] else "-hidden"
    return f"{case['tool_parser']}-{case['reasoning_parser']}-{choice}{single}{hidden}-{case['name']}"


def _without_ids(value: Any) -> Any:
    """`value` with each tool call id checked for vLLM's prefix and replaced by a marker."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if k == "id" and isinstance(v, str):
                assert v.startswith("chatcmpl-tool-") and len(v) == len("chatcmpl-tool-") + 16
                out[k] = "<id>"
            else:
                out[k] = _without_ids(v)
        return out
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def _parser(case: dict[str, Any]) -> OutputParser:
    body: dict[str, Any] = {}
    if case["tool_parser"] is not None:
        body = {
            "tools": CONFORMANCE["tools"],
            "tool_choice": case["tool_choice"],
            "parallel_tool_calls": case["parallel_tool_calls"],
        }
    return OutputParser(
        tool_request=parse_tool_request(body, tool_parser=case["tool_parser"]),
        tool_parser=case["tool_parser"],
        reasoning_parser=case["reasoning_parser"],
        vocab=VOCAB.get,
        include_reasoning=case["include_reasoning"],
    )


def _ours(delta: dict[str, Any]) -> dict[str, Any]:
    """Our delta or message as vLLM's: `reasoning_content` mirrors `reasoning`."""
    delta = dict(delta)
    if "reasoning" in delta:
        assert delta.pop("reasoning_content") == delta["reasoning"]
    return delta


@pytest.mark.parametrize("case", CONFORMANCE["cases"], ids=_case_id)
def test_message_matches_vllm(case: dict[str, Any]) -> None:
    for finish, expected in case["messages"].items():
        message, reason = _parser(case).message(case["text"], case["token_ids"], finish)
        want = {
            k: v
            for k, v in expected["message"].items()
            if k in ("role", "content", "tool_calls", "reasoning")
        }
        assert _without_ids(_ours(message)) == _without_ids(want), finish
        assert reason == expected["finish_reason"], finish


def _with_flushed_content(case: dict[str, Any], expected: list[Any]) -> list[Any]:
    """vLLM's stream with the one deviation applied: hermes sends at the end the content it held
    back as a possible partial `<tool_call>`, which vLLM never sends."""
    message = case["messages"]["stop"]["message"]
    deltas = [e[0] for e in expected if e is not None]
    if case["tool_parser"] != "hermes" or any("tool_calls" in d for d in deltas) or not message["content"]:
        return expected
    streamed = "".join(d.get("content") or "" for d in deltas)
    lost = message["content"][len(streamed) :]
    if not lost or case["tool_choice"] == "none":
        return expected
    assert message["content"].startswith(streamed)
    last, reason = expected[-1]
    return [*expected[:-1], [{**last, "content": (last.get("content") or "") + lost}, reason]]


@pytest.mark.parametrize("case", CONFORMANCE["cases"], ids=_case_id)
def test_stream_matches_vllm(case: dict[str, Any]) -> None:
    for split, stream in case["streams"].items():
        for finish in ("stop", "length"):
            if finish not in stream:
                continue
            parser = _parser(case)
            chunks = stream["chunks"]
            for n, (chunk, expected) in enumerate(
                zip(chunks, _with_flushed_content(case, stream[finish]), strict=True)
            ):
                last = n == len(chunks) - 1
                deltas, reason = parser.delta(chunk["text"], chunk["ids"], finish if last else None)
                got = [[_ours(d), reason] for d in deltas]
                want = [] if expected is None else [expected]
                assert _without_ids(got) == _without_ids(want), (split, finish, n, chunk)


@pytest.mark.parametrize("case", REQUESTS, ids=lambda c: c["name"])
def test_request_validation_matches_vllm(case: dict[str, Any]) -> None:
    body = case["body"]
    if "error" in case:
        for tool_parser in ("hermes", None):
            with pytest.raises(GatewayError) as err:
                parse_tool_request(body, tool_parser=tool_parser)
            assert err.value.status == 400
            if case["error"]["message"] is not None:
                assert err.value.message == case["error"]["message"]
                assert err.value.param == case["error"]["parameter"]
        return
    for tool_parser, adjusted in case["adjusted"].items():
        request = parse_tool_request(body, tool_parser=tool_parser)
        if request is None:
            assert case["template_tools"] is None
            assert adjusted == {"skip_special_tokens": True, "structured_outputs": None}
            continue
        assert request.template_tools() == case["template_tools"]
        if case["tool_choice"] is None:  # null is taken as "none": see the package docstring
            continue
        params = request.decode_params()
        assert params.get("skip_special_tokens", True) == adjusted["skip_special_tokens"]
        want = adjusted["structured_outputs"]
        got = params.get("structured_outputs")
        if want is None:
            assert got is None
            continue
        assert got is not None and set(got) == set(want)
        assert json.loads(got["structural_tag"]) == json.loads(want["structural_tag"])
        assert got["structural_tag"] == want["structural_tag"]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: f"{c['tool_parser']}-{c['reasoning_parser']}")
def test_parser_checks_match_vllm(check: dict[str, Any]) -> None:
    if check["ok"]:
        check_parsers(check["tool_parser"], check["reasoning_parser"], TINY_VOCAB.get)
    else:
        with pytest.raises(ValueError):
            check_parsers(check["tool_parser"], check["reasoning_parser"], TINY_VOCAB.get)
