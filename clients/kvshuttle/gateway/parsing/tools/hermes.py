"""`--tool-call-parser hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Follows vLLM 0.32's `vllm/tool_parsers/hermes_tool_parser.py` (Apache-2.0) line by line.
"""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

from kvshuttle.gateway.parsing.base import (
    Delta,
    Extracted,
    ToolCall,
    make_tool_call_id,
    partial_tag_overlap,
    register_tool_parser,
)
from kvshuttle.gateway.parsing.tools.json_util import is_complete_json

__all__ = ["HermesToolParser"]

START = "<tool_call>"
END = "</tool_call>"
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


@register_tool_parser("hermes")
class HermesToolParser:
    structural_tag_model: ClassVar[str] = "hermes"
    keeps_special_tokens: ClassVar[bool] = True
    required_tokens: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._sent_content = 0
        self._calls: list[dict[str, Any]] = []  # vLLM's prev_tool_call_arr
        self._streamed: list[str] = []  # vLLM's streamed_args_for_tool

    def extract(self, output: str) -> Extracted:
        if START not in output:
            return Extracted(False, [], output)
        try:
            raw = [json.loads(a if a else b) for a, b in _CALL.findall(output)]
            calls = [ToolCall(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in raw]
        except (ValueError, KeyError, TypeError):
            return Extracted(False, [], output)
        content = output[: output.find(START)]
        return Extracted(True, calls, content or None)

    def stream(self, current_text: str, delta_text: str) -> Delta | None:
        content = self._content(current_text)
        deltas: list[dict[str, Any]] = []
        for i, (body, complete) in enumerate(self._bodies(current_text)):
            if i >= len(self._calls):
                self._calls.append({})
                self._streamed.append("")
            if "name" not in self._calls[i]:
                match = _NAME.search(body)
                if not match:
                    break  # call i+1 waits until call i has its name
                self._calls[i]["name"] = match.group(1)
                deltas.append(
                    {
                        "id": make_tool_call_id(),
                        "type": "function",
                        "index": i,
                        "function": {"name": match.group(1)},
                    }
                )
            diff = self._arguments_diff(i, body, complete)
            if diff:
                deltas.append({"index": i, "function": {"arguments": diff}})
        if content or deltas:
            return {"content": content, "tool_calls": deltas}
        return None

    def unsent_content(self, current_text: str) -> str:
        """At the end, the held-back text that turned out not to be a tag (vLLM loses it)."""
        if START in current_text:
            return ""
        content, self._sent_content = current_text[self._sent_content :], len(current_text)
        return content

    def remaining_arguments(self) -> str:
        if not self._calls:
            return ""
        expected = self._calls[-1].get("arguments", "{}")
        actual = self._streamed[-1]
        return expected[len(actual) :] if expected.startswith(actual) else ""

    def _content(self, text: str) -> str | None:
        """Unsent text before the first <tool_call>, holding back a possible partial tag."""
        end = text.index(START) if START in text else len(text) - partial_tag_overlap(text, START)
        if end > self._sent_content:
            content = text[self._sent_content : end]
            self._sent_content = end
            return content
        return None

    @staticmethod
    def _bodies(text: str) -> list[tuple[str, bool]]:
        """(json text, complete) of each <tool_call> region."""
        out: list[tuple[str, bool]] = []
        pos = 0
        while (start := text.find(START, pos)) != -1:
            body_start = start + len(START)
            end = text.find(END, body_start)
            if end != -1:
                out.append((text[body_start:end].strip(), True))
                pos = end + len(END)
                continue
            raw = text[body_start:]
            overlap = partial_tag_overlap(raw, END)
            body = (raw[:-overlap] if overlap else raw).strip()
            # Valid JSON without the closing tag: the body is done, the tag not yet here.
            out.append((body, is_complete_json(body) if body else False))
            break
        return out

    def _arguments_diff(self, i: int, body: str, complete: bool) -> str | None:
        match = _ARGUMENTS.search(body)
        if not match:
            return None
        args = body[match.end() :]
        if complete:
            args = args.rstrip()
            if args.endswith("}"):
                args = args[:-1].rstrip()
        if len(args) <= len(self._streamed[i]):
            return None
        diff = args[len(self._streamed[i]) :]
        self._streamed[i] = args
        self._calls[i]["arguments"] = args
        return diff
