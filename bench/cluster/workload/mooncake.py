"""Mooncake (FAST'25) request traces into sessions.

A Mooncake record is one request: `timestamp` (ms from the trace's start), `input_length`,
`output_length`, `hash_ids` (one per 512-token block, prefix-chained, the last block partial when
the prompt is not a multiple of 512). Sessions are not labelled, so they are inferred:

    A request R continues the session of the latest earlier request P whose full blocks
    (hash_ids[: input_length // 512]) are a prefix of R's hash_ids, the longest such P first, when
    that prefix is longer than the trace's common prefix (the blocks every request starts with:
    a system prompt shared by all, no evidence of a conversation). If P is its session's last turn,
    R is the next turn; if P already has a next turn, R forks: it starts a session of its own
    (its shared blocks keep their ids, so the replay still shares them).

Full blocks, not the whole hash_ids: a turn appends the answer and a new message to its
prompt, which refills the previous prompt's partial last block, so that block's id changes and
the whole-hash_ids rule (`R starts with all of P's ids`) misses nearly every turn of the trace.
The report counts the turns each rule finds.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.cluster.workload.model import InputKind, Request, Session, StopReason

MOONCAKE_BLOCK = 512


@dataclass(frozen=True, slots=True)
class Record:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Inference:
    """What the session inference found."""

    requests: int
    sessions: int
    # Requests that continue a session (requests - sessions).
    turns_continued: int
    # Of those, continuations whose parent's whole hash_ids (partial block included) prefix R's.
    whole_prefix_turns: int
    # Requests that matched a parent already continued: started a session of their own.
    forks: int
    common_prefix_blocks: int


def read_records(path: Path) -> list[Record]:
    records = []
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                records.append(
                    Record(
                        float(raw["timestamp"]),
                        int(raw["input_length"]),
                        int(raw["output_length"]),
                        tuple(int(h) for h in raw["hash_ids"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: not a Mooncake record: {e!r}") from None
    return records


def common_prefix(records: Sequence[Record]) -> int:
    """How many leading ids every record shares."""
    if not records:
        return 0
    first, length = records[0].hash_ids, len(records[0].hash_ids)
    for record in records[1:]:
        shared = 0
        for a, b in zip(first[:length], record.hash_ids, strict=False):
            if a != b:
                break
            shared += 1
        length = shared
    return length


def infer_sessions(records: Iterable[Record], name: str = "mc") -> tuple[list[Session], Inference]:
    """Sessions in order of their first request, turns in arrival order; see the module's rule."""
    ordered = sorted(records, key=lambda r: r.timestamp_ms)  # stable: file order breaks ties
    common = common_prefix(ordered)
    # Ids are prefix-chained, so the id of a request's last full block names its full-block
    # prefix: the latest request whose full blocks end in that id.
    latest_by_last_full: dict[int, int] = {}
    session_of: list[int] = []
    members: list[list[int]] = []
    whole = forks = 0
    for i, record in enumerate(ordered):
        ids, parent = record.hash_ids, None
        for k in range(len(ids), common, -1):
            parent = latest_by_last_full.get(ids[k - 1])
            if parent is not None:
                break
        if parent is not None and members[session_of[parent]][-1] == parent:
            session_of.append(session_of[parent])
            members[session_of[parent]].append(i)
            whole += ordered[parent].hash_ids == ids[: len(ordered[parent].hash_ids)]
        else:
            forks += parent is not None
            session_of.append(len(members))
            members.append([i])
        full = record.input_length // MOONCAKE_BLOCK
        if full > common:
            latest_by_last_full[ids[full - 1]] = i
    sessions = [_session(f"{name}-{n}", [ordered[i] for i in turns]) for n, turns in enumerate(members)]
    report = Inference(
        requests=len(ordered),
        sessions=len(sessions),
        turns_continued=len(ordered) - len(sessions),
        whole_prefix_turns=whole,
        forks=forks,
        common_prefix_blocks=common,
    )
    return sessions, report


def _session(session_id: str, turns: list[Record]) -> Session:
    start = turns[0].timestamp_ms
    return Session(
        session_id=session_id,
        block_size=MOONCAKE_BLOCK,
        start_ms=start,
        requests=tuple(
            Request(
                input_tokens=r.input_length,
                output_tokens=r.output_length,
                hash_ids=r.hash_ids,
                input_kind=InputKind.TEXT,
                # The trace records how many tokens came out, not why they stopped.
                stop_reason=StopReason.STOP,
                arrival_offset_ms=r.timestamp_ms - start,
            )
            for r in turns
        ),
    )


__all__ = ["MOONCAKE_BLOCK", "Inference", "Record", "common_prefix", "infer_sessions", "read_records"]
