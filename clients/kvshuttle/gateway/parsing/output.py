"""Decode's text as chat messages and stream deltas: reasoning, content and tool calls.

Follows vLLM 0.32's `DelegatingParser.parse` / `parse_delta` (`vllm/parser/abstract_parser.py`)
and the message / chunk assembly of `vllm/entrypoints/openai/chat_completion/serving.py`
(Apache-2.0). With `VLLM_ENFORCE_STRICT_TOOL_CALLING` at its default, hermes and llama3_json
parse `required` and named choices with the same parser as `auto` (the structural tag makes
the model write its native call format), so every choice but "none" goes through it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvshuttle.gateway.parsing.base import (
    REASONING_REGISTRY,
    TOOL_REGISTRY,
    Delta,
    ReasoningParser,
    ToolParser,
    Vocab,
    make_tool_call_id,
)
from kvshuttle.gateway.parsing.request.validate import ToolRequest

__all__ = ["OutputParser", "check_parsers", "reasoning_decode_params"]


def check_parsers(tool_parser: str | None, reasoning_parser: str | None, vocab: Vocab) -> None:
    """Refuse at start-up what vLLM refuses: unknown names, tokens missing from the vocabulary."""
    if tool_parser is not None:
        if tool_parser not in TOOL_REGISTRY:
            raise ValueError(f"tool parser {tool_parser!r} is not one of {sorted(TOOL_REGISTRY)}")
        for token in TOOL_REGISTRY[tool_parser].required_tokens:
            if vocab(token) is None:
                raise ValueError(
                    f"--tool-call-parser {tool_parser} needs the token {token!r} in the vocabulary"
                )
    if reasoning_parser is not None:
        if reasoning_parser not in REASONING_REGISTRY:
            raise ValueError(
                f"reasoning parser {reasoning_parser!r} is not one of {sorted(REASONING_REGISTRY)}"
            )
        REASONING_REGISTRY[reasoning_parser](vocab)


def reasoning_decode_params(reasoning_parser: str | None) -> dict[str, Any]:
    """What the reasoning parser's adjust_request sets on every request (tools or not)."""
    if reasoning_parser is not None and REASONING_REGISTRY[reasoning_parser].keeps_special_tokens:
        return {"skip_special_tokens": False}
    return {}


@dataclass
class _Stream:
    reasoning_ended: bool
    tool_text_started: bool = False
    previous_text: str = ""
    previous_ids: list[int] = field(default_factory=list)
    tools_streamed: bool = False


class OutputParser:
    """One request's reading of decode's output; `delta` is stateful, call it per chunk."""

    def __init__(
        self,
        *,
        tool_request: ToolRequest | None,
        tool_parser: str | None,
        reasoning_parser: str | None,
        vocab: Vocab,
        include_reasoning: bool = True,
    ) -> None:
        self._choice = tool_request.choice if tool_request is not None else "none"
        self._single = tool_request is not None and not tool_request.parallel_tool_calls
        self._include_reasoning = include_reasoning
        self._tool: ToolParser | None = TOOL_REGISTRY[tool_parser]() if tool_parser else None
        self._reasoning: ReasoningParser | None = (
            REASONING_REGISTRY[reasoning_parser](vocab) if reasoning_parser else None
        )
        # vLLM feeds engine-based parsers (qwen3) deltas, the others the accumulated text.
        self._engine_based = self._tool is None and reasoning_parser in (None, "qwen3")
        self._stream = _Stream(reasoning_ended=self._reasoning is None)

    def message(
        self, text: str, token_ids: Sequence[int], finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """The non-streamed assistant message and the finish_reason to report."""
        reasoning, content = self._reasoning.extract(text) if self._reasoning else (None, text)
        calls, content = self._tool_calls(content)
        if not self._include_reasoning:
            reasoning = None
        auto_called = False
        if self._choice in ("required", "function"):
            content = content or ""
        elif self._choice == "auto" and self._tool is not None:
            auto_called = bool(calls)
        else:
            calls = []
        tool_calls = [
            {
                "id": make_tool_call_id(),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
        if self._single:
            tool_calls = tool_calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        message["reasoning"] = message["reasoning_content"] = reasoning
        reason = finish_reason or "stop"
        if auto_called or (self._choice == "required" and finish_reason == "stop"):
            reason = "tool_calls"
        return message, reason

    def delta(
        self, delta_text: str, delta_token_ids: Sequence[int], finish_reason: str | None
    ) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas to send for one decode chunk, and the finish_reason with the last one."""
        delta = self._parse_delta(delta_text, list(delta_token_ids), finished=finish_reason is not None)
        if delta is not None and delta.get("tool_calls"):
            self._stream.tools_streamed = True
        if delta is None:
            if finish_reason is None:
                return [], None
            delta = {}
        reason = None
        if finish_reason is not None:
            tool_reason = (
                self._stream.tools_streamed and self._choice != "function" and finish_reason == "stop"
            )
            reason = "tool_calls" if tool_reason else finish_reason
        if self._single and delta.get("tool_calls"):
            delta["tool_calls"] = [tc for tc in delta["tool_calls"] if tc["index"] == 0]
        if not delta.get("tool_calls"):
            delta.pop("tool_calls", None)  # vLLM's DeltaMessage drops an empty list
        if "reasoning" in delta:
            delta["reasoning_content"] = delta["reasoning"]
        return [delta], reason

    def _tool_calls(self, content: str | None) -> tuple[list[Any], str | None]:
        """DelegatingParser._extract_tool_calls, every choice but "none" parsed as auto."""
        if self._tool is None or self._choice == "none":
            return [], content
        info = self._tool.extract(content if content is not None else "")
        if info.tools_called:
            content = info.content
            return info.tool_calls, None if content is not None and not content.strip() else content
        if self._choice in ("required", "function") and (content is None or not content.strip()):
            return [], None
        return [], content

    def _parse_delta(self, delta_text: str, delta_ids: list[int], *, finished: bool) -> Delta | None:
        st = self._stream
        current_text = delta_text if self._engine_based else st.previous_text + delta_text
        current_ids = delta_ids if self._engine_based else st.previous_ids + delta_ids
        delta: Delta | None = None
        transitioned = False
        if self._reasoning is not None and not st.reasoning_ended:
            delta = self._reasoning.stream(st.previous_ids, delta_text, delta_ids)
            if self._reasoning.ended(delta_ids):
                st.reasoning_ended = transitioned = True
                current_ids = self._reasoning.content_ids(delta_ids)
                flushed = self._reasoning.flush()
                current_text = ((delta or {}).get("content") or "") + ((flushed or {}).get("content") or "")
                if not self._engine_based:
                    delta_text = current_text
                elif current_text:
                    delta = delta if delta is not None else {}
                    delta["content"] = current_text
        if self._tool is not None and st.reasoning_ended:
            if not st.tool_text_started:
                st.tool_text_started = True
                st.previous_text, st.previous_ids = "", []
                delta_text, delta_ids = current_text, current_ids
            batch_reasoning = delta.get("reasoning") if delta else None
            if self._choice == "none":
                delta = {"content": delta_text} if delta_text else None
            else:
                delta = self._tool.stream(current_text, delta_text)
            if batch_reasoning:
                if delta is None:
                    delta = {"reasoning": batch_reasoning}
                elif not delta.get("reasoning"):
                    delta["reasoning"] = batch_reasoning
        if delta is None and not transitioned and st.reasoning_ended and self._tool is None:
            delta = {"content": delta_text}
        st.previous_text, st.previous_ids = ("", []) if self._engine_based else (current_text, current_ids)
        if finished:
            delta = self._finish(delta)
        if delta is not None and not self._include_reasoning:
            delta["reasoning"] = None
            if not delta.get("content") and not delta.get("tool_calls"):
                delta = None
        return delta

    def _finish(self, delta: Delta | None) -> Delta | None:
        """vLLM's finalize_generation and _flush_engine_parsers, and the content a tool parser
        still holds back (deviation: vLLM drops it)."""
        st = self._stream
        tool_phase = self._tool is not None and st.tool_text_started and self._choice != "none"
        if tool_phase and self._tool is not None and (held := self._tool.unsent_content(st.previous_text)):
            delta = delta if delta is not None else {}
            delta["content"] = (delta.get("content") or "") + held
        if self._tool is not None and delta and delta.get("tool_calls"):
            last = delta["tool_calls"][-1]
            if "function" in last:
                function = last["function"]
                function["arguments"] = (function.get("arguments") or "") + self._tool.remaining_arguments()
        if self._reasoning is not None and not self._stream.reasoning_ended:
            flushed = self._reasoning.flush()
            if flushed:
                if delta is None:
                    return flushed
                for key in ("content", "reasoning"):
                    if flushed.get(key):
                        delta[key] = (delta.get(key) or "") + flushed[key]
        return delta
