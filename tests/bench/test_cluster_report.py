"""bench/cluster's figures (report.py), PNGs (plots.py), what the full run replays (plan.py) and
the replay's horizon, on made-up turn records, traces and an instant policy: no cluster."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from pathlib import Path

import aiohttp
from bench.cluster import plots
from bench.cluster.client import Streamed
from bench.cluster.plan import Workload, compress_gaps, mooncake_sessions, sessions_per_rate
from bench.cluster.policies import Served, Turn
from bench.cluster.replay import CUT, Replay, ReplayConfig, TurnRecord
from bench.cluster.report import summarize, table
from bench.cluster.workload.arrivals import Arrival
from bench.cluster.workload.model import Request, Session
from bench.cluster.workload.tokens import TokenMap

COUNTERS = {"gpu_busy_s": 8.0, "prefill_gpu_s": 4.0, "prefill_nodes_busy_gpu_s": 5.0, "bytes_moved": 3e6}


def record(turn: int, ttft_s: float, reason: str, *, itl_s: float = 0.01, wrong: bool = False) -> TurnRecord:
    return TurnRecord("s", turn, 0.0, 1000, 4, False, reason, 500, ttft_s, [itl_s] * 3, wrong)


def summary() -> dict[str, object]:
    records = [
        record(0, 0.5, "recompute:cost"),
        record(1, 0.2, "reuse:reuse_cheaper"),
        record(2, 0.1, "extend:holder_cheaper"),  # a decision the harness does not know of
        record(3, 3.0, "recompute:cost"),  # misses the TTFT SLO
        record(4, 0.1, "reuse:reuse_cheaper", itl_s=0.2),  # misses the ITL SLO
        TurnRecord("s", 5, 0.0, 1000, 4, False, error=CUT),
    ]
    return summarize(records, COUNTERS, gpus=4, wall_s=10.0, cpu_s=0.05, prefill_gpus=2)


def test_the_summary_counts_every_decision_and_the_prefill_nodes_busy_share() -> None:
    s = summary()
    assert s["decisions"] == {"recompute:cost": 2, "reuse:reuse_cheaper": 2, "extend:holder_cheaper": 1}
    assert (s["turns"], s["served"], s["errors"], s["cut"]) == (6, 5, 1, 1)
    assert s["slo_attainment"] == 0.5
    assert s["goodput_turns_per_s_per_gpu"] == round(3 / 10.0 / 4, 4)
    assert s["prefill_nodes_busy"] == 0.25  # 5 GPU-s over 10 s on 2 GPUs
    assert s["parked_bytes"] == 0
    assert s["bytes_moved_per_turn"] == 600_000
    assert s["ttft_ms"] == {"p50": 200.0, "p90": 3000.0, "p99": 3000.0}
    cdf = s["ttft_cdf_ms"]
    assert isinstance(cdf, dict) and len(cdf) == 99 and cdf["p1"] == 100.0 and cdf["p99"] == 3000.0


def test_the_table_has_a_line_per_workload_policy_and_rate_with_its_decisions() -> None:
    rows = [{"workload": "agent", "policy": "kvshuttle", "rate": 2.0, "summary": summary()}]
    lines = table(rows).splitlines()
    assert lines[0].split()[:4] == ["workload", "policy", "rate", "P"]
    assert lines[1].split()[:4] == ["agent", "kvshuttle", "2.00", "0.25"]
    assert lines[1].endswith("extend:holder_cheaper 1, recompute:cost 2, reuse:reuse_cheaper 2")


def test_both_pngs_are_written_beside_the_result(tmp_path: Path) -> None:
    rows = [
        {"workload": w, "policy": p, "rate": r, "summary": summary(),
         "decode_kv_blocks": [[0.0, 0, 0], [1.0, 120, 40], [2.0, 60, 60]]}
        for w in ("mooncake", "agent") for r in (2.0, 1.0) for p in ("recompute", "kvshuttle")
    ]  # fmt: skip
    assert [(w, r, len(m)) for w, r, m in plots.panels(rows)] == [
        ("mooncake", 1.0, 2), ("mooncake", 2.0, 2), ("agent", 1.0, 2), ("agent", 2.0, 2)
    ]  # fmt: skip
    written = plots.write(rows, tmp_path / "cluster-x.json", "title")
    assert [p.name for p in written] == ["cluster-x-ttft-cdf.png", "cluster-x-decode-kv.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in written)


def test_a_trace_turns_gaps_are_compressed_and_its_think_times_kept() -> None:
    requests = (Request(4, 1, (1,), arrival_offset_ms=0.0), Request(8, 1, (1, 2), arrival_offset_ms=6000.0))
    session = Session("a", 4, requests, start_ms=500.0)
    got = compress_gaps(session, 60)
    assert [r.arrival_offset_ms for r in got.requests] == [0.0, 100.0] and got.start_ms is None
    thinking = Session(
        "b", 4, (Request(4, 1, (1,), think_time_ms=0.0), Request(8, 1, (1, 2), think_time_ms=50.0))
    )
    assert compress_gaps(thinking, 60) == thinking


def write_mooncake(path: Path, conversations: int) -> Path:
    """Raw Mooncake records: `conversations` of two turns each, a shared system block 0."""
    lines = []
    for c in range(conversations):
        first = [0, 10 + 2 * c]
        lines.append({"timestamp": 1000 * c, "input_length": 1024, "output_length": 8, "hash_ids": first})
        lines.append({"timestamp": 1000 * c + 600_000, "input_length": 1536, "output_length": 8,
                      "hash_ids": [*first, 11 + 2 * c]})  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_mooncake_sessions_are_a_seeded_sample_with_compressed_gaps(tmp_path: Path) -> None:
    trace = write_mooncake(tmp_path / "conversation_trace.jsonl", 20)
    got = mooncake_sessions(trace, 5, seed=3, gap_divisor=60)
    assert [s.session_id for s in got] == [
        s.session_id for s in mooncake_sessions(trace, 5, seed=3, gap_divisor=60)
    ]
    assert len({s.session_id for s in got}) == 5
    assert all([r.arrival_offset_ms for r in s.requests] == [0.0, 10_000.0] for s in got)


def test_each_rate_replays_rate_times_window_sessions_of_its_own() -> None:
    steps = sessions_per_rate(Workload("agent", (0.5, 1.5)), window_s=4, seed=1, gap_divisor=60)
    assert [(rate, len(sessions)) for rate, sessions in steps] == [(0.5, 2), (1.5, 6)]
    ids = [s.session_id for _, sessions in steps for s in sessions]
    assert len(set(ids)) == len(ids) == 8


class Instant:
    """A policy answering every turn at once with one token; a turn of `hangs` never."""

    name = "instant"

    def __init__(self, hangs: str = "") -> None:
        self.hangs = hangs

    async def serve(self, http: aiohttp.ClientSession, turn: Turn) -> Served:
        if turn.conversation == self.hangs:
            await asyncio.Event().wait()
        return Served(Streamed(ids=[7], token_times=[time.monotonic()]), "recompute:test", 0)

    def cpu_s(self) -> float:
        return 0.0

    async def close(self) -> None:
        pass


async def test_no_turn_is_sent_past_the_horizon_and_none_stays_in_flight_past_the_drain() -> None:
    requests = tuple(
        Request(4 * (i + 1), 1, tuple(range(i + 1)), arrival_offset_ms=i * 10_000.0) for i in range(3)
    )
    sessions = [Session(f"s{k}", 4, requests) for k in range(2)]
    config = ReplayConfig(token_map=TokenMap(100, reserved=2), vocab_size=100, time_scale=0.01,
                          max_model_len=1000, max_output=1, max_turns=3, edit_fraction=0.0, seed=1,
                          horizon_s=15.0)  # fmt: skip
    replay = Replay(Instant(), config, lambda prompt, n: [7])
    async with aiohttp.ClientSession() as http:
        got = await replay.run(http, [Arrival(0.0, sessions[0]), Arrival(20.0, sessions[1])])
    # s0's turns at 0 and 10 s; its third (20 s) and all of s1 (from 20 s) are past 15 s (100 ms
    # of real time a profile 10 s: wide of the loop's jitter).
    assert sorted((r.session, r.turn) for r in got) == [("s0", 0), ("s0", 1)]
    assert all(r.error is None for r in got)

    # A turn still in flight drain_s after the horizon is cut, an error; the others are kept.
    hung = Replay(
        Instant(hangs="s1"), dataclasses.replace(config, horizon_s=25.0, drain_s=5.0), lambda p, n: [7]
    )
    async with aiohttp.ClientSession() as http:
        got = await hung.run(http, [Arrival(0.0, sessions[0]), Arrival(20.0, sessions[1])])
    assert sorted((r.session, r.turn, r.error) for r in got) == [
        ("s0", 0, None), ("s0", 1, None), ("s0", 2, None), ("s1", 0, CUT)
    ]  # fmt: skip
