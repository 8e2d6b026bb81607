"""Decode's answer (the turn's DecodeOutput, kvshuttle.gateway.turns.record) as the client's
OpenAI objects (chat.completion, text_completion, and their stream chunks).

Decode always runs a token-id `/v1/completions`; chat clients get its output translated into
chat.completion(.chunk) objects (tool calls and reasoning split out of its text by the
request's OutputParser, kvshuttle.gateway.parsing, where it has one), completions clients get
it as it is, with the gateway's id and model name and without `kv_transfer_params` (never shown
to a client).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from kvshuttle.gateway.parsing import OutputParser
from kvshuttle.gateway.turns.record import DecodeOutput

__all__ = [
    "SSE_DONE",
    "ChatStream",
    "CompletionStream",
    "chat_completion",
    "completion",
    "dumps",
    "sse",
]


def dumps(obj: Any) -> bytes:
    """Compact UTF-8 JSON. orjson: a long prompt's token ids echoed back (`return_token_ids`) cost
    the stdlib encoder ~90 ns an id, ~20x orjson's."""
    return orjson.dumps(obj)


def sse(obj: Any) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def with_cached_tokens(usage: Any, cached_tokens: int | None) -> Any:
    """`usage` with `prompt_tokens_details.cached_tokens`: the prompt tokens prefill did not
    compute (read from decode's retained KV, or its own prefix cache), as prefill reported them
    (`remote_prefill_cached_tokens`). What agent SDKs read for cache hits; decode's own figure
    would say nothing (it computes no prompt). Unchanged when either is unknown: an extend turn
    has no prefill, and decode's own figure is then its prefix cache's hits on the history."""
    if not isinstance(usage, dict) or cached_tokens is None:
        return usage
    details = usage.get("prompt_tokens_details")
    details = dict(details) if isinstance(details, dict) else {}
    prompt_tokens = usage.get("prompt_tokens")
    bound = prompt_tokens if isinstance(prompt_tokens, int) and not isinstance(prompt_tokens, bool) else None
    details["cached_tokens"] = cached_tokens if bound is None else min(cached_tokens, bound)
    return {**usage, "prompt_tokens_details": details}


def chat_completion(
    *,
    response_id: str,
    created: int,
    model: str,
    out: DecodeOutput,
    prompt_ids: list[int],
    token_ids: bool,
    cached_tokens: int | None = None,
    parser: OutputParser | None = None,
) -> dict[str, Any]:
    """A chat.completion from decode's (non-streaming) completion."""
    message: dict[str, Any]
    if parser is None:
        message, finish = {"role": "assistant", "content": out.text}, out.finish_reason
    else:
        message, finish = parser.message(out.text, out.token_ids, out.finish_reason)
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": finish,
        "stop_reason": out.stop_reason,
    }
    response: dict[str, Any] = {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": with_cached_tokens(out.usage, cached_tokens),
    }
    if token_ids:
        choice["token_ids"] = out.token_ids
        response["prompt_token_ids"] = prompt_ids
    return response


def completion(
    body: dict[str, Any], *, response_id: str, model: str, token_ids: bool, cached_tokens: int | None = None
) -> dict[str, Any]:
    """Decode's completion as the client's: the gateway's id and model name, no KV params."""
    body.pop("kv_transfer_params", None)
    if "usage" in body:
        body["usage"] = with_cached_tokens(body["usage"], cached_tokens)
    body["id"] = response_id
    body["model"] = model
    if not token_ids:
        body.pop("prompt_token_ids", None)
        for choice in body.get("choices") or ():
            if isinstance(choice, dict):
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
    return body


class ChatStream:
    """Decode's completion chunks as chat.completion.chunk events."""

    def __init__(
        self,
        *,
        response_id: str,
        created: int,
        model: str,
        prompt_ids: list[int],
        token_ids: bool,
        include_usage: bool,
        parser: OutputParser | None = None,
    ) -> None:
        self._id = response_id
        self._created = created
        self._parser = parser
        self._model = model
        self._prompt_ids = prompt_ids
        self._token_ids = token_ids
        self._usage = include_usage
        self._role_sent = False

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self._id,
            "object": "chat.completion.chunk",
            "created": self._created,
            "model": self._model,
            "choices": choices,
            **extra,
        }

    def events(self, chunk: Mapping[str, Any]) -> bytes:
        """The SSE bytes for one decode chunk (b"" when it carries nothing for the client)."""
        out = b""
        choices = chunk.get("choices") or []
        if choices and isinstance(choices[0], dict):
            choice = choices[0]
            if not self._role_sent:
                self._role_sent = True
                role = {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                extra = {"prompt_token_ids": self._prompt_ids} if self._token_ids else {}
                out += sse(self._chunk([role], **extra))
            text = choice.get("text") or ""
            finish = choice.get("finish_reason")
            ids = choice.get("token_ids")
            deltas: list[dict[str, Any]]
            if self._parser is None:
                deltas = [{"content": text}] if text else []
            else:
                deltas, finish = self._parser.delta(text, ids or [], finish)
            if not deltas and (finish is not None or (self._token_ids and ids)):
                deltas = [{}]
            for i, body in enumerate(deltas):
                last = i == len(deltas) - 1
                delta: dict[str, Any] = {
                    "index": 0,
                    "delta": body,
                    "logprobs": None,
                    "finish_reason": finish if last else None,
                }
                if last and finish is not None:
                    delta["stop_reason"] = choice.get("stop_reason")
                if self._token_ids:
                    delta["token_ids"] = (ids or []) if i == 0 else []
                out += sse(self._chunk([delta]))
        elif self._usage and chunk.get("usage"):
            out += sse(self._chunk([], usage=chunk["usage"]))
        return out


class CompletionStream:
    """Decode's completion chunks, as the client's: the gateway's id and model name, no KV params."""

    def __init__(self, *, response_id: str, model: str, token_ids: bool, include_usage: bool) -> None:
        self._id = response_id
        self._model = model
        self._token_ids = token_ids
        self._usage = include_usage

    def events(self, chunk: dict[str, Any]) -> bytes:
        chunk.pop("kv_transfer_params", None)
        choices = chunk.get("choices") or []
        if not self._usage:
            chunk.pop("usage", None)
        if not choices and not chunk.get("usage"):
            return b""  # e.g. a chunk that only carried kv_transfer_params
        chunk["id"] = self._id
        chunk["model"] = self._model
        if not self._token_ids:
            for choice in choices:
                if isinstance(choice, dict):
                    choice.pop("token_ids", None)
                    choice.pop("prompt_token_ids", None)
        return sse(chunk)
