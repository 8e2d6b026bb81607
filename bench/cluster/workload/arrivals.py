"""Open-loop session arrivals: sessions start as a Poisson process at a given rate whatever the
system's state (open loop: a slow system does not slow the arrivals, so past saturation the
queues grow, which is what the rate ladder is for). Within a session the turns are closed-loop:
a turn is sent after the previous answer completed (a client cannot send turn k+1 before it
has answer k), at the later of its recorded offset and that completion, or its think time after it.

A schedule is a ladder of increasing rates, one window each; each step draws sessions it has not
used (a session replayed twice would find its own private blocks cached), so the trace must hold
enough sessions for the whole ladder. The replayer stops climbing when it sees saturation (that
judgement is the emulator's, not the schedule's).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from bench.cluster.workload.model import Request, Session


@dataclass(frozen=True, slots=True)
class Arrival:
    time_s: float
    session: Session


@dataclass(frozen=True, slots=True)
class RateStep:
    rate_per_s: float
    start_s: float
    window_s: float
    arrivals: tuple[Arrival, ...]


def poisson_times(rate_per_s: float, start_s: float, window_s: float, rng: random.Random) -> list[float]:
    """Arrival times of a Poisson process of `rate_per_s` in [start_s, start_s + window_s)."""
    if rate_per_s <= 0:
        raise ValueError(f"rate {rate_per_s} is not positive")
    times, t = [], start_s + rng.expovariate(rate_per_s)
    while t < start_s + window_s:
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return times


def rate_ladder(first_per_s: float, factor: float, steps: int) -> list[float]:
    """first, first * factor, first * factor**2, ...: `steps` increasing session rates."""
    if first_per_s <= 0 or factor <= 1 or steps < 1:
        raise ValueError("a ladder climbs: first > 0, factor > 1, steps >= 1")
    return [first_per_s * factor**i for i in range(steps)]


def open_loop_schedule(
    sessions: Sequence[Session], rates: Sequence[float], window_s: float, seed: int
) -> list[RateStep]:
    """One window per rate, back to back, each with Poisson session starts; sessions are drawn
    without replacement in a seeded order. Raises ValueError when the trace runs out."""
    rng = random.Random(seed)
    order = list(range(len(sessions)))
    rng.shuffle(order)
    steps, used = [], 0
    for i, rate in enumerate(rates):
        start = i * window_s
        times = poisson_times(rate, start, window_s, rng)
        if used + len(times) > len(sessions):
            raise ValueError(
                f"rate {rate:g}/s needs {used + len(times)} sessions by its window's end; "
                f"the trace has {len(sessions)}"
            )
        arrivals = tuple(Arrival(t, sessions[order[used + j]]) for j, t in enumerate(times))
        used += len(times)
        steps.append(RateStep(rate, start, window_s, arrivals))
    return steps


def send_time_s(request: Request, session_start_s: float, previous_done_s: float | None) -> float:
    """When a turn is sent: the first at the session's start; a later one at its recorded offset
    but never before the previous answer completed (`previous_done_s`), or its think time after."""
    if previous_done_s is None:
        return session_start_s
    if request.think_time_ms is not None:
        return previous_done_s + request.think_time_ms / 1000
    assert request.arrival_offset_ms is not None
    return max(session_start_s + request.arrival_offset_ms / 1000, previous_done_s)


__all__ = ["Arrival", "RateStep", "open_loop_schedule", "poisson_times", "rate_ladder", "send_time_s"]
