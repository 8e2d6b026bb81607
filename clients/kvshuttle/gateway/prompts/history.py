"""Exact-token history: each conversation's last turn as token ids, so that the next turn's
prompt carries the ids decode generated instead of a re-tokenization of their text.

A chat client sends the whole conversation every turn, the previous answer as text. Tokenized
again, that text rarely gives back the ids decode generated (a model's output is not in its
tokenizer's canonical form), so the new prompt differs from the KV decode retained from the
answer's first token on, and that KV cannot be reused. This history remembers, per
conversation, the last turn's prompt ids, a digest and the length of its rendered chat text,
and decode's output ids with their text. When the next rendered chat starts with exactly the
previous rendered text followed by exactly that answer (the digest of the prefix, then the
answer compared character for character), the prompt is the previous prompt's ids, the answer's
ids, and the tokenization of the rest; otherwise nothing is spliced and the chat is tokenized
as usual. A byte of difference (an edited, trimmed or re-parsed answer) is never spliced.

Keyed by the tenant-scoped conversation name (`tenants/{t}/conversations/{id}`): nothing is
shared across tenants or conversations. Bounded by bytes, least recently used conversation out.
No I/O, no transport: kvshuttle.gateway.openai.prompt uses it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["ExactHistory", "Splice"]

# A remembered turn's fields, its digest and its table slot, beyond ids and text.
_ENTRY_BYTES = 400


@dataclass(frozen=True, slots=True)
class Splice:
    """A chat that extends the remembered turn exactly: its prompt is `ids` and then the
    tokenization of `rest`, the text after the previous answer."""

    ids: array[int]
    rest: str


@dataclass(frozen=True, slots=True)
class _Turn:
    prompt_ids: array[int]
    text_sha256: bytes
    # Characters of the turn's rendered chat text.
    text_len: int
    output_ids: array[int]
    output_text: str
    nbytes: int


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


class ExactHistory:
    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        self._turns: OrderedDict[str, _Turn] = OrderedDict()

    def splice(self, conversation: str, text: str) -> Splice | None:
        """The splice of `text` (a rendered chat) onto the conversation's last turn, or None
        when it does not start with that turn's rendered text and answer, exactly."""
        turn = self._turns.get(conversation)
        if turn is None:
            return None
        n, answer = turn.text_len, turn.output_text
        end = n + len(answer)
        if len(text) < end or text[n:end] != answer or _digest(text[:n]) != turn.text_sha256:
            return None
        self._turns.move_to_end(conversation)
        return Splice(turn.prompt_ids + turn.output_ids, text[end:])

    def remember(
        self,
        conversation: str,
        *,
        prompt_ids: Sequence[int],
        text: str,
        output_ids: Sequence[int],
        output_text: str,
        decode: Callable[[Sequence[int]], str],
    ) -> bool:
        """Remember a finished turn (its prompt ids and rendered text, decode's complete output
        ids and text), replacing the conversation's previous one. Remembered only when the ids
        decode to exactly the text (`decode`: special tokens kept), after dropping a last id the
        text does not contain (a stop token: EOS, a stop_token_id); otherwise the conversation
        is forgotten, and its next turn tokenized as usual. True when remembered."""
        self.forget(conversation)
        ids = list(output_ids)
        if decode(ids) != output_text:
            if not ids or decode(ids[:-1]) != output_text:
                return False
            ids.pop()
        turn = _Turn(
            prompt_ids=array("I", prompt_ids),
            text_sha256=_digest(text),
            text_len=len(text),
            output_ids=array("I", ids),
            output_text=output_text,
            nbytes=4 * (len(prompt_ids) + len(ids)) + 4 * len(output_text) + _ENTRY_BYTES,
        )
        if turn.nbytes > self._max_bytes:
            return False
        self._turns[conversation] = turn
        self._bytes += turn.nbytes
        while self._bytes > self._max_bytes:
            _, evicted = self._turns.popitem(last=False)
            self._bytes -= evicted.nbytes
        return True

    def forget(self, conversation: str) -> None:
        turn = self._turns.pop(conversation, None)
        if turn is not None:
            self._bytes -= turn.nbytes

    def __len__(self) -> int:
        return len(self._turns)

    @property
    def nbytes(self) -> int:
        return self._bytes
