"""What the full comparison replays (`python -m bench.cluster`, issue 20 §3): each workload's
sessions and its ladder of session rates.

- `mooncake`: the Mooncake FAST'25 conversation trace, converted (workload/mooncake.py: sessions
  inferred from shared hash prefixes), then `sessions` per rate drawn without replacement by
  `random.Random(seed).sample` from every inferred session (so the trace's mix: most are one
  request). The trace's own start times are dropped (arrivals are the run's open loop), and the
  gaps between a session's turns, minutes in the trace (p50 273 s), are divided by
  `gap_divisor`: the recorded pace would not fit a step of a 20-minute run.
- `agent`: the synthetic agent loop (workload/agent.py) generated with `seed`.
- a session-trace JSONL (`--trace`): its sessions in file order.

Each rate replays rate x `window_s` sessions of its own (their starts then span about the window).
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.cluster.workload import mooncake
from bench.cluster.workload.agent import AgentLoop, generate
from bench.cluster.workload.jsonl import read_sessions
from bench.cluster.workload.model import Session
from bench.report import ROOT

# The project's ../shared/traces, or where KVSHUTTLE_TRACES says (a worktree), as the tests read it.
TRACES = Path(os.environ.get("KVSHUTTLE_TRACES", ROOT.parent / "shared" / "traces"))
CONVERSATION_TRACE = TRACES / "mooncake" / "conversation_trace.jsonl"


@dataclass(frozen=True)
class Workload:
    """`name`: mooncake, agent, or a session-trace JSONL's path; `rates`: session starts per
    profile second, increasing, one step each."""

    name: str
    rates: tuple[float, ...]


def compress_gaps(session: Session, divisor: float) -> Session:
    """The session with every turn's arrival offset divided by `divisor` (think times kept)."""
    requests = tuple(
        r
        if r.arrival_offset_ms is None
        else dataclasses.replace(r, arrival_offset_ms=r.arrival_offset_ms / divisor)
        for r in session.requests
    )
    return dataclasses.replace(session, requests=requests, start_ms=None)


def mooncake_sessions(path: Path, count: int, *, seed: int, gap_divisor: float) -> list[Session]:
    """`count` sessions of the converted trace at `path`, drawn with `seed`, gaps compressed."""
    sessions, _ = mooncake.infer_sessions(mooncake.read_records(path), name=path.stem)
    if len(sessions) < count:
        raise SystemExit(f"{path}: {len(sessions)} sessions; {count} needed")
    return [compress_gaps(s, gap_divisor) for s in random.Random(seed).sample(sessions, count)]


def sessions_per_rate(
    workload: Workload, *, window_s: float, seed: int, gap_divisor: float
) -> list[tuple[float, list[Session]]]:
    """Each rate's own sessions, rate x `window_s` of them (none replayed twice: a replayed
    session would hit its own blocks)."""
    counts = [max(1, round(rate * window_s)) for rate in workload.rates]
    need = sum(counts)
    pool: Sequence[Session]
    if workload.name == "agent":
        pool = generate(AgentLoop(), sessions=need, seed=seed)
    elif workload.name == "mooncake":
        pool = mooncake_sessions(CONVERSATION_TRACE, need, seed=seed, gap_divisor=gap_divisor)
    else:
        pool = list(read_sessions(Path(workload.name)))
        if len(pool) < need:
            raise SystemExit(f"{workload.name}: {len(pool)} sessions; {need} needed")
    steps, used = [], 0
    for rate, count in zip(workload.rates, counts, strict=True):
        steps.append((rate, list(pool[used : used + count])))
        used += count
    return steps


__all__ = ["CONVERSATION_TRACE", "Workload", "compress_gaps", "mooncake_sessions", "sessions_per_rate"]
