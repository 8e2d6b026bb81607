"""Figures of a session trace: sessions, turns, turns per session, token counts, and the
shared-prefix (cache) ratio.

Cache ratio: the fraction of all prompt tokens an unbounded prefix cache holds when the requests
arrive in the trace's order: a request hits its longest prefix of blocks some earlier request
had (ids are prefix-chained, so a known id means a known prefix). Split by who brought the
blocks: the same session (earlier turns) or another (a shared system prompt or document). Order:
the recorded one (session start + arrival offset) when every request has one, else the sessions
one after another.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.cluster.workload.model import Session

_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 32), (33, None))


@dataclass(frozen=True, slots=True)
class Quantiles:
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @staticmethod
    def of(values: Sequence[float]) -> Quantiles:
        a = np.asarray(values, dtype=np.float64)
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return Quantiles(float(a.mean()), float(p50), float(p90), float(p99), float(a.max()))

    def __str__(self) -> str:
        return (
            f"mean {self.mean:,.1f}  p50 {self.p50:,.0f}  p90 {self.p90:,.0f}  "
            f"p99 {self.p99:,.0f}  max {self.max:,.0f}"
        )


@dataclass(frozen=True, slots=True)
class TraceStats:
    sessions: int
    requests: int
    turns_per_session: Quantiles
    turns_histogram: dict[str, int]
    input_tokens: Quantiles
    output_tokens: Quantiles
    cache_ratio: float
    cache_ratio_same_session: float
    cache_ratio_other_sessions: float
    recorded_order: bool


def _order(sessions: Sequence[Session]) -> tuple[list[tuple[int, int]], bool]:
    recorded = all(
        s.start_ms is not None and all(r.arrival_offset_ms is not None for r in s.requests) for s in sessions
    )
    pairs = [(s, r) for s, session in enumerate(sessions) for r in range(len(session.requests))]
    if recorded:

        def at(pair: tuple[int, int]) -> float:
            session = sessions[pair[0]]
            offset = session.requests[pair[1]].arrival_offset_ms
            assert session.start_ms is not None and offset is not None
            return session.start_ms + offset

        pairs.sort(key=at)
    return pairs, recorded


def trace_stats(sessions: Sequence[Session]) -> TraceStats:
    if not sessions:
        raise ValueError("no sessions")
    requests = [r for s in sessions for r in s.requests]
    turns = [len(s.requests) for s in sessions]
    histogram = {}
    for low, high in _BUCKETS:
        label = f"{low}" if low == high else f"{low}+" if high is None else f"{low}-{high}"
        histogram[label] = sum(1 for t in turns if t >= low and (high is None or t <= high))
    owner: dict[int, int] = {}  # block id -> the session that first had it
    total = same = other = 0
    pairs, recorded = _order(sessions)
    for s, r in pairs:
        session = sessions[s]
        request = session.requests[r]
        bs, ids = session.block_size, request.hash_ids
        for k, block in enumerate(ids):
            first = owner.get(block)
            if first is None:
                break
            tokens = min(bs, request.input_tokens - k * bs)
            if first == s:
                same += tokens
            else:
                other += tokens
        for block in ids:
            owner.setdefault(block, s)
        total += request.input_tokens
    return TraceStats(
        sessions=len(sessions),
        requests=len(requests),
        turns_per_session=Quantiles.of(turns),
        turns_histogram=histogram,
        input_tokens=Quantiles.of([r.input_tokens for r in requests]),
        output_tokens=Quantiles.of([r.output_tokens for r in requests]),
        cache_ratio=(same + other) / total,
        cache_ratio_same_session=same / total,
        cache_ratio_other_sessions=other / total,
        recorded_order=recorded,
    )


def format_stats(stats: TraceStats) -> str:
    histogram = "  ".join(f"{label}: {n:,}" for label, n in stats.turns_histogram.items())
    order = "recorded arrival order" if stats.recorded_order else "sessions one after another"
    return "\n".join(
        [
            f"sessions            {stats.sessions:,}",
            f"requests (turns)    {stats.requests:,}",
            f"turns per session   {stats.turns_per_session}",
            f"  sessions by turns {histogram}",
            f"input tokens        {stats.input_tokens}",
            f"output tokens       {stats.output_tokens}",
            f"cache ratio         {stats.cache_ratio:.1%} (same session {stats.cache_ratio_same_session:.1%},"
            f" other sessions {stats.cache_ratio_other_sessions:.1%}; unbounded prefix cache, {order})",
        ]
    )


__all__ = ["Quantiles", "TraceStats", "format_stats", "trace_stats"]
