"""A request's prompt as the token ids the engines get and the router verifies, computed
exactly as the engine would (kvshuttle.gateway.prompts.tokenizer): a token-id prompt as it is, a text
prompt with the tokenizer's default special tokens, a chat through its template and the
segment cache. Tokenizing that would hold the event loop up runs in a thread.

With transcripts (kvshuttle.gateway.prompts.transcript, the model's `history: exact_tokens`), a chat
that extends a retained turn exactly gets that turn's prompt and answer ids, found through the
router by the digest of the previous prompt's rendered text, and only the rest of the text is
tokenized; each finished turn's transcript is committed with it (transcript_spec).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvshuttle.gateway.errors import GatewayError
from kvshuttle.gateway.openai.protocol import TurnRequest
from kvshuttle.gateway.prompts.chat_template import TemplateError
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.gateway.prompts.transcript import (
    Splice,
    answer_ids,
    answer_sha256,
    lookup_key,
    previous_turn_end,
    splice,
)
from kvshuttle.gateway.turns.background import BackgroundTasks
from kvshuttle.gateway.turns.ports import TranscriptPort
from kvshuttle.gateway.turns.record import DecodeOutput
from kvshuttle.router.v1 import router_service_pb2 as pb

__all__ = ["Prompt", "Transcripts", "prompt_ids", "transcript_spec"]


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]
    # The rendered chat (None for a completions prompt).
    text: str | None = None
    # Leading ids taken from a retained turn's transcript (0: none).
    history_tokens: int = 0
    # The key this turn's own transcript is committed under (b"": it keeps none).
    lookup_key: bytes = b""


@dataclass(frozen=True, slots=True)
class Transcripts:
    """Where a request's transcripts are found: the router (`port`), for `tenant`
    ("tenants/{t}"), keyed under the served `model` and the turn's `cache_salt`."""

    port: TranscriptPort
    tenant: str
    model: str
    cache_salt: str
    # The request's conversation ("" for none): which router replica is asked first.
    conversation: str = ""

    def key(self, text: str) -> bytes:
        return lookup_key(self.cache_salt, self.model, text)


async def prompt_ids(
    tok: ChatTokenizer,
    treq: TurnRequest,
    *,
    max_tokens: int,
    background: BackgroundTasks,
    transcripts: Transcripts | None = None,
) -> Prompt:
    """The prompt's ids; GatewayError (400) for an empty or too long prompt or a template that
    refuses the messages. A sampled cached tokenization is re-checked in `background`. With
    `transcripts`, a chat that extends a retained turn exactly is spliced onto its transcript."""
    text: str | None = None
    spliced = 0
    if treq.kind == "completions":
        if treq.prompt_ids is not None:
            ids = treq.prompt_ids
        else:
            ids = await _encode_exact(tok, treq.prompt_text or "", treq.add_special_tokens)
    else:
        if not tok.has_chat_template:
            raise GatewayError.invalid(
                f"model {treq.model!r} has no chat template; use /v1/completions", "messages"
            )
        try:
            text = tok.render(
                treq.messages,
                add_generation_prompt=treq.add_generation_prompt,
                template_kwargs=treq.template_kwargs,
                tools=treq.tools.template_tools() if treq.tools else None,
            )
        except TemplateError as exc:
            raise GatewayError.invalid(
                f"chat template: {exc}", "messages", code="chat_template_error"
            ) from None
        joined = (
            await _spliced(tok, treq, text, transcripts)
            if transcripts is not None and not treq.add_special_tokens and treq.add_generation_prompt
            else None
        )
        if joined is not None:
            onto = joined
            rest = await _encode_chat(tok, onto.rest, background) if onto.rest else []
            ids, spliced = [*onto.ids, *rest], len(onto.ids)
        elif treq.add_special_tokens:
            ids = await _encode_exact(tok, text, True)
        else:
            ids = await _encode_chat(tok, text, background)
    if not ids:
        raise GatewayError.invalid(
            "the prompt is empty", "prompt" if treq.kind == "completions" else "messages"
        )
    if len(ids) > max_tokens:
        raise GatewayError.invalid(
            f"the prompt has {len(ids)} tokens, more than {max_tokens}", code="context_length_exceeded"
        )
    # A chat with add_special_tokens has ids its text lacks (BOS): it keeps no transcript.
    own = text if text is not None and not treq.add_special_tokens else None
    key = transcripts.key(own) if transcripts is not None and own is not None else b""
    return Prompt(ids, own, spliced, key)


async def _spliced(
    tok: ChatTokenizer, treq: TurnRequest, text: str, transcripts: Transcripts
) -> Splice | None:
    """The splice of the chat `text` onto the transcript of its previous turn (its messages up
    to the last assistant message, rendered as that turn's prompt was); None when there is none
    or it does not extend exactly."""
    end = previous_turn_end(treq.messages)
    if not end:
        return None
    try:
        previous = tok.render(
            treq.messages[:end],
            add_generation_prompt=True,
            template_kwargs=treq.template_kwargs,
            tools=treq.tools.template_tools() if treq.tools else None,
        )
    except TemplateError:
        return None  # e.g. a template that wants the conversation to end with a user message
    if not text.startswith(previous):
        return None  # the template renders earlier turns otherwise once a later one follows
    found = await transcripts.port.find_transcript(
        transcripts.tenant,
        transcripts.model,
        transcripts.key(previous),
        conversation=transcripts.conversation,
    )
    if found is None or not found.conversation.startswith(f"{transcripts.tenant}/"):
        return None
    return splice(text, previous, found.token_ids, found.answer_sha256, found.answer_chars)


def transcript_spec(tok: ChatTokenizer, prompt: Prompt, out: DecodeOutput) -> pb.TranscriptSpec | None:
    """The transcript a finished chat turn commits: its prompt ids and decode's output ids, when
    decode finished with complete ids that decode to exactly its text; else its prompt ids alone
    (an empty answer: the next turn's answer text is tokenized again, after the prompt's exact
    ids); None for a turn decode did not finish."""
    if not prompt.lookup_key or out.finish_reason is None:
        return None
    kept = None
    if out.ids_complete:
        kept = answer_ids(
            out.token_ids, out.text, lambda ids: tok.tokenizer.decode(list(ids), skip_special_tokens=False)
        )
    answer = out.text if kept is not None else ""
    return pb.TranscriptSpec(
        lookup_key=prompt.lookup_key,
        num_tokens=len(prompt.ids) + len(kept or ()),
        answer_sha256=answer_sha256(answer),
        answer_chars=len(answer),
    )


async def _encode_chat(tok: ChatTokenizer, text: str, background: BackgroundTasks) -> list[int]:
    """Rendered chat text (add_special_tokens=False) through the segment cache when it is on."""
    if not tok.cached:
        return await _encode_exact(tok, text, False)
    parts, missing = tok.pieces(text)
    if tok.needs_thread(missing):
        encoded = await asyncio.to_thread(tok.encode_missing, missing)
    else:
        encoded = tok.encode_missing(missing)
    ids = tok.assemble(parts, missing, encoded)
    if tok.should_verify():
        background.spawn(_verify(tok, text, ids), "tokenizer.verify")
    return ids


async def _verify(tok: ChatTokenizer, text: str, ids: list[int]) -> None:
    """Re-tokenize the whole chat off the event loop; a mismatch turns the cache off (here,
    on the loop: the cache belongs to it)."""
    mismatch = await asyncio.to_thread(tok.check, text, ids)
    if mismatch and tok.cached:
        tok.disable_cache(mismatch)


async def _encode_exact(tok: ChatTokenizer, text: str, add_special_tokens: bool) -> list[int]:
    if tok.needs_thread([text]):
        return await asyncio.to_thread(tok.encode_exact, text, add_special_tokens=add_special_tokens)
    return tok.encode_exact(text, add_special_tokens=add_special_tokens)
