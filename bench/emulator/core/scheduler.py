"""A vLLM engine's step scheduler, timed by an engine profile (deploy/profiles): pure logic, no
clock and no sleeps. bench/emulator/core/timing.py drives it in an event loop; `simulate` drives it
with a fake clock.

vLLM V1's loop, reduced to what decides time: one forward (step) at a time. Each step gives every
running sequence that has its first token one more (decode), then fills what is left of the token
budget (max_num_batched_tokens) with prefill chunks: partial prefills first, then waiting requests
in arrival order while the batch has room (max_batch sequences) and the KV pool gives them blocks
(a waiting head that does not fit blocks the queue, as vLLM's FCFS does). The step that computes a
prompt's last token samples its first output token.

A step's time (ms) is its prefill part plus its decode part:
* prefill: `prefill.fixed_ms` once, plus for each chunk of c tokens with k tokens before it
  (cached, read or computed by earlier chunks): per_token_ms*c + per_pair_ns*1e-6*(c*k + c(c+1)/2),
  and per_cached_token_ms times the request's cached tokens on its first chunk. A prompt computed
  in one step takes exactly `PrefillModel.ms(computed, cached)`; chunked, the token and pair terms
  add up to the same and each step adds its fixed_ms (the cached term counts once, not per chunk).
* decode: `DecodeModel.itl_ms(batch, ctx)` when any sequence decodes, ctx being the tokens of
  context of every decoding sequence.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from deploy.profiles.schema import EngineProfile

__all__ = ["BlockBudget", "Chunk", "EngineRequest", "Scheduler", "Step", "simulate"]


class BlockBudget(Protocol):
    """Where admitted requests get their KV blocks (bench/emulator/core/pool.py's BlockPool)."""

    def try_reserve(self, blocks: int) -> bool: ...

    def unreserve(self, blocks: int) -> None: ...


@dataclass(eq=False)
class EngineRequest:
    """One request in the engine: `cached` prompt tokens already have KV (prefix hit or read),
    the rest are computed; `output` tokens are sampled, the first by the last prefill chunk."""

    prompt: int
    cached: int
    output: int
    blocks: int
    arrived_at: float
    computed: int = 0  # prompt tokens computed so far
    token_times: list[float] = field(default_factory=list)
    reserved: bool = False  # holds `blocks` of the budget

    @property
    def prefilled(self) -> bool:
        return self.cached + self.computed >= self.prompt

    @property
    def finished(self) -> bool:
        return len(self.token_times) >= self.output

    @property
    def context(self) -> int:
        """Tokens the next decode step attends over (the one it feeds in included)."""
        return self.prompt + len(self.token_times)


@dataclass(frozen=True, slots=True)
class Chunk:
    request: EngineRequest
    tokens: int
    position: int  # tokens before the chunk


@dataclass(frozen=True, slots=True)
class Step:
    chunks: tuple[Chunk, ...]
    decodes: tuple[EngineRequest, ...]
    ms: float


class Scheduler:
    """One engine's queue and batch; `budget` None: blocks are not counted."""

    def __init__(self, profile: EngineProfile, budget: BlockBudget | None = None) -> None:
        self.profile = profile
        self.budget = budget
        self._waiting: deque[EngineRequest] = deque()
        self._running: list[EngineRequest] = []  # admitted, in admission order

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def add(self, prompt: int, cached: int, output: int, now: float, blocks: int = 0) -> EngineRequest:
        """Queue a request. vLLM computes at least the prompt's last token (its logits sample
        the first output token), so at most prompt - 1 tokens count as cached."""
        if prompt < 1 or output < 1:
            raise ValueError("a request has at least one prompt and one output token")
        request = EngineRequest(prompt, max(0, min(cached, prompt - 1)), output, blocks, now)
        self._waiting.append(request)
        return request

    def abort(self, request: EngineRequest) -> None:
        """The request leaves (its client went away, or it finished being served)."""
        if request in self._waiting:
            self._waiting.remove(request)
        if request in self._running:
            self._running.remove(request)
        self.release(request)

    def release(self, request: EngineRequest) -> None:
        """Its blocks are no longer reserved (placed in the pool, or never needed)."""
        if request.reserved and self.budget is not None:
            self.budget.unreserve(request.blocks)
        request.reserved = False

    def next_step(self) -> Step | None:
        """The next forward's batch and time; None when there is nothing it could run."""
        limits = self.profile.engine
        left = limits.max_num_batched_tokens
        decodes = tuple(r for r in self._running if r.prefilled and not r.finished)
        left -= len(decodes)
        chunks: list[Chunk] = []
        for request in self._running:
            if left <= 0:
                break
            if not request.prefilled:
                chunks.append(self._chunk(request, left))
                left -= chunks[-1].tokens
        while self._waiting and left > 0 and len(self._running) < self.profile.decode.max_batch:
            head = self._waiting[0]
            if self.budget is not None:
                if not self.budget.try_reserve(head.blocks):
                    break
                head.reserved = True
            self._running.append(self._waiting.popleft())
            chunks.append(self._chunk(head, left))
            left -= chunks[-1].tokens
        if not chunks and not decodes:
            return None
        return Step(tuple(chunks), decodes, self.step_ms(chunks, decodes))

    def step_ms(self, chunks: Sequence[Chunk], decodes: Sequence[EngineRequest]) -> float:
        prefill, ms = self.profile.prefill, 0.0
        for chunk in chunks:
            c, k = chunk.tokens, chunk.position
            ms += prefill.per_token_ms * c + prefill.per_pair_ns * 1e-6 * (c * k + c * (c + 1) / 2)
            if chunk.request.computed == 0:
                ms += prefill.per_cached_token_ms * chunk.request.cached
        if chunks:
            ms += prefill.fixed_ms
        if decodes:
            ms += self.profile.decode.itl_ms(len(decodes), sum(r.context for r in decodes))
        return ms

    def finish_step(self, step: Step, now: float) -> list[EngineRequest]:
        """The step ended at `now`: chunks computed, tokens sampled. The requests that got a
        token; finished ones leave the batch and release their blocks."""
        got: list[EngineRequest] = []
        for chunk in step.chunks:
            chunk.request.computed += chunk.tokens
            if chunk.request.prefilled:
                got.append(chunk.request)
        got += step.decodes
        for request in got:
            request.token_times.append(now)
            if request.finished:
                self.abort(request)
        return got

    @staticmethod
    def _chunk(request: EngineRequest, left: int) -> Chunk:
        done = request.cached + request.computed
        return Chunk(request, min(request.prompt - done, left), done)


def simulate(
    profile: EngineProfile, arrivals: Iterable[tuple[float, int, int, int]], budget: BlockBudget | None = None
) -> list[EngineRequest]:
    """One engine under a fake clock: `arrivals` as (seconds, prompt, cached, output tokens),
    each request's token times back, in arrival order (a request arriving during a step joins
    the next one). Requests that never fit the budget keep no token times."""
    scheduler = Scheduler(profile, budget)
    pending = deque(sorted(arrivals))
    requests: list[EngineRequest] = []
    now = 0.0
    while True:
        while pending and pending[0][0] <= now:
            at, prompt, cached, output = pending.popleft()
            blocks = -(-(prompt + output - 1) // profile.engine.block_size)
            requests.append(scheduler.add(prompt, cached, output, at, blocks))
        step = scheduler.next_step()
        if step is not None:
            now += step.ms / 1e3
            scheduler.finish_step(step, now)
        elif pending:
            now = pending[0][0]
        else:
            return requests
