"""A request's prompt as the token ids the engines get and the router verifies, computed
exactly as the engine would (kvshuttle.gateway.prompts.tokenizer): a token-id prompt as it is, a text
prompt with the tokenizer's default special tokens, a chat through its template and the
segment cache. Tokenizing that would hold the event loop up runs in a thread.

With exact-token history (kvshuttle.gateway.prompts.history, the model's `history: exact_tokens`), a
chat that extends its conversation's last turn exactly gets that turn's prompt ids and decode's
output ids, and only the rest of the text is tokenized; each finished turn is remembered for the
next (remember_turn).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from kvshuttle.gateway.errors import GatewayError
from kvshuttle.gateway.openai.protocol import TurnRequest
from kvshuttle.gateway.prompts.chat_template import TemplateError
from kvshuttle.gateway.prompts.history import ExactHistory
from kvshuttle.gateway.prompts.tokenizer import ChatTokenizer
from kvshuttle.gateway.turns.background import BackgroundTasks
from kvshuttle.gateway.turns.record import DecodeOutput

__all__ = ["Prompt", "prompt_ids", "remember_turn"]


@dataclass(frozen=True, slots=True)
class Prompt:
    ids: list[int]
    # The rendered chat (None for a completions prompt).
    text: str | None = None
    # Leading ids taken from the conversation's exact-token history (0: none).
    history_tokens: int = 0


async def prompt_ids(
    tok: ChatTokenizer,
    treq: TurnRequest,
    *,
    max_tokens: int,
    background: BackgroundTasks,
    history: ExactHistory | None = None,
    conversation: str = "",
) -> Prompt:
    """The prompt's ids; GatewayError (400) for an empty or too long prompt or a template that
    refuses the messages. A sampled cached tokenization is re-checked in `background`. With
    `history`, a chat of `conversation` that extends its last turn exactly is spliced onto it."""
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
        splice = (
            history.splice(conversation, text)
            if history is not None and conversation and not treq.add_special_tokens
            else None
        )
        if splice is not None:
            rest = await _encode_chat(tok, splice.rest, background) if splice.rest else []
            ids, spliced = [*splice.ids, *rest], len(splice.ids)
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
    # A chat with add_special_tokens has ids its text lacks (BOS): never remembered.
    return Prompt(ids, None if treq.add_special_tokens else text, spliced)


def remember_turn(
    history: ExactHistory, tok: ChatTokenizer, conversation: str, prompt: Prompt, out: DecodeOutput
) -> None:
    """After a chat turn of `conversation`: remember it when decode finished with complete
    token ids; anything else forgets the conversation (its next turn is tokenized as usual)."""
    if prompt.text is None or out.finish_reason is None or not out.ids_complete:
        history.forget(conversation)
        return
    history.remember(
        conversation,
        prompt_ids=prompt.ids,
        text=prompt.text,
        output_ids=out.token_ids,
        output_text=out.text,
        decode=lambda ids: tok.tokenizer.decode(list(ids), skip_special_tokens=False),
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
