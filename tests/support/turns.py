"""Prompt tokens, one gateway turn and the plain-vLLM reference answer, shared by the e2e and chaos tests."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
import uuid
from typing import Any

from deploy.local.launch import VllmPair
from deploy.local.stack import KvshuttleStack


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def turn(
    stack: KvshuttleStack,
    conversation: str,
    prompt: list[int],
    max_tokens: int = 24,
    headers: dict[str, str] | None = None,
) -> tuple[list[int], Any]:
    """One completions turn through the gateway, greedy (`headers`: the request's extra ones);
    returns the output ids and the response's headers."""
    body, got = post(
        f"{stack.gateway_url}/v1/completions",
        {
            "model": "m",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "conversation_id": conversation,
        },
        headers,
    )
    return list(body["choices"][0]["token_ids"]), got


def reference(pair: VllmPair, prompt: list[int], max_tokens: int = 24) -> list[int]:
    """The same request on one server, computed from scratch (a fresh cache salt: no cache hit)."""
    body, _ = post(
        f"{pair.decode.url}/v1/completions",
        {
            "model": "m",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
            "cache_salt": uuid.uuid4().hex,
        },
    )
    return list(body["choices"][0]["token_ids"])


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> tuple[dict[str, Any], Any]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            return json.loads(response.read()), response.headers
    except urllib.error.HTTPError as err:
        raise AssertionError(f"{url}: {err.code} {err.read()[:500]!r}") from None
