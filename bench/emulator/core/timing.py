"""How long a stand-in engine (bench/emulator/http/engine.py) takes: a request's `Run` paces its
answer (prefill done, each output token, the end).

* `FixedTiming`: the stand-in's own flat costs (`--prefill-us-per-token`,
  `--decode-ms-per-token`), each request on its own, as without a profile.
* `SteppedTiming`: an engine profile (deploy/profiles) driving the step scheduler
  (bench/emulator/core/scheduler.py): one forward at a time, slept for its modelled time times
  `time_scale`; requests wait for blocks of the engine's pool and for each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Final, Protocol

from deploy.profiles.schema import EngineProfile

from bench.emulator.core.pool import BlockPool, CacheFull
from bench.emulator.core.scheduler import EngineRequest, Scheduler, Step

__all__ = ["EngineDied", "FixedTiming", "Run", "SteppedTiming", "Timing"]

log = logging.getLogger(__name__)

# A request waiting for blocks looks again this often (real seconds) even without a kick.
_RECHECK_S: Final = 0.05
# A driver this far behind its schedule (real seconds: a loaded machine) drops the lag rather
# than running the missed steps back to back.
_MAX_LAG_S: Final = 0.02


class Run(Protocol):
    """One request's pace; `close` whatever happens."""

    async def prefilled(self) -> None:
        """Until its prompt is computed (its first output token is out)."""

    async def token(self, index: int) -> None:
        """Until output token `index` may be sent."""

    async def finished(self) -> None:
        """Until its last output token is out."""

    def placed(self) -> None:
        """Its blocks are in the pool now: the reservation it was admitted with ends."""

    def close(self) -> None: ...


class Timing(Protocol):
    @property
    def waiting(self) -> int:
        """Requests queued for admission (vLLM's num_requests_waiting)."""

    def submit(self, prompt: int, cached: int, output: int) -> Run:
        """A request of `prompt` tokens, `cached` of them with KV already, answering `output`
        tokens. Raises CacheFull when it could never fit."""

    def kick(self) -> None:
        """Blocks were freed: a waiting request may fit now."""

    def start(self) -> None: ...

    async def stop(self) -> None: ...


class _FixedRun:
    def __init__(self, computed: int, output: int, prefill_s_per_token: float, decode_s: float) -> None:
        self._prefill_s = computed * prefill_s_per_token
        self._output = output
        self._decode_s = decode_s

    async def prefilled(self) -> None:
        await asyncio.sleep(self._prefill_s)

    async def token(self, index: int) -> None:
        await asyncio.sleep(self._decode_s)

    async def finished(self) -> None:
        await asyncio.sleep(self._decode_s * self._output)

    def placed(self) -> None:
        pass

    def close(self) -> None:
        pass


class FixedTiming:
    """Flat costs per request: `prefill_us_per_token` per computed token, `decode_ms_per_token`
    per output token (0 on a prefill engine), times `time_scale`."""

    def __init__(
        self, prefill_us_per_token: float, decode_ms_per_token: float, time_scale: float = 1.0
    ) -> None:
        self._prefill_s = prefill_us_per_token / 1e6 * time_scale
        self._decode_s = decode_ms_per_token / 1e3 * time_scale

    @property
    def waiting(self) -> int:
        return 0

    def submit(self, prompt: int, cached: int, output: int) -> Run:
        return _FixedRun(prompt - cached, output, self._prefill_s, self._decode_s)

    def kick(self) -> None:
        pass

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


class EngineDied(RuntimeError):
    """The engine's step loop ended with an error: its requests fail (HTTP 500) instead of
    waiting forever for steps that will not come."""


class _SteppedRun:
    def __init__(self, owner: SteppedTiming, request: EngineRequest) -> None:
        self._owner = owner
        self.request = request
        self.progress = asyncio.Event()
        # The token index awaited: the step loop wakes this run only once it is out (a run
        # awaiting its last token is not woken by each of the steps before it).
        self.awaiting = 0

    async def prefilled(self) -> None:
        await self.token(0)

    async def token(self, index: int) -> None:
        self.awaiting = index
        while len(self.request.token_times) <= index:
            if self._owner.failure is not None:
                raise EngineDied("the engine's step loop died") from self._owner.failure
            self.progress.clear()
            await self.progress.wait()

    async def finished(self) -> None:
        await self.token(self.request.output - 1)

    def placed(self) -> None:
        self._owner.scheduler.release(self.request)
        self._owner.kick()

    def close(self) -> None:
        self._owner.close(self)


class SteppedTiming:
    """One engine's scheduler, driven in real time: each step sleeps its modelled ms times
    `time_scale`; requests reserve blocks of `pool` for prompt + output - 1 tokens (what a
    decode engine retains; a prefill engine answers one token)."""

    def __init__(self, profile: EngineProfile, pool: BlockPool[Any, Any], *, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError("time_scale must be positive")
        self.profile = profile
        self.pool = pool
        self.time_scale = time_scale
        self.scheduler = Scheduler(profile, pool)
        self._runs: dict[EngineRequest, _SteppedRun] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.steps = 0
        # Modelled ms (the profile's hardware, not times time_scale) of the steps run: in all,
        # and their prefill parts (what a benchmark counts as GPU time spent prefilling).
        self.busy_ms = 0.0
        self.prefill_ms = 0.0
        # Why the step loop died, if it did.
        self.failure: BaseException | None = None

    @property
    def waiting(self) -> int:
        return self.scheduler.waiting

    def submit(self, prompt: int, cached: int, output: int) -> Run:
        if self.failure is not None:
            raise EngineDied("the engine's step loop died") from self.failure
        blocks = -(-(prompt + output - 1) // self.pool.block_size)
        if blocks > self.pool.num_blocks:
            tokens = prompt + output - 1
            raise CacheFull(f"{tokens} tokens need {blocks} blocks; the pool has {self.pool.num_blocks}")
        now = asyncio.get_running_loop().time()
        run = _SteppedRun(self, self.scheduler.add(prompt, cached, output, now, blocks))
        self._runs[run.request] = run
        self.kick()
        return run

    def close(self, run: _SteppedRun) -> None:
        self._runs.pop(run.request, None)
        self.scheduler.abort(run.request)
        self.kick()

    def kick(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._drive())
        self._task.add_done_callback(self._driver_done)

    def _driver_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        self.failure = task.exception()
        log.error("the step loop died: %r", self.failure)
        for run in self._runs.values():
            run.progress.set()  # each fails (EngineDied) rather than waiting on

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            # Cancelled, or dead already (its error logged and kept in `failure`).
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        end = loop.time()  # when the last step ended, on schedule
        while True:
            step = self.scheduler.next_step()
            if step is None:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(_RECHECK_S if self.scheduler.waiting else None):
                        await self._wake.wait()
                end = loop.time()
                continue
            # Steps are laid end to end on the schedule, so sleeping late now and then does not
            # slow the engine down.
            end = await self._run(step, max(end, loop.time() - _MAX_LAG_S) + step.ms / 1e3 * self.time_scale)

    async def _run(self, step: Step, end: float) -> float:
        """Run `step`, due to end at `end`: sleep to it, then finish it. When the last step run
        ended (a subclass may run more than one)."""
        await asyncio.sleep(end - asyncio.get_running_loop().time())
        self._finish(step, end)
        return end

    def _finish(self, step: Step, end: float) -> None:
        """A step's end: counted, its tokens out, the requests waiting on them woken."""
        self.steps += 1
        self.busy_ms += step.ms
        if step.chunks:
            self.prefill_ms += self.scheduler.step_ms(step.chunks, ())
        for request in self.scheduler.finish_step(step, end):
            run = self._runs.get(request)
            if run is not None and (len(request.token_times) > run.awaiting or request.finished):
                run.progress.set()
