"""Exact-token transcripts: each retained turn's token ids as its engines saw them (prompt and
answer), kept with its retention in the registry, so that the next turn's prompt carries the ids
decode generated instead of a re-tokenization of their text, whichever gateway replica (or
endpoint picker) serves it, with or without a conversation id.

A chat client sends the whole conversation every turn, the previous answer as text. Tokenized
again, that text rarely gives back the ids decode generated (a model's output is not in its
tokenizer's canonical form), so the new prompt differs from the KV decode retained from the
answer's first token on, and that KV cannot be reused. A finished turn's transcript is found by
its lookup key: a digest of the turn's rendered prompt text (under the cache salt and model). The
next request's previous prompt is its messages up to its last assistant message (the previous
answer), rendered with a generation prompt: its digest finds the transcript, and when the new
rendered chat starts with exactly that text followed by exactly the answer (its digest and length
in characters), the prompt is the transcript's ids and the tokenization of the rest. Otherwise
nothing is spliced and the chat is tokenized as usual: a byte of difference (an edited, trimmed or
re-parsed answer, a template that renders earlier turns differently) is never spliced.

No I/O, no transport: kvshuttle.gateway.openai.prompt finds and commits transcripts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Splice", "answer_ids", "answer_sha256", "lookup_key", "previous_turn_end", "splice"]

# Domain separation: a transcript key is never another digest's value.
_KEY_DOMAIN = b"kvshuttle.transcript.v1\x00"


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def lookup_key(cache_salt: str, model: str, text: str) -> bytes:
    """The key a turn's transcript is found by: SHA-256 of its rendered prompt `text`, under the
    turn's cache salt and model (32 bytes; the salt itself is never sent anywhere)."""
    h = hashlib.sha256(_KEY_DOMAIN)
    for part in (cache_salt, model):
        encoded = _utf8(part)
        h.update(len(encoded).to_bytes(8, "little"))
        h.update(encoded)
    h.update(_utf8(text))
    return h.digest()


def answer_sha256(text: str) -> bytes:
    return hashlib.sha256(_utf8(text)).digest()


def previous_turn_end(messages: Sequence[Mapping[str, Any]]) -> int:
    """How many leading messages were the previous turn's prompt: those before the last assistant
    message (its answer); 0 when there is none after a first message."""
    for i in range(len(messages) - 1, 0, -1):
        if messages[i].get("role") == "assistant":
            return i
    return 0


@dataclass(frozen=True, slots=True)
class Splice:
    """A chat that extends a transcript exactly: its prompt is `ids` and then the tokenization
    of `rest`, the text after the previous answer."""

    ids: Sequence[int]
    rest: str


def splice(
    text: str, previous: str, token_ids: Sequence[int], answer_digest: bytes, answer_chars: int
) -> Splice | None:
    """The splice of `text` (a rendered chat) onto the transcript of the turn whose rendered
    prompt was `previous`, or None unless `text` is `previous`, then the answer, then more."""
    n = len(previous)
    end = n + answer_chars
    if len(text) < end or not text.startswith(previous) or answer_sha256(text[n:end]) != answer_digest:
        return None
    return Splice(token_ids, text[end:])


def answer_ids(
    output_ids: Sequence[int], output_text: str, decode: Callable[[Sequence[int]], str]
) -> list[int] | None:
    """The answer's ids that make its transcript: decode's complete output ids when they decode
    to exactly its text (`decode`: special tokens kept), after dropping a last id the text does
    not contain (a stop token: EOS, a stop_token_id); None when they do not (then no transcript
    is kept and the next turn is tokenized as usual)."""
    ids = list(output_ids)
    if decode(ids) == output_text:
        return ids
    if ids and decode(ids[:-1]) == output_text:
        return ids[:-1]
    return None
