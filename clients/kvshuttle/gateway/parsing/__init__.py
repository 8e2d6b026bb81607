"""Tool calls and reasoning out of decode's text, as `vllm serve --enable-auto-tool-choice
--tool-call-parser {hermes|llama3_json} --reasoning-parser {deepseek_r1|qwen3}` makes them.

A port of vLLM 0.32 (Apache-2.0): `vllm/tool_parsers/hermes_tool_parser.py`,
`vllm/tool_parsers/llama_tool_parser.py`, `vllm/reasoning/deepseek_r1_reasoning_parser.py`,
`vllm/parser/qwen3.py`, `vllm/parser/abstract_parser.py` and the chat serving layer, without
importing vLLM (torch). A parser is one module registered by its vLLM name (`base.py`).

Reasoning is reported twice, under vLLM's name `reasoning` and DeepSeek's `reasoning_content`
(which agent SDKs read), with the same value, in messages and in deltas.

Where this differs from vLLM 0.32 (each found by tests/gateway/parsing against vLLM itself):
- hermes, streamed: text at the very end that could have begun `<tool_call>` ("… <tool") is
  held back and, in vLLM, never sent; here it goes out with the last delta, so the streamed
  content equals the non-streamed content.
- tool_choice null with tools is treated as "none" (vLLM shows the tools, streams tool calls
  but never parses them non-streamed).
- The prompt is not consulted: vLLM starts a stream with reasoning already ended when the
  prompt's last think marker is `</think>`; our chat template never renders reasoning.
- qwen3 recognises its markers by text, vLLM by token id where the marker is one token (the
  same for the test models, whose markers are single added tokens).
- Request validation: where pydantic would refuse a tool, the message is ours (it names the
  field, e.g. `tools[2].function.name`); `tools` is bounded (128 tools, 1 MiB of JSON).
"""

from kvshuttle.gateway.parsing.base import REASONING_REGISTRY, TOOL_REGISTRY
from kvshuttle.gateway.parsing.output import OutputParser, check_parsers, reasoning_decode_params
from kvshuttle.gateway.parsing.reasoning import deepseek_r1, qwen3
from kvshuttle.gateway.parsing.request.validate import ToolRequest, parse_tool_request
from kvshuttle.gateway.parsing.tools import hermes, llama3_json

__all__ = [
    "REASONING_PARSERS",
    "TOOL_PARSERS",
    "OutputParser",
    "ToolRequest",
    "check_parsers",
    "parse_tool_request",
    "reasoning_decode_params",
]

del deepseek_r1, hermes, llama3_json, qwen3  # imported to register

TOOL_PARSERS: frozenset[str] = frozenset(TOOL_REGISTRY)
REASONING_PARSERS: frozenset[str] = frozenset(REASONING_REGISTRY)
