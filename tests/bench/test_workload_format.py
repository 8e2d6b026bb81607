"""bench/cluster/workload: the session-trace model and its JSONL form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench.cluster.workload.jsonl import read_sessions, session_to_dict, write_sessions
from bench.cluster.workload.model import InputKind, Request, Session, StopReason, TraceError


def two_turns() -> Session:
    return Session(
        session_id="s1",
        block_size=4,
        start_ms=10.0,
        requests=(
            Request(6, 2, (1, 2), arrival_offset_ms=0.0),
            Request(9, 3, (1, 3, 4), InputKind.TOOL_RESULT, StopReason.TOOL_CALLS, arrival_offset_ms=5.0),
        ),
    )


def test_a_trace_round_trips_through_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    agent = Session(
        "s2", 4, (Request(3, 1, (7,), think_time_ms=0.0), Request(5, 1, (7, 8), think_time_ms=1.5))
    )
    assert write_sessions(path, [two_turns(), agent]) == 2
    assert list(read_sessions(path)) == [two_turns(), agent]
    assert "start_ms" not in json.loads(path.read_text().splitlines()[1])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda s: s["requests"][1].update(hash_ids=[1, 3]), "requests[1].hash_ids"),
        (lambda s: s["requests"][1].update(input_kind="image"), "requests[1].input_kind"),
        (lambda s: s["requests"][0].update(output_tokens="2"), "requests[0].output_tokens"),
        (lambda s: s["requests"][1].update(think_time_ms=1.0), "requests[1].arrival_offset_ms"),
        (lambda s: s["requests"][1].update(arrival_offset_ms=-1), "requests[1].arrival_offset_ms"),
        (lambda s: s["requests"][0].update(arrival_offset_ms=3), "requests[0].arrival_offset_ms"),
        (lambda s: s["requests"][1].pop("input_tokens"), "requests[1].input_tokens"),
        (lambda s: s.update(block_size=0), "block_size"),
        (lambda s: s.update(colour="red"), "colour"),
    ],
)
def test_a_bad_field_is_named_with_its_line(tmp_path: Path, change: object, field: str) -> None:
    good = session_to_dict(two_turns())
    bad = session_to_dict(two_turns())
    assert callable(change)
    change(bad)
    path = tmp_path / "t.jsonl"
    path.write_text(f"{json.dumps(good)}\n\n{json.dumps(bad)}\n")
    with pytest.raises(TraceError) as raised:
        list(read_sessions(path))
    assert (raised.value.line, raised.value.field) == (3, field)
    assert str(raised.value).startswith(f"line 3: {field}: ")


def test_a_line_that_is_not_json_is_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("{nope\n")
    with pytest.raises(TraceError, match="line 1: session: not JSON"):
        list(read_sessions(path))
