"""bench/fleet/published.py: llm-d's agentic P/D workload has the published shape (24 conversations
of 12 requests, the lengths in their ranges, one shared system prefix) and is a function of its
seed; the closed loop keeps each session's turns in order, a turn after the previous one's tool
call, at most the concurrency in flight; the P2P arm pulls decode's history and the baseline
neither pulls nor has a CPU tier; the comparison's ratios."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import pytest
from bench.fleet.published import (
    PUBLISHED,
    Lognormal,
    Sent,
    Workload,
    compare,
    conversations,
    figures,
    run_arm,
)
from deploy.profiles.schema import load_engine_profiles

PROFILE = load_engine_profiles(Path(__file__).parents[2] / "deploy/profiles/qwen3-30b-a3b-h200-tp1.toml")[0]
# Eight requests over four short conversations, two in flight: a run of a fraction of a second.
TINY = Workload(
    conversations=4,
    requests=8,
    concurrency=2,
    workers=2,
    shared_system_tokens=1000,
    system_tokens=Lognormal(3000, 1000, 2000, 5000),
    turns=Lognormal(2, 1, 1, 3),
    input_tokens=Lognormal(300, 100, 100, 600),
    output_tokens=Lognormal(100, 50, 50, 200),
    tool_s=Lognormal(2, 1, 1, 4),
)


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_the_workload_has_the_published_shape_and_is_a_function_of_its_seed() -> None:
    w = Workload()
    convs = conversations(w, 1)
    assert len(convs) == 24 and [c.requests for c in convs] == [12] * 24  # 288 requests, round-robin
    assert conversations(w, 1) == convs and conversations(w, 2) != convs
    shared = w.shared_system_tokens // w.block_size
    firsts = [c.sessions[0].requests[0].hash_ids for c in convs]
    assert {_common(a, b) for a in firsts for b in firsts if a is not b} == {shared}  # then their own
    for c in convs:
        assert len(c.tool_s) == 12 and all(1 <= t <= 20 and t == int(t) for t in c.tool_s)
        for session in c.sessions:
            # A conversation starting over keeps its system prompt (at least 13,000 tokens).
            assert _common(session.requests[0].hash_ids, firsts[c.index]) >= 13_000 // w.block_size
            requests = session.requests
            assert 1 <= len(requests) <= 40 and requests[0].think_time_ms == 0
            assert 13_100 <= requests[0].input_tokens <= 113_000  # system prompt and first input
            for prev, r in itertools.pairwise(requests):
                assert 50 <= prev.output_tokens <= 10_000
                added = r.input_tokens - prev.input_tokens - prev.output_tokens
                assert 100 <= added <= 10_000  # the previous prompt and answer, then the new input
                assert _common(r.hash_ids, prev.hash_ids) == prev.input_tokens // w.block_size
                assert 1_000 <= (r.think_time_ms or 0) <= 20_000


def test_the_client_keeps_turns_in_order_after_their_tool_call_and_the_concurrency() -> None:
    run = run_arm("llm-d-no-p2p", TINY, PROFILE, 1)
    sent = run.sent
    assert len(sent) == 8 and all(s.end_s is not None and not s.record.error for s in sent)
    ends = [s.end_s for s in sent if s.end_s is not None]
    by_session: dict[str, list[Sent]] = {}
    for s in sorted(sent, key=lambda s: s.record.sent_s):
        by_session.setdefault(s.record.session, []).append(s)
    for turns in by_session.values():
        assert [t.record.turn for t in turns] == list(range(len(turns)))
        for prev, nxt in itertools.pairwise(turns):
            assert prev.end_s is not None and prev.record.done_s is not None
            assert nxt.record.sent_s >= prev.end_s
            assert prev.end_s - prev.record.done_s >= 1.0 - 1e-9  # its tool call, before the lock goes
    events = sorted([(s.record.sent_s, 1) for s in sent] + [(e, -1) for e in ends])
    in_flight = [sum(step for _, step in events[: i + 1]) for i in range(len(events))]
    assert max(in_flight) <= TINY.concurrency
    f = figures(run)
    span = max(ends) - min(s.record.sent_s for s in sent)
    assert f["failed"] == 0 and f["throughput_rps"] == pytest.approx(8 / span, rel=1e-3)


def test_only_the_p2p_arm_has_a_cpu_tier_and_pulls() -> None:
    """Answers of 1,500-3,000 tokens: a later turn's decode holds over minCachedTokenDelta (1,024)
    tokens more than its prefill pod, in its CPU tier, so the P2P arm pulls them; the baseline has
    no CPU tier and never pulls."""
    long_answers = replace(TINY, output_tokens=Lognormal(2000, 500, 1500, 3000))
    got = {arm: figures(run_arm(arm, long_answers, PROFILE, 1)) for arm in ("llm-d", "llm-d-no-p2p")}
    assert got["llm-d"]["pulls"] > 0 and got["llm-d"]["pulled_tokens"] >= 1024
    assert got["llm-d-no-p2p"]["pulls"] == got["llm-d-no-p2p"]["host_tokens_per_request"] == 0
    assert got["llm-d"]["failed"] == got["llm-d-no-p2p"]["failed"] == 0


def _row(arm: str, seed: int, ttft: float, rps: float) -> dict[str, object]:
    return {
        "arm": arm,
        "seed": seed,
        "ttft_p50_s": ttft,
        "throughput_rps": rps,
        "prompt_tokens_mean": 60_000,
        "pulls": 0,
        "pulled_tokens": 0,
    }


def test_the_comparison_takes_each_seeds_ratio_and_their_median_against_the_published() -> None:
    rows = [
        _row("llm-d-no-p2p", 1, 6.0, 0.8),
        _row("llm-d", 1, 1.0, 1.2),  # 6x, 1.5x
        _row("llm-d-no-p2p", 2, 8.0, 1.0),
        _row("llm-d", 2, 2.0, 1.1),  # 4x, 1.1x
    ]
    checks = compare(rows)["checks"]
    assert checks["ttft_p50 ratio (without / with)"]["sim"] == 5.0
    assert checks["ttft_p50 ratio (without / with)"]["seeds"] == [6.0, 4.0]
    assert checks["ttft_p50 ratio (without / with)"]["within_25pct"]  # 5 vs 6.27: -20 %
    assert checks["throughput ratio (with / without)"]["sim"] == pytest.approx(1.3)
    assert checks["llm-d-no-p2p ttft_p50_s"] == {
        "sim": 7.0,
        "published": PUBLISHED["llm-d-no-p2p"]["ttft_p50_s"],
        "off": round(7.0 / 6.83 - 1, 3),
        "within_25pct": True,
    }
    assert not checks["llm-d ttft_p50_s"]["within_25pct"]  # 1.5 vs 1.09: +38 %
