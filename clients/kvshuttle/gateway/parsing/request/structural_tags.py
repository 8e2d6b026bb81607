"""The xgrammar structural tag vLLM 0.32 puts on a tool request.

With `VLLM_ENFORCE_STRICT_TOOL_CALLING` on (its default), hermes and llama3_json constrain
tool calls with a structural tag in their own call format, not with the JSON-array schema of
`get_json_schema_from_tools` (vLLM's `Parser._apply_structural_tag`,
`tool_parsers/structural_tag_registry.py` and xgrammar's builtin "llama" template). The tag
applies for `required` and named choices, for `auto` when a tool is `strict` or
`parallel_tool_calls` is false; a non-strict tool's arguments stay free (`true` schema).
The dicts here are `StructuralTag.model_dump()` as vLLM serializes it, key order included.
"""

from __future__ import annotations

from typing import Any

__all__ = ["structural_tag"]


def _content(schema: Any) -> dict[str, Any]:
    return {
        "type": "json_schema",
        "json_schema": schema,
        "style": "json",
        "any_order": False,
        "max_whitespace_cnt": None,
        "excludes": [],
    }


def _schema(function: dict[str, Any]) -> Any:
    if function.get("strict") is not True:
        return True
    params = function.get("parameters")
    return params if params is not None else True


def structural_tag(
    model: str, functions: list[dict[str, Any]], choice: str, function_name: str | None, single_call: bool
) -> dict[str, Any] | None:
    """The tag for `choice` ("auto" / "required" / "function"), or None when vLLM sets none."""
    if choice == "auto" and not single_call and not any(f.get("strict") is True for f in functions):
        return None
    if choice == "function":
        functions = [f for f in functions if f["name"] == function_name]
    if model == "hermes":
        return {"type": "structural_tag", "format": _hermes(functions, choice, single_call)}
    return {"type": "structural_tag", "format": _llama(functions, choice, single_call)}


def _hermes(functions: list[dict[str, Any]], choice: str, single_call: bool) -> dict[str, Any]:
    tags = [
        {
            "type": "tag",
            "begin": begin + f["name"] + '", "arguments": ',
            "content": _content(_schema(f)),
            "end": end,
        }
        for f in functions
        for begin, end in (
            ('<tool_call>\n{"name": "', "}\n</tool_call>"),
            ('<tool_call>{"name": "', "}</tool_call>"),
        )
    ]
    if choice == "auto":
        return {
            "type": "triggered_tags",
            "triggers": ["<tool_call>"],
            "tags": tags,
            "at_least_one": False,
            "stop_after_first": single_call,
            "excludes": [],
        }
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "",
        "at_least_one": True,
        "stop_after_first": choice == "function" or single_call,
    }


def _llama(functions: list[dict[str, Any]], choice: str, single_call: bool) -> dict[str, Any]:
    tags = [
        {
            "type": "tag",
            "begin": '{"name": "' + f["name"] + '", "parameters": ',
            "content": _content(_schema(f)),
            "end": "}",
        }
        for f in functions
    ]
    if choice == "function":
        return tags[0]
    return {
        "type": "triggered_tags",
        "triggers": ['{"name": '],
        "tags": tags,
        "at_least_one": choice == "required",
        "stop_after_first": single_call,
        "excludes": ["<think>", "</think>"],
    }
