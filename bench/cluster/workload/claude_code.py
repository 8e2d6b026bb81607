"""Claude Code session traces (callanjfox/kv-cache-tester, shared/traces/claude-code) into sessions.

A file `trace_NNNN.json.gz` is one Claude Code session: `block_size` (64), `requests[]`, each with
`t` (s since the session began), `in`, `out`, `hash_ids` (one id per FULL block, prefix-chained,
unique within the file only), `input_types`, `stop`, `api_time` and `think_time` (s after the
previous answer). An entry `type: "subagent"` (its `t`: when it started) holds a subagent's own
`requests[]`, timed from the subagent's start. One file gives the main session `cc-NNNN` and one
session per subagent, `cc-NNNN-sub1`, ... in the order they appear.

- Ids: a file's ids get the namespace NNNN << 40 (the traces' ids stay below 2**39), so files
  never collide while a subagent keeps its file's ids: in these traces subagents share no block
  with their parent (another model and system prompt) but most of their first prompt (a median
  98 %, 152 blocks) with an earlier sibling. The trace omits the partial last block; it gets an
  id of its own, namespace | 2**39 | a per-file counter, so no two requests share a partial block
  (every id stays below 2**61, under the context cut's derived ids).
- Timing: `think_time_ms` from `think_time` (the replay sends a turn that long after the previous
  answer, whatever the policy made that answer take); `t` would replay the recorded answer times.
  Where `think_time` is missing (a few streamed requests) it is `t` minus the previous request's
  `t` and `api_time`. The main session's `start_ms` is its first `t` (0), a subagent's is its
  entry's `t` plus its first request's `t`: ms from the main session's start.
- Stop: `tool_use` -> tool_calls, `end_turn` -> stop, empty (streamed requests) -> stop, counted.
  Input kind: tool_result when `input_types` holds `tool_result` (the trace says so itself; the
  previous answer's `stop` disagrees for ~1 % of requests and is empty for ~8 %), else text.
  `out` 0 (a few streamed requests) becomes 1.
- Context: a client whose context is full gets an error and the session ends there, so
  end_at_context keeps the requests before the first one whose input + output exceeds the model's
  limit (context.py's CutRule instead drops the oldest history and goes on). convert also drops
  the subagents that started after their main session ended.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.cluster.workload.model import InputKind, Request, Session, StopReason

NAMESPACE_BITS = 40
_PARTIAL = 1 << (NAMESPACE_BITS - 1)
_MAX_FILE = 1 << (61 - NAMESPACE_BITS)
_STOPS = {"tool_use": StopReason.TOOL_CALLS, "end_turn": StopReason.STOP}
_NUMBER = re.compile(r"(\d+)\.json(\.gz)?$")


@dataclass(frozen=True, slots=True)
class Summary:
    files: int
    sessions: int  # main sessions and subagents kept
    subagents: int
    requests: int
    empty_stops: int  # `stop` neither tool_use nor end_turn: read as stop
    think_times_from_t: int  # `think_time` missing: derived from `t` and `api_time`
    outputs_raised: int  # `out` 0, sent as 1
    # With a max_model_len: requests dropped (sessions ended, subagents started after their main
    # session ended), and sessions dropped whole (the first request did not fit, or started late).
    requests_cut: int = 0
    sessions_dropped: int = 0


@dataclass(frozen=True, slots=True)
class _File:
    sessions: list[Session]  # main session first
    main_t_ms: tuple[float, ...]  # the main session's recorded request times


def file_number(path: Path) -> int:
    match = _NUMBER.search(path.name)
    if match is None:
        raise ValueError(f"{path}: no trace number in the name (trace_NNNN.json.gz)")
    return int(match.group(1))


def _open(path: Path) -> Any:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


class _Reader:
    def __init__(self, path: Path, number: int, counts: Counter[str]) -> None:
        if not 0 <= number < _MAX_FILE:
            raise ValueError(f"{path}: trace number {number} outside [0, {_MAX_FILE})")
        self.path, self.namespace, self.counts, self.partials = path, number << NAMESPACE_BITS, counts, 0

    def ids(self, raw: dict[str, Any], block: int, at: str) -> tuple[int, ...]:
        local, tokens = raw["hash_ids"], int(raw["in"])
        if len(local) not in (tokens // block, math.ceil(tokens / block)):
            raise ValueError(f"{self.path}: {at}: {len(local)} hash_ids for {tokens} tokens")
        if any(not 0 <= h < _PARTIAL for h in local):
            raise ValueError(f"{self.path}: {at}: an id outside [0, 2**{NAMESPACE_BITS - 1})")
        ids = tuple(self.namespace | int(h) for h in local)
        if len(ids) < math.ceil(tokens / block):
            ids += (self.namespace | _PARTIAL | self.partials,)
            self.partials += 1
        return ids

    def session(self, session_id: str, raw: list[dict[str, Any]], block: int, start_ms: float) -> Session:
        requests, previous = [], None
        for i, r in enumerate(raw):
            at = f"{session_id} request {i}"
            if i == 0:
                think = 0.0
            elif "think_time" in r:
                think = float(r["think_time"])
            else:
                assert previous is not None
                think = max(0.0, r["t"] - previous["t"] - previous.get("api_time", 0.0))
                self.counts["think_times_from_t"] += 1
            stop = _STOPS.get(r.get("stop") or "")
            self.counts["empty_stops"] += stop is None
            self.counts["outputs_raised"] += int(r["out"]) < 1
            kind = InputKind.TOOL_RESULT if "tool_result" in r.get("input_types", ()) else InputKind.TEXT
            requests.append(
                Request(
                    input_tokens=int(r["in"]),
                    output_tokens=max(1, int(r["out"])),
                    hash_ids=self.ids(r, block, at),
                    input_kind=kind,
                    stop_reason=stop or StopReason.STOP,
                    think_time_ms=think * 1000,
                )
            )
            previous = r
        return Session(session_id, block, tuple(requests), start_ms=start_ms)


def _read(path: Path, counts: Counter[str], number: int | None = None) -> _File:
    number = file_number(path) if number is None else number
    reader, trace = _Reader(path, number, counts), _open(path)
    block, name = int(trace["block_size"]), f"cc-{number:04d}"
    entries = trace["requests"]
    main = [r for r in entries if r.get("type") != "subagent"]
    if not main:
        raise ValueError(f"{path}: no requests of the main session")
    sessions = [reader.session(name, main, block, float(main[0]["t"]) * 1000)]
    subagents = [r for r in entries if r.get("type") == "subagent" and r.get("requests")]
    for n, sub in enumerate(subagents, start=1):
        start_s = float(sub["t"]) + float(sub["requests"][0]["t"])
        sessions.append(reader.session(f"{name}-sub{n}", sub["requests"], block, start_s * 1000))
    return _File(sessions, tuple(float(r["t"]) * 1000 for r in main))


def read_session_file(path: Path, *, number: int | None = None) -> list[Session]:
    """The main session and its subagents; `number` (the id namespace) defaults to the NNNN of
    the file's name."""
    return _read(path, Counter(), number).sessions


def end_at_context(session: Session, max_model_len: int) -> Session | None:
    """The session up to (not including) its first request whose input + output exceeds
    `max_model_len`; None when even the first does not fit."""
    for i, r in enumerate(session.requests):
        if r.input_tokens + r.output_tokens > max_model_len:
            return replace(session, requests=session.requests[:i]) if i else None
    return session


def trace_files(directory: Path, limit: int | None = None) -> list[Path]:
    files = sorted(directory.glob("trace_*.json.gz"))
    if not files:
        raise FileNotFoundError(f"{directory}: no trace_*.json.gz")
    return files if limit is None else files[:limit]


def convert(
    directory: Path, *, limit: int | None = None, max_model_len: int | None = None
) -> tuple[list[Session], Summary]:
    """Every session of the first `limit` files (all by default) in name order, with a
    max_model_len ended at that context (see the module's doc), and what the conversion found."""
    counts: Counter[str] = Counter()
    files = trace_files(directory, limit)
    out: list[Session] = []
    for path in files:
        read = _read(path, counts)
        out += read.sessions if max_model_len is None else _end_file(read, max_model_len, counts)
    summary = Summary(
        files=len(files),
        sessions=len(out),
        subagents=sum(1 for s in out if "-sub" in s.session_id),
        requests=sum(len(s.requests) for s in out),
        empty_stops=counts["empty_stops"],
        think_times_from_t=counts["think_times_from_t"],
        outputs_raised=counts["outputs_raised"],
        requests_cut=counts["requests_cut"],
        sessions_dropped=counts["sessions_dropped"],
    )
    return out, summary


def _end_file(read: _File, max_model_len: int, counts: Counter[str]) -> list[Session]:
    """The file's sessions ended at the context; a subagent that started (recorded time) at or
    after its main session's first dropped request is dropped whole."""
    out, ended = [], math.inf
    for k, session in enumerate(read.sessions):
        late = k > 0 and (session.start_ms or 0.0) >= ended
        kept = None if late else end_at_context(session, max_model_len)
        if k == 0 and (kept is None or len(kept.requests) < len(session.requests)):
            ended = read.main_t_ms[0 if kept is None else len(kept.requests)]
        counts["requests_cut"] += len(session.requests) - (len(kept.requests) if kept else 0)
        counts["sessions_dropped"] += kept is None
        if kept is not None:
            out.append(kept)
    return out


def read_sessions(directory: Path, *, limit: int | None = None) -> list[Session]:
    """Every session of the first `limit` trace files (all by default), files in name order."""
    return convert(directory, limit=limit)[0]


__all__ = [
    "NAMESPACE_BITS",
    "Summary",
    "convert",
    "end_at_context",
    "file_number",
    "read_session_file",
    "read_sessions",
    "trace_files",
]
