"""`--reasoning-parser deepseek_r1`: reasoning up to `</think>`, with or without a leading `<think>`.

Follows vLLM 0.32's `vllm/reasoning/deepseek_r1_reasoning_parser.py` and its base
`BaseThinkingReasoningParser` (`vllm/reasoning/basic_parsers.py`), Apache-2.0. Streaming is
token-id based: the markers are recognised by their ids, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvshuttle.gateway.parsing.base import Delta, Vocab, register_reasoning_parser

__all__ = ["DeepSeekR1ReasoningParser"]

START = "<think>"
END = "</think>"


@register_reasoning_parser("deepseek_r1")
class DeepSeekR1ReasoningParser:
    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self, vocab: Vocab) -> None:
        start, end = vocab(START), vocab(END)
        if start is None or end is None:
            raise ValueError(
                "DeepSeekR1ReasoningParser reasoning parser could not locate think start/end tokens "
                "in the tokenizer!"
            )
        self._start, self._end = start, end

    def extract(self, output: str) -> tuple[str | None, str | None]:
        before, marker, after = output.partition(START)
        output = after if marker else before
        if END not in output:
            return output, None
        reasoning, _, content = output.partition(END)
        return reasoning, content or None

    def stream(self, previous_ids: Sequence[int], delta_text: str, delta_ids: Sequence[int]) -> Delta | None:
        delta = self._base_stream(previous_ids, delta_text, delta_ids)
        if delta is None or self._start in previous_ids or self._start in delta_ids:
            return delta
        # No <think> seen (the template may have opened it): reasoning until </think>.
        return self._inside(previous_ids, delta_text, delta_ids)

    def _inside(self, previous_ids: Sequence[int], delta_text: str, delta_ids: Sequence[int]) -> Delta:
        """A delta of a reasoning already open: reasoning until </think>, content after it."""
        if self._end in delta_ids:
            end = delta_text.find(END)
            return {"reasoning": delta_text[:end], "content": delta_text[end + len(END) :] or None}
        if self._end in previous_ids:
            return {"content": delta_text}
        return {"reasoning": delta_text}

    def _base_stream(
        self, previous_ids: Sequence[int], delta_text: str, delta_ids: Sequence[int]
    ) -> Delta | None:
        if len(delta_ids) == 1 and delta_ids[0] in (self._start, self._end):
            return None
        if self._start in previous_ids:
            return self._inside(previous_ids, delta_text, delta_ids)
        if self._start in delta_ids:
            if self._end in delta_ids:
                start, end = delta_text.find(START), delta_text.find(END)
                return {
                    "reasoning": delta_text[start + len(START) : end],
                    "content": delta_text[end + len(END) :] or None,
                }
            return {"reasoning": delta_text}
        return {"content": delta_text}

    def ended(self, delta_ids: Sequence[int]) -> bool:
        return self._end in delta_ids

    def content_ids(self, delta_ids: Sequence[int]) -> list[int]:
        ids = list(delta_ids)
        if self._end not in ids[:-1]:
            return []
        return ids[ids.index(self._end) + 1 :]

    def flush(self) -> Delta | None:
        return None
