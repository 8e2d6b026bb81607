"""The agent pool's data plane on stand-ins (bench/emulator/http/pool_plane.py), in one event loop
with in-process stand-in engines: the engine's handshake checked, a park reads decode's held
blocks (and frees them), the pool serves them to a prefill as decode would (released once
read), and a READ of blocks the holder no longer has fails leaving the pool empty."""

from __future__ import annotations

import random
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq.asyncio
from bench.emulator.http.config import in_process_config
from bench.emulator.http.engine import StandinEngine
from bench.emulator.http.kv import output_tokens
from bench.emulator.http.pool_plane import StandinDataPlane, StandinReadServer
from bench.emulator.http.tokenizer import make_tokenizer

from kvshuttle.agent.config import PoolSettings
from kvshuttle.agent.pool.blocks import BlockPool, PoolLayout
from kvshuttle.agent.pool.data_plane import OpenedPool, RetainedBlocks
from kvshuttle.core.errors import Unavailable
from kvshuttle.vllm.kv_transfer_params import from_vllm
from kvshuttle.vllm.nixl_compat import Expected
from kvshuttle.vllm.nixl_wire import NixlIncompatible

BS = 32
LAYOUT = PoolLayout(regions=1, blocks=64, block_bytes=BS * 1024)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


@pytest.fixture
async def engines(tmp_path: Path) -> AsyncIterator[tuple[StandinEngine, StandinEngine]]:
    model_dir = make_tokenizer(tmp_path / "model")
    prefill = StandinEngine(in_process_config("prefill", "p-1", model_dir, prefix_caching=False))
    decode = StandinEngine(in_process_config("decode", "d-1", model_dir))
    await prefill.start()
    await decode.start()
    try:
        yield prefill, decode
    finally:
        await prefill.stop()
        await decode.stop()


async def complete(http: aiohttp.ClientSession, engine: StandinEngine, prompt: list[int], max_tokens: int,
                   params: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True,
            "kv_transfer_params": params}  # fmt: skip
    async with http.post(f"{engine.url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        got: dict[str, Any] = await response.json()
        return got


async def test_parked_blocks_are_read_from_the_pool_as_from_decode(
    engines: tuple[StandinEngine, StandinEngine],
) -> None:
    prefill, decode = engines
    context = zmq.asyncio.Context()
    plane, pool = StandinDataPlane(LAYOUT), BlockPool(LAYOUT)
    with pytest.raises(NixlIncompatible):
        await plane.verify_engine(context, "127.0.0.1", decode.side_channel_port,
                                  Expected(block_size=BS, engine_id="other"), reply_timeout=5)  # fmt: skip
    engine = await plane.verify_engine(
        context,
        "127.0.0.1",
        decode.side_channel_port,
        Expected(block_size=BS, engine_id="d-1"),
        reply_timeout=5,
    )
    opened: OpenedPool = await plane.open(
        pool, engine, PoolSettings(size_bytes=LAYOUT.total_bytes), context, name="a"
    )
    try:
        async with aiohttp.ClientSession() as http:
            prompt = tokens(200, 1)
            first = await complete(http, prefill, prompt, 1, {"do_remote_decode": True})
            answer = await complete(http, decode, prompt, 8, first["kv_transfer_params"])
            retained = RetainedBlocks.of(from_vllm(answer["kv_transfer_params"]))
            assert decode.cache.holdings() == 1

            prepared = opened.reader.prepare("r", retained, engine)
            parked = await opened.reader.read(prepared, expire_at=time.monotonic() + 60)
            assert parked.num_tokens == 200 + 8 - 1 and decode.cache.holdings() == 0  # the READ freed them
            assert isinstance(opened.server, StandinReadServer)
            pooled = opened.server.publish("r", parked.num_tokens)

            # The next turn's prefill reads them from the pool: its answer is a clean recompute's.
            history = prompt + answer["choices"][0]["token_ids"]
            nxt = history + tokens(40, 2)
            got = await complete(http, prefill, nxt, 1, pooled)
            assert got["kv_transfer_params"]["remote_prefill_cached_tokens"] == len(history) - 1
            assert got["choices"][0]["token_ids"] == output_tokens(nxt, 1, prefill.vocabulary)
            assert pool.allocations() == [] and opened.server.served == {}  # read once, released

            # Decode's holding is gone: a second READ fails, and leaves nothing in the pool.
            with pytest.raises(Unavailable):
                await opened.reader.read(
                    opened.reader.prepare("r2", retained, engine), expire_at=time.monotonic() + 60
                )
            assert pool.allocations() == []
    finally:
        await opened.close()
        context.destroy(linger=0)
