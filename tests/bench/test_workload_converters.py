"""bench/cluster/workload: the converters (Mooncake session inference, vLLM's multi-turn
generator shape, the agent loop), the stats and the CLI."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from bench.cluster.workload import agent, vllm_multiturn
from bench.cluster.workload.__main__ import main
from bench.cluster.workload.jsonl import read_sessions
from bench.cluster.workload.model import InputKind, StopReason
from bench.cluster.workload.mooncake import Record, infer_sessions
from bench.cluster.workload.stats import trace_stats

# The project's ../shared/traces (README of bench/cluster), or where KVSHUTTLE_TRACES says (a worktree).
ROOT = Path(__file__).resolve().parents[2]
TRACES = Path(os.environ.get("KVSHUTTLE_TRACES", ROOT.parent / "shared" / "traces")) / "mooncake"


def record(t: float, tokens: int, *ids: int) -> Record:
    return Record(t, tokens, 10, ids)


def test_a_turn_extends_the_full_blocks_of_its_sessions_last_turn() -> None:
    records = [
        record(0, 1100, 0, 1, 2),  # A: full blocks (0, 1)
        record(0, 700, 0, 3),  # B: one full block, the common prefix only
        record(3000, 1600, 0, 1, 4, 5),  # A's next turn: its partial block 2 refilled as 4
        record(3000, 1400, 0, 3, 6),  # shares only the common prefix with B: a session of its own
        record(6000, 2100, 0, 1, 4, 7, 8),  # A again (extends turn 2's full blocks 0, 1, 4)
        record(6000, 1600, 0, 1, 4, 9),  # also extends turn 2, already continued: a fork
    ]
    sessions, found = infer_sessions(records, name="t")
    assert [[r.hash_ids for r in s.requests] for s in sessions] == [
        [(0, 1, 2), (0, 1, 4, 5), (0, 1, 4, 7, 8)],
        [(0, 3)],
        [(0, 3, 6)],
        [(0, 1, 4, 9)],
    ]
    assert (found.sessions, found.turns_continued, found.forks, found.common_prefix_blocks) == (4, 2, 1, 1)
    assert found.whole_prefix_turns == 0
    a = sessions[0]
    assert (a.session_id, a.block_size, a.start_ms) == ("t-0", 512, 0.0)
    assert [r.arrival_offset_ms for r in a.requests] == [0.0, 3000.0, 6000.0]


def test_an_exact_multiple_of_the_block_matches_by_the_whole_rule_too() -> None:
    _, found = infer_sessions([record(0, 1024, 5, 6), record(1, 1500, 5, 6, 7), record(2, 600, 8, 9)])
    assert (found.sessions, found.whole_prefix_turns) == (2, 1)


@pytest.mark.skipif(not TRACES.is_dir(), reason="the Mooncake traces live in ../shared/traces")
def test_the_conversation_trace_converts_and_keeps_its_cache_ratio(tmp_path: Path) -> None:
    out = tmp_path / "c.jsonl"
    assert main(["convert", "mooncake", str(TRACES / "conversation_trace.jsonl"), "--out", str(out)]) == 0
    stats = trace_stats(list(read_sessions(out)))
    assert stats.requests == 12_031 and 1 < stats.turns_per_session.mean < 3
    assert 0.30 < stats.cache_ratio < 0.45  # the paper: 40 %
    assert stats.recorded_order


def test_the_vllm_example_config_gives_its_conversations() -> None:
    sessions = vllm_multiturn.generate(vllm_multiturn.EXAMPLE_CONFIG, seed=1, block_size=16)
    assert len(sessions) == 24
    assert all(6 <= len(s.requests) <= 9 for s in sessions)  # 12-18 messages, half are user turns
    first_blocks = {s.requests[0].hash_ids[: 500 // 16] for s in sessions}
    assert len(first_blocks) == 1  # the common prefix's full blocks, shared by every conversation
    for s in sessions:
        for previous, request in zip(s.requests, s.requests[1:], strict=False):
            assert (
                request.hash_ids[: previous.input_tokens // 16]
                == previous.hash_ids[: previous.input_tokens // 16]
            )
            assert 120 <= request.input_tokens - previous.input_tokens - previous.output_tokens <= 160
            assert 80 <= request.output_tokens <= 120 and request.stop_reason is StopReason.LENGTH
    assert vllm_multiturn.generate(vllm_multiturn.EXAMPLE_CONFIG, seed=1, block_size=16) == sessions


def test_a_bad_generator_config_names_its_field() -> None:
    config = json.loads(json.dumps(vllm_multiturn.EXAMPLE_CONFIG))
    del config["prompt_input"]["num_tokens"]["min"]
    with pytest.raises(vllm_multiturn.ConfigError, match=r"prompt_input\.num_tokens\.min: missing"):
        vllm_multiturn.generate(config, seed=1)
    config["prompt_input"]["num_tokens"] = {"distribution": "pareto"}
    with pytest.raises(vllm_multiturn.ConfigError, match="unknown 'pareto'"):
        vllm_multiturn.generate(config, seed=1)


def test_agent_sessions_loop_over_tool_calls() -> None:
    sessions = agent.generate(agent.AgentLoop(), sessions=20, seed=2)
    assert agent.generate(agent.AgentLoop(), sessions=20, seed=2) == sessions
    system = {s.requests[0].hash_ids[: 6000 // 64] for s in sessions}
    assert len(system) == 1
    for s in sessions:
        first = s.requests[0]
        assert first.input_kind is InputKind.TEXT and first.think_time_ms == 0.0
        assert s.requests[-1].stop_reason is StopReason.STOP
        for previous, request in zip(s.requests, s.requests[1:], strict=False):
            # A tool result follows a tool call; a user's text follows a final answer.
            follows_call = previous.stop_reason is StopReason.TOOL_CALLS
            assert (request.input_kind is InputKind.TOOL_RESULT) == follows_call
            assert request.think_time_ms is not None and request.think_time_ms >= (
                0 if follows_call else 2000
            )
    stats = trace_stats(sessions)
    assert stats.cache_ratio > 0.8  # each call re-sends the whole history


def test_the_cli_writes_agent_sessions_and_cuts_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "a.jsonl"
    assert main(["convert", "agent", "--sessions", "5", "--out", str(out)]) == 0
    assert len(list(read_sessions(out))) == 5
    assert main(["stats", str(out), "--max-model-len", "16384", "--low-water", "0.75"]) == 0
    printed = capsys.readouterr().out
    assert "sessions            5" in printed and "cut at 16,384 tokens:" in printed


def test_the_example_trace_is_what_the_agent_converter_writes(tmp_path: Path) -> None:
    out = tmp_path / "a.jsonl"
    args = ["convert", "agent", "--sessions", "2", "--seed", "1", "--block-size", "512", "--out", str(out)]
    assert main(args) == 0
    assert out.read_text() == (ROOT / "bench" / "cluster" / "examples" / "agent-2-sessions.jsonl").read_text()
