"""bench/cluster/workload/claude_code.py: Claude Code traces (gzipped JSON, one session and its
subagents per file) into sessions: ids namespaced per file, partial blocks, think times, stops,
subagent starts, the session's end at the model's context, the CLI."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from bench.cluster.plan import TRACES
from bench.cluster.workload import claude_code
from bench.cluster.workload.__main__ import main
from bench.cluster.workload.claude_code import NAMESPACE_BITS, convert, end_at_context, read_session_file
from bench.cluster.workload.jsonl import read_sessions as read_jsonl
from bench.cluster.workload.model import InputKind, StopReason, validate

CLAUDE_CODE = TRACES / "claude-code"
PARTIAL = 1 << (NAMESPACE_BITS - 1)


def request(
    t: float, tokens: int, out: int, ids: list[int], stop: str, inputs: str, **extra: Any
) -> dict[str, Any]:
    return {
        "t": t,
        "type": "n",
        "model": "m",
        "in": tokens,
        "out": out,
        "hash_ids": ids,
        "input_types": [inputs],
        "output_types": ["text"],
        "stop": stop,
        **extra,
    }


def write_trace(path: Path) -> Path:
    subagent = {
        "t": 12.5,
        "type": "subagent",
        "agent_id": "agent_001",
        "subagent_type": "Explore",
        "requests": [
            request(0.0, 130, 5, [50, 51], "tool_use", "text", think_time=0.0, api_time=1.0),
            request(4.0, 192, 7, [50, 51, 52], "end_turn", "tool_result", think_time=2.5, api_time=1.0),
        ],
    }
    trace = {
        "id": path.name.split(".")[0],
        "block_size": 64,
        "hash_id_scope": "local",
        "requests": [
            # 200 tokens: 3 full blocks and a partial one the trace leaves out.
            request(0.0, 200, 10, [1, 2, 3], "tool_use", "text", think_time=0.0, api_time=2.0),
            # Exactly 4 blocks: no partial; an empty stop and an empty answer.
            request(5.0, 256, 0, [1, 2, 3, 4], "", "tool_result", think_time=3.0, api_time=1.0),
            subagent,
            # No think_time: 20 - 5 - 1.0 (the previous api_time) = 14 s.
            request(20.0, 300, 20, [1, 2, 3, 4], "end_turn", "text"),
        ],
    }
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    return path


def test_a_file_is_its_main_session_and_its_subagents(tmp_path: Path) -> None:
    main_session, sub = read_session_file(write_trace(tmp_path / "trace_0007.json.gz"))
    ns = 7 << NAMESPACE_BITS
    assert (main_session.session_id, sub.session_id) == ("cc-0007", "cc-0007-sub1")
    assert main_session.block_size == sub.block_size == 64
    assert [r.hash_ids for r in main_session.requests] == [
        (ns | 1, ns | 2, ns | 3, ns | PARTIAL | 0),
        (ns | 1, ns | 2, ns | 3, ns | 4),
        (ns | 1, ns | 2, ns | 3, ns | 4, ns | PARTIAL | 1),
    ]
    assert [r.hash_ids for r in sub.requests] == [
        (ns | 50, ns | 51, ns | PARTIAL | 2),
        (ns | 50, ns | 51, ns | 52),
    ]
    assert [(r.input_tokens, r.output_tokens) for r in main_session.requests] == [
        (200, 10),
        (256, 1),
        (300, 20),
    ]
    assert [r.think_time_ms for r in main_session.requests] == [0.0, 3000.0, 14000.0]
    assert [r.think_time_ms for r in sub.requests] == [0.0, 2500.0]
    assert all(r.arrival_offset_ms is None for r in main_session.requests + sub.requests)
    assert [r.stop_reason for r in main_session.requests] == [
        StopReason.TOOL_CALLS,
        StopReason.STOP,
        StopReason.STOP,
    ]
    assert [r.stop_reason for r in sub.requests] == [StopReason.TOOL_CALLS, StopReason.STOP]
    assert [r.input_kind for r in main_session.requests] == [
        InputKind.TEXT,
        InputKind.TOOL_RESULT,
        InputKind.TEXT,
    ]
    assert (main_session.start_ms, sub.start_ms) == (0.0, 12500.0)


def test_files_never_share_ids_and_the_summary_counts(tmp_path: Path) -> None:
    write_trace(tmp_path / "trace_0007.json.gz")
    write_trace(tmp_path / "trace_0012.json.gz")
    sessions, summary = convert(tmp_path)
    assert [s.session_id for s in sessions] == ["cc-0007", "cc-0007-sub1", "cc-0012", "cc-0012-sub1"]
    ids = [{h for s in sessions[k : k + 2] for r in s.requests for h in r.hash_ids} for k in (0, 2)]
    assert len(ids[0]) == len(ids[1]) == 10 and not ids[0] & ids[1]
    assert all(0 <= h < 1 << 61 for group in ids for h in group)
    assert (summary.files, summary.sessions, summary.subagents, summary.requests) == (2, 4, 2, 10)
    assert (summary.empty_stops, summary.think_times_from_t, summary.outputs_raised) == (2, 2, 2)
    assert (summary.requests_cut, summary.sessions_dropped) == (0, 0)
    assert [s.session_id for s in claude_code.read_sessions(tmp_path, limit=1)] == ["cc-0007", "cc-0007-sub1"]


def test_a_session_ends_before_its_first_request_past_the_context(tmp_path: Path) -> None:
    main_session, sub = read_session_file(write_trace(tmp_path / "trace_0007.json.gz"))
    assert end_at_context(main_session, 320) is main_session  # 300 + 20 fits exactly
    ended = end_at_context(main_session, 300)
    assert ended is not None and [r.input_tokens for r in ended.requests] == [200, 256]
    assert ended.start_ms == 0.0 and ended.session_id == "cc-0007"
    assert end_at_context(main_session, 209) is None
    assert end_at_context(sub, 199) is sub


@pytest.mark.parametrize(
    ("limit", "kept", "cut", "dropped"),
    [
        # The main session ends at 20 s, after the subagent started (12.5 s): both stay.
        (300, {"cc-0007": 2, "cc-0007-sub1": 2}, 1, 0),
        # The main session ends at 5 s: the subagent, started later, never runs.
        (250, {"cc-0007": 1}, 4, 1),
        (100, {}, 5, 2),
    ],
)
def test_convert_ends_sessions_and_drops_subagents_started_after_the_end(
    tmp_path: Path, limit: int, kept: dict[str, int], cut: int, dropped: int
) -> None:
    write_trace(tmp_path / "trace_0007.json.gz")
    sessions, summary = convert(tmp_path, max_model_len=limit)
    assert {s.session_id: len(s.requests) for s in sessions} == kept
    assert (summary.requests_cut, summary.sessions_dropped, summary.sessions) == (cut, dropped, len(kept))


def test_hash_ids_that_fit_no_block_count_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "trace_0001.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"block_size": 64, "requests": [request(0.0, 200, 1, [1], "end_turn", "text")]}, f)
    with pytest.raises(ValueError, match="1 hash_ids for 200 tokens"):
        read_session_file(path)
    with pytest.raises(ValueError, match="no trace number"):
        read_session_file(tmp_path / "x.json.gz")


def test_the_cli_converts_a_folder(tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    traces.mkdir()
    write_trace(traces / "trace_0007.json.gz")
    out = tmp_path / "cc.jsonl"
    assert main(["convert", "claude-code", str(traces), "--out", str(out), "--end-at-context", "300"]) == 0
    back = list(read_jsonl(out))
    assert [(s.session_id, len(s.requests), s.start_ms) for s in back] == [
        ("cc-0007", 2, 0.0),
        ("cc-0007-sub1", 2, 12500.0),
    ]
    assert back[0].requests[1].think_time_ms == 3000.0


@pytest.mark.skipif(not CLAUDE_CODE.is_dir(), reason="the Claude Code traces live in ../shared/traces")
def test_three_real_files_convert() -> None:
    sessions, summary = convert(CLAUDE_CODE, limit=3)
    assert summary.files == 3 and summary.sessions == 3 + summary.subagents
    assert summary.requests == sum(len(s.requests) for s in sessions) > 30
    mains = [s for s in sessions if "-sub" not in s.session_id]
    assert all(s.session_id.startswith("cc-") and s.block_size == 64 and s.start_ms == 0.0 for s in mains)
    for session in sessions:
        validate(session)
    owners: dict[int, str] = {}
    for session in sessions:
        for r in session.requests:
            for h in r.hash_ids:
                assert owners.setdefault(h, session.session_id[:7]) == session.session_id[:7]
    pairs = [(a, b) for s in sessions for a, b in zip(s.requests, s.requests[1:], strict=False)]
    extend = sum(b.hash_ids[: a.input_tokens // 64] == a.hash_ids[: a.input_tokens // 64] for a, b in pairs)
    assert extend / len(pairs) > 0.8
    assert 1_000 < sorted(r.input_tokens for _, r in pairs)[len(pairs) // 2] < 1_000_000
