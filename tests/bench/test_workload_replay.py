"""bench/cluster/workload: what a replay sends: token ids per block, engine blocks, the context
cut, and when sessions and their turns arrive."""

from __future__ import annotations

import random

import numpy as np
import pytest
from bench.cluster.workload.arrivals import open_loop_schedule, poisson_times, rate_ladder, send_time_s
from bench.cluster.workload.blocks import DERIVED_ID_BASE, BlockIds, engine_block_ids
from bench.cluster.workload.context import ContextTooLong, CutRule, cut_session
from bench.cluster.workload.model import Request, Session
from bench.cluster.workload.tokens import TokenMap


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.nonzero(a[:n] != b[:n])[0]
    return int(differ[0]) if len(differ) else n


def test_prompts_sharing_k_ids_share_exactly_k_blocks_of_tokens() -> None:
    tokens = TokenMap(vocab_size=32_000, seed=7, reserved=100)
    first = tokens.prompt([5, 6, 7, 8], 4 * 512 - 100, 512)  # a partial last block
    second = tokens.prompt([5, 6, 9], 3 * 512, 512)
    assert len(first) == 4 * 512 - 100 and len(second) == 3 * 512
    assert shared_prefix(first, second) == 2 * 512
    assert first.min() >= 100 and first.max() < 32_000
    # Deterministic, and a partial block is the full block's first tokens.
    assert np.array_equal(tokens.prompt([5, 6, 7, 8], 4 * 512 - 100, 512), first)
    assert np.array_equal(tokens.blocks([8], 512)[0][:412], first[3 * 512 :])
    assert shared_prefix(TokenMap(32_000, seed=8).prompt([5], 512, 512), tokens.prompt([5], 512, 512)) < 512


def test_a_prompt_must_fill_its_blocks() -> None:
    with pytest.raises(ValueError, match="do not hold"):
        TokenMap(1000).prompt([1, 2], 512, 512)


@pytest.mark.parametrize("engine", [16, 48, 512, 1024])
def test_engine_blocks_name_exactly_the_shared_prefix(engine: int) -> None:
    tokens = TokenMap(50_000)
    a_ids, b_ids, length = [1, 2, 3], [1, 2, 4], 3 * 512 - 7
    a = engine_block_ids(a_ids, length, 512, engine)
    b = engine_block_ids(b_ids, length, 512, engine)
    assert len(a) == length // engine
    shared_tokens = shared_prefix(tokens.prompt(a_ids, length, 512), tokens.prompt(b_ids, length, 512))
    assert shared_prefix(a, b) == shared_tokens // engine  # whole engine blocks of the shared tokens
    assert len(set(a.tolist())) == len(a)


def test_an_extended_prompt_keeps_the_prefix_full_blocks_only() -> None:
    ids = BlockIds()
    first = ids.fresh(3)
    assert ids.extend(first, 2 * 16 + 5, 2 * 16 + 5, 16) == first  # nothing added: the same prompt
    assert ids.extend(first, 2 * 16 + 5, 4 * 16, 16) == (0, 1, 3, 4)  # the partial block refilled


def session(*inputs: int, output: int = 10, block: int = 4) -> Session:
    ids = BlockIds()
    requests: list[Request] = []
    prompt: tuple[int, ...] = ()
    tokens = 0
    for i, n in enumerate(inputs):
        prompt, tokens = ids.extend(prompt, tokens, n, block), n
        requests.append(Request(n, output, prompt, think_time_ms=0.0 if i == 0 else 1.0))
    return Session("s", block, tuple(requests))


def test_a_prompt_that_fits_is_not_cut() -> None:
    s = session(20, 30)
    assert cut_session(s, CutRule(max_model_len=40)) == (s, 0)


def test_the_cut_keeps_the_head_and_the_newest_blocks_and_stays_put() -> None:
    s = session(30, 38, 46)  # room: 50 - 10 = 40 tokens of prompt
    cut, count = cut_session(s, CutRule(max_model_len=50, head_blocks=1))
    assert count == 1 and cut.requests[:2] == s.requests[:2]
    third = cut.requests[2]
    assert third.input_tokens == 46 - 2 * 4  # the 2 oldest blocks after the head dropped
    assert third.hash_ids[0] == s.requests[2].hash_ids[0]
    assert all(h >= DERIVED_ID_BASE for h in third.hash_ids[1:])


def test_a_session_keeps_what_it_dropped_so_later_turns_share_the_cut_prefix() -> None:
    s = session(36, 42, 48, output=4)  # room: 44 - 4 = 40
    cut, count = cut_session(s, CutRule(max_model_len=44, head_blocks=1, low_water=0.5))
    second, third = cut.requests[1], cut.requests[2]
    assert (count, second.input_tokens, third.input_tokens) == (2, 42 - 24, 48 - 24)  # 6 blocks, twice
    full = second.input_tokens // 4  # the cut prompt's full blocks, which the next turn shares
    assert third.hash_ids[:full] == second.hash_ids[:full] and third.hash_ids[full] != second.hash_ids[full]


def test_with_low_water_1_every_turn_past_the_limit_cuts_again_and_shares_only_the_head() -> None:
    s = session(36, 42, 48, output=4)
    cut, count = cut_session(s, CutRule(max_model_len=44, head_blocks=1))
    second, third = cut.requests[1], cut.requests[2]
    assert (count, second.input_tokens, third.input_tokens) == (2, 38, 40)
    assert second.hash_ids[0] == third.hash_ids[0] and second.hash_ids[1] != third.hash_ids[1]


def test_a_context_no_cut_fits_is_refused() -> None:
    with pytest.raises(ContextTooLong, match="request 0"):
        cut_session(session(20, output=30), CutRule(max_model_len=40, head_blocks=2))


def test_poisson_arrivals_are_seeded_and_near_their_rate() -> None:
    times = poisson_times(5.0, 100.0, 200.0, random.Random(1))
    assert times == poisson_times(5.0, 100.0, 200.0, random.Random(1))
    assert all(100.0 <= t < 300.0 for t in times) and times == sorted(times)
    assert 900 < len(times) < 1100


def test_a_schedule_climbs_the_ladder_with_unused_sessions() -> None:
    sessions = [session(8) for _ in range(400)]
    sessions = [Session(f"s{i}", s.block_size, s.requests) for i, s in enumerate(sessions)]
    rates = rate_ladder(0.5, 2.0, 3)
    assert rates == [0.5, 1.0, 2.0]
    steps = open_loop_schedule(sessions, rates, window_s=60.0, seed=3)
    assert [(s.rate_per_s, s.start_s) for s in steps] == [(0.5, 0.0), (1.0, 60.0), (2.0, 120.0)]
    used = [a.session.session_id for step in steps for a in step.arrivals]
    assert len(used) == len(set(used))
    assert all(step.start_s <= a.time_s < step.start_s + 60 for step in steps for a in step.arrivals)
    with pytest.raises(ValueError, match="the trace has 400"):
        open_loop_schedule(sessions, [100.0], window_s=60.0, seed=3)


def test_a_turn_waits_for_the_previous_answer() -> None:
    recorded = Request(4, 1, (1,), arrival_offset_ms=2000.0)
    thought = Request(4, 1, (1,), think_time_ms=500.0)
    assert send_time_s(recorded, 10.0, None) == 10.0
    assert send_time_s(recorded, 10.0, 11.0) == 12.0  # its recorded time
    assert send_time_s(recorded, 10.0, 13.0) == 13.0  # not before the answer
    assert send_time_s(thought, 10.0, 13.0) == 13.5
