"""What real vLLM (0.32, CPU build) does with a request's `cache_salt`: it accepts it on
/v1/completions with a token-id prompt, folds it into its block hashes (so another salt's blocks
never serve it), and reports it in the first block's `extra_keys` of its BlockStored event, which
the agent's decoder keeps as the salt's SHA-256 (what the block index chains from)."""

from __future__ import annotations

import json
import random
import time
import urllib.request
import uuid
from typing import Any

import msgpack
import pytest
import zmq
from deploy.local.launch import VllmPair

from kvshuttle.core.hashing import cache_salt_digest
from kvshuttle.core.kv_events import BlockStored
from kvshuttle.vllm.kv_events import KvEventDecoder

pytestmark = pytest.mark.vllm
BS = 32


def _complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def test_vllm_salts_block_hashes_and_reports_the_salt_in_its_events(vllm_pair: VllmPair) -> None:
    rng = random.Random(4242)
    prompt = [rng.randrange(10, 2000) for _ in range(3 * BS + 5)]
    salt = f"e2e-{uuid.uuid4().hex}"
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(vllm_pair.decode.events_endpoint)
    try:
        time.sleep(1.0)  # the SUB's subscription reaches the publisher before the requests
        for body in ({"cache_salt": salt}, {}):
            answer = _complete(
                vllm_pair.decode.url, {"model": "m", "prompt": prompt, "max_tokens": 1, **body}
            )
            assert answer["choices"], answer
        decoder = KvEventDecoder()
        raw_first: list[dict[str, Any]] = []
        stored: list[BlockStored] = []
        deadline = time.monotonic() + 20
        while len(stored) < 2 and time.monotonic() < deadline:
            if not sub.poll(500):
                continue
            frames = sub.recv_multipart()
            batch = decoder.decode_message(frames)
            assert batch is not None
            for event in batch.events:
                if isinstance(event, BlockStored) and event.token_ids[:BS] == tuple(prompt[:BS]):
                    stored.append(event)
            for item in msgpack.unpackb(frames[2], raw=False, strict_map_key=False)[1]:
                if isinstance(item, dict) and item.get("token_ids", [])[:BS] == prompt[:BS]:
                    raw_first.append(item)
    finally:
        sub.close()
        context.term()
    salted, plain = stored[:2]
    # The salt is in the first block's extra keys, as the decoder expects it.
    assert raw_first[0]["extra_keys"][0] == [salt], raw_first[0].get("extra_keys")
    assert salted.parent_block_hash is None and plain.parent_block_hash is None
    assert salted.cache_salt_sha256 == cache_salt_digest(salt)
    assert plain.cache_salt_sha256 == b""
    # The same tokens, two salts: vLLM keyed them apart (no prefix-cache hit across salts).
    assert salted.token_ids == plain.token_ids
    assert not set(salted.block_hashes) & set(plain.block_hashes)
