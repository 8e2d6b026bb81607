"""The fleet benchmark's workloads, as open-loop session arrivals (Poisson at a rate, over a
window), the same for every policy at a given rate and seed:

    mooncake     the Mooncake FAST'25 conversation trace (../shared/traces/mooncake), its sessions
                 inferred by shared prefix (bench/cluster/workload/mooncake.py); a session's turns
                 at their recorded offsets divided by `MOONCAKE_GAP_DIVISOR` (the trace's gaps,
                 p50 273 s, would put most later turns past any affordable window), never
                 before the previous answer
    claude-code  the 224 real Claude Code sessions (../shared/traces/claude-code, read in place;
                 bench/cluster/workload/claude_code.py): recorded think times, each capped at
                 `THINK_CAP_S` (the traces hold overnight gaps; no retention outlives one), and
                 the subagents a session started, arriving their recorded offset after it
    agent        the synthetic agent loop (bench/cluster/workload/agent.py)

Sessions are drawn without replacement while the trace has them; past that a session is drawn
again with its block ids re-keyed (a copy shares no block with its original).
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections import defaultdict
from collections.abc import Sequence
from typing import Final

from bench.cluster.plan import CONVERSATION_TRACE, TRACES, compress_gaps
from bench.cluster.workload import claude_code, mooncake
from bench.cluster.workload.agent import AgentLoop, generate
from bench.cluster.workload.model import Session
from bench.fleet.replay import Arrival

__all__ = ["THINK_CAP_S", "WORKLOADS", "arrivals"]

THINK_CAP_S: Final = 600.0
MOONCAKE_GAP_DIVISOR: Final = 10.0
WORKLOADS: Final = ("mooncake", "claude-code", "agent")
_MASK: Final = (1 << 62) - 1


def _rekey(session: Session, copy: int) -> Session:
    if copy == 0:
        return session

    def key(i: int) -> int:
        x = (i * 0x9E3779B97F4A7C15 + copy * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
        x ^= x >> 31
        return x & _MASK

    requests = tuple(
        dataclasses.replace(r, hash_ids=tuple(key(i) for i in r.hash_ids)) for r in session.requests
    )
    return dataclasses.replace(session, session_id=f"{session.session_id}~{copy}", requests=requests)


@functools.cache
def _mooncake() -> tuple[tuple[Session, ...], ...]:
    sessions, _ = mooncake.infer_sessions(mooncake.read_records(CONVERSATION_TRACE), name="mc")
    return tuple((compress_gaps(s, MOONCAKE_GAP_DIVISOR),) for s in sessions)


@functools.cache
def _claude_code(max_model_len: int) -> tuple[tuple[Session, ...], ...]:
    sessions, _ = claude_code.convert(TRACES / "claude-code", max_model_len=max_model_len)
    groups: dict[str, list[Session]] = defaultdict(list)
    for s in sessions:
        groups[s.session_id.split("-sub")[0]].append(_capped(s))
    return tuple(tuple(g) for _, g in sorted(groups.items()))


def _capped(session: Session) -> Session:
    cap_ms = THINK_CAP_S * 1e3
    requests = tuple(
        dataclasses.replace(r, think_time_ms=min(r.think_time_ms, cap_ms))
        if r.think_time_ms is not None
        else r
        for r in session.requests
    )
    return dataclasses.replace(session, requests=requests)


def _groups(workload: str, count: int, seed: int, max_model_len: int) -> list[tuple[Session, ...]]:
    if workload == "agent":
        return [(s,) for s in generate(AgentLoop(), sessions=count, seed=seed)]
    pool: Sequence[tuple[Session, ...]]
    if workload == "mooncake":
        pool = _mooncake()
    elif workload == "claude-code":
        pool = _claude_code(max_model_len)
    else:
        raise ValueError(f"unknown workload {workload!r}")
    rng = random.Random(f"{workload}-{seed}")
    order = list(range(len(pool)))
    picked: list[tuple[Session, ...]] = []
    copy = 0
    while len(picked) < count:
        rng.shuffle(order)
        for i in order[: count - len(picked)]:
            picked.append(tuple(_rekey(s, copy) for s in pool[i]))
        copy += 1
    return picked


def arrivals(workload: str, rate: float, window_s: float, seed: int, max_model_len: int) -> list[Arrival]:
    """Sessions starting as a Poisson process of `rate` per second over `window_s`."""
    rng = random.Random(f"arrivals-{workload}-{rate}-{seed}")
    times, t = [], rng.expovariate(rate)
    while t < window_s:
        times.append(t)
        t += rng.expovariate(rate)
    out: list[Arrival] = []
    for at, group in zip(times, _groups(workload, len(times), seed, max_model_len), strict=True):
        main, *subagents = group
        out.append(Arrival(at, main))
        out.extend(Arrival(at + (s.start_ms or 0.0) / 1e3, s) for s in subagents)
    return sorted(out, key=lambda a: a.time_s)
