"""The stand-in engines (bench/emulator/http/engine.py) speak what kvshuttle consumes of vLLM, and
the whole control plane runs over them: real processes on loopback, nothing left running.

* Their block hashes are vLLM's (checked against a real vLLM 0.32 capture), their KV events
  decode with the agent's decoder, replay through the agent's replayer, and index in the
  registry's block index under kvshuttle's chain of the same tokens.
* Wrong KV is visible: a prefill handed blocks of other tokens answers other tokens than a clean
  recompute, so comparing answers with `StandinPair.expected` checks what the router served.
* Gateway -> router -> registry over a StandinPair: a conversation's turns reuse decode's KV
  (prefill reads it) and answer as a clean recompute; an edited history reuses at most the
  verified prefix and still answers as a clean recompute.
"""

from __future__ import annotations

import asyncio
import json
import random
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from bench.emulator.http.kv import int64_of, vllm_block_hashes
from bench.emulator.http.launcher import StandinPair
from deploy.local.stack import KvshuttleStack
from tests.e2e.stacks import DEAR_LINK, EXTEND_ENV, PROFILE

from kvshuttle.agent.events import ZmqReplayer
from kvshuttle.core.hashing import cache_salt_digest, chain_hashes, salted_root
from kvshuttle.core.kv_events import BlockStored
from kvshuttle.registry.block_index import BlockIndex
from kvshuttle.vllm.kv_events import KvEventDecoder

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-0.32.0-cpu-kv-events.json"
BS = 32


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read()), response.headers


def complete(url: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    body = {"model": "m", "prompt": prompt, "max_tokens": 8, "return_token_ids": True, **fields}
    return post(f"{url}/v1/completions", body)[0]


@pytest.fixture
def pair(vllm_model: Path, tmp_path: Path) -> Iterator[StandinPair]:
    # The tiny model's tokenizer (built once per session, as the vLLM tests build it). Prefix
    # caching off on prefill: every reuse turn reads decode's blocks over the side channel.
    with StandinPair(vllm_model, log_dir=tmp_path / "engines", prefill_prefix_caching=False) as started:
        yield started
    assert not any(engine.running for engine in started.engines)


def test_block_hashes_are_vllms() -> None:
    frames = [bytes.fromhex(f) for f in json.loads(FIXTURE.read_text())["live"][0]]
    event = msgpack.unpackb(frames[2], raw=False)[1][0]
    hashes = vllm_block_hashes(event["token_ids"], event["block_size"])
    assert [int64_of(h) for h in hashes] == event["block_hashes"]


def test_kv_events_decode_replay_and_index_as_kvshuttles_chain(pair: StandinPair) -> None:
    prompt, salt = tokens(100, 1), "tenant-salt"

    async def run() -> tuple[list[Any], list[Any]]:
        context = zmq.asyncio.Context()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.connect(pair.decode.events_endpoint)
        try:
            await asyncio.sleep(0.3)  # the subscription reaches the publisher
            await asyncio.to_thread(complete, pair.decode.url, prompt, cache_salt=salt)
            await asyncio.to_thread(complete, pair.decode.url, prompt + tokens(40, 2), cache_salt=salt)
            decoder = KvEventDecoder()
            live = [decoder.decode_message(await sub.recv_multipart()) for _ in range(2)]
            replayer = ZmqReplayer(context, pair.decode.replay_endpoint, decoder, timeout=5, max_batches=10)
            return live, await replayer.fetch(0, 2)
        finally:
            sub.close(0)
            context.term()

    live, replayed = asyncio.run(run())
    assert [b.seq for b in live if b] == [b.seq for b in replayed] == [0, 1]
    assert live == replayed
    first, second = (b.events[0] for b in replayed if b)
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.parent_block_hash is None and first.cache_salt_sha256 == cache_salt_digest(salt)
    assert list(first.block_hashes) == [int64_of(h) for h in vllm_block_hashes(prompt, BS, salt)]
    assert second.parent_block_hash == first.block_hashes[-1]  # 100 + 40 tokens: one more block
    index = BlockIndex(max_blocks_per_node=1000)
    for batch in replayed:
        index.apply("nodes/decode", [batch])
    longer = prompt + tokens(40, 2)
    chain = chain_hashes(longer, BS, salted_root(cache_salt_digest(salt)))
    assert index.lookup(chain) == [("nodes/decode", 4)]


def test_a_prefill_handed_other_tokens_kv_answers_otherwise(pair: StandinPair) -> None:
    history = tokens(300, 3)
    start = {"do_remote_decode": True, "do_remote_prefill": False}
    p_params = complete(pair.prefill.url, history, max_tokens=1, kv_transfer_params=start)[
        "kv_transfer_params"
    ]
    d = complete(pair.decode.url, history, kv_transfer_params=p_params)
    assert d["choices"][0]["token_ids"] == pair.expected(history, 8)
    retained = d["kv_transfer_params"]
    assert retained["do_remote_decode"] and retained["remote_num_tokens"] == 300 + 8 - 1
    edited = [history[0] + 1, *history[1:], *tokens(50, 4)]  # the first token changed
    wrong = complete(pair.prefill.url, edited, max_tokens=1, kv_transfer_params=retained)
    assert wrong["kv_transfer_params"]["remote_prefill_cached_tokens"] == 307  # read, unverified
    d2 = complete(pair.decode.url, edited, kv_transfer_params=wrong["kv_transfer_params"])
    assert d2["choices"][0]["token_ids"] != pair.expected(edited, 8)
    again = complete(pair.prefill.url, edited, max_tokens=1, kv_transfer_params=retained)
    assert again["kv_transfer_params"]["remote_prefill_cached_tokens"] == 0  # single use: read once


def test_conversations_over_the_real_control_plane_reuse_and_answer_as_a_recompute(
    pair: StandinPair, tmp_path: Path
) -> None:
    stack = KvshuttleStack(pair, work_dir=tmp_path / "kvshuttle", profile=PROFILE)
    stack.start()
    try:
        conversation, prompt = f"c-{uuid.uuid4().hex[:8]}", tokens(600, 5)
        decisions = []
        for turn in range(3):
            body, headers = post(
                f"{stack.gateway_url}/v1/completions",
                {"model": "m", "prompt": prompt, "max_tokens": 24, "return_token_ids": True,
                 "conversation_id": conversation},
            )  # fmt: skip
            out = body["choices"][0]["token_ids"]
            assert out == pair.expected(prompt, 24), turn
            decisions.append((headers["X-Kvshuttle-Decision"], int(headers["X-Kvshuttle-Reused-Tokens"])))
            history = prompt + out
            prompt = history + tokens(80, 6 + turn)
        assert decisions[0] == ("recompute", 0)
        assert decisions[1:] == [("reuse", 600 + 24 - 1), ("reuse", 600 + 24 + 80 + 24 - 1)]
        # An edited history: a token in the middle changed. At most the verified prefix is
        # reused, and the answer is still a clean recompute's.
        edited = list(prompt)
        edited[400] = edited[400] + 1 if edited[400] < 2000 else 10
        body, headers = post(
            f"{stack.gateway_url}/v1/completions",
            {"model": "m", "prompt": edited, "max_tokens": 24, "return_token_ids": True,
             "conversation_id": conversation},
        )  # fmt: skip
        assert int(headers["X-Kvshuttle-Reused-Tokens"]) <= 400
        assert body["choices"][0]["token_ids"] == pair.expected(edited, 24)
        assert pair.decode.get_json("/standin/timings")["stats"]["kv_load_failures_total"] == 0
        assert pair.prefill.get_json("/standin/timings")["stats"]["kv_reads_total"] >= 2
    finally:
        codes = stack.stop()
    assert all(code == 0 for code in codes.values()), codes


def test_a_short_turn_extends_on_its_holder_as_on_real_vllm(pair: StandinPair, tmp_path: Path) -> None:
    """tests/e2e/test_extend.py's conversation, on the stand-ins: the same decisions, the holder's
    full blocks as its cached tokens, the next long turn reading the extend turn's KV."""
    stack = KvshuttleStack(pair, work_dir=tmp_path / "kvshuttle", profile=DEAR_LINK,
                           extra_env={"router": EXTEND_ENV})  # fmt: skip
    stack.start()
    try:
        conversation, prompt, seen = f"c-{uuid.uuid4().hex[:8]}", tokens(600, 11), []
        for new in (40, 400, 0):
            body, headers = post(
                f"{stack.gateway_url}/v1/completions",
                {"model": "m", "prompt": prompt, "max_tokens": 24, "return_token_ids": True,
                 "conversation_id": conversation},
            )  # fmt: skip
            out = body["choices"][0]["token_ids"]
            assert out == pair.expected(prompt, 24)
            cached = body["usage"].get("prompt_tokens_details", {}).get("cached_tokens")
            seen.append((headers["X-Kvshuttle-Decision"], int(headers["X-Kvshuttle-Reused-Tokens"]), cached))
            prompt = prompt + out + tokens(new, 12 + new)
        (first, extend, reuse) = seen
        assert first[0] == "recompute"
        assert extend == ("extend", 623 // BS * BS, 623 // BS * BS)
        assert reuse[:2] == ("reuse", 600 + 24 + 40 + 24 - 1)
    finally:
        codes = stack.stop()
    assert all(code == 0 for code in codes.values()), codes
