"""A request's prompt as the token ids the engines get and the router verifies, computed
exactly as the engine would (kvshuttle.gateway.tokenizer): a token-id prompt as it is, a text
prompt with the tokenizer's default special tokens, a chat through its template and the
segment cache. Tokenizing that would hold the event loop up runs in a thread.
"""

from __future__ import annotations

import asyncio

from kvshuttle.gateway.background import BackgroundTasks
from kvshuttle.gateway.errors import GatewayError
from kvshuttle.gateway.protocol import TurnRequest
from kvshuttle.gateway.tokenizer import ChatTokenizer, TemplateError

__all__ = ["prompt_ids"]


async def prompt_ids(
    tok: ChatTokenizer, treq: TurnRequest, *, max_tokens: int, background: BackgroundTasks
) -> list[int]:
    """The prompt's ids; GatewayError (400) for an empty or too long prompt or a template that
    refuses the messages. A sampled cached tokenization is re-checked in `background`."""
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
            )
        except TemplateError as exc:
            raise GatewayError.invalid(
                f"chat template: {exc}", "messages", code="chat_template_error"
            ) from None
        if treq.add_special_tokens or not tok.cached:
            ids = await _encode_exact(tok, text, treq.add_special_tokens)
        else:
            parts, missing = tok.pieces(text)
            if tok.needs_thread(missing):
                encoded = await asyncio.to_thread(tok.encode_missing, missing)
            else:
                encoded = tok.encode_missing(missing)
            ids = tok.assemble(parts, missing, encoded)
            if tok.should_verify():
                background.spawn(_verify(tok, text, ids), "tokenizer.verify")
    if not ids:
        raise GatewayError.invalid(
            "the prompt is empty", "prompt" if treq.kind == "completions" else "messages"
        )
    if len(ids) > max_tokens:
        raise GatewayError.invalid(
            f"the prompt has {len(ids)} tokens, more than {max_tokens}", code="context_length_exceeded"
        )
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
