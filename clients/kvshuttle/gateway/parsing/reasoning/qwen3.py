"""`--reasoning-parser qwen3`: reasoning from the start (thinking on) up to `</think>`, or up to a
`<tool_call>`, which ends reasoning implicitly and stays in the content.

Follows vLLM 0.32's `vllm/parser/qwen3.py` grammar as its reasoning adapter
(`vllm/parser/engine/adapters.py`, tool parsing skipped) runs it, Apache-2.0: `<think>` inside
reasoning is dropped, `</think>` after reasoning is dropped where the engine still reads (the
whole output non-streamed, the rest of the chunk that ends reasoning streamed), and while streaming
a suffix that may begin a marker is held back until the next chunk or the end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvshuttle.gateway.parsing.base import Delta, Vocab, partial_tag_overlap, register_reasoning_parser

__all__ = ["Qwen3ReasoningParser"]

START = "<think>"
END = "</think>"
TOOL = "<tool_call>"
_MARKERS = (START, END, TOOL)


@register_reasoning_parser("qwen3")
class Qwen3ReasoningParser:
    # vLLM's parser engine sets skip_special_tokens=False on every request.
    keeps_special_tokens: ClassVar[bool] = True

    def __init__(self, vocab: Vocab) -> None:
        missing = [t for t in (START, END) if vocab(t) is None]
        if missing:
            raise ValueError(f"qwen3 reasoning parser could not locate {', '.join(missing)} in the tokenizer")
        self._held = ""
        self._ended = False

    def extract(self, output: str) -> tuple[str | None, str | None]:
        reasoning, content, ended = _scan(output)
        if ended:
            content = content.replace(END, "")
        return reasoning or None, content or None

    def stream(self, previous_ids: Sequence[int], delta_text: str, delta_ids: Sequence[int]) -> Delta | None:
        reasoning, content, ended = _scan(self._held + delta_text)
        self._held = ""
        if ended:
            content = content.replace(END, "")  # the engine read the chunk to its end
        else:
            self._held = _held_suffix(reasoning)
            reasoning = reasoning[: len(reasoning) - len(self._held)]
        self._ended = ended
        delta: Delta = {}
        if content:
            delta["content"] = content
        if reasoning:
            delta["reasoning"] = reasoning
        return delta or None

    def ended(self, delta_ids: Sequence[int]) -> bool:
        return self._ended

    def content_ids(self, delta_ids: Sequence[int]) -> list[int]:
        return []

    def flush(self) -> Delta | None:
        held, self._held = self._held, ""
        if not held or self._ended:
            return None
        return {"reasoning": held}


def _scan(text: str) -> tuple[str, str, bool]:
    """(reasoning, content, reasoning ended) of `text` read from the reasoning state."""
    reasoning: list[str] = []
    pos = 0
    while True:
        hits = [(i, m) for m in _MARKERS if (i := text.find(m, pos)) != -1]
        if not hits:
            reasoning.append(text[pos:])
            return "".join(reasoning), "", False
        i, marker = min(hits)
        reasoning.append(text[pos:i])
        if marker == START:
            pos = i + len(START)
            continue
        # </think> is consumed; <tool_call> ends reasoning and opens the content.
        rest = text[i + len(END) :] if marker == END else text[i:]
        return "".join(reasoning), rest, True


def _held_suffix(reasoning: str) -> str:
    n = max(partial_tag_overlap(reasoning, m) for m in _MARKERS)
    return reasoning[len(reasoning) - n :] if n else ""
