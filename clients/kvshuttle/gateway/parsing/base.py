"""What a tool parser and a reasoning parser are, and the registries that name them.

A parser is one small module that registers its class under vLLM's name for it
(`--tool-call-parser NAME`, `--reasoning-parser NAME`); `kvshuttle.gateway.parsing` imports
the modules so that they register. Deltas are plain dicts shaped like vLLM's serialized
`DeltaMessage` (`model_dump(exclude_unset=True)`): a key is present when vLLM sets it, even to
None, so the streamed JSON matches vLLM's.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

__all__ = [
    "REASONING_REGISTRY",
    "TOOL_REGISTRY",
    "Delta",
    "Extracted",
    "ReasoningParser",
    "ToolCall",
    "ToolParser",
    "Vocab",
    "make_tool_call_id",
    "partial_tag_overlap",
    "register_reasoning_parser",
    "register_tool_parser",
]

Delta = dict[str, Any]
Vocab = Callable[[str], "int | None"]


def partial_tag_overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that ends `text` (text a streaming parser
    holds back: it may be the start of a marker). Shared by tool and reasoning parsers."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def make_tool_call_id() -> str:
    """vLLM's `make_tool_call_id()`: "chatcmpl-tool-" and 16 random hex digits."""
    return f"chatcmpl-tool-{secrets.token_hex(8)}"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True, slots=True)
class Extracted:
    """A tool parser's reading of a whole output (vLLM's ExtractedToolCallInformation)."""

    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None


class ToolParser(Protocol):
    """One request's tool-call parser (vLLM's ToolParser, the methods the serving layer uses)."""

    # The structural tag (xgrammar) vLLM builds for required/named/strict tool choices.
    structural_tag_model: ClassVar[str]
    # Whether vLLM's adjust_request turns skip_special_tokens off for tool requests.
    keeps_special_tokens: ClassVar[bool]
    # Tokens that must be in the vocabulary (vLLM refuses the parser at start-up otherwise).
    required_tokens: ClassVar[tuple[str, ...]]

    def extract(self, output: str) -> Extracted: ...

    def stream(self, current_text: str, delta_text: str) -> Delta | None: ...

    def unsent_content(self, current_text: str) -> str:
        """Content still held back when decode finishes."""
        ...

    def remaining_arguments(self) -> str:
        """Arguments parsed but not streamed yet, added to the last delta (vLLM's
        get_remaining_unstreamed_args)."""
        ...


class ReasoningParser(Protocol):
    """One request's reasoning parser (vLLM's ReasoningParser as the Parser drives it)."""

    keeps_special_tokens: ClassVar[bool]

    def extract(self, output: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output."""
        ...

    def stream(self, previous_ids: Sequence[int], delta_text: str, delta_ids: Sequence[int]) -> Delta | None:
        """The delta for one chunk while reasoning has not ended."""
        ...

    def ended(self, delta_ids: Sequence[int]) -> bool:
        """Whether reasoning ended in the chunk just streamed."""
        ...

    def content_ids(self, delta_ids: Sequence[int]) -> list[int]: ...

    def flush(self) -> Delta | None:
        """Text held back (a possible marker prefix), at the transition or the end."""
        ...


TOOL_REGISTRY: dict[str, type[Any]] = {}
REASONING_REGISTRY: dict[str, type[Any]] = {}


def register_tool_parser(name: str) -> Callable[[type[Any]], type[Any]]:
    def register(cls: type[Any]) -> type[Any]:
        TOOL_REGISTRY[name] = cls
        return cls

    return register


def register_reasoning_parser(name: str) -> Callable[[type[Any]], type[Any]]:
    def register(cls: type[Any]) -> type[Any]:
        REASONING_REGISTRY[name] = cls
        return cls

    return register
