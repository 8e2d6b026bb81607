"""`--tool-call-parser llama3_json`: bare JSON objects `{"name": ..., "arguments"|"parameters": ...}`,
optionally after `<|python_tag|>`, several separated by "; ".

Follows vLLM 0.32's `vllm/tool_parsers/llama_tool_parser.py` (Apache-2.0) line by line.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from kvshuttle.gateway.parsing.base import Delta, Extracted, ToolCall, make_tool_call_id, register_tool_parser
from kvshuttle.gateway.parsing.tools.json_util import (
    Allow,
    MalformedJSON,
    find_common_prefix,
    is_complete_json,
    partial_json_loads,
)

__all__ = ["Llama3JsonToolParser"]

BOT = "<|python_tag|>"


@register_tool_parser("llama3_json")
class Llama3JsonToolParser:
    structural_tag_model: ClassVar[str] = "llama"
    keeps_special_tokens: ClassVar[bool] = False
    required_tokens: ClassVar[tuple[str, ...]] = (BOT,)

    def __init__(self) -> None:
        self._calls: list[dict[str, Any]] = []  # vLLM's prev_tool_call_arr
        self._current = -1
        self._name_sent = False
        self._streamed: list[str] = []

    def extract(self, output: str) -> Extracted:
        if BOT not in output and "{" not in output:
            return Extracted(False, [], output)
        decoder = json.JSONDecoder()
        end = -1
        calls: list[ToolCall] = []
        for start, ch in enumerate(output):
            if ch != "{" or start <= end:  # braces inside an object already read
                continue
            try:
                obj, length = decoder.raw_decode(output[start:])
                end = start + length
                args = obj["arguments"] if "arguments" in obj else obj["parameters"]
                calls.append(ToolCall(obj["name"], json.dumps(args, ensure_ascii=False)))
            except (ValueError, KeyError, TypeError):
                return Extracted(False, [], output)
        if calls:
            return Extracted(True, calls, None)
        return Extracted(False, [], output)

    def stream(self, current_text: str, delta_text: str) -> Delta | None:
        if not (current_text.startswith(BOT) or current_text.startswith("{")):
            return {"content": delta_text}
        # The name goes out whole: no partial strings until it has been sent.
        flags = Allow.ALL if self._name_sent else Allow.ALL & ~Allow.STR
        try:
            calls: list[dict[str, Any]] = []
            complete: list[bool] = []
            start = len(BOT) if current_text.startswith(BOT) else 0
            try:
                while start < len(current_text):
                    obj, length = partial_json_loads(current_text[start:], flags)
                    complete.append(is_complete_json(current_text[start : start + length]))
                    start += length + len("; ")
                    if "parameters" in obj:
                        if "arguments" in obj:
                            return None  # vLLM asserts, logs and skips the chunk
                        obj["arguments"] = obj["parameters"]
                    calls.append(obj)
            except MalformedJSON:
                return None
            return self._step(calls, complete)
        except Exception:  # vLLM logs any error and skips the chunk
            return None

    def _step(self, calls: list[dict[str, Any]], complete: list[bool]) -> Delta | None:
        if not calls:
            return None
        current = calls[self._current]
        delta: Delta | None = None
        if len(calls) > self._current + 1:
            # A new call starts: first flush what the JSON completion added to the previous one.
            if self._current >= 0 and (args := current.get("arguments")):
                rest = json.dumps(args, ensure_ascii=False)[len(self._streamed[self._current]) :]
                delta = {"tool_calls": [{"index": self._current, "function": {"arguments": rest}}]}
                self._streamed[self._current] += rest
            self._current = len(calls) - 1
            self._name_sent = False
            self._streamed.append("")
            return delta
        if not self._name_sent:
            if name := current.get("name"):
                delta = {
                    "tool_calls": [
                        {
                            "id": make_tool_call_id(),
                            "type": "function",
                            "index": self._current,
                            "function": {"name": name},
                        }
                    ]
                }
                self._name_sent = True
        elif args := current.get("arguments"):
            sent = len(self._streamed[self._current])
            args_json = json.dumps(args, ensure_ascii=False)
            prev_args = self._calls[self._current].get("arguments")
            diff: str | None = None
            if complete[self._current]:
                diff = args_json[sent:]
            elif prev_args:
                prev_json = json.dumps(prev_args, ensure_ascii=False)
                if args_json != prev_json:
                    diff = find_common_prefix(prev_json, args_json)[sent:]
            if diff is not None:
                delta = {"tool_calls": [{"index": self._current, "function": {"arguments": diff}}]}
                self._streamed[self._current] += diff
        self._calls = calls
        return delta

    def unsent_content(self, current_text: str) -> str:
        return ""  # content goes out as it comes

    def remaining_arguments(self) -> str:
        if not self._calls:
            return ""
        index = len(self._calls) - 1
        args = self._calls[index].get("arguments", {})
        expected = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        actual = self._streamed[index] if index < len(self._streamed) else ""
        return expected[len(actual) :] if expected.startswith(actual) else ""
