"""The stand-in engine's HTTP shapes (bench/emulator/http/engine.py): a `/v1/completions` body
read as vLLM 0.32 reads it (and refused with vLLM's error bodies), and the answers written as
vLLM writes them: the completion, its SSE chunks (the finish chunk carries the
`kv_transfer_params`), usage, `/v1/models` and the Prometheus text of `/metrics`; and the
vocabulary answers are drawn from (ids that decode to plain text). No state and no KV here: the
engine decides what is answered, this module only how it is spelled."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from aiohttp import web
from tokenizers import Tokenizer

DEFAULT_MAX_TOKENS: Final = 16  # vLLM's for /v1/completions


def plain_vocabulary(tokenizer: Tokenizer) -> tuple[list[int], dict[int, str]]:
    """Output ids that decode to plain ASCII letters and digits, alone and side by side (so no
    concatenation spells a special or tool tag), with their texts; never EOS or an added token."""
    ids, texts = [], {}
    special = set(tokenizer.get_added_tokens_decoder())
    for i in range(tokenizer.get_vocab_size(with_added_tokens=False)):
        text = tokenizer.decode([i])
        if i in special or not text or not text.isascii() or not text.replace(" ", "").isalnum():
            continue
        if tokenizer.decode([i, i]) == text + text:
            ids.append(i)
            texts[i] = text
    if not ids:
        raise ValueError("the tokenizer has no plain-text ids to answer with")
    return ids, texts


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def error_response(message: str, status: int) -> web.Response:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return web.json_response(body, status=status)


@dataclass(frozen=True)
class CompletionRequest:
    prompt: list[int]
    max_tokens: int | None  # None: not given (vLLM's default applies)
    stops: list[str]
    kv_transfer_params: dict[str, Any]
    cache_salt: str | None
    stream: bool
    return_token_ids: bool
    include_usage: bool


def parse_completion(body: Any, *, model: str, vocab_size: int, max_model_len: int) -> CompletionRequest:
    """The request, or BadRequest with vLLM's message for what it refuses."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if body.get("model") != model:
        raise BadRequest(f"The model `{body.get('model')}` does not exist.", 404)
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):  # fmt: skip
        raise BadRequest("the stand-in takes token-id prompts only (a non-empty list of ints)")
    if (bad := next((t for t in prompt if not 0 <= t < vocab_size), None)) is not None:
        raise BadRequest(f"Token id {bad} is out of vocabulary")
    max_tokens = body.get("max_tokens")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise BadRequest("max_tokens must be at least 1")
    asked = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if len(prompt) + asked > max_model_len:
        raise BadRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(prompt) + asked} tokens ({len(prompt)} in the messages, {asked} "
            "in the completion)."
        )
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str)]
    params = body.get("kv_transfer_params")
    salt = body.get("cache_salt")
    return CompletionRequest(
        prompt=prompt,
        max_tokens=max_tokens,
        stops=stops,
        kv_transfer_params=params if isinstance(params, dict) else {},
        cache_salt=salt if isinstance(salt, str) and salt else None,
        stream=bool(body.get("stream")),
        return_token_ids=bool(body.get("return_token_ids")),
        include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
    )


@dataclass(frozen=True)
class Answer:
    """What the engine answers: the output ids and their texts (one text, the cut one, when a
    stop string matched), why it finished, and the KV params (None: nothing held)."""

    ids: list[int]
    texts: list[str]
    finish: str
    stop_reason: str | None
    aborted: bool


def apply_stops(ids: list[int], texts: list[str], stops: list[str], finish: str = "length") -> Answer:
    """vLLM's stop strings: a detokenizer match cuts the text before it, then an abort (so
    nothing is retained); no match: the answer as it is, finished for `finish`."""
    for i in range(len(ids)):
        done = "".join(texts[: i + 1])
        hit = next((s for s in stops if s in done), None)
        if hit is not None:
            return Answer(ids[: i + 1], [done[: done.index(hit)]], "stop", hit, aborted=True)
    return Answer(ids, texts, finish, None, aborted=False)


def usage(prompt: list[int], ids: list[int], cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": len(prompt),
        "total_tokens": len(prompt) + len(ids),
        "completion_tokens": len(ids),
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def head(request_id: str, model: str) -> dict[str, Any]:
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": int(time.time()),
            "model": model}  # fmt: skip


def completion_body(
    req: CompletionRequest,
    top: dict[str, Any],
    answer: Answer,
    params: dict[str, Any] | None,
    used: dict[str, Any],
) -> dict[str, Any]:
    """The non-streaming answer."""
    choice: dict[str, Any] = {"index": 0, "text": "".join(answer.texts), "logprobs": None,
                              "finish_reason": answer.finish, "stop_reason": answer.stop_reason,
                              "prompt_logprobs": None}  # fmt: skip
    if req.return_token_ids:
        choice.update(token_ids=answer.ids, prompt_token_ids=req.prompt)
    return {**top, "choices": [choice], "usage": used, "kv_transfer_params": params}


def sse_chunks(
    req: CompletionRequest, top: dict[str, Any], answer: Answer, params: dict[str, Any] | None
) -> Iterator[bytes]:
    """One `data:` event per output piece (a token, or the whole cut text after a stop
    string); the last carries the finish reason and the KV params."""
    ids, texts = answer.ids, answer.texts
    pieces = list(zip(ids, texts, strict=True)) if len(texts) == len(ids) else [(ids[-1], texts[0])]
    for i, (token, text) in enumerate(pieces):
        last = i == len(pieces) - 1
        chunk_choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                                        "finish_reason": answer.finish if last else None,
                                        "stop_reason": answer.stop_reason if last else None}  # fmt: skip
        if req.return_token_ids:
            chunk_choice["token_ids"] = ids if len(pieces) == 1 else [token]
            if i == 0:
                chunk_choice["prompt_token_ids"] = req.prompt
        chunk: dict[str, Any] = {**top, "choices": [chunk_choice]}
        if last and params is not None:
            chunk["kv_transfer_params"] = params
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"


def sse_error(message: str, status: int) -> bytes:
    """An error event in place of the rest of a stream (vLLM's, when the engine core dies), then
    `[DONE]`."""
    error = {"message": message, "type": "InternalServerError", "param": None, "code": status}
    return b"data: " + json.dumps({"error": error}).encode() + b"\n\ndata: [DONE]\n\n"


def sse_tail(req: CompletionRequest, top: dict[str, Any], used: dict[str, Any]) -> bytes:
    """After the pieces: the usage chunk when asked for, then `[DONE]`."""
    tail = b""
    if req.include_usage:
        tail += b"data: " + json.dumps({**top, "choices": [], "usage": used}).encode() + b"\n\n"
    return tail + b"data: [DONE]\n\n"


def models_body(model: str, root: Path, max_model_len: int) -> dict[str, Any]:
    entry = {"id": model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
             "root": str(root), "parent": None, "max_model_len": max_model_len}  # fmt: skip
    return {"object": "list", "data": [entry]}


def metrics_text(model: str, running: int, waiting: int, kv_usage: float, stats: Mapping[str, int]) -> str:
    """vLLM's gauges kvshuttle's agent reads, then the stand-in's own counters."""
    labels = f'{{engine="0",model_name="{model}"}}'
    lines = [
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{labels} {running}",
        "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{labels} {waiting}",
        "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{labels} {kv_usage}",
    ]  # fmt: skip
    for name, value in stats.items():
        lines += [f"# TYPE standin_{name} gauge", f"standin_{name} {value}"]
    return "\n".join(lines) + "\n"
