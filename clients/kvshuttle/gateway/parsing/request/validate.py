"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, validated as vLLM 0.32 does.

Follows `ChatCompletionRequest.check_tool_usage` and the tool models of
`vllm/entrypoints/openai/chat_completion/protocol.py`, the tool-parser checks of
`vllm/renderers/online_renderer.py` and `adjust_request` (Apache-2.0). vLLM's own messages are
kept where it has them; where pydantic would refuse a field, the message names the field.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvshuttle.gateway.errors import GatewayError
from kvshuttle.gateway.parsing.base import TOOL_REGISTRY
from kvshuttle.gateway.parsing.request.structural_tags import structural_tag

__all__ = ["MAX_TOOLS", "MAX_TOOLS_JSON", "ToolRequest", "parse_tool_request"]

MAX_TOOLS = 128
MAX_TOOLS_JSON = 1 << 20
_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]  # as vLLM dumps them for the chat template
    choice: str  # "none" | "auto" | "required" | "function"
    function_name: str | None
    parallel_tool_calls: bool
    tool_parser: str | None = None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The template's `tools`: shown even for tool_choice "none", as vLLM does by default
        (`--exclude-tools-when-tool-choice-none` off)."""
        return self.tools

    def decode_params(self) -> dict[str, Any]:
        """What vLLM's adjust_request changes in the sampling parameters, as decode's
        /v1/completions fields."""
        if self.tool_parser is None or self.choice == "none":
            return {}
        parser = TOOL_REGISTRY[self.tool_parser]
        params: dict[str, Any] = {}
        tag = structural_tag(
            parser.structural_tag_model,
            [t["function"] for t in self.tools],
            self.choice,
            self.function_name,
            single_call=not self.parallel_tool_calls,
        )
        if tag is not None:
            params["structured_outputs"] = {"structural_tag": json.dumps(tag)}
        if parser.keeps_special_tokens:
            params["skip_special_tokens"] = False
        return params


def parse_tool_request(body: Mapping[str, Any], *, tool_parser: str | None) -> ToolRequest | None:
    """The request's tool use, or None without tools (and no tool_choice but "none")."""
    tools = body.get("tools")
    if tools == []:
        raise GatewayError.invalid(
            "`tools` must not be an empty array. "
            "Either provide at least one tool or omit the field entirely.",
            "tools",
        )
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice is not None and choice != "none":
        if tools is None:
            raise GatewayError.invalid("When using `tool_choice`, `tools` must be set.", "tool_choice")
        if choice not in ("auto", "required") and not isinstance(choice, dict):
            raise GatewayError.invalid(
                f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
                '"required" are supported.',
                "tool_choice",
            )
    validated = _validate_tools(tools) if tools is not None else None
    name = _named_function(choice, validated or []) if isinstance(choice, dict) else None
    parallel = body.get("parallel_tool_calls", True)
    if parallel is not None and not isinstance(parallel, bool):
        raise GatewayError.invalid("`parallel_tool_calls` must be a boolean", "parallel_tool_calls")
    if validated is None:
        return None
    kind = "function" if name is not None else ("none" if choice is None else str(choice))
    _check_parser(kind, name, tool_parser)
    return ToolRequest(validated, kind, name, parallel is not False, tool_parser)


def _check_parser(kind: str, name: str | None, tool_parser: str | None) -> None:
    if tool_parser is not None or kind == "none":
        return
    if kind == "auto":
        raise GatewayError.invalid(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            "tool_choice",
        )
    desc = f'function "{name}"' if kind == "function" else f'"{kind}"'
    raise GatewayError.invalid(f"tool_choice={desc} requires --tool-call-parser to be set", "tool_choice")


def _named_function(choice: dict[str, Any], tools: list[dict[str, Any]]) -> str:
    function = choice.get("function")
    if not isinstance(function, dict):
        raise GatewayError.invalid(
            f"Invalid value for `function`: `{function}` in `tool_choice`! {_USAGE}", "tool_choice.function"
        )
    if "name" not in function:
        raise GatewayError.invalid(
            f"Expected field `name` in `function` in `tool_choice`! {_USAGE}", "tool_choice.function.name"
        )
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise GatewayError.invalid(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_USAGE}", "tool_choice.function.name"
        )
    if not any(t["function"]["name"] == name for t in tools):
        raise GatewayError.invalid(
            "The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice"
        )
    if choice.get("type", "function") != "function":
        raise GatewayError.invalid('`tool_choice.type` must be "function"', "tool_choice.type")
    return name


def _validate_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise GatewayError.invalid("`tools` must be an array of tools", "tools")
    if len(tools) > MAX_TOOLS:
        raise GatewayError.invalid(
            f"`tools` has {len(tools)} tools; at most {MAX_TOOLS} are allowed", "tools"
        )
    size = len(json.dumps(tools, ensure_ascii=False).encode())
    if size > MAX_TOOLS_JSON:
        raise GatewayError.invalid(
            f"`tools` is {size} bytes of JSON; at most {MAX_TOOLS_JSON} are allowed", "tools"
        )
    return [_validate_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]


def _validate_tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict):
        raise GatewayError.invalid(f"`{where}` must be an object", where)
    if tool.get("type", "function") != "function":
        raise GatewayError.invalid(f'`{where}.type` must be "function"', f"{where}.type")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise GatewayError.invalid(f"`{where}.function` must be an object", f"{where}.function")
    fields: dict[str, tuple[type, ...]] = {
        "name": (str,),
        "description": (str, type(None)),
        "parameters": (dict, type(None)),
        "strict": (bool, type(None)),
        "defer_loading": (bool, type(None)),
    }
    for key, types in fields.items():
        if key == "name" and key not in function:
            raise GatewayError.invalid(f"`{where}.function.name` is required", f"{where}.function.name")
        if not isinstance(function.get(key), types):
            raise GatewayError.invalid(
                f"`{where}.function.{key}` has the wrong type", f"{where}.function.{key}"
            )
    top_defer = tool.get("defer_loading")
    if not isinstance(top_defer, (bool, type(None))):
        raise GatewayError.invalid(f"`{where}.defer_loading` has the wrong type", f"{where}.defer_loading")
    # vLLM's model_dump: unknown keys dropped, strict / defer_loading only when set.
    dumped = {
        "name": function["name"],
        "description": function.get("description"),
        "parameters": function.get("parameters"),
    }
    defer = function.get("defer_loading", top_defer)
    for key, value in (("strict", function.get("strict")), ("defer_loading", defer)):
        if value is not None:
            dumped[key] = value
    out: dict[str, Any] = {"type": "function", "function": dumped}
    if top_defer is not None:
        out["defer_loading"] = top_defer
    return out
