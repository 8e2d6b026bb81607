"""Replaying a session trace against one policy: open-loop session starts (workload/arrivals.py),
closed-loop turns, the prompts each turn sends, and one record per turn.

Prompts: a session's first prompt is its trace prompt's tokens (workload/tokens.py). A later
prompt is what an agent client sends: the previous prompt, the answer the engine actually gave
(its ids), then the tokens the trace appends after the recorded answer. With `edit_fraction`, that
share of later turns resends the history edited (the answer's first token changed, as a chat
template re-rendering the assistant message does): whoever reuses decode's KV without checking
that the prompt extends it answers those turns from the wrong KV.

Times: the engines run `time_scale` times faster than the profile's hardware, and the replay
scales the trace's times (arrivals, think times) the same way; records are in the profile's
time (real seconds / time_scale). With `horizon_s` no turn is sent after it, and the turns still
in flight `drain_s` after it are cut. A turn is `wrong` when its answer differs from a clean
recompute of its prompt (bench/emulator/http/kv.py's `output_tokens`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import aiohttp

from bench.cluster.client import TurnFailed
from bench.cluster.policies import Policy, Turn
from bench.cluster.workload.arrivals import Arrival, send_time_s
from bench.cluster.workload.model import Request
from bench.cluster.workload.tokens import TokenMap

CUT = "cut: in flight at the step's end"  # a turn's error when the step's drain ended it


@dataclass
class TurnRecord:
    session: str
    turn: int
    sent_s: float
    prompt_tokens: int
    max_tokens: int
    edited: bool
    reason: str = ""
    reused_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    wrong: bool = False
    error: str | None = None


@dataclass(frozen=True)
class ReplayConfig:
    token_map: TokenMap
    vocab_size: int
    time_scale: float
    max_model_len: int
    max_output: int
    max_turns: int
    edit_fraction: float
    seed: int
    # No turn is sent later than this (profile seconds after the replay began): a step's length
    # bound, as a measurement window; the sessions still running end there. None: no bound.
    horizon_s: float | None = None
    # With a horizon: the turns still in flight this long after it are cut (an error each), so
    # that a hung request does not hold the step for the client's 60 s silence timeout.
    drain_s: float = 15.0


def think_s(requests: Sequence[Request], i: int, max_turns: int) -> float | None:
    """The think time the trace gives after turn `i`'s answer (profile seconds), if a next turn
    is replayed and its time is a think time (a recorded trace's offsets are not)."""
    if i + 1 >= min(len(requests), max_turns):
        return None
    after = requests[i + 1].think_time_ms
    return None if after is None else after / 1000


class Replay:
    """One policy's run over `arrivals`; `expected(prompt, n)`: a clean recompute's answer."""

    def __init__(
        self,
        policy: Policy,
        config: ReplayConfig,
        expected: Callable[[list[int], int], list[int]],
    ) -> None:
        self.policy, self.config, self.expected = policy, config, expected
        self.records: list[TurnRecord] = []
        self._t0 = 0.0

    def now_s(self) -> float:
        """Profile time since the replay began."""
        return (time.monotonic() - self._t0) / self.config.time_scale

    async def _sleep_until(self, at_s: float) -> None:
        delay = (at_s - self.now_s()) * self.config.time_scale
        if delay > 0:
            await asyncio.sleep(delay)

    async def run(self, http: aiohttp.ClientSession, arrivals: Sequence[Arrival]) -> list[TurnRecord]:
        self._t0 = time.monotonic()
        cfg = self.config
        sessions = [asyncio.create_task(self._session(http, a)) for a in arrivals]
        if not sessions:
            return self.records
        end = None if cfg.horizon_s is None else (cfg.horizon_s + cfg.drain_s) * cfg.time_scale
        done, pending = await asyncio.wait(sessions, timeout=end)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()  # a bug in a session raises here
        return self.records

    def _edit(self, token: int) -> int:
        return token + 1 if token + 1 < self.config.vocab_size else self.config.token_map.reserved

    async def _session(self, http: aiohttp.ClientSession, arrival: Arrival) -> None:
        cfg, session = self.config, arrival.session
        rng = random.Random(f"{cfg.seed}-{session.session_id}")
        await self._sleep_until(arrival.time_s)
        prompt: list[int] = []
        done_s: float | None = None
        edited = False  # this turn's history was resent edited
        for i, request in enumerate(session.requests[: cfg.max_turns]):
            trace = [
                int(t)
                for t in cfg.token_map.prompt(request.hash_ids, request.input_tokens, session.block_size)
            ]
            max_tokens = min(request.output_tokens, cfg.max_output)
            if i:
                previous = session.requests[i - 1]
                appended = trace[min(previous.input_tokens + previous.output_tokens, len(trace) - 1) :]
                prompt += appended
            else:
                prompt = trace
            if len(prompt) + max_tokens > cfg.max_model_len:
                return  # the session ends where its context would not fit
            send_s = send_time_s(request, arrival.time_s, done_s)
            if cfg.horizon_s is not None and send_s > cfg.horizon_s:
                return
            await self._sleep_until(send_s)
            record = TurnRecord(session.session_id, i, self.now_s(), len(prompt), max_tokens, edited)
            self.records.append(record)
            turn = Turn(session.session_id, prompt, max_tokens, think_s(session.requests, i, cfg.max_turns))
            sent = time.monotonic()
            try:
                served = await self.policy.serve(http, turn)
            except asyncio.CancelledError:
                record.error = CUT
                raise
            except (TurnFailed, aiohttp.ClientError, TimeoutError, KeyError, ValueError) as exc:
                record.error = f"{type(exc).__name__}: {exc}"[:300]
                return
            done_s = self.now_s()
            answer = served.answer
            record.reason, record.reused_tokens = served.reason, served.reused_tokens
            if answer.token_times:
                scale = cfg.time_scale
                record.ttft_s = (answer.token_times[0] - sent) / scale
                record.itl_s = [
                    (b - a) / scale for a, b in zip(answer.token_times, answer.token_times[1:], strict=False)
                ]
            record.wrong = answer.ids != self.expected(prompt, max_tokens)
            # The next turn's history: this prompt and the answer as given, or edited.
            history = list(answer.ids)
            edited = bool(history) and rng.random() < cfg.edit_fraction
            if edited:
                history[0] = self._edit(history[0])
            prompt = prompt + history


__all__ = ["CUT", "Replay", "ReplayConfig", "TurnRecord"]
