"""The emulator's step timing (bench/emulator/core/timing.py's `SteppedTiming`) for the fleet simulator,
where a decode-only stretch costs one wakeup instead of one per step.

Decoding, an engine runs a step per output token, and a step is a sleep, a timer and a trip
through the event loop: a Claude Code answer of 500 tokens was 500 wakeups of this process for
one request. While nothing can change the batch, the steps are known in advance: the same
sequences, each one token further per step, until one of them finishes or reaches a token its
request waits for. `JumpingTiming` sleeps once to the end of such a stretch (at most
`MAX_STRETCH_STEPS` steps) and applies its steps when it wakes; anything that could change the
next step (a request submitted or closed, blocks freed: `kick`) cuts the stretch at the end of
the step in progress, from which the engine goes on step by step as before.

Every step's batch, time and end are the ones `SteppedTiming` computes (the same arithmetic, in
the same order), and so is every token time and every wakeup of a waiting request: a run's
records are identical.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from deploy.profiles.schema import EngineProfile

from bench.emulator.core.pool import BlockPool
from bench.emulator.core.scheduler import EngineRequest, Step
from bench.emulator.core.timing import _MAX_LAG_S, SteppedTiming

__all__ = ["MAX_STRETCH_STEPS", "JumpingTiming"]

# A stretch is planned in full before it is slept through, and a kick throws away the rest of
# it: this bounds what a kick can waste, while one wakeup per 64 steps is already cheap.
MAX_STRETCH_STEPS: Final = 64


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class JumpingTiming(SteppedTiming):
    def __init__(self, profile: EngineProfile, pool: BlockPool[Any, Any], *, time_scale: float = 1.0) -> None:
        super().__init__(profile, pool, time_scale=time_scale)
        # The stretch being slept through: per step (ms, end, when its wakeup would have been),
        # and what a kick resolves to cut it.
        self._stretch: list[tuple[float, float, float]] = []
        self._cut: asyncio.Future[None] | None = None

    # Steps of the stretch in progress count from their end on, as if each had woken the loop.
    @property
    def busy_ms(self) -> float:
        busy = self._busy_ms
        now = asyncio.get_running_loop().time() if self._stretch else 0.0
        for ms, _, when in self._stretch:
            if when > now:
                break
            busy += ms
        return busy

    @busy_ms.setter
    def busy_ms(self, value: float) -> None:
        self._busy_ms = value

    @property
    def steps(self) -> int:
        if not self._stretch:
            return self._steps
        now = asyncio.get_running_loop().time()
        return self._steps + sum(1 for _, _, when in self._stretch if when <= now)

    @steps.setter
    def steps(self, value: int) -> None:
        self._steps = value

    def kick(self) -> None:
        super().kick()
        if self._cut is not None:
            _resolve(self._cut)

    async def _run(self, step: Step, end: float) -> float:
        steps = self._plan(step, end, asyncio.get_running_loop().time())
        if len(steps) == 1:
            return await super()._run(step, end)
        return await self._sleep_through(step.decodes, steps)

    def _plan(self, first: Step, end: float, now: float) -> list[tuple[float, float, float]]:
        """The steps from `first` (ending at `end`) that run unchanged unless kicked: (ms, end,
        wakeup) each, as SteppedTiming would compute them; one when `first` may be followed by
        anything else."""
        decodes = first.decodes
        if first.chunks or self.scheduler.waiting or len(decodes) != self.scheduler.running:
            return [(first.ms, end, 0.0)]
        # Steps until one of them finishes a sequence or reaches a token a request waits for.
        left = MAX_STRETCH_STEPS
        for request in decodes:
            done = len(request.token_times)
            left = min(left, request.output - done)
            run = self._runs.get(request)
            if run is not None:
                if done > run.awaiting:
                    return [(first.ms, end, 0.0)]  # woken, and not yet waiting again: unknown
                left = min(left, run.awaiting + 1 - done)
        if left <= 1:
            return [(first.ms, end, 0.0)]
        # Scheduler.step_ms of a decode-only step: the profile's ITL at the batch's context.
        batch, ctx = len(decodes), sum(r.context for r in decodes)
        itl, scale = self.profile.decode.itl_ms, self.time_scale
        when = now + (end - now)  # asyncio.sleep(end - now)'s timer
        steps = [(first.ms, end, when)]
        for k in range(1, left):
            ms = 0.0 + itl(batch, ctx + k * batch)
            end = max(end, when - _MAX_LAG_S) + ms / 1e3 * scale
            when = when + (end - when)
            steps.append((ms, end, when))
        return steps

    async def _sleep_through(
        self, decodes: tuple[EngineRequest, ...], steps: list[tuple[float, float, float]]
    ) -> float:
        """Sleep to the stretch's last wakeup, or to the end of the step in progress when kicked
        before; apply the steps done. The last one's end."""
        loop = asyncio.get_running_loop()
        self._stretch = steps
        cut = self._cut = loop.create_future()
        timer = loop.call_at(steps[-1][2], _resolve, cut)
        try:
            await cut
            self._cut = None  # the step in progress runs to its end whatever happens now
            now = loop.time()
            done = next((i for i, (_, _, when) in enumerate(steps) if when > now), len(steps) - 1)
            if steps[done][2] > now:
                timer.cancel()
                rest = loop.create_future()
                timer = loop.call_at(steps[done][2], _resolve, rest)
                await rest
        finally:
            timer.cancel()
            self._cut = None
            self._stretch = []
        # The steps before the last: a token each for every sequence, nothing finished or
        # awaited (that is where the stretch ends), as SteppedTiming's step ends would leave them.
        ends = [end for _, end, _ in steps[:done]]
        for request in decodes:
            request.token_times.extend(ends)
        busy = self._busy_ms
        for ms, _, _ in steps[:done]:
            busy += ms
        self._busy_ms, self._steps = busy, self._steps + done
        ms, end, _ = steps[done]
        self._finish(Step((), decodes, ms), end)
        return end
