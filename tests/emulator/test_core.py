"""The profile-timed stand-in (the emulator): its block pool, its shared link, and engines in one
event loop answering with the KV they were handed, at the profile's pace (time scaled down)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from bench.emulator.core.link import Link, ProcessorSharing
from bench.emulator.core.pool import BlockPool
from bench.emulator.core.timing import SteppedTiming
from bench.emulator.http.cluster import StandinCluster
from bench.emulator.http.config import in_process_config, with_profile
from bench.emulator.http.engine import StandinEngine
from bench.emulator.http.kv import int64_of, output_tokens, removed_event, stored_events, vllm_block_hashes
from bench.emulator.http.tokenizer import make_tokenizer
from deploy.profiles.schema import DecodeModel, EngineLimits, EngineProfile, Hardware

from kvshuttle.router.cost import LinkModel, PrefillModel

PROFILE = EngineProfile(
    model="m",
    kv_bytes_per_token=16384,
    min_reuse_tokens=64,
    prefill=PrefillModel(fixed_ms=50.0, per_token_ms=0.5, per_cached_token_ms=0.02, per_pair_ns=100.0),
    link=LinkModel(bandwidth_gb_s=4.0, fixed_ms=5.0),
    decode=DecodeModel(fixed_ms=20.0, per_seq_ms=0.5, per_ctx_token_ns=100.0, max_batch=64),
    engine=EngineLimits(
        kv_capacity_tokens=65536, block_size=32, max_num_batched_tokens=2048, gpu_memory_utilization=1.0
    ),
    hardware=Hardware(gpu="cpu", tp=1, gpus_per_engine=1, gpu_memory_gib=1.0),
)
SCALE = 0.05


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("model"))


# -- the block pool ------------------------------------------------------------------------------


Pool = BlockPool[bytes, tuple[int, ...]]


def pool_with_events(num_blocks: int, block_size: int, **kw: Any) -> tuple[Pool, list[dict[str, Any]]]:
    """A pool wired to vLLM-shaped KV events as the HTTP stand-in wires it."""
    events: list[dict[str, Any]] = []

    def stored(indices: list[int], sequence: tuple[list[int], list[bytes], int]) -> None:
        tokens, hashes, prompt = sequence
        events.extend(
            stored_events(tokens, hashes, indices, block_size, None, first_generated=prompt // block_size)
        )

    pool: Pool = BlockPool(
        num_blocks,
        block_size,
        on_stored=stored,
        on_removed=lambda keys: events.append(removed_event(keys, "GPU")),
        **kw,
    )
    return pool, events


def place(pool: Pool, tokens: list[int], prompt: int | None = None) -> list[int]:
    bs, hashes = pool.block_size, vllm_block_hashes(tokens, pool.block_size)
    blocks = [tuple(tokens[i : i + bs]) for i in range(0, len(tokens), bs)]
    return pool.place(hashes, blocks, (tokens, hashes, len(tokens) if prompt is None else prompt))


def test_lru_evicts_the_least_recently_used_unreferenced_block() -> None:
    pool, events = pool_with_events(4, 2)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    pool.release(place(pool, a))
    pool.release(place(pool, b))
    assert len(pool.hits(vllm_block_hashes(a, 2))) == 2  # a is used again: b is the LRU
    events.clear()
    pool.release(place(pool, c))
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    # vLLM frees a sequence tail first: its head is evicted last.
    assert removed == [int64_of(h) for h in reversed(vllm_block_hashes(b, 2))]
    assert len(pool.hits(vllm_block_hashes(a, 2))) == 2
    assert pool.hits(vllm_block_hashes(b, 2)) == []


def test_blocks_filled_by_generated_tokens_are_stored_one_event_each_as_vllms_decode_steps() -> None:
    # Real vLLM (tests/e2e/test_conformance.py): a prompt's new full blocks in one BlockStored,
    # then one per block a decode step fills, each linked to the block before.
    pool, events = pool_with_events(16, 2)
    tokens = list(range(1, 10))  # a 5-token prompt (2 full blocks) + 4 generated: blocks 2 and 3
    hashes = [int64_of(h) for h in vllm_block_hashes(tokens, 2)]
    place(pool, tokens, prompt=5)
    stored = [(e["block_hashes"], e["parent_block_hash"]) for e in events]
    assert stored == [(hashes[:2], None), (hashes[2:3], hashes[1]), (hashes[3:4], hashes[2])]


def test_referenced_blocks_are_not_evicted_and_reservations_count_evictable_ones() -> None:
    pool, _ = pool_with_events(4, 2)
    pinned = place(pool, [1, 2, 3, 4])
    pool.release(place(pool, [5, 6, 7, 8]))
    assert pool.available() == 2  # the two cached, unreferenced blocks
    assert pool.try_reserve(2) and not pool.try_reserve(1)
    pool.unreserve(2)
    pool.release(place(pool, [9, 10, 11, 12]))
    assert len(pool.hits(vllm_block_hashes([1, 2, 3, 4], 2))) == 2
    pool.release(pinned)
    assert pool.available() == 4


def test_retained_blocks_expire_after_the_ttl_and_free_on_the_readers_notification() -> None:
    pool, _ = pool_with_events(8, 2, prefix_caching=False)
    pool.hold("retained", place(pool, [1, 2, 3, 4]), expires_at=100.0)
    pool.hold("read-once", place(pool, [5, 6, 7, 8]), expires_at=100.0)
    assert pool.available() == 4
    assert pool.expire(99.0) == 0
    assert pool.take("read-once", []) == []  # the notification alone frees them
    assert pool.available() == 6
    assert pool.take("read-once", []) is None  # single use
    assert pool.expire(100.0) == 1 and pool.holdings() == 0
    assert pool.available() == 8


# -- the link ------------------------------------------------------------------------------------


def test_reads_overlapping_on_a_link_share_its_bandwidth() -> None:
    link: ProcessorSharing[str] = ProcessorSharing(bytes_per_s=1e9)
    link.add("a", 1e9, now=0.0)
    assert link.next_done() == pytest.approx(1.0)
    link.add("b", 1e9, now=0.0)
    assert link.next_done() == pytest.approx(2.0)  # two equal reads: twice as long
    link.remove("b", now=0.5)  # a moved a quarter of its bytes; alone again
    assert link.next_done() == pytest.approx(1.25)
    link.add("c", 0.25e9, now=0.5)
    assert link.next_done() == pytest.approx(1.0)  # c: 0.25e9 at half the rate
    assert link.advance(1.0) == ["c"]
    assert link.advance(1.499) == []
    assert link.advance(1.5) == ["a"]


def test_a_read_joining_or_leaving_hands_back_the_reads_it_finds_finished() -> None:
    # The link's timer for a's end may not have run yet when b joins at (or within a
    # nanosecond of) that end: b's join finishes a, and a's reader must hear of it (it waited
    # forever: a hung emulated request, three times in a bench of ~300 turns).
    link: ProcessorSharing[str] = ProcessorSharing(bytes_per_s=1e9)
    link.add("a", 1e9, now=0.0)
    assert link.add("b", 1e9, now=1.0) == ["a"]
    link.add("c", 2e9, now=1.0)
    assert link.remove("c", now=3.0) == ["b"]  # c leaves as b ends


async def test_two_equal_reads_on_a_link_take_about_twice_one() -> None:
    link = Link(LinkModel(bandwidth_gb_s=1.0, fixed_ms=0.0), time_scale=1.0)
    loop = asyncio.get_running_loop()
    began = loop.time()
    await link.transfer(50_000_000)  # 50 ms alone
    one = loop.time() - began
    began = loop.time()
    await asyncio.gather(link.transfer(50_000_000), link.transfer(50_000_000))
    two = loop.time() - began
    # What the sleeps bound (no timing upper bounds: the machine may be loaded): alone 50 ms,
    # sharing the link each takes 100.
    assert one >= 0.05
    assert two >= 0.1
    assert link.transfers == 3


# -- engines -------------------------------------------------------------------------------------


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with session.post(f"{url}/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        got: dict[str, Any] = await response.json()
        return got


def engine(role: Any, model_dir: Path, profile: EngineProfile = PROFILE, **overrides: Any) -> StandinEngine:
    config = in_process_config(role, f"engine-{role}", model_dir, time_scale=SCALE, **overrides)
    return StandinEngine(with_profile(config, profile))


async def test_a_profile_timed_prefill_takes_the_profiles_time_and_decode_answers_from_its_kv(
    model_dir: Path,
) -> None:
    prefill, decode = engine("prefill", model_dir), engine("decode", model_dir)
    prompt = [(i * 7) % 500 + 10 for i in range(1000)]
    await prefill.start()
    await decode.start()
    try:
        async with aiohttp.ClientSession() as session:
            began = time.perf_counter()
            first = await post(
                session,
                prefill.url,
                {"model": "m", "prompt": prompt, "max_tokens": 1,
                 "kv_transfer_params": {"do_remote_decode": True}},
            )  # fmt: skip
            ttft = time.perf_counter() - began
            assert ttft >= PROFILE.prefill.ms(1000, 0) / 1e3 * SCALE
            params = first["kv_transfer_params"]
            began = time.perf_counter()
            body = {"model": "m", "prompt": prompt, "max_tokens": 10, "return_token_ids": True,
                    "kv_transfer_params": params}  # fmt: skip
            second = await post(session, decode.url, body)
            took = time.perf_counter() - began
        assert second["choices"][0]["token_ids"] == output_tokens(prompt, 10, decode.vocabulary)
        link = decode.core.link
        assert decode.stats()["kv_reads_total"] == 1 and link is not None
        assert link.bytes_moved == 32 * 32 * PROFILE.kv_bytes_per_token  # 1000 tokens: 32 blocks
        read = PROFILE.link.ms(link.bytes_moved)
        decode_steps = sum(PROFILE.decode.itl_ms(1, 1000 + i) for i in range(1, 10))
        assert took >= (read + PROFILE.prefill.ms(1, 999) + decode_steps) / 1e3 * SCALE
        assert prefill.cache.holdings() == 0  # decode's read freed prefill's blocks
    finally:
        await prefill.stop()
        await decode.stop()


async def test_a_stream_is_paced_per_step_and_a_failed_read_fails_under_policy_fail(model_dir: Path) -> None:
    decode = engine("decode", model_dir, kv_load_failure_policy="fail")
    await decode.start()
    try:
        async with aiohttp.ClientSession() as session:
            body = {"model": "m", "prompt": list(range(10, 110)), "max_tokens": 6, "stream": True}
            async with session.post(f"{decode.url}/v1/completions", json=body) as response:
                events = [line async for line in response.content if line.startswith(b"data: {")]
            assert len(events) == 6
            gone = {"do_remote_prefill": True, "remote_block_ids": [[0, 1, 2]], "remote_request_id": "gone",
                    "remote_num_tokens": 100,
                    "remote_host": "127.0.0.1", "remote_port": decode.side_channel_port}  # fmt: skip
            body = {"model": "m", "prompt": list(range(10, 110)), "kv_transfer_params": gone}
            async with session.post(f"{decode.url}/v1/completions", json=body) as response:
                assert response.status == 500
                assert (await response.json())["error"]["message"] == "KV load failed"
        assert decode.stats()["kv_load_failures_total"] == 1
        assert isinstance(decode.timing, SteppedTiming) and decode.timing.steps == 6
    finally:
        await decode.stop()


async def test_a_request_waits_for_blocks(model_dir: Path) -> None:
    # 64 blocks: one 1500-token request at a time. The first one holds its blocks for 200 decode
    # steps of 12.5 ms (2.5 s here, longer on a loaded machine: its steps are timers in this loop
    # too), so the second is seen waiting however late this test looks; it used to look once after
    # a fixed sleep, which a loaded machine overshot (both not yet arrived, or the first done).
    small = dataclasses.replace(
        PROFILE,
        engine=dataclasses.replace(PROFILE.engine, kv_capacity_tokens=64 * 32),
        decode=dataclasses.replace(PROFILE.decode, fixed_ms=250.0),
    )
    decode = engine("decode", model_dir, profile=small, prefix_caching=False)
    await decode.start()
    try:
        async with aiohttp.ClientSession() as session:
            prompts = [[(i * k) % 500 + 10 for i in range(1500)] for k in (3, 5)]
            tasks = [
                asyncio.create_task(post(session, decode.url, {"model": "m", "prompt": p, "max_tokens": n}))
                for p, n in zip(prompts, (200, 20), strict=True)
            ]
            while decode.timing.waiting != 1:
                assert not any(t.done() for t in tasks), "a request finished before the other waited"
                await asyncio.sleep(0.005)
            async with session.get(f"{decode.url}/metrics") as response:
                assert 'vllm:num_requests_waiting{engine="0",model_name="m"} 1' in await response.text()
            await asyncio.gather(*tasks)
        assert decode.timing.waiting == 0 and decode.cache.reserved == 0
    finally:
        await decode.stop()


async def test_a_4p_4d_cluster_in_one_loop_answers_on_every_engine(model_dir: Path) -> None:
    async with StandinCluster(model_dir, prefill=4, decode=4, profile=PROFILE, time_scale=SCALE) as cluster:
        endpoints = json.loads(json.dumps(cluster.endpoints()))
        assert [e["role"] for e in endpoints["engines"]] == ["prefill"] * 4 + ["decode"] * 4
        assert len({e["url"] for e in endpoints["engines"]}) == 8
        assert endpoints["block_size"] == 32
        prompt = list(range(10, 300))
        async with aiohttp.ClientSession() as session:
            body = {"model": "m", "prompt": prompt, "max_tokens": 4, "return_token_ids": True}
            answers = await asyncio.gather(*(post(session, e["url"], body) for e in endpoints["engines"]))
        vocabulary = cluster.engines[0].vocabulary
        for answer, e in zip(answers, endpoints["engines"], strict=True):
            count = 1 if e["role"] == "prefill" else 4
            assert answer["choices"][0]["token_ids"] == output_tokens(prompt, count, vocabulary)


async def test_a_local_answer_is_cached_and_prefill_time_is_counted(model_dir: Path) -> None:
    decode = engine("decode", model_dir)
    await decode.start()
    try:
        async with aiohttp.ClientSession() as session:
            prompt = list(range(10, 110))
            body = {"model": "m", "prompt": prompt, "max_tokens": 40, "return_token_ids": True}
            first = await post(session, decode.url, body)
            assert isinstance(decode.timing, SteppedTiming)
            assert decode.timing.prefill_ms == pytest.approx(PROFILE.prefill.ms(100, 0))
            assert decode.timing.busy_ms > decode.timing.prefill_ms
            # vLLM caches the answer's full blocks: the next turn finds prompt + answer - 1.
            history = prompt + first["choices"][0]["token_ids"]
            second = await post(session, decode.url, {**body, "prompt": [*history, 11, 12]})
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 128  # 139 tokens: 4 blocks
    finally:
        await decode.stop()


async def test_a_host_tier_offloads_answers_its_blocks_back_and_serves_a_peers_p2p_read(
    model_dir: Path,
) -> None:
    # vLLM's OffloadingConnector (offload_prompt_only: false) and llm-d's P2P read of a peer's
    # CPU tier: the source answers a plain request, its GPU cache is reset, and both a later
    # request on it and a peer's request find the prompt's blocks in its host tier.
    source, peer = engine("decode", model_dir, host_blocks=256), engine("prefill", model_dir)
    prompt = [(i * 11) % 500 + 10 for i in range(320)]  # 10 blocks of 32
    await source.start()
    await peer.start()
    try:
        async with aiohttp.ClientSession() as session:
            await post(session, source.url, {"model": "m", "prompt": prompt, "max_tokens": 4})
            assert len(source.core.host) == 10  # prompt + 3 answer tokens: 10 full blocks
            source.cache.clear()
            again = await post(session, source.url, {"model": "m", "prompt": prompt, "max_tokens": 1})
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 320  # from host memory
            p2p = {"p2p_source_engine": source.config.engine_id, "p2p_source_tokens": 320,
                   "p2p_source_url": f"http://127.0.0.1:{source.side_channel_port}"}  # fmt: skip
            body = {"model": "m", "prompt": prompt, "max_tokens": 1, "return_token_ids": True,
                    "kv_transfer_params": p2p}  # fmt: skip
            read = await post(session, peer.url, body)
        assert read["usage"]["prompt_tokens_details"]["cached_tokens"] == 320
        assert read["choices"][0]["token_ids"] == output_tokens(prompt, 1, peer.vocabulary)
        assert peer.core.counters.read_blocks == 10 and len(source.core.host) == 10  # not freed there
    finally:
        await peer.stop()
        await source.stop()
