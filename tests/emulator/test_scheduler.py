"""The profile-timed scheduler (bench/emulator/core/scheduler.py) under a fake clock: its times are the
profile's formulas, exactly."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from bench.emulator.core.pool import BlockPool
from bench.emulator.core.scheduler import EngineRequest, Scheduler, simulate
from bench.emulator.core.timing import EngineDied, SteppedTiming
from deploy.profiles.schema import DecodeModel, EngineLimits, EngineProfile, Hardware

from kvshuttle.router.cost import LinkModel, PrefillModel

PROFILE = EngineProfile(
    model="m",
    kv_bytes_per_token=1000,
    min_reuse_tokens=64,
    prefill=PrefillModel(fixed_ms=10.0, per_token_ms=0.1, per_cached_token_ms=0.01, per_pair_ns=2.0),
    link=LinkModel(bandwidth_gb_s=1.0, fixed_ms=5.0),
    decode=DecodeModel(fixed_ms=8.0, per_seq_ms=0.5, per_ctx_token_ns=100.0, max_batch=16),
    engine=EngineLimits(
        kv_capacity_tokens=16 * 1024, block_size=16, max_num_batched_tokens=1024, gpu_memory_utilization=0.9
    ),
    hardware=Hardware(gpu="cpu", tp=1, gpus_per_engine=1, gpu_memory_gib=1.0),
)


def ttft(request: EngineRequest) -> float:
    return request.token_times[0] - request.arrived_at


def test_one_requests_ttft_is_the_profiles_prefill_formula() -> None:
    (alone,) = simulate(PROFILE, [(0.0, 800, 0, 1)])
    assert ttft(alone) == pytest.approx(PROFILE.prefill.ms(800, 0) / 1e3, rel=1e-12)
    (hit,) = simulate(PROFILE, [(0.0, 800, 600, 1)])
    assert ttft(hit) == pytest.approx(PROFILE.prefill.ms(200, 600) / 1e3, rel=1e-12)
    assert ttft(hit) < ttft(alone) / 2  # a prefix hit cuts prefill time


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    (request,) = simulate(PROFILE, [(0.0, 800, 800, 1)])
    assert ttft(request) == pytest.approx(PROFILE.prefill.ms(1, 799) / 1e3)


def test_a_long_prompt_is_chunked_and_each_step_adds_its_fixed_cost() -> None:
    (request,) = simulate(PROFILE, [(0.0, 2500, 0, 1)])  # 1024 + 1024 + 452
    expected = PROFILE.prefill.ms(2500, 0) + 2 * PROFILE.prefill.fixed_ms
    assert ttft(request) * 1e3 == pytest.approx(expected)


def test_two_concurrent_prefills_serialize() -> None:
    first, second = simulate(PROFILE, [(0.0, 1024, 0, 1), (0.0, 1024, 0, 1)])
    one = PROFILE.prefill.ms(1024, 0) / 1e3
    assert ttft(first) == pytest.approx(one)
    assert ttft(second) == pytest.approx(2 * one)
    # Two short ones share one step (one forward): both wait for the whole batch.
    a, b = simulate(PROFILE, [(0.0, 300, 0, 1), (0.0, 300, 0, 1)])
    assert ttft(a) == ttft(b) > PROFILE.prefill.ms(300, 0) / 1e3


def test_decode_steps_are_the_itl_formula_and_grow_with_the_batch() -> None:
    (alone,) = simulate(PROFILE, [(0.0, 100, 0, 5)])
    gaps = [b - a for a, b in zip(alone.token_times, alone.token_times[1:], strict=False)]
    assert gaps[0] * 1e3 == pytest.approx(PROFILE.decode.itl_ms(1, 101))
    assert gaps[-1] * 1e3 == pytest.approx(PROFILE.decode.itl_ms(1, 104))
    batch = simulate(PROFILE, [(0.0, 100, 0, 5)] * 8)
    assert all(len(r.token_times) == 5 for r in batch)
    gap8 = batch[0].token_times[2] - batch[0].token_times[1]
    assert gap8 * 1e3 == pytest.approx(PROFILE.decode.itl_ms(8, 8 * 102))
    assert gap8 > gaps[1]


def test_chunked_prefill_interleaves_with_decode() -> None:
    decoding, long = simulate(PROFILE, [(0.0, 100, 0, 40), (0.05, 3000, 0, 1)])
    gaps = [b - a for a, b in zip(decoding.token_times, decoding.token_times[1:], strict=False)]
    plain = PROFILE.decode.itl_ms(1, 110) / 1e3
    # While the long prompt is prefilled, each decode step also carries one of its chunks: the
    # decode sequence keeps getting a token every step, but a slower one.
    slowed = [g for g in gaps if g > 2 * plain]
    assert len(slowed) == 3  # 1023 + 1023 + 954 tokens: three chunks beside a decode token
    assert max(slowed) < (PROFILE.prefill.ms(1023, 2000) + PROFILE.decode.itl_ms(1, 200)) / 1e3
    assert long.token_times[0] < decoding.token_times[-1]


def test_admission_waits_for_blocks() -> None:
    pool = BlockPool[int, int](num_blocks=100, block_size=16)
    first, second = simulate(PROFILE, [(0.0, 1000, 0, 10), (0.0, 1000, 0, 10)], budget=pool)
    assert second.token_times[0] > first.token_times[-1]  # 63 blocks each: one at a time
    assert pool.reserved == 0


def test_admission_stops_at_max_batch() -> None:
    profile = dataclasses.replace(PROFILE, decode=dataclasses.replace(PROFILE.decode, max_batch=2))
    scheduler = Scheduler(profile)
    for _ in range(3):
        scheduler.add(10, 0, 4, 0.0)
    step = scheduler.next_step()
    assert step is not None and len(step.chunks) == 2 and scheduler.waiting == 1


async def test_requests_fail_rather_than_hang_when_the_step_loop_dies() -> None:
    timing = SteppedTiming(PROFILE, BlockPool[int, int](num_blocks=1024, block_size=16), time_scale=0.001)
    timing.start()
    waiting = timing.submit(100, 0, 4)

    def broken(*_: object) -> None:
        raise ZeroDivisionError("a bug in a step")

    timing.scheduler.next_step = broken  # type: ignore[method-assign]
    timing.kick()
    with pytest.raises(EngineDied):
        await asyncio.wait_for(waiting.prefilled(), 5)
    with pytest.raises(EngineDied):
        timing.submit(100, 0, 4)
    await timing.stop()
