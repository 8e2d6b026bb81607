"""The HTTP calls a turn makes: a prefill (`max_tokens` 1, its KV params back) and a streamed
decode (TTFT, every token's arrival, the answer's ids, the params on its finish chunk, usage), to
an engine or to kvshuttle's gateway (its X-Kvshuttle-* headers kept)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.cluster.engines import Node

MAX_LINE_BYTES = 64 << 20


class TurnFailed(Exception):
    """An engine or the gateway answered an error."""


@dataclass
class Streamed:
    """A streamed answer; times are `time.monotonic()` values."""

    ids: list[int] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    params: dict[str, Any] | None = None
    cached_tokens: int = 0
    headers: dict[str, str] = field(default_factory=dict)


def _body(
    model: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None, **extra: Any
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": max_tokens, **extra}
    if params is not None:
        body["kv_transfer_params"] = params
    return body


async def prefill(
    http: aiohttp.ClientSession, node: Node, model: str, prompt: list[int], params: dict[str, Any]
) -> tuple[dict[str, Any], int]:
    """Prefill on `node` with `params` in: the params it answers (for decode) and the prompt
    tokens it found (its prefix cache, or read from the engine the params name)."""
    node.in_flight += 1
    node.sent += 1
    try:
        async with http.post(f"{node.url}/v1/completions", json=_body(model, prompt, 1, params)) as response:
            answer = await response.json()
            if response.status != 200:
                raise TurnFailed(f"prefill {node.name}: {response.status} {answer}")
    finally:
        node.in_flight -= 1
    cached = int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    return answer["kv_transfer_params"], cached


async def stream(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    node: Node | None = None,
    *,
    headers: dict[str, str] | None = None,
) -> Streamed:
    """POST `body` streamed to `url`/v1/completions (with `headers`); `node` counts it in flight."""
    body = {**body, "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    got = Streamed()
    if node is not None:
        node.in_flight += 1
        node.sent += 1
    try:
        async with http.post(f"{url}/v1/completions", json=body, headers=headers) as response:
            if response.status != 200:
                raise TurnFailed(f"{url}: {response.status} {await response.text()}")
            got.headers = {k: v for k, v in response.headers.items() if k.startswith("X-Kvshuttle")}
            # The first chunk carries the prompt's ids (return_token_ids): past aiohttp's 512 KiB
            # line limit from ~80k tokens.
            while line := await response.content.readline(max_line_length=MAX_LINE_BYTES):
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise TurnFailed(f"{url}: {chunk['error']}")
                for choice in chunk.get("choices", ()):
                    ids = choice.get("token_ids") or []
                    if ids:
                        got.ids.extend(ids)
                        got.token_times.extend([time.monotonic()] * len(ids))
                if chunk.get("kv_transfer_params"):
                    got.params = chunk["kv_transfer_params"]
                if chunk.get("usage"):
                    got.cached_tokens = int(
                        (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    )
    finally:
        if node is not None:
            node.in_flight -= 1
    return got


async def decode(
    http: aiohttp.ClientSession,
    node: Node,
    model: str,
    prompt: list[int],
    max_tokens: int,
    params: dict[str, Any] | None,
) -> Streamed:
    """A streamed decode on `node`: with prefill's params it reads prefill's KV; without, it
    computes what its own prefix cache lacks."""
    return await stream(http, node.url, _body(model, prompt, max_tokens, params), node)


__all__ = ["Streamed", "TurnFailed", "decode", "prefill", "stream"]
