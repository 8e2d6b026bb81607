"""The fleet's step timing (bench/emulator/fleet/stepping.py): a decode-only stretch slept
through in one wakeup must run exactly the steps SteppedTiming runs, one wakeup per step: the same
token times for every request, the same step count and busy time, however requests arrive, wait
on tokens part way and leave early."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bench.emulator.core.pool import BlockPool
from bench.emulator.core.timing import SteppedTiming
from bench.emulator.fleet import vtime
from bench.emulator.fleet.stepping import JumpingTiming
from deploy.profiles.schema import load_engine_profiles

PROFILE = load_engine_profiles(Path(__file__).parents[2] / "deploy/profiles/qwen3-32b-h200-tp2.toml")[0]

# (arrives at s, prompt tokens, output tokens, a token it waits for part way or None, leaves after
# that many tokens or None): long and short answers overlapping, one arriving mid-stretch, one
# client gone early.
REQUESTS = (
    (0.0, 3000, 300, None, None),
    (0.05, 800, 40, 10, None),
    (0.4, 5000, 150, None, None),
    (0.41, 200, 90, 45, 60),
    (2.0, 12000, 20, None, None),
)


async def _serve(timing: SteppedTiming) -> tuple[list[list[float]], int, float]:
    timing.start()
    loop = asyncio.get_running_loop()

    async def one(at: float, prompt: int, output: int, waits: int | None, leaves: int | None) -> list[float]:
        await asyncio.sleep(at - loop.time())
        run = timing.submit(prompt, 0, output)
        try:
            await run.prefilled()
            run.placed()
            if waits is not None:
                await run.token(waits)
                await asyncio.sleep(0.05)  # the client reads, then asks on
            if leaves is not None:
                await run.token(leaves)
            else:
                await run.finished()
            return list(run.request.token_times)  # type: ignore[attr-defined]
        finally:
            run.close()

    times = await asyncio.gather(*(one(*r) for r in REQUESTS))
    await timing.stop()
    return list(times), timing.steps, timing.busy_ms


def test_a_decode_stretch_in_one_wakeup_runs_the_steps_one_wakeup_each_would() -> None:
    def pool() -> BlockPool[int, int]:
        bs = PROFILE.engine.block_size
        return BlockPool(PROFILE.engine.kv_capacity_tokens // bs, bs)

    stepped = vtime.run(_serve(SteppedTiming(PROFILE, pool())))
    jumping = vtime.run(_serve(JumpingTiming(PROFILE, pool())))
    assert [len(t) for t in stepped[0]] == [300, 40, 150, 61, 20]
    assert jumping == stepped
