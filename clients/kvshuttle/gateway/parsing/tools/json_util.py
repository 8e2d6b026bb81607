"""JSON helpers of vLLM's `tool_parsers/utils.py` that the tool parsers share."""

from __future__ import annotations

import json
from typing import Any

import partial_json_parser  # type: ignore[import-untyped]
from partial_json_parser.core.options import Allow  # type: ignore[import-untyped]

__all__ = [
    "Allow",
    "MalformedJSON",
    "find_common_prefix",
    "is_complete_json",
    "partial_json_loads",
]

MalformedJSON = partial_json_parser.core.exceptions.MalformedJSON


def is_complete_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def find_common_prefix(a: str, b: str) -> str:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return a[:n]


def partial_json_loads(text: str, flags: Any) -> tuple[Any, int]:
    """partial_json_parser.loads, falling back to raw_decode on "Extra data" (several objects)."""
    try:
        return partial_json_parser.loads(text, flags), len(text)
    except json.JSONDecodeError as e:
        if "Extra data" in e.msg:
            return json.JSONDecoder().raw_decode(text)
        raise
